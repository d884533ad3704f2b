"""epochraft's API, the chained face of data.py (CheckpointableDataset): the tutorial's code
cells run with only the import changed and print what it prints; every verb resumes exactly
from a state cut anywhere (random chains), and reshards or is refused by name; stride keeps
one order of samples whatever the number of ranks; Files' standby shards change no sample."""

import json
import threading
import time
from pathlib import Path

import pytest
import torch
from helpers import ROOT, comparable, examples, jsonl, stage
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from transformers import AutoTokenizer

import data
from data import CheckpointableDataset, concat_datasets, interleave_datasets

TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")  # (the tutorial's: Hub)
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa".split()


def corpus(directory, sizes):
    """Shards of the given sizes (documents); each document "d<i> ..." of its own length."""
    docs, urls = 0, []
    for k, size in enumerate(sizes):
        urls.append(str(directory / f"part-{k}.jsonl"))
        words = [" ".join(WORDS[:n % 9 + 1]) for n in range(docs, docs + size)]
        jsonl(directory / f"part-{k}.jsonl", [{"text": f"d{docs + i} {words[i]}", "n": docs + i}
                                              for i in range(size)])
        docs += size
    return urls


def read(it, n=None):
    out = []
    while n is None or len(out) < n:
        try:
            out.append(comparable(next(it)))
        except StopIteration:
            break
    return out


# -- The tutorial, cell by cell --------------------------------------------------------------------

def test_the_tutorials_code_cells_print_what_it_prints(tmp_path):
    url = corpus(tmp_path, [40])[0]
    first = json.loads(open(url).readline())
    # Quick Start: the pipeline, a batch, its state saved with torch.save and loaded back
    dataset = (CheckpointableDataset.from_files(url, repeat=True, shuffle_shards=True)
               .tokenize(TOKENIZER).ensure_bos_eos(TOKENIZER).concat_chunk(16).shuffle(1000)
               .batch(8))
    assert isinstance(dataset, torch.utils.data.IterableDataset)
    it = dataset.iter()
    batch = next(it)
    assert type(batch["input_ids"]) is torch.Tensor and batch["input_ids"].shape == (8, 16)
    torch.save({"it": it.state_dict()}, tmp_path / "checkpoint.pth")
    expected = read(it, 3)
    it.close()
    state_dict = torch.load(tmp_path / "checkpoint.pth", weights_only=True)
    with dataset.iter(state_dict=state_dict["it"]) as it:
        assert read(it, 3) == expected
    # from_files: one URL, a list, a brace pattern
    jsonl(tmp_path / "other.jsonl", [{"text": "second shard"}])
    for urls in (url, [url, str(tmp_path / "other.jsonl")], str(tmp_path / "part-{0..0}.jsonl")):
        assert next(iter(CheckpointableDataset.from_files(urls))) == first
    samples = [{"text": "Hello world!"}, {"text": "こんにちは世界！"}, {"text": "你好世界！"},
               {"text": "안녕하세요 세계!"}]
    shuffled = list(CheckpointableDataset.from_sequence(samples, shuffle=True))
    assert sorted(s["text"] for s in shuffled) == sorted(s["text"] for s in samples)

    def upper(sample):
        sample = sample.copy()
        sample["text"] = sample["text"].upper()
        return sample

    assert next(iter(CheckpointableDataset.from_sequence(samples).map(upper))) == {
        "text": "HELLO WORLD!"}
    short = CheckpointableDataset.from_sequence(samples).filter(lambda s: len(s["text"]) < 10)
    assert [s["text"] for s in short] == ["こんにちは世界！", "你好世界！", "안녕하세요 세계!"]
    threaded = CheckpointableDataset.from_sequence(samples).parallel_map(
        upper, executor_type="thread", max_workers=1)
    assert next(iter(threaded)) == {"text": "HELLO WORLD!"}
    tokenized = CheckpointableDataset.from_sequence(samples).tokenize(TOKENIZER, max_workers=2)
    ids = TOKENIZER("Hello world!")["input_ids"]
    assert next(iter(tokenized))["input_ids"] == ids
    assert next(iter(tokenized.ensure_bos_eos(TOKENIZER)))["input_ids"] == ids + [
        TOKENIZER.eos_token_id]  # (its BOS and EOS are one token: only EOS is added)
    # Chunking: chunk and concat_chunk of 6
    docs = [{"input_ids": list(range(10))}, {"input_ids": [10, 11, 12]},
            {"input_ids": list(range(20, 27))}]
    chunks = CheckpointableDataset.from_sequence(docs).chunk(6)
    assert [c["input_ids"].tolist() for c in chunks] == [list(range(6)), list(range(20, 26))]
    chunks = CheckpointableDataset.from_sequence(docs).concat_chunk(6)
    assert [c["input_ids"].tolist() for c in chunks] == [
        [0, 1, 2, 3, 4, 5], [6, 7, 8, 9, 10, 11], [12, 20, 21, 22, 23, 24]]
    # Combinations: interleave 1.5 : 1, and take 3 + concat
    hello = CheckpointableDataset.from_sequence([{"text": "Hello world!"}], repeat=True)
    konnichiwa = CheckpointableDataset.from_sequence([{"text": "こんにちは世界！"}], repeat=True)
    it = iter(interleave_datasets([hello, konnichiwa], weights=[1.5, 1]))
    assert "".join("HK"[next(it)["text"] != "Hello world!"] for _ in range(10)) == "HKHKHHKHKH"
    both = concat_datasets([hello.take(3), konnichiwa.take(3)])
    assert [s["text"] for s in both] == ["Hello world!"] * 3 + ["こんにちは世界！"] * 3
    assert [s["text"] for s in hello.take(1) + konnichiwa.take(1)] == [
        "Hello world!", "こんにちは世界！"]


# -- Every verb: cut anywhere, resumed in a new pipeline -------------------------------------------

def keep(sample):
    return sample["n"] % 3 != 1


def tag(sample):
    return {**sample, "tag": sample["n"] * 2}


def tag_or_drop(sample):
    return tag(sample) if keep(sample) else None


TEXT_VERBS = {
    "map": lambda d: d.map(tag),
    "filter": lambda d: d.filter(keep),
    "filter_map": lambda d: d.filter_map(tag_or_drop),
    "parallel_map": lambda d: d.parallel_map(tag, max_workers=2, prefetch_factor=2,
                                             executor_type="thread"),
    "parallel_filter": lambda d: d.parallel_filter(keep, max_workers=1, executor_type="thread"),
    "take": lambda d: d.take(25),
    "enumerate": lambda d: d.enumerate(),
    "stride": lambda d: d.stride(2, 1),
    "shuffle": lambda d: d.shuffle(7, seed=3),
    "cache": lambda d: d.cache(),
}
ID_VERBS = {  # (one of them)
    "chunk": lambda d: d.chunk(4),
    "concat_chunk": lambda d: d.concat_chunk(8),
    "pad": lambda d: d.pad({"input_ids": 1}, 32),
    "pack_chunk": lambda d: d.pack_chunk(24, ["input_ids"]),
    "none": lambda d: d,
}
LAST_VERBS = {"shuffle": lambda d: d.shuffle(5), "take": lambda d: d.take(30),
              "batch": lambda d: d.batch(3), "prefetch": lambda d: d.then(data.Prefetch)}


def source(kind, urls, repeat):
    records = [json.loads(line) for url in urls for line in open(url)]
    if kind == "files":
        return CheckpointableDataset.from_files(urls, repeat=repeat, shuffle_shards=True,
                                                n_active_shards=3)
    if kind == "sequence":
        return CheckpointableDataset.from_sequence(records, repeat=repeat, shuffle=True)
    if kind == "iterable":
        return CheckpointableDataset.from_iterable(tuple(records), repeat=repeat)
    half = len(records) // 2
    parts = [CheckpointableDataset.from_sequence(records[:half], repeat=repeat),
             CheckpointableDataset.from_files(urls[-1:], repeat=repeat, n_active_shards=2)]
    if kind == "interleave":
        return interleave_datasets(parts, weights=[2, 1], chunk_size=7)
    return concat_datasets(parts)


CHAIN = st.fixed_dictionaries({
    "source": st.sampled_from(["files", "sequence", "iterable", "interleave", "concat"]),
    "repeat": st.booleans(),
    "text": st.lists(st.sampled_from(sorted(TEXT_VERBS)), max_size=3),
    "bos_eos": st.booleans(),
    "ids": st.sampled_from(sorted(ID_VERBS)),
    "last": st.lists(st.sampled_from(sorted(LAST_VERBS)), max_size=2, unique=True),
    "cuts": st.lists(st.integers(0, 40), max_size=3),
})


def build(p, urls):
    dataset = source(p["source"], urls, p["repeat"])
    for verb in p["text"]:
        dataset = TEXT_VERBS[verb](dataset)
    dataset = dataset.tokenize(TOKENIZER, max_workers=2)
    if p["bos_eos"]:
        dataset = dataset.ensure_bos_eos(TOKENIZER)
    dataset = ID_VERBS[p["ids"]](dataset)
    for verb in p["last"]:
        dataset = LAST_VERBS[verb](dataset)
    return dataset


@settings(max_examples=examples(40), deadline=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(p=CHAIN)
def test_every_verb_resumes_exactly_from_a_cut_anywhere(tmp_path_factory, p):
    urls = corpus(tmp_path_factory.mktemp("c"), [9, 2, 14])  # uneven shards
    dataset, total = build(p, urls), 45
    with dataset.iter() as it:
        straight = read(it, total)
    with dataset.iter() as it:  # (a cache hands out what it keeps)
        assert read(it, total) == straight
    resumed, it = [], dataset.iter()
    for cut in sorted(p["cuts"]):
        resumed += read(it, max(0, cut - len(resumed)))
        state = json.loads(json.dumps(it.state_dict()))
        it.close()
        it = build(p, urls).iter(state_dict=state)  # as a new process builds it
    resumed += read(it, total - len(resumed))
    it.close()
    assert resumed == straight


def test_a_process_pool_maps_in_order_and_resumes_exactly(tmp_path):
    dataset = CheckpointableDataset.from_files(corpus(tmp_path, [10, 7])).parallel_map(
        tag, max_workers=2, executor_type="process")
    with dataset.iter() as it:
        first = read(it, 6)
        state = it.state_dict()
        rest = read(it)
    assert [s["tag"] for s in first + rest] == [2 * s["n"] for s in first + rest]
    with dataset.iter(state_dict=state) as it:
        assert read(it) == rest
    unordered = CheckpointableDataset.from_files(corpus(tmp_path, [10, 7])).parallel_map(
        tag, max_workers=2, ordered=False, executor_type="process")
    assert sorted(s["n"] for s in unordered) == sorted(s["n"] for s in first + rest)


def children(pid):
    """The pids of the processes whose parent is ``pid``."""
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            if stat.read_text().rsplit(")", 1)[1].split()[1] == str(pid):
                out.append(int(stat.parent.name))
        except (OSError, IndexError):  # (gone meanwhile)
            pass
    return out


def test_a_process_pool_in_prefetchs_process_dies_with_it(tmp_path):
    """Prefetch's process is killed on close(); its ParallelMap's workers, which ignore SIGTERM
    as it does (the trainer's signals), must not live on as orphans."""
    dataset = CheckpointableDataset.from_files(corpus(tmp_path, [30])).parallel_map(
        tag, max_workers=2, executor_type="process").then(data.Prefetch)
    it = dataset.iter()
    next(it)
    workers = children(it._pid)
    assert len(workers) == 2
    it.close()
    deadline = time.monotonic() + 30
    while any(Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text()
              .rsplit(")", 1)[1].split()[0] for pid in workers):
        assert time.monotonic() < deadline, "a pool worker outlived Prefetch's process"
        time.sleep(0.01)


def test_from_files_reads_as_many_slots_as_the_world_size_divides(tmp_path):
    """The default 10 slots on 4 ranks: 8, each rank reading its 2."""
    urls = corpus(tmp_path, [12, 9])
    ranks = [CheckpointableDataset.from_files(urls, rank=r, world_size=4) for r in range(4)]
    assert [stage(it.build(), data.Files).config["n_active_shards"] for it in ranks] == [8] * 4
    assert sorted(s["n"] for d in ranks for s in d) == list(range(21))


def test_a_caches_state_loads_only_into_a_cache_of_the_same_data():
    ten = CheckpointableDataset.from_sequence([{"i": i} for i in range(10)]).cache()
    with ten.iter() as it:
        read(it, 3)
        state = it.state_dict()
    other = CheckpointableDataset.from_sequence([{"j": i} for i in range(11)]).cache()
    with pytest.raises(data.ConfigMismatch, match="Cache: the saved state was made with upstream"):
        other.iter(state_dict=state)


def test_a_verb_asked_for_what_the_stages_do_not_do_is_refused_by_name():
    dataset = CheckpointableDataset.from_sequence([{"text": "a"}])
    with pytest.raises(ValueError, match="tokenize: executor_type='process' not supported"):
        dataset.tokenize(TOKENIZER, executor_type="process")
    with pytest.raises(ValueError, match=r"concat_chunk: \('attention_mask',\) not supported"):
        dataset.concat_chunk(8, target_columns=("attention_mask",))
    with pytest.raises(ValueError, match="executor_type='fiber'"):
        next(iter(dataset.parallel_map(tag, executor_type="fiber")))


# -- Resharding: each verb on another number of ranks, or refused by name --------------------------

RESHARDABLE = {  # (the stages of the trainer's pipelines: test_reshard.py)
    "map": lambda d: d.map(tag), "filter": lambda d: d.filter(keep),
    "filter_map": lambda d: d.filter_map(tag_or_drop),
    "parallel_map": lambda d: d.parallel_map(tag, max_workers=1, executor_type="thread"),
    "parallel_filter": lambda d: d.parallel_filter(keep, max_workers=2, executor_type="thread"),
    "tokenize": lambda d: d.tokenize(TOKENIZER).ensure_bos_eos(TOKENIZER),
    "shuffle": lambda d: d.shuffle(4), "batch": lambda d: d.batch(2),
    "concat": lambda d: concat_datasets([d, d.filter(keep)]),
    "interleave": lambda d: interleave_datasets([d.filter(keep), d.filter(lambda s: not keep(s))],
                                                weights=[2, 1], chunk_size=3),
}
REFUSED = {"take": (lambda d: d.take(50), "Count"), "enumerate": (lambda d: d.enumerate(), "Count"),
           "chunk": (lambda d: d.tokenize(TOKENIZER).chunk(4), "Chunk"),
           "cache": (lambda d: d.cache(), "Cache")}


def names(item):
    return item["n"] if isinstance(item["n"], list) else [item["n"]]


@pytest.mark.parametrize("verb", sorted(RESHARDABLE))
def test_a_verb_moves_from_2_ranks_to_3_reading_every_document_once(tmp_path, verb):
    urls = corpus(tmp_path, [10, 7, 13, 5, 9, 8])

    def pipeline(rank, world):
        return RESHARDABLE[verb](CheckpointableDataset.from_files(
            urls, n_active_shards=6, rank=rank, world_size=world)).iter()

    seen, states = [], []
    for rank in range(2):
        it = pipeline(rank, 2)
        seen += [n for item in read(it, 4) for n in names(item)]
        states.append(json.loads(json.dumps(it.state_dict())))
        it.close()
    for rank in range(3):
        it = pipeline(rank, 3)
        data.reshard(it, states)
        seen += [n for item in read(it) for n in names(item)]
    kept = [n for n in range(52) if n % 3 != 1]
    if verb == "interleave":  # (it ends with the first of its pipelines to end)
        assert len(set(seen)) == len(seen) > 40
        return
    assert sorted(seen) == sorted({"concat": [*range(52), *kept], "filter_map": kept,
                                   "filter": kept, "parallel_filter": kept}.get(verb, range(52)))


@pytest.mark.parametrize("verb", sorted(REFUSED))
def test_a_verb_whose_state_is_per_rank_is_refused_by_name_on_another_number(tmp_path, verb):
    urls, (make, cls) = corpus(tmp_path, [6, 6]), REFUSED[verb]
    pipes = [make(CheckpointableDataset.from_files(
        urls, n_active_shards=2, rank=r, world_size=2)).iter() for r in range(2)]
    states = [json.loads(json.dumps(p.state_dict())) for p in pipes if next(p)]
    one = make(CheckpointableDataset.from_files(urls, n_active_shards=2)).iter()
    with pytest.raises(ValueError, match=f"reshard: .*{cls}"):
        data.reshard(one, states)


@pytest.mark.parametrize("source", ["from_sequence", "from_iterable"])
def test_an_in_memory_source_is_refused_by_name_on_another_number_of_ranks(source):
    """(With stride on top they reshard: the stride test.)"""
    dataset = getattr(CheckpointableDataset, source)([{"text": str(i)} for i in range(10)])
    pipes = [dataset.iter() for _ in range(2)]
    states = [p.state_dict() for p in pipes if next(p)]
    with pytest.raises(ValueError, match="reshard: .*reads Sequence"):
        data.reshard(dataset.iter(), states)


# -- stride: one order of samples on any number of ranks -------------------------------------------

def global_order(pipes, n):
    """The samples of ranks striding over one stream, as that stream had them: round-robin."""
    return [pipes[i % len(pipes)].__next__()["n"] for i in range(n)]


def test_stride_keeps_one_order_on_1_2_and_3_ranks_past_an_epoch_and_across_a_reshard(tmp_path):
    stream = CheckpointableDataset.from_files(corpus(tmp_path, [9, 2, 14]), repeat=True,
                                              shuffle_shards=True, n_active_shards=3)
    one = global_order([stream.iter()], 120)  # 25 documents: over four epochs
    assert sorted(one[:25]) == list(range(25)) == sorted(one[25:50])
    for world in (2, 3):
        assert global_order([stream.stride(world, r).iter() for r in range(world)], 120) == one
    two = [stream.stride(2, r).iter() for r in range(2)]
    assert global_order(two, 36) == one[:36]
    states = [json.loads(json.dumps(p.state_dict())) for p in two]
    three = [stream.stride(3, r).iter() for r in range(3)]
    for pipe in three:
        data.reshard(pipe, states)
    assert global_order(three, 84) == one[36:]
    two = [stream.stride(2, r).iter() for r in range(2)]
    two[0].__next__()  # rank 0 a sample ahead: the ranks stopped out of step
    with pytest.raises(ValueError, match="stopped at different places"):
        data.reshard(stream.stride(3, 0).iter(), [p.state_dict() for p in two])


# -- Files: standby shards, CBOR -------------------------------------------------------------------

def test_standby_shards_are_opened_off_the_training_thread_and_change_no_sample(
        tmp_path, monkeypatch):
    urls = corpus(tmp_path, [3, 5, 1, 4, 6, 2, 3, 5])
    opened = []  # (of this test's shards: other tests' pipelines may still open theirs)
    reader = data.Shards.reader
    monkeypatch.setattr(data.Shards, "reader", lambda self, slot: (
        slot["url"] in urls and opened.append(threading.current_thread().name.startswith(
            "standby")), reader(self, slot))[1])

    def samples(standby):
        return [s["n"] for s in CheckpointableDataset.from_files(
            urls, repeat=True, n_active_shards=2, n_standby_shards=standby).take(70)]

    without = samples(0)
    assert not any(opened) and len(opened) > 16  # (over two epochs)
    opened.clear()
    assert samples(2) == without
    assert opened.count(False) == 2 and len(opened) > 16  # the first two slots' only


def test_a_cbor_shard_reads_resumes_and_is_checked_like_json_lines(tmp_path):
    import cbor2
    records = [{"text": f"document {i}", "n": i} for i in range(12)]
    url = tmp_path / "x.cbor"
    with open(url, "wb") as f:
        for record in records:
            cbor2.dump(record, f)
    dataset = CheckpointableDataset.from_files(str(url), format="cbor")
    assert list(dataset) == records and list(CheckpointableDataset.from_files(str(url))) == records
    with dataset.iter() as it:
        read(it, 5)
        state = it.state_dict()
    with dataset.iter(state_dict=state) as it:
        assert read(it) == records[5:]
    whole = url.read_bytes()
    url.write_bytes(whole[:-3])
    with pytest.raises(data.DataError, match=r"x.cbor: cut short inside record 12"):
        list(dataset)
    edited = bytearray(whole)  # the record read last before the cut, of the same size
    edited[edited.index(b"document 4") + 9] = ord("X")
    url.write_bytes(bytes(edited))
    with pytest.raises(data.DataError, match=r"x.cbor changed since this run read it"):
        read(dataset.iter(state_dict=state))
