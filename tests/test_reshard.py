"""Resharding the pipelines the trainer builds besides plain pretraining: a Mix of domains with
Online Data Mixing, and fine-tuning (SFT) samples packed (Pack) or padded (Pad).

W ranks read a while and save; W' ranks (divisors of the slots) resume from those states with
data.reshard and read on; the last world reads to the end of the (finite) data. Every document
(every SFT record) must come out exactly once over all ranks, and the mixer's state must be
the same on every rank after the reshard. Documents carry an id token (helpers.write_corpus).
"""

import collections
import json

import pytest
from helpers import ID_OF, Count, examples, stage, write_corpus
from helpers import WORD_TOKENIZER as TOKENIZER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import data
import train_llm

WORLDS = st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=3)  # divisors of 4 slots


def args_for(p, *extra):
    return train_llm.get_parser().parse_args([
        "-e", "x", "--active-shards=4", "--epochs=1", f"--seed={p['seed']}",
        "--tokenizer-threads=1", f"--seq-length={p['length']}",
        f"--shuffle-buffer={p['shuffle']}", "--batch-size=1", *extra])


def ids_in(batch):
    return [ID_OF[t] for t in batch["input_ids"].flatten().tolist() if t in ID_OF]


def run_worlds(p, build, after_reading=lambda pipe, k: None, check_resharded=lambda pipes: None):
    """Ranks of each world size in ``p["worlds"]`` in turn, each resuming from the states the
    ranks before saved; every world but the last reads ``p["cuts"][k]`` batches per rank (or
    what is left), the last reads to the end. Returns the document ids of every batch, and
    the last pipelines."""
    states, seen = None, []
    for k, world in enumerate(p["worlds"]):
        last = k == len(p["worlds"]) - 1
        pipes = [build(rank, world) for rank in range(world)]
        if states is not None:
            for pipe in pipes:
                assert data.reshard(pipe, states)["old_world_size"] == len(states)
            check_resharded(pipes)
        states = []
        for pipe in pipes:
            for batch in pipe if last else Count(pipe, p["cuts"][k]):
                seen += ids_in(batch)
            after_reading(pipe, k)
            states.append(json.loads(json.dumps(pipe.state_dict())))
        if not last:
            for pipe in pipes:
                pipe.close()
    return seen, pipes


@settings(max_examples=examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.fixed_dictionaries({
    "domains": st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=4), min_size=2,
                        max_size=4),
    "worlds": WORLDS,
    "cuts": st.lists(st.integers(0, 15), min_size=3, max_size=3),
    "length": st.integers(2, 9),
    "shuffle": st.integers(1, 6),
    "seed": st.integers(0, 3),
    "variant": st.sampled_from(["exp3", "smoothed-mean"]),
}))
def test_a_mix_with_odm_reshards_every_document_exactly_once(tmp_path_factory, p):
    """2-4 domains, ODM updated once per batch of the cut with the same losses on every rank
    (as the trainer's all-reduced ones are, and however many batches a rank still had). A Mix
    ends when its drawn domain runs dry: what the other domains still hold (prefetched,
    shuffled, chunked) is read out after it."""
    root = tmp_path_factory.mktemp("domains")
    n_docs = 0
    for d, sizes in enumerate(p["domains"]):
        n_docs += write_corpus(root / f"dom{d}", sizes, seed=p["seed"] + d, first_id=n_docs)
    args = args_for(p, f"--odm={p['variant']}", "--odm-warmup-steps=1")
    urls = str(root / "*/*.jsonl")
    args.dataset = urls

    def build(rank, world):  # (Mix here, not in Prefetch's process: its domains are read out)
        _, weights, mixer = train_llm.mixture(args, {"config": {}})  # a new run's state
        return train_llm.build_pipeline(urls, TOKENIZER, args, rank, world, train=True,
                                        weights=weights, mixer=mixer).src

    def after_reading(pipe, k):  # losses that differ by domain and step, the same on all ranks
        mixer = stage(pipe, data.Mix).mixer
        for n in range(p["cuts"][k]):
            mixer.update({d: 1 + (d * 7 + n + k) % 5 for d in range(len(p["domains"]))}, n + 2)

    def check_resharded(pipes):
        mixers = [json.dumps(stage(pipe, data.Mix).mixer.state_dict()) for pipe in pipes]
        assert len(set(mixers)) == 1

    try:
        seen, pipes = run_worlds(p, build, after_reading, check_resharded)
    except data.DataError:  # a domain with fewer documents than slots: refused at start
        return
    for pipe in pipes:  # what the domains hold after the Mix stopped
        for domain in stage(pipe, data.Mix).pipelines:
            seen += [i for item in domain for i in ids_in(item)]
            chunker = stage(domain.src, data.ConcatChunk)
            seen += [ID_OF[t] for t in chunker.buf[chunker.pos:].tolist() if t in ID_OF]
        pipe.close()
    assert collections.Counter(seen) == collections.Counter(range(n_docs))


def write_records(directory, sizes, seed):
    """Shards of instruction records whose instruction starts with the record's id token."""
    n = write_corpus(directory, sizes, seed=seed)
    for shard in directory.glob("*.jsonl"):
        records = [json.loads(line)["text"].split(" ", 1) + [""] for line in
                   shard.read_text().splitlines()]
        shard.write_text("".join(json.dumps({"instruction": words[0], "output": words[1]}) + "\n"
                                 for words in records))
    return n


@settings(max_examples=examples(25), deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 25), min_size=1, max_size=6),
    "worlds": WORLDS,
    "cuts": st.lists(st.integers(0, 15), min_size=3, max_size=3),
    "length": st.integers(40, 60),  # (the prompt's own words take about 15 tokens)
    "shuffle": st.integers(1, 6),
    "seed": st.integers(0, 3),
    "pad": st.booleans(),
}))
def test_sft_samples_reshard_exactly_once_packed_or_padded(tmp_path_factory, p):
    """The trainer's SFT pipeline (Pack: a sample that did not fit waits in its state), or the
    same with Pad, one sample per sequence."""
    directory = tmp_path_factory.mktemp("records")
    n_records = write_records(directory, p["sizes"], p["seed"])
    args = args_for(p, "--task=sft")
    urls = str(directory / "*.jsonl")

    def build(rank, world):
        if not p["pad"]:
            return train_llm.build_pipeline(urls, TOKENIZER, args, rank, world, train=True)
        try:
            pipe = data.source(urls, train=True, rank=rank, world_size=world, sft=True,
                               slots=args.active_shards, epochs=args.epochs, seed=args.seed,
                               tokenizer=TOKENIZER)
        except data.DataError:  # fewer records than slots: refused at start, as by the trainer
            raise data.SplitError("too few", 1) from None
        pipe = data.Pad(data.FormatInstructions(pipe, TOKENIZER), p["length"], pad_id=0)
        return data.Batch(data.Shuffle(pipe, p["shuffle"], seed=p["seed"]), 1)

    try:
        seen, pipes = run_worlds(p, build)
    except (data.DataError, data.SplitError):  # fewer records than slots: nothing to check
        return
    for pipe in pipes:
        pipe.close()
    assert collections.Counter(seen) == collections.Counter(range(n_records))


@settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 25), min_size=1, max_size=6),
    "worlds": WORLDS,
    "cuts": st.lists(st.integers(0, 15), min_size=3, max_size=3),
    "length": st.integers(2, 9),
    "shuffle": st.integers(1, 6),
    "seed": st.integers(0, 3),
    "threads": st.integers(1, 2),
    "before": st.sampled_from(["filter", "shuffle"]),
}))
def test_a_stage_before_tokenize_reshards_every_kept_document_once(tmp_path_factory, p):
    """Files -> a Filter (dropping every third document) and a Map, or a Shuffle (state of its
    own, and a reshard_state) -> Tokenize -> ... -> Batch: Tokenize keeps its upstream's state
    where its consumer stood, so every kept document comes out exactly once, no dropped one."""
    directory = tmp_path_factory.mktemp("corpus")
    n_docs = write_corpus(directory, p["sizes"], seed=p["seed"])
    urls = str(directory / "*.jsonl")

    def build(rank, world):
        pipe = data.Files(urls, epochs=1, repeat=True, seed=p["seed"], shuffle_shards=True,
                          rank=rank, world_size=world, n_active_shards=4)
        if p["before"] == "filter":
            pipe = data.Filter(pipe, lambda record: int(record["text"].split()[0][1:]) % 3 != 0)
            pipe = data.Map(pipe, lambda record: {"text": record["text"].upper().lower()})
        else:
            pipe = data.Shuffle(pipe, p["shuffle"], seed=p["seed"])
        pipe = data.Tokenize(pipe, TOKENIZER, num_threads=p["threads"], batch_size=3)
        pipe = data.ConcatChunk(data.EnsureBosEos(pipe, TOKENIZER), p["length"])
        return data.Batch(data.Shuffle(pipe, p["shuffle"], seed=p["seed"]), 1)

    try:
        seen, pipes = run_worlds(p, build)
    except data.SplitError:  # fewer documents than slots: nothing to check
        return
    for pipe in pipes:
        chunker = stage(pipe, data.ConcatChunk)
        seen += [ID_OF[t] for t in chunker.buf[chunker.pos:].tolist() if t in ID_OF]
        pipe.close()
    assert collections.Counter(seen) == collections.Counter(
        [d for d in range(n_docs) if p["before"] == "shuffle" or d % 3 != 0])


def test_a_stage_with_state_before_tokenize_that_cannot_reshard_is_refused_by_name(tmp_path):
    write_corpus(tmp_path, [10, 10])
    pipes = [data.Tokenize(Count(data.Files(str(tmp_path / "*.jsonl"), rank=r, world_size=2,
                                                n_active_shards=2), 5), TOKENIZER)
             for r in range(2)]
    states = [pipe.state_dict() for pipe in pipes]
    one = data.Tokenize(Count(data.Files(str(tmp_path / "*.jsonl"), n_active_shards=2), 5),
                        TOKENIZER)
    with pytest.raises(ValueError, match="the state of Count cannot be split across ranks"):
        data.reshard(one, states)


def test_stride_gives_the_trainers_pipeline_one_order_on_any_number_of_ranks(tmp_path):
    """--stride with ODM: whatever the number of ranks (at one global batch), step s trains on
    the same sequences, from the same domains, as on one rank, also across a 2 -> 3 reshard.
    The mixer learns between steps from losses that are the same on every rank."""
    for d in range(2):
        write_corpus(tmp_path / f"dom{d}", [7, 5, 9], seed=d, first_id=100 * d)
    urls = str(tmp_path / "*/*.jsonl")
    args = args_for({"seed": 1, "length": 6, "shuffle": 4}, "--odm=exp3", "--stride",
                    "--odm-warmup-steps=1", f"--dataset={urls}")
    args.epochs = None  # (endless: the steps run through several epochs)

    def ranks(world, states=None):
        args.grad_accum = 6 // world  # (a global batch of 6 sequences)
        pipes, mixers = [], []
        for rank in range(world):
            _, weights, mixer = train_llm.mixture(args, {"config": {}})
            pipes.append(train_llm.build_pipeline(urls, TOKENIZER, args, rank, world, train=True,
                                                  weights=weights, mixer=mixer))
            mixers.append(mixer)
            if states:
                data.reshard(pipes[-1], states)
        return pipes, mixers

    def steps(pipes, mixers, first, n):
        """The sequences of n steps from step ``first``, in the global order: micro-batch j of
        rank r holds sequence j * world + r of the step."""
        out = []
        for step in range(first, first + n):
            batches = [[next(pipe) for _ in range(args.grad_accum)] for pipe in pipes]
            out += [(batches[r][j]["input_ids"].tolist(), batches[r][j]["domain"].tolist())
                    for j in range(args.grad_accum) for r in range(len(pipes))]
            for mixer in mixers:
                mixer.update({0: 1 + step % 3, 1: 2 - step % 2}, step + 1)
        return out

    one = steps(*ranks(1), 0, 10)
    assert steps(*ranks(3), 0, 10) == one
    two = ranks(2)
    assert steps(*two, 0, 4) == one[:24]
    states = [json.loads(json.dumps(pipe.state_dict())) for pipe in two[0]]
    assert steps(*ranks(3, states), 4, 6) == one[24:]
