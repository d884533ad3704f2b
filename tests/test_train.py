"""train_llm.py end to end, run the way a user runs it: as a subprocess from the repo root.

A one-layer, 32-wide model on 32-token sequences keeps a run to a few seconds, most of it
Python start-up. The reference run trains straight through; the other runs are killed,
stopped or broken on purpose and must continue from their checkpoints to the very same bits.
"""

import argparse
import glob
import json
import random
import signal
import subprocess
import sys
import tempfile
import textwrap
import threading
import time
import types
from pathlib import Path

import pytest
import torch
from helpers import (
    ENV,
    MAX_STEPS,
    ROOT,
    assert_same_run,
    digest,
    global_step,
    kill_at,
    last_step,
    metrics,
    resumable_step,
    resumed_steps,
    start,
    straight_and_killed,
    train,
    train_args,
    wait_for,
)

import train_llm
import utils

CKPT_FILES = {"model.pt", "optimizer.pt", "lr_scheduler.pt", "rng-rank0.pt", "loader-rank0.json",
              "state.json"}


@pytest.fixture(scope="module")
def straight(tmp_path_factory, tiny_model):
    """The reference: one uninterrupted run."""
    save_dir = tmp_path_factory.mktemp("straight")
    result = train(train_args(save_dir, tiny_model))
    assert result.returncode == 0, result.stderr
    return save_dir / "run"


@pytest.mark.slow
def test_trains_and_writes_the_documented_layout(straight, tiny_model):
    state = json.loads((straight / "state.json").read_text())
    assert state["global_step"] == MAX_STEPS
    assert state["tokens_seen"] == MAX_STEPS * 4 * 32
    assert state["checkpoint"] == f"checkpoints/step-{MAX_STEPS:06d}"
    assert {"epoch", "wandb_run_id", "config"} <= set(state)
    # --keep-checkpoints 2: the last two survive, complete; no temporary debris.
    checkpoints = straight / "checkpoints"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["step-000020", "step-000030"]
    for ckpt in checkpoints.iterdir():
        assert {p.name for p in ckpt.iterdir()} == CKPT_FILES
        for name in CKPT_FILES - {"loader-rank0.json", "state.json"}:
            torch.load(ckpt / name, weights_only=True)
        # The checkpoint's own copy of the run state names it: a run can resume from it alone.
        own = json.loads((ckpt / "state.json").read_text())
        assert own["checkpoint"] == f"checkpoints/{ckpt.name}"

    rows = metrics(straight)
    assert [row["step"] for row in rows] == list(range(1, MAX_STEPS + 1))
    assert [row["step"] for row in rows if "val_loss" in row] == [10, 20, 30]
    assert all("tokens_per_s" in row for row in rows if row["step"] % 5 == 0)
    first, last = rows[0]["loss"], sum(row["loss"] for row in rows[-5:]) / 5
    assert first > 8.5 and last < first - 1.5, (first, last)
    assert rows[-1]["val_loss"] < rows[0]["loss"] - 1.0

    # The same command again has nothing to do: it says so and exits 0 without writing.
    before = digest(straight / "metrics.jsonl")
    result = train(train_args(straight.parent, tiny_model, log_freq=3))
    assert result.returncode == 0, result.stderr
    assert "is done" in result.stderr
    assert digest(straight / "metrics.jsonl") == before

    result = subprocess.run([sys.executable, "scripts/plot_metrics.py", str(straight)], cwd=ROOT,
                            env=ENV, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert (straight / "metrics.png").stat().st_size > 0


@pytest.mark.slow
def test_sigkill_at_random_moments_then_resume_is_bit_identical(straight, tiny_model, tmp_path):
    """Kill -9 three times, each after a random step and a random moment of the next: in a
    step, in validation, in a save. Every restart must say it resumes from the last checkpoint
    before its kill. (A kill inside a background write, saving every step: test_failed_saves.py;
    while one is in flight: test_checkpoints.py.)"""
    rng = random.Random(7)
    args = train_args(tmp_path, tiny_model, ckpt_freq=7)
    exp_dir = tmp_path / "run"
    expected = []
    for at in sorted(rng.sample(range(3, MAX_STEPS - 5), 3)):
        expected.append(resumable_step(exp_dir))
        kill_at(start(args, tmp_path / "log.txt"), exp_dir, at, rng.uniform(0, 0.02))
    expected.append(resumable_step(exp_dir))
    result = train(args)
    assert result.returncode == 0, result.stderr
    log = (tmp_path / "log.txt").read_text() + result.stderr
    assert resumed_steps(log) == [step for step in expected if step]
    assert expected[-1] > 0
    assert_same_run(exp_dir, straight)


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_exits_cleanly(tiny_model, tmp_path):
    args = train_args(tmp_path, tiny_model, max_steps=100_000, ckpt_freq=100_000)
    exp_dir = tmp_path / "run"
    proc = start(args, tmp_path / "log.txt")
    wait_for(lambda: (exp_dir / "metrics.jsonl").exists() and len(metrics(exp_dir)) >= 3, proc)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(timeout=60) == 0
    log = (tmp_path / "log.txt").read_text()
    assert "rerun the same command to resume" in log
    stopped_at = metrics(exp_dir)[-1]["step"]
    assert global_step(exp_dir) == stopped_at
    # --max-steps may change on resume; the run says that it resumes, and finishes.
    result = train(train_args(tmp_path, tiny_model, max_steps=stopped_at + 5))
    assert result.returncode == 0, result.stderr
    assert f"from checkpoints/step-{stopped_at:06d}" in result.stderr
    assert [row["step"] for row in metrics(exp_dir)] == list(range(1, stopped_at + 6))


@pytest.mark.slow
@pytest.mark.parametrize("flag, value", [("seq_length", 64), ("seed", 1), ("grad_clip", 0.5),
                                         ("dataset", "data/sample/code/train-*.jsonl")])
def test_resuming_with_a_changed_argument_is_refused(straight, tiny_model, flag, value):
    before = digest(straight / "state.json")
    result = train(train_args(straight.parent, tiny_model, **{flag: value}))
    assert result.returncode != 0
    assert f"--{flag.replace('_', '-')} was" in result.stderr
    assert digest(straight / "state.json") == before


@pytest.mark.slow
def test_non_finite_loss_stops_and_keeps_the_last_checkpoint(tiny_model, tmp_path):
    # An absurd learning rate: step 1 computes a finite loss, then its update blows the
    # weights up to ~1e30, so step 2's forward overflows.
    exp_dir = tmp_path / "run"
    result = train(train_args(tmp_path, tiny_model, lr=1e30, warmup_steps=0, max_steps=1))
    assert result.returncode == 0, result.stderr
    files = [exp_dir / "state.json", *sorted((exp_dir / "checkpoints").rglob("*"))]
    before = {path: digest(path) for path in files if path.is_file()}

    result = train(train_args(tmp_path, tiny_model, lr=1e30, warmup_steps=0, max_steps=3))
    assert result.returncode != 0
    assert "Step 2: loss" in result.stderr and "Stopping without a checkpoint" in result.stderr
    assert "last good one is checkpoints/step-000001" in result.stderr
    after = [exp_dir / "state.json", *sorted((exp_dir / "checkpoints").rglob("*"))]
    assert {path: digest(path) for path in after if path.is_file()} == before


def test_a_save_killed_halfway_leaves_the_previous_checkpoint(tmp_path, monkeypatch):
    """The write order of utils.write_checkpoint, checked without a subprocess: the save
    dies after its first file, as if killed."""
    state = {"global_step": 1}
    utils.write_checkpoint(tmp_path, 1, {"a.pt": torch.ones(3), "b.json": {}}, state, keep=1)

    real_save = torch.save

    def save_then_die(obj, f):  # writes the first file, dies in the second
        monkeypatch.setattr(torch, "save", lambda *args: sys.exit("killed"))
        real_save(obj, f)

    monkeypatch.setattr(torch, "save", save_then_die)
    with pytest.raises(SystemExit):
        utils.write_checkpoint(tmp_path, 2, {"a.pt": torch.ones(3), "b.pt": 1}, dict(state),
                              keep=1)
    monkeypatch.undo()
    assert json.loads((tmp_path / "state.json").read_text())["checkpoint"] == \
        "checkpoints/step-000001"
    assert torch.equal(utils.load(tmp_path / "checkpoints/step-000001/a.pt", "cpu"),
                       torch.ones(3))
    utils.discard_after(tmp_path, 1)  # what a resume does first
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-000001"]


@pytest.mark.slow
def test_a_second_run_in_the_same_directory_is_refused(tiny_model, tmp_path):
    """While one process trains in a run directory (here: holds its lock), another is refused
    before it touches anything."""
    import fcntl

    exp_dir = tmp_path / "run"
    exp_dir.mkdir()
    with open(exp_dir / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        result = train(train_args(tmp_path, tiny_model))
    assert result.returncode != 0
    assert "Another process is training in" in result.stderr
    assert sorted(p.name for p in exp_dir.iterdir()) == [".lock"]


@pytest.mark.slow
def test_grad_accum_resumes_exactly_and_the_global_batch_may_be_regrouped(
        tiny_model, tmp_path):
    """--batch-size 2 --grad-accum 2, killed after step 13, resumes to the bits of a straight
    run. Then the same global batch regrouped on resume: 4 x 1 up to step 10, 2 x 2 after it.
    The regrouped run reads the very same sequences (loader files byte-identical at the end)."""
    def accum(name, **overrides):
        return train_args(tmp_path, tiny_model, name, batch_size=2, grad_accum=2, **overrides)

    straight, killed, resumed = straight_and_killed(accum, tmp_path)
    assert resumed == [10]
    assert_same_run(killed, straight)

    result = train(train_args(tmp_path, tiny_model, "regrouped", batch_size=4, max_steps=10))
    assert result.returncode == 0, result.stderr
    first = metrics(tmp_path / "regrouped")
    result = train(accum("regrouped"))
    assert result.returncode == 0, result.stderr
    assert resumed_steps(result.stderr) == [10]
    rows = metrics(tmp_path / "regrouped")
    assert rows[:10] == first and [r["step"] for r in rows] == list(range(1, MAX_STEPS + 1))
    final = f"checkpoints/step-{MAX_STEPS:06d}/loader-rank0.json"
    assert digest(tmp_path / "regrouped" / final) == digest(tmp_path / "straight" / final)


@pytest.mark.slow
def test_init_from_pretrained_starts_from_the_saved_weights(tiny_model, tmp_path):
    """--init-from-pretrained loads the weights of --model-name: the loss of step 1 (computed
    before any update) is those weights' loss on the first batch. A fresh init's is not."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    import train_llm

    config = AutoConfig.from_pretrained(tiny_model, resid_pdrop=0.0, embd_pdrop=0.0,
                                        attn_pdrop=0.0)  # no dropout: a loss without RNG
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    model.save_pretrained(tmp_path / "pretrained")
    argv = train_args(tmp_path, tmp_path / "pretrained", max_steps=1)

    args = train_llm.parse_args(argv)  # the trainer's first batch, built the same way
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    loader = train_llm.build_pipeline(args.dataset, tokenizer, args, 0, 1, train=True)
    batch = next(loader)
    loader.close()
    with torch.no_grad():
        sums, counts = train_llm.sequence_losses(*train_llm.forward(model, batch, "cpu")[:2])
    expected = (sums.sum() / counts.sum()).item()

    for name, flags, same in (("loaded", ["--init-from-pretrained"], True), ("fresh", [], False)):
        result = train([*train_args(tmp_path, tmp_path / "pretrained", name, max_steps=1),
                        *flags])
        assert result.returncode == 0, result.stderr
        loss = metrics(tmp_path / name)[0]["loss"]
        assert (abs(loss - expected) < 1e-5) == same, (name, loss, expected)


def test_every_step_reaches_wandb_in_order_and_a_log_step_does_not_wait_for_it(tmp_path):
    """MetricsLog hands wandb every step, in order, a late validation with its step, and no
    None (wandb would import pandas to look at one), through a thread of its own: the training
    thread goes on while a wandb.log waits (for wandb's own thread, in a real run)."""
    args = argparse.Namespace(max_steps=25, wandb="disabled")
    log = utils.MetricsLog(tmp_path, args, {"global_step": 0}, rank=0)
    sent, answer, late = [], threading.Event(), []
    log.wandb = types.SimpleNamespace(finish=lambda: None, log=lambda m, step: (
        sent.append((step, m)), late.append(not answer.wait(timeout=5))))
    for step in range(1, 26):
        speed = {"tokens_per_s": 5.0, "mfu": None} if step % 10 == 0 else {}
        log.write({"step": step, "loss": 1.0 / step, "lr": 0.1, "data_wait": 0.0} | speed)
    log.rewrite_last({"step": 25, "loss": 0.04, "lr": 0.1, "val_loss": 2.0})
    answer.set()  # (wandb answers only now: had a write waited for it, it would be late)
    log.close()
    assert [s for s, _ in sent] == list(range(1, 26)) and not any(late)
    assert sent[-1][1]["val_loss"] == 2.0
    assert all(None not in m.values() for _, m in sent) and "tokens_per_s" in sent[9][1]


def test_a_step_that_wandb_refuses_is_logged_and_the_later_ones_still_sent(tmp_path, caplog):
    log = utils.MetricsLog(tmp_path, argparse.Namespace(max_steps=5, wandb="disabled"),
                           {"global_step": 0}, rank=0)
    sent = []

    def wandb_log(metrics, step):
        if step == 2:
            raise ValueError("bad value")
        sent.append(step)
    log.wandb = types.SimpleNamespace(log=wandb_log, finish=lambda: None)
    for step in range(1, 6):
        log.write({"step": step, "loss": 1.0, "lr": 0.1})
    log.close()
    assert sent == [1, 3, 4, 5] and "wandb did not take step 2: bad value" in caplog.text


@pytest.mark.slow
def test_the_loaders_process_is_forked_while_no_other_thread_runs(tmp_path, tiny_model):
    """A fork copies the locks that other threads hold, without the threads: under the default
    flags (wandb offline, the progress bar) Prefetch forks while the trainer runs its main
    thread alone, when a run starts and when it resumes."""
    counted = tmp_path / "count_threads.py"
    counted.write_text(textwrap.dedent(f"""
        import json, runpy, sys, threading
        sys.path.insert(0, {str(ROOT)!r})
        import data
        fork = data.Prefetch._start
        def start(self):
            if self._pid is None:
                with open({str(tmp_path / "threads.jsonl")!r}, "a") as f:
                    f.write(json.dumps([t.name for t in threading.enumerate()]) + "\\n")
            fork(self)
        data.Prefetch._start = start
        sys.argv = sys.argv[1:]
        runpy.run_path(sys.argv[0], run_name="__main__")
    """))
    for steps in (2, 3):  # (a start, then a resume)
        args = train_args(tmp_path, tiny_model, max_steps=steps, ckpt_freq=2, wandb="offline")
        result = subprocess.run([sys.executable, counted, ROOT / "train_llm.py", *args], cwd=ROOT,
                                env=ENV, capture_output=True, text=True, timeout=120)
        assert result.returncode == 0, result.stderr
    forks = (tmp_path / "threads.jsonl").read_text().splitlines()
    assert [json.loads(line) for line in forks] == [["MainThread"]] * 2


def process_state(pid):
    """(state letter, parent pid) of a process, ("X", "") once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (FileNotFoundError, ProcessLookupError):
        return "X", ""
    return fields[0], fields[1]


def test_a_killed_run_leaves_no_process_and_no_shared_memory(tmp_path, tiny_model):
    """kill -9 of the trainer mid-run: the data process (Prefetch's) dies with it, and nothing
    is left in /dev/shm or the temp directory (the batches' shared memory is anonymous)."""
    def leftovers():
        return {*glob.glob("/dev/shm/*"), *glob.glob(f"{tempfile.gettempdir()}/pymp-*")}

    def alive(pid):
        return process_state(pid)[0] not in "XZ"  # (a zombie has no memory left)

    before = leftovers()
    run = start(train_args(tmp_path, tiny_model, max_steps=10_000), tmp_path / "log.txt")
    wait_for(lambda: last_step(tmp_path / "run") >= 2, run)
    children = [int(p.name) for p in Path("/proc").iterdir()
                if p.name.isdigit() and process_state(p.name)[1] == str(run.pid)]
    assert children, "the trainer runs its pipeline in a process of its own"
    run.kill()
    run.wait()
    deadline = time.monotonic() + 30
    while any(map(alive, children)):
        assert time.monotonic() < deadline, "the data process outlived the trainer"
        time.sleep(0.01)
    assert leftovers() <= before


@pytest.mark.slow
def test_raising_max_steps_trains_on_at_min_lr_never_back_up(tiny_model, tmp_path):
    """The cosine keeps the length the run started with: a finished 10-step run trained on to
    15 runs steps 11-15 at --min-lr (the start line says so), where stretching the cosine would
    raise the learning rate again; --decay-steps sets the length on purpose."""
    flags = dict(max_steps=10, warmup_steps=2, lr=1e-2, min_lr=1e-3, ckpt_freq=5, log_freq=1)
    assert train(train_args(tmp_path, tiny_model, **flags)).returncode == 0
    result = train(train_args(tmp_path, tiny_model, **{**flags, "max_steps": 15}))
    assert result.returncode == 0, result.stderr
    assert "cosine to --min-lr 0.001 at step 10, then --min-lr to step 15" in result.stderr
    lrs = [row["lr"] for row in metrics(tmp_path / "run")]
    assert len(lrs) == 15 and lrs[10:] == [pytest.approx(1e-3)] * 5
    assert all(a >= b for a, b in zip(lrs[2:], lrs[3:]))  # down, never up again
    longer = train(train_args(tmp_path, tiny_model, name="longer", decay_steps=15, **flags))
    assert longer.returncode == 0 and "cosine to --min-lr 0.001 at step 15" in longer.stderr
    assert metrics(tmp_path / "longer")[9]["lr"] > 1.5e-3


@pytest.mark.parametrize("given, state, refused", [
    (20, {}, "--decay-steps 20 ends the cosine inside --warmup-steps 20"),
    (10, {"decay_steps": 40}, "--decay-steps 10 ends the cosine inside"),
    (50, {"decay_steps": 40}, "this run's cosine ends at step 40"),
    (40, {"decay_steps": 40}, None), (None, {"decay_steps": 40}, None)])
def test_a_decay_that_ends_inside_the_warmup_or_changes_on_resume_is_refused(given, state,
                                                                            refused):
    """--decay-steps at or below --warmup-steps (the lr would drop 13x at the warmup's end), or
    not the one the run's cosine keeps: refused before any work; the same one, or none, runs."""
    args = argparse.Namespace(decay_steps=given, warmup_steps=20, max_steps=100, lr=1e-2,
                              min_lr=1e-3)
    if refused:
        with pytest.raises(SystemExit, match=refused):
            utils.keep_schedule(args, state)
    else:
        utils.keep_schedule(args, state)
        assert state["decay_steps"] == args.decay_steps == 40


def test_a_run_shorter_than_its_warmup_says_so_and_sets_its_cosine_when_trained_on(caplog):
    """--max-steps 10 under a 60-step warmup: the start line says the run ends inside it (no
    cosine "at step 10"); trained on to 100 steps, the cosine ends at 100, not at step 10 (where
    the lr would drop from --lr to --min-lr at the warmup's end)."""
    caplog.set_level("INFO", logger="train_llm")
    state, short = {}, dict(decay_steps=None, warmup_steps=60, lr=1e-2, min_lr=1e-3)
    utils.keep_schedule(argparse.Namespace(max_steps=10, **short), state)
    assert "this run ends at step 10, inside it" in caplog.text and "cosine" not in caplog.text
    longer = argparse.Namespace(max_steps=100, **short)
    utils.keep_schedule(longer, state)
    assert state["decay_steps"] == longer.decay_steps == 100
    lrs = [train_llm.get_lr(step, longer) for step in range(100)]
    assert max(lrs) == pytest.approx(1e-2) and all(a >= b for a, b in zip(lrs[60:], lrs[61:]))


@pytest.mark.slow
def test_an_moe_models_own_loss_term_is_logged_at_every_step(tmp_path):
    """--model-name a transformers MoE config (Mixtral, output_router_logits): the CLI trains
    it with its load-balancing term and logs that term as aux_loss beside the loss."""
    from transformers import MixtralConfig
    MixtralConfig(vocab_size=8192, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=2, num_key_value_heads=2, num_local_experts=4,
                  num_experts_per_tok=2, output_router_logits=True,
                  router_aux_loss_coef=0.02).save_pretrained(tmp_path / "moe")
    result = train(train_args(tmp_path, tmp_path / "moe", max_steps=3, val_freq=3))
    assert result.returncode == 0, result.stderr
    lines = metrics(tmp_path / "run")
    assert [m["step"] for m in lines] == [1, 2, 3]
    assert all(0 < m["aux_loss"] < 1 < m["loss"] for m in lines)
