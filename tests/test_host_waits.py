"""An ordinary training step never makes the host wait for the GPU.

A GPU step is fast only while the training thread stays ahead of the GPU; every read of a GPU
value, and every copy of Python data onto the GPU, stops it until the GPU has caught up.
tests/host_waits.py counts both on the CPU, telling device tensors from host ones by where
they came from (its docstring has the rules), inside the model's forward too: transformers'
two checks of each batch (padding, packing) are skipped for the kit's batches
(utils.skip_mask_checks). A step's numbers are read a step late (utils.StepNumbers); the
steps that validate or save read theirs at once, so they are not ordinary. --profile-steps
records the last step (and warms up in the one before): the steps outside it pay nothing, and
the same run shows its trace, its table and train.log's environment.
"""

import collections
import json
import re
import subprocess
import sys

import pytest
from helpers import ENV, ROOT, train_args

MAX_STEPS = 5  # the last step validates and saves: its reads are not a step's
PHASES = ("data", "forward", "backward", "update")  # the loop's record_function ranges


def waits_per_step(tmp_path, tiny_model, ranks=1, env=(), **flags):
    """{step: [(kind, op, where, inside the model), ...]} of a run's steps, rank by rank; the
    last step profiled (--profile-steps)."""
    args = train_args(tmp_path, tiny_model, max_steps=MAX_STEPS, grad_accum=2, log_freq=2,
                      val_freq=100, ckpt_freq=100, profile_steps=f"{MAX_STEPS}:{MAX_STEPS}",
                      **flags)
    script = [str(ROOT / "tests/host_waits.py"), "train_llm.py", *args]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable])
    out = tmp_path / "waits.json"
    result = subprocess.run([*launcher, *script], cwd=ROOT, capture_output=True, text=True,
                            env={**ENV, **dict(env), "HOST_WAITS_OUT": str(out)}, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = []
    for rank in range(ranks):
        found = json.loads(out.with_name(out.name + (str(rank) if ranks > 1 else "")).read_text())
        steps = collections.defaultdict(list)
        for fetches, kind, op, where, in_model in found["events"]:
            if fetches:
                steps[(fetches - 1) // found["grad_accum"] + 1].append((kind, op, where, in_model))
        per_rank.append(steps)
    return per_rank


def assert_no_wait_on_ordinary_steps(per_rank):
    for rank, steps in enumerate(per_rank):
        for step in range(1, MAX_STEPS):
            assert not steps[step], f"rank {rank}, step {step}: {steps[step]}"
        assert steps[MAX_STEPS], "the last step reads its numbers: the count saw nothing"


def assert_profiled(run_dir, ranks=1):
    """Each rank's trace holds the last step alone, with the loop's ranges; rank 0's log says
    how long each rank took to write its trace, and the table of the ranges' time per step."""
    for rank in range(ranks):
        trace = run_dir / f"profile/rank{rank}-steps{MAX_STEPS}-{MAX_STEPS}.json"
        names = collections.Counter(e.get("name") for e in json.loads(trace.read_text())[
            "traceEvents"] if e.get("name") in PHASES or e.get("name", "").startswith("Profiler"))
        # (the profiler counts from its warm-up, the step before: ProfilerStep#0)
        assert names == {"ProfilerStep#1": 1, "data": 1, "forward": 2, "backward": 2,
                         "update": 1}, names
    log = (run_dir / "train.log").read_text()
    assert all(re.search(rf"[0-9.]+ s \(rank {rank}\)", log) for rank in range(ranks)), log
    for phase in (*PHASES, "step"):
        assert re.search(rf"^{phase} +[0-9]+\.[0-9]{{2}}$", log, re.MULTILINE), (phase, log)


def test_no_wait_on_an_ordinary_step(tmp_path, tiny_model):
    """Pretraining, two micro-batches a step: no read of a GPU value, no blocking upload. The
    same run (one run: the fast tier's time) writes the last step's trace and table, and its
    train.log holds the environment that changes a run, with no secret's value."""
    per_rank = waits_per_step(tmp_path, tiny_model, env={
        "WANDB_API_KEY": "secret123", "WANDB_BASE_URL": "https://me:secret456@wandb.example"})
    assert_no_wait_on_ordinary_steps(per_rank)
    assert_profiled(tmp_path / "run")
    log = (tmp_path / "run/train.log").read_text()
    environment = re.search(r"Environment: (.*)", log).group(1).split()
    assert "OMP_NUM_THREADS=1" in environment and "WANDB_API_KEY=<set>" in environment
    assert "secret123" not in log and "secret456" not in log and "https://<set>@" in log


@pytest.mark.slow
def test_no_wait_on_an_ordinary_step_with_packed_sft(tmp_path, tiny_model):
    """--task sft: packed samples, masked per sample without transformers' packing check."""
    assert_no_wait_on_ordinary_steps(waits_per_step(tmp_path, tiny_model, task="sft",
                                                    seq_length=64))


@pytest.mark.slow
def test_no_wait_on_an_ordinary_step_with_odm(tmp_path, tiny_model):
    """--odm: the domain ids go to the device without a wait; the bandit learns a step late."""
    assert_no_wait_on_ordinary_steps(waits_per_step(tmp_path, tiny_model, odm="exp3",
                                                    odm_warmup_steps=0))


@pytest.mark.slow
def test_no_wait_on_an_ordinary_step_on_two_ranks_with_epochs(tmp_path, tiny_model):
    """2 ranks, --epochs: the numbers are all-reduced on the device, read a step late; whether
    every rank still has data is agreed on the CPU."""
    assert_no_wait_on_ordinary_steps(waits_per_step(tmp_path, tiny_model, ranks=2, epochs=3))
    assert_profiled(tmp_path / "run", ranks=2)  # (then a barrier: both ranks wrote theirs)
