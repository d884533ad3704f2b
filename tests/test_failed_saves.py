"""A save that dies or fails partway: a crash before any file-system step of a save (each fsync,
the rename, the state.json replace, the keep-k deletion) leaves a complete checkpoint, and the
rerun ends bit-identical to a run that never crashed; a full disk names the file and leaves the
last checkpoint untouched. tests/crashing_train.py dies where it is told to."""

import json
import os
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from helpers import (
    ENV,
    ROOT,
    copy_run,
    refused,
    small_disk_of,
    snapshot,
    train,
    train_args,
)

import utils


class Crash(BaseException):
    """What the process would die of: nothing after it runs (not even `finally` blocks that
    catch Exception)."""


def crash_before(monkeypatch, at):
    """Make the at-th file-system step (fsync, rename, replace, rmtree) raise Crash; return
    the list of steps met."""
    met = []

    def counted(real, name):
        def step(*args, **kwargs):
            if threading.current_thread() is not threading.main_thread():
                return real(*args, **kwargs)  # the helper that deletes a renamed old checkpoint
            met.append(name)
            if len(met) == at:
                raise Crash()
            return real(*args, **kwargs)
        return step

    for module, name in [(os, "fsync"), (os, "rename"), (os, "replace"), (shutil, "rmtree")]:
        monkeypatch.setattr(module, name, counted(getattr(module, name), name))
    return met


def save(exp_dir, step):
    state = {"global_step": step, "config": {}, "checkpoint": None}
    files = {"model.pt": {"w": torch.full((3,), float(step))}, "loader-rank0.json": {"s": step}}
    utils.write_checkpoint(exp_dir, step, files, state, keep=1)


def test_a_crash_at_every_step_of_a_save_leaves_a_complete_checkpoint(tmp_path, monkeypatch):
    """Die just before each file-system step of a save (every fsync, the rename, the
    state.json replace, the keep-k deletion): what a rerun finds is a complete checkpoint, the
    old one or the new one, with every file whole. (A save that replaced state.json before
    renaming its directory fails here; so does one that deletes the old checkpoint first.)"""
    save(tmp_path / "count", 2)
    met = crash_before(monkeypatch, 0)
    save(tmp_path / "count", 4)
    steps = list(met)
    assert steps.count("fsync") >= 5 and {"rename", "replace", "rmtree"} <= set(steps)
    for at in range(1, len(steps) + 2):  # before each step, and after the last
        exp = tmp_path / f"crash{at}"
        monkeypatch.undo()
        save(exp, 2)
        crash_before(monkeypatch, at)
        try:
            save(exp, 4)
        except Crash:
            pass
        monkeypatch.undo()
        state, _ = utils.run_state(exp)
        ckpt = exp / state["checkpoint"]
        assert state["global_step"] in (2, 4) and ckpt.name == f"step-{state['global_step']:06d}"
        assert torch.load(ckpt / "model.pt", weights_only=True)["w"][0] == state["global_step"]
        assert json.loads((ckpt / "loader-rank0.json").read_text()) == {"s": state["global_step"]}
        assert json.loads((ckpt / "state.json").read_text())["checkpoint"] == state["checkpoint"]


CRASH_FLAGS = dict(max_steps=6, ckpt_freq=1, keep_checkpoints=1, val_freq=100, log_freq=100,
                   checkpoint_writer="background")


@pytest.mark.slow
def test_a_crash_inside_a_background_save_then_the_rerun_is_bit_identical(tmp_path, tiny_model):
    """The same end to end, as a SIGKILL would leave it (os._exit), in the background writer of
    a run that saves every step while training goes on: just before the save of step 4
    replaces state.json, its directory already renamed into place. The rerun resumes from
    that checkpoint, which state.json does not name yet, and ends with the weights of a run
    that never crashed. (A crash at an earlier step leaves the previous checkpoint, and the
    debris a resume deletes: the in-process tests here and in test_train.py.)"""
    env = {**ENV, "CRASH_STEP": "4", "CRASH_AT": "0", "CRASH_COUNT_FILE": str(tmp_path / "steps")}
    uncrashed = subprocess.run([sys.executable, "tests/crashing_train.py",
                                *train_args(tmp_path, tiny_model, "straight", **CRASH_FLAGS)],
                               cwd=ROOT, env=env, capture_output=True, timeout=120)
    assert uncrashed.returncode == 0, uncrashed.stderr[-3000:]
    steps = (tmp_path / "steps").read_text().split(",")
    env = {**ENV, "CRASH_STEP": "4", "CRASH_AT": str(steps.index("replace") + 1)}
    crashed = subprocess.run([sys.executable, "tests/crashing_train.py",
                              *train_args(tmp_path, tiny_model, **CRASH_FLAGS)], cwd=ROOT,
                             env=env, capture_output=True, timeout=120)
    assert crashed.returncode == 137
    assert json.loads((tmp_path / "run/state.json").read_text())["global_step"] == 3
    result = train(train_args(tmp_path, tiny_model, **CRASH_FLAGS))
    assert result.returncode == 0, result.stderr
    assert f"Resuming {tmp_path / 'run'} from checkpoints/step-000004" in result.stderr
    def weights(name):
        return torch.load(tmp_path / name / "checkpoints/step-000006/model.pt", weights_only=True)
    final, again = weights("straight"), weights("run")
    assert all(torch.equal(final[k], again[k]) for k in final)


@pytest.mark.slow
def test_a_full_disk_while_saving_names_the_file_and_keeps_the_last_checkpoint(
        ten_steps, tmp_path, tiny_model):
    exp = copy_run(ten_steps, tmp_path)
    before = snapshot(exp / "checkpoints")
    limit = (exp / "checkpoints/step-000010/model.pt").stat().st_size // 2
    result = subprocess.run(
        [sys.executable, "train_llm.py", *train_args(tmp_path, tiny_model, name="k",
                                                     max_steps=15, ckpt_freq=5,
                                                     checkpoint_writer="background")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120,
        preexec_fn=small_disk_of(limit))
    refused(result, "model.pt failed", "GiB free on that disk", "last checkpoint is untouched")
    assert "step-000015 in the background" in result.stderr  # the write that failed
    assert json.loads((exp / "state.json").read_text())["checkpoint"] == "checkpoints/step-000010"
    assert {k: v for k, v in snapshot(exp / "checkpoints").items() if ".tmp" not in k} == before
