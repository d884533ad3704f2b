"""The training loop makes the host wait for the GPU at most once per optimizer step.

A GPU step is fast only while the training thread stays ahead of the GPU; every read of a GPU
value, and every copy of Python data onto the GPU, stops it until the GPU has caught up.
tests/host_waits.py counts both on the CPU, telling device tensors from host ones by where
they came from (its docstring has the rules). What a model does inside its own forward is the
model's business and is not counted here: transformers' GPT-2 reads two values per forward in
eager mode (a padding warning and the packed-sequence check), none under --compile.
"""

import collections
import json
import subprocess
import sys

import pytest
from helpers import ENV, ROOT, train_args

MAX_STEPS = 5  # the last step validates and saves: its reads are not a step's


def waits_per_step(tmp_path, tiny_model, ranks=1, **flags):
    """{step: [(kind, op, where), ...]} of a run's training steps, rank by rank."""
    args = train_args(tmp_path, tiny_model, max_steps=MAX_STEPS, grad_accum=2, log_freq=2,
                      val_freq=100, ckpt_freq=100, **flags)
    script = [str(ROOT / "tests/host_waits.py"), "train_llm.py", *args]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 f"--nproc-per-node={ranks}"] if ranks > 1 else [sys.executable])
    out = tmp_path / "waits.json"
    result = subprocess.run([*launcher, *script], cwd=ROOT, capture_output=True, text=True,
                            env={**ENV, "HOST_WAITS_OUT": str(out)}, timeout=180)
    assert result.returncode == 0, result.stderr[-3000:]
    per_rank = []
    for rank in range(ranks):
        found = json.loads(out.with_name(out.name + (str(rank) if ranks > 1 else "")).read_text())
        steps = collections.defaultdict(list)
        for fetches, kind, op, where, in_model in found["events"]:
            if fetches and not in_model:
                steps[(fetches - 1) // found["grad_accum"] + 1].append((kind, op, where))
        per_rank.append(steps)
    return per_rank


def assert_one_wait_per_step(per_rank):
    for rank, steps in enumerate(per_rank):
        for step in range(1, MAX_STEPS):
            reads = [e for e in steps[step] if e[0] == "read"]
            uploads = [e for e in steps[step] if e[0] == "upload"]
            assert len(reads) <= 1 and not uploads, f"rank {rank}, step {step}: {steps[step]}"


@pytest.mark.slow
def test_one_wait_per_step_with_odm(tmp_path, tiny_model):
    """--odm: the domain ids of each micro-batch go to the device without a wait."""
    assert_one_wait_per_step(waits_per_step(tmp_path, tiny_model, odm="exp3"))


@pytest.mark.slow
def test_one_wait_per_step_on_two_ranks_with_epochs(tmp_path, tiny_model):
    """--epochs on 2 ranks: whether every rank still has data is agreed on the CPU."""
    assert_one_wait_per_step(waits_per_step(tmp_path, tiny_model, ranks=2, epochs=3))

