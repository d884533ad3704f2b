"""Several ranks: data sharding, resharding to another world size, and train_llm.py under torchrun.

The data tests build the trainer's own pipeline (train_llm.build_pipeline) in-process. The
trainer tests run `torchrun --nproc-per-node 2` on CPU with gloo, as a user would, on a corpus
of fixed-length documents ("d17 q w e ...": one document is exactly one 32-token sequence) and a
word-level tokenizer, so that which documents a run trained on can be read off its loader state.
"""

import collections
import fcntl
import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from helpers import (
    CORPUS_STEPS,
    ENV,
    ID_OF,
    ROOT,
    Count,
    assert_same_weights,
    consumed,
    corpus_args,
    digest,
    examples,
    export,
    final_model,
    kill_at,
    loader_states,
    metrics,
    ranks_command,
    resumable_step,
    resumed_steps,
    run_ranks,
    stage,
    word_tokenizer,
    write_corpus,
)
from helpers import WORD_TOKENIZER as TOKENIZER
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

import data
import train_llm

# ----------------------------------------------------------------------------------------------
# data.reshard on the trainer's pipeline
# ----------------------------------------------------------------------------------------------

def pipeline(urls, rank, world_size, p):
    args = train_llm.get_parser().parse_args([
        "-e", "x", "--active-shards=4", "--epochs=1", f"--seed={p['seed']}",
        "--tokenizer-threads=1", f"--seq-length={p['length']}",
        f"--shuffle-buffer={p['shuffle']}", "--batch-size=1"])
    return train_llm.build_pipeline(urls, TOKENIZER, args, rank, world_size, train=True)


@settings(max_examples=examples(100), deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 25), min_size=1, max_size=6),
    "worlds": st.lists(st.sampled_from([1, 2, 4]), min_size=2, max_size=3),
    "length": st.integers(2, 9),
    "shuffle": st.integers(1, 6),
    "seed": st.integers(0, 3),
    "cuts": st.lists(st.integers(0, 40), min_size=12, max_size=12),
}))
def test_reshard_trains_every_document_exactly_once(tmp_path_factory, p):
    """Ranks of world size W read a while, save; W' ranks resume from those states (and maybe
    W'' from theirs) and read to the end of the (finite) data. Every document's id token must
    be emitted exactly once, counting the tokens ConcatChunk holds back at the very end."""
    directory = tmp_path_factory.mktemp("corpus")
    n_docs = write_corpus(directory, p["sizes"], seed=p["seed"])
    urls = str(directory / "*.jsonl")
    cuts = iter(p["cuts"])
    emitted, states, leftovers = [], None, []
    for k, world in enumerate(p["worlds"]):
        last = k == len(p["worlds"]) - 1
        new_states = []
        for rank in range(world):
            pipe = pipeline(urls, rank, world, p)
            if states is not None:
                report = data.reshard(pipe, states)
                assert report["old_world_size"] == len(states)
            for batch in pipe if last else Count(pipe, next(cuts)):
                emitted += batch["input_ids"].flatten().tolist()
            new_states.append(json.loads(json.dumps(pipe.state_dict())))
            pipe.close()
            if last:  # what Prefetch's process read past its last batch, read again here
                pipe = pipeline(urls, rank, world, p).src
                pipe.load_state_dict(new_states[-1]["upstream"])
                emitted += [t for batch in pipe for t in batch["input_ids"].flatten().tolist()]
                chunker = stage(pipe, data.ConcatChunk)
                leftovers += chunker.buf[chunker.pos:].tolist()
        states = new_states

    tokens = emitted + leftovers
    seen = collections.Counter(ID_OF[t] for t in tokens if t in ID_OF)
    assert seen == collections.Counter(range(n_docs))
    letters = sum(1 for t in tokens if t not in ID_OF and t > 2)
    bos_eos = sum(1 for t in tokens if t in (0, 1))
    assert bos_eos == 2 * n_docs
    expected_letters = sum(len(json.loads(line)["text"].split()) - 1
                           for f in sorted(directory.glob("*.jsonl"))
                           for line in f.read_text().splitlines())
    assert letters == expected_letters


@settings(max_examples=examples(40), deadline=None, suppress_health_check=list(HealthCheck))
@given(p=st.fixed_dictionaries({
    "sizes": st.lists(st.integers(0, 12), min_size=1, max_size=5),
    "slots": st.sampled_from([1, 2, 4, 8]),
    "world": st.sampled_from([1, 2, 4]),
    "epochs": st.integers(1, 3),
    "shuffle_shards": st.booleans(),
    "threads": st.integers(1, 3),
    "length": st.integers(2, 9),
    "shuffle": st.integers(1, 6),
    "batch": st.integers(1, 3),
    "seed": st.integers(0, 3),
}))
def test_every_stage_passes_on_every_document_once_per_epoch(tmp_path_factory, p):
    """The pipeline cut after each of its stages, all ranks together, --epochs E: every
    document's id token comes out exactly E times (counting what ConcatChunk still holds at
    the end). "Resumed == uninterrupted" alone cannot see a stage that repeats or drops
    documents: a stream that repeats each one 8 times resumes exactly too."""
    if p["slots"] % p["world"]:
        p["world"] = p["slots"]
    directory = tmp_path_factory.mktemp("corpus")
    n_docs = write_corpus(directory, p["sizes"], seed=p["seed"])
    urls = str(directory / "*.jsonl")
    stages = [
        lambda pipe: data.Tokenize(pipe, TOKENIZER, num_threads=p["threads"], batch_size=3),
        lambda pipe: data.EnsureBosEos(pipe, TOKENIZER),
        lambda pipe: data.ConcatChunk(pipe, p["length"]),
        lambda pipe: data.Shuffle(pipe, p["shuffle"], seed=p["seed"]),
        lambda pipe: data.Batch(pipe, p["batch"]),
        lambda pipe: data.Prefetch(pipe),
    ]
    def build(rank, depth):
        pipe = data.Files(urls, epochs=p["epochs"], repeat=True, seed=p["seed"],
                          shuffle_shards=p["shuffle_shards"], rank=rank, world_size=p["world"],
                          n_active_shards=p["slots"])
        for make in stages[:depth]:
            pipe = make(pipe)
        return pipe

    def ids_in(pipe, depth):
        if depth == 0:
            return [int(item["text"].split()[0][1:]) for item in pipe]
        return [ID_OF[t] for item in pipe
                for t in torch.as_tensor(item["input_ids"]).flatten().tolist() if t in ID_OF]

    for depth in range(len(stages) + 1):
        ids = []
        for rank in range(p["world"]):
            try:
                pipe = build(rank, depth)
            except data.SplitError:  # fewer lines than slots: nothing to check
                return
            ids += ids_in(pipe, depth)
            if isinstance(pipe, data.Prefetch):  # its stages ran in its process: what they read
                state = pipe.state_dict()["upstream"]  # past its last item is read again here
                pipe.close()
                pipe = build(rank, depth - 1)
                pipe.load_state_dict(state)
                ids += ids_in(pipe, depth - 1)
            if depth >= 3:  # ConcatChunk's last, incomplete chunk
                chunker = stage(pipe, data.ConcatChunk)
                ids += [ID_OF[t] for t in chunker.buf[chunker.pos:].tolist() if t in ID_OF]
            pipe.close()
        assert collections.Counter(ids) == collections.Counter(
            {doc: p["epochs"] for doc in range(n_docs)}), f"after {depth} stages"


@settings(max_examples=examples(20), deadline=None, suppress_health_check=list(HealthCheck))
@given(sizes=st.lists(st.integers(0, 25), min_size=1, max_size=6), world=st.sampled_from([1, 2]),
       cut=st.integers(0, 30), seed=st.integers(0, 3), shuffle=st.integers(1, 6))
def test_reshard_to_the_same_world_size_is_exact(tmp_path_factory, sizes, world, cut, seed,
                                                 shuffle):
    """Resharding W -> W (what a changed --batch-size goes through) changes nothing at all."""
    directory = tmp_path_factory.mktemp("corpus")
    write_corpus(directory, sizes, seed=seed)
    urls = str(directory / "*.jsonl")
    p = {"seed": seed, "length": 4, "shuffle": shuffle}
    for rank in range(world):
        straight = [b["input_ids"].tolist() for b in pipeline(urls, rank, world, p)]
        states = []
        for r in range(world):
            pipe = pipeline(urls, r, world, p)
            for _ in Count(pipe, cut):
                pass
            states.append(pipe.state_dict())
            pipe.close()
        resumed = pipeline(urls, rank, world, p)
        data.reshard(resumed, states)
        assert [b["input_ids"].tolist() for b in resumed] == straight[cut:]


def test_reshard_refuses_stages_it_cannot_split():
    pipe = Count(data.Files(str(ROOT / "data/sample/prose/val-*.jsonl")), 3)
    with pytest.raises(ValueError, match="Count"):
        data.reshard(pipe, [pipe.state_dict()])


# ----------------------------------------------------------------------------------------------
# train_llm.py under torchrun
# ----------------------------------------------------------------------------------------------

@pytest.mark.slow
def test_ranks_read_disjoint_documents_whose_union_is_the_one_rank_run(
        two_ranks, tiny_model, corpus, tmp_path):
    one = tmp_path / "run"
    run_ranks(corpus_args(tmp_path, tiny_model, corpus, batch_size=8), ranks=1)
    for step in (8, CORPUS_STEPS):
        slots_two, buffered_two = consumed(loader_states(two_ranks, step))
        slots_one, buffered_one = consumed(loader_states(one, step))
        assert buffered_two == buffered_one == 0
        assert slots_two == slots_one  # same documents; disjointness checked in consumed()
    # Every step of the 2-rank run is logged once by rank 0, with the tokens of both ranks.
    rows = metrics(two_ranks)
    assert [row["step"] for row in rows] == list(range(1, CORPUS_STEPS + 1))
    assert rows[-1]["tokens_seen"] == CORPUS_STEPS * 2 * 4 * 32
    assert rows[-1]["loss"] < rows[0]["loss"]
    state = json.loads((two_ranks / "state.json").read_text())
    assert state["world_size"] == 2
    assert {p.name for p in (two_ranks / state["checkpoint"]).iterdir()} == {
        "model.pt", "optimizer.pt", "lr_scheduler.pt", "rng-rank0.pt", "rng-rank1.pt",
        "loader-rank0.json", "loader-rank1.json", "state.json"}


def kill_until_done(args, exp_dir, log, at=(4, 8)):
    """Start the 2-rank run and SIGKILL torchrun and its ranks once rank 0 has logged each
    step of ``at``, at a random moment of the next step; then let it finish. Every restart
    must say it resumes from the last checkpoint before its kill."""
    rng = random.Random(0)
    expected = []
    for step in at:
        expected.append(resumable_step(exp_dir))
        with open(log, "ab") as out:
            proc = subprocess.Popen(ranks_command(args, 2), cwd=ROOT, env=ENV, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
        # torchrun and its ranks share a process group: they die together
        kill_at(proc, exp_dir, step, rng.uniform(0, 0.02), timeout=120,
                kill=lambda: os.killpg(proc.pid, signal.SIGKILL))  # noqa: B023
        assert_no_orphans(exp_dir)
    expected.append(resumable_step(exp_dir))
    result = run_ranks(args, ranks=2)
    assert resumed_steps(log.read_text() + result.stderr) == [s for s in expected if s]
    assert expected[-1] > 0


def assert_no_orphans(exp_dir, timeout=30):
    """No rank outlives a killed torchrun: rank 0's lock on the run directory gets free."""
    deadline = time.monotonic() + timeout
    with open(exp_dir / ".lock", "w") as f:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                return
            except BlockingIOError:
                assert time.monotonic() < deadline, "a rank survived its torchrun"
                time.sleep(0.05)


@pytest.mark.slow
def test_sigkill_the_torchrun_group_then_resume_is_bit_identical(
        two_ranks, tiny_model, corpus, tmp_path):
    # Written in the background (the barriers on the writer's own gloo group), the reference
    # in the training thread: equal to the bit.
    args = corpus_args(tmp_path, tiny_model, corpus, ckpt_freq=3,
                       checkpoint_writer="background")
    exp_dir = tmp_path / "run"
    kill_until_done(args, exp_dir, tmp_path / "log.txt")
    assert_same_weights(final_model(exp_dir), final_model(two_ranks))
    for name in ("optimizer.pt", "loader-rank0.json", "loader-rank1.json"):
        final = f"checkpoints/step-{CORPUS_STEPS:06d}/{name}"
        assert digest(exp_dir / final) == digest(two_ranks / final), name
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert ([[row.get(k) for k in keys] for row in metrics(exp_dir)]
            == [[row.get(k) for k in keys] for row in metrics(two_ranks)])


@pytest.mark.slow
@pytest.mark.parametrize("before, after", [(2, 1), (1, 2)])
def test_a_resume_on_another_number_of_ranks_skips_and_repeats_no_document(two_ranks, tiny_model,
                                                                           corpus, tmp_path,
                                                                           before, after):
    """W -> W' ranks at step 6 with the global batch kept (per-rank batch 8/W); --max-steps
    raised at the same time. No document is skipped or repeated: with one document per
    sequence and no shuffle buffer the documents consumed are those of the W-rank run."""
    exp_dir = tmp_path / "run"
    run_ranks(corpus_args(tmp_path, tiny_model, corpus, batch_size=8 // before, max_steps=6),
              before)
    result = run_ranks(corpus_args(tmp_path, tiny_model, corpus, batch_size=8 // after), after)
    assert f"Data of {before} rank(s) moved to {after}" in result.stderr
    assert "no document skipped or repeated" in result.stderr
    state = json.loads((exp_dir / "state.json").read_text())
    assert state["global_step"] == CORPUS_STEPS and state["world_size"] == after
    assert [row["step"] for row in metrics(exp_dir)] == list(range(1, CORPUS_STEPS + 1))
    assert consumed(loader_states(exp_dir)) == consumed(loader_states(two_ranks))
    # The run goes on from the checkpoint's weights, not from a fresh model's loss of ~9.
    rows = metrics(exp_dir)
    assert rows[6]["loss"] < rows[0]["loss"] - 1.0, (rows[0]["loss"], rows[6]["loss"])


@pytest.mark.slow
def test_a_changed_global_batch_is_refused(two_ranks, tiny_model, corpus):
    before = digest(two_ranks / "state.json")
    result = subprocess.run(ranks_command(corpus_args(two_ranks.parent, tiny_model, corpus,
                                                      max_steps=CORPUS_STEPS + 2), 1),
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode != 0
    assert "global batch" in result.stderr and "was 8 sequences" in result.stderr
    assert digest(two_ranks / "state.json") == before


@pytest.mark.slow
def test_skipped_records_are_counted_over_all_ranks(tiny_model, tmp_path):
    """A bad first line in each of 4 shards, 2 ranks reading 2 shards each: by step 20 every
    rank has handed on its first tokenizer batch (64 documents), which held its 2 skips, and
    data/skipped counts all 4, not rank 0's 2."""
    corpus = tmp_path / "bad"
    write_corpus(corpus / "train", [40] * 4, words=29)
    for shard in (corpus / "train").glob("*.jsonl"):
        shard.write_text("{not json\n" + shard.read_text())
    write_corpus(corpus / "val", [10], words=29)
    word_tokenizer().save_pretrained(corpus / "tokenizer")
    run_ranks(corpus_args(tmp_path, tiny_model, corpus, max_steps=20, log_freq=20,
                          val_freq=20, ckpt_freq=20, skip_bad_records=True), ranks=2)
    assert [row["data/skipped"] for row in metrics(tmp_path / "run") if "data/skipped" in row] \
        == [4]


@pytest.mark.slow
def test_uneven_finite_data_stops_every_rank(tiny_model, tmp_path):
    """--epochs 1 over shards of very different sizes: rank 1's slots (21 documents, 5 steps
    of 4) run dry long before rank 0's. Both ranks stop at the same step, save (or, when that
    step was just saved, only mark the run done), and a rerun says the run is done."""
    corpus = tmp_path / "uneven"
    write_corpus(corpus / "train", [60, 12, 60, 9], words=29)
    write_corpus(corpus / "val", [10], words=29)
    word_tokenizer().save_pretrained(corpus / "tokenizer")
    for ckpt_freq in (1000, 5):  # the last step's checkpoint is written at the end / exists
        args = corpus_args(tmp_path, tiny_model, corpus, name=f"ckpt{ckpt_freq}",
                           max_steps=1000, epochs=1, ckpt_freq=ckpt_freq)
        result = run_ranks(args, ranks=2, timeout=120)
        assert "The data ran out (--epochs 1) before step 6" in result.stderr
        state = json.loads((tmp_path / f"ckpt{ckpt_freq}/state.json").read_text())
        assert state["data_exhausted"] and state["global_step"] == 5
        assert state["checkpoint"] == "checkpoints/step-000005"
        assert (tmp_path / f"ckpt{ckpt_freq}/checkpoints/step-000005/model.pt").exists()
        assert "is done: its data ran out" in run_ranks(args, ranks=2).stderr


@pytest.mark.slow
def test_the_failing_ranks_paragraph_is_said_last_and_the_others_stop_quietly(tiny_model,
                                                                               tmp_path):
    """A bad record in the shard only rank 1 reads (2 slots: one shard each): rank 1's
    paragraph, naming the shard and line, comes after anything rank 0 says (torchrun's table
    of failures repeats it as the root cause), and rank 0, whose collective fails when rank 1
    exits, prints no traceback. torchrun's own traceback, around its table, is the only one."""
    corpus = tmp_path / "corpus"
    write_corpus(corpus / "train", [300, 300], words=29)  # neither rank reaches the other's
    shard = corpus / "train/train-001.jsonl"
    lines = shard.read_text().splitlines(keepends=True)
    shard.write_text("".join([*lines[:2], '{"text": 5}\n', *lines[3:]]))
    write_corpus(corpus / "val", [10], words=29)
    word_tokenizer().save_pretrained(corpus / "tokenizer")
    result = subprocess.run(ranks_command(corpus_args(tmp_path, tiny_model, corpus,
                                                      active_shards=2), 2),
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=180)
    err = result.stderr
    paragraph = f"DataError: shard {shard}, line 3: bad record"
    assert result.returncode != 0 and paragraph in err, err[-3000:]
    tail = err[err.rindex(paragraph):]  # from where it is said last: nothing of rank 0
    assert "rank 0:" not in tail and "local_rank: 0" not in tail, err
    assert err.count("Traceback") == err.count("raise ChildFailedError("), err
    assert "Connection closed" not in err and "[rank0]:" not in err, err


@pytest.mark.slow
def test_fsdp_trains_saves_sharded_and_resumes_exactly(two_ranks, tiny_model, corpus, tmp_path):
    """FSDP2 on CPU with gloo, the default optimizer (Muon, on whole matrices: muon.Muon): a run
    killed and resumed equals one that was not, and its first step equals DDP's up to float
    rounding (same data, same math)."""
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    run_ranks(corpus_args(tmp_path, tiny_model, corpus, name="straight", fsdp=True), ranks=2)
    # dcp.save off the loop. Killed after step 7: the save of step 6 waited for step 3's
    # write, so a complete checkpoint exists (a kill after step 5 may land before one does).
    kill_until_done(corpus_args(tmp_path, tiny_model, corpus, name="killed", fsdp=True,
                                ckpt_freq=3, checkpoint_writer="background"),
                    killed, tmp_path / "log.txt", at=(7,))
    assert json.loads((straight / "state.json").read_text())["config"]["optimizer"] == "muon"
    weights = []
    for exp_dir in (straight, killed):
        ckpt = exp_dir / f"checkpoints/step-{CORPUS_STEPS:06d}"
        assert {p.name for p in ckpt.iterdir()} >= {"dcp", "loader-rank0.json",
                                                   "loader-rank1.json", "lr_scheduler.pt"}
        dcp_to_torch_save(ckpt / "dcp", tmp_path / f"{exp_dir.name}.pt")
        weights.append(torch.load(tmp_path / f"{exp_dir.name}.pt", weights_only=True)["model"])
    assert_same_weights(*weights)
    # export_hf.py gathers the shards: the final weights, in plain transformers.
    hf = AutoModelForCausalLM.from_pretrained(export(straight)).state_dict()
    assert_same_weights({k: v for k, v in hf.items() if k in weights[0]}, weights[0])
    # FSDP computes what DDP does: the first step's loss and gradient norm (before any update,
    # so whatever the optimizer) agree up to float rounding.
    fsdp_first, ddp_first = metrics(straight)[0], metrics(two_ranks)[0]
    for key in ("loss", "grad_norm"):
        assert fsdp_first[key] == pytest.approx(ddp_first[key], rel=1e-4), key


HUNG_RANK = """
import sys, time
import torch, torch.distributed as dist
sys.path.insert(0, {root!r})
import utils
dist.init_process_group("gloo")
dist.barrier()
utils.set_collective_timeout(3)
if dist.get_rank() == 1:
    time.sleep(600)  # a hung rank: alive, but never joins the all-reduce
start = time.monotonic()
try:
    dist.all_reduce(torch.ones(1))
except Exception as e:
    print(f"rank 0 failed after {{time.monotonic() - start:.0f}} s: {{type(e).__name__}}")
    sys.exit(3)
"""


@pytest.mark.slow
def test_a_hung_rank_fails_the_others_after_the_short_timeout(tmp_path):
    """What --dist-timeout relies on: after utils.set_collective_timeout, a collective that a
    rank never joins fails in seconds (gloo's default would wait 30 minutes)."""
    script = tmp_path / "hung.py"
    script.write_text(HUNG_RANK.format(root=str(ROOT)))
    result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                             "--nproc-per-node=2", str(script)], env=ENV, capture_output=True,
                            text=True, timeout=120)
    assert result.returncode != 0
    seconds = int(result.stdout.split("rank 0 failed after ")[1].split()[0])
    assert 2 <= seconds <= 30, result.stdout


@pytest.mark.slow
def test_a_resume_on_three_ranks_is_bit_identical(tiny_model, corpus, tmp_path):
    """Three ranks' gradient sums round by the order they are added in, which DDP takes from its
    bucket layout: a run stopped at step 5 and resumed ends with the weights of one that ran
    straight. One JSONL file, as a user has. (FSDP2's reduce-scatter has one layout: 3-rank
    resumes were exact by hand.)"""
    write_corpus(tmp_path / "one", [320], words=29)
    for name, stops in (("straight", [CORPUS_STEPS]), ("resumed", [5, CORPUS_STEPS])):
        for steps in stops:
            run_ranks(corpus_args(tmp_path, tiny_model, corpus, name=name, max_steps=steps,
                                  decay_steps=CORPUS_STEPS, ckpt_freq=CORPUS_STEPS,
                                  dataset=tmp_path / "one/train-000.jsonl", active_shards=3),
                      ranks=3)
    assert_same_weights(final_model(tmp_path / "straight"), final_model(tmp_path / "resumed"))
