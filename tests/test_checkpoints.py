"""Checkpoints off the training path: staged to CPU memory and written in the background,
with every guarantee of a synchronous save. (test_failed_saves.py crashes the background
writer before each kind of file-system step and fills its disk; test_train.py and
test_distributed.py SIGKILL runs that write in the background.)"""

import errno
import json
import os
import subprocess
import sys

import pytest
import torch
from helpers import ENV, ROOT, last_step, metrics, train, train_args, wait_for
from transformers import AutoConfig, AutoModelForCausalLM

import utils

FLAGS = dict(checkpoint_writer="background", max_steps=12, ckpt_freq=4, grad_accum=2,
             batch_size=2, odm="exp3", odm_warmup_steps=2, val_freq=100, log_freq=1,
             sample_tokens=0)


@pytest.mark.slow
def test_a_kill_while_a_background_write_is_in_flight_resumes_bit_identically(tmp_path,
                                                                              tiny_model):
    """The save of step 8 is held in its writer (tests/crashing_train.py, HOLD_STEP) while
    training goes on to step 10, which shows that the loop does not wait for a write; a
    SIGKILL then leaves step 4's checkpoint as the newest complete one, and the rerun resumes
    from it. It ends equal, to the bit, to a straight run that saved synchronously
    (--grad-accum 2 and ODM, whose state is part of the loader's)."""
    straight = train(train_args(tmp_path / "straight", tiny_model,
                                **{**FLAGS, "checkpoint_writer": "sync"}))
    assert straight.returncode == 0, straight.stderr
    assert "synchronously" in straight.stderr and "in the background" not in straight.stderr

    args = train_args(tmp_path, tiny_model, **FLAGS)
    exp = tmp_path / "run"
    log_path = tmp_path / "log.txt"
    with open(log_path, "w") as log:
        proc = subprocess.Popen([sys.executable, "tests/crashing_train.py", *args], cwd=ROOT,
                                env={**ENV, "HOLD_STEP": "8"}, stdout=log,
                                stderr=subprocess.STDOUT)
    wait_for(lambda: last_step(exp) >= 10, proc)
    proc.kill()
    proc.wait()
    assert "Saving checkpoints/step-000008 in the background" in log_path.read_text()
    assert json.loads((exp / "state.json").read_text())["checkpoint"] == "checkpoints/step-000004"
    assert not (exp / "checkpoints/step-000008").exists()
    result = train(args)
    assert result.returncode == 0, result.stderr
    assert "from checkpoints/step-000004" in result.stderr
    final = "checkpoints/step-000012/model.pt"
    a, b = (torch.load(d / final, weights_only=True) for d in (tmp_path / "straight/run", exp))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert [r["loss"] for r in metrics(exp)] == [r["loss"] for r in
                                                 metrics(tmp_path / "straight/run")]


@pytest.fixture(scope="module")
def model_and_optimizer(tiny_model):
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny_model))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(input_ids=torch.arange(8).view(1, 8), labels=torch.arange(8).view(1, 8)).loss.backward()
    optimizer.step()
    return model, optimizer


def test_staging_copies_exactly_and_reuses_its_buffers(model_and_optimizer):
    """Every save after the first copies into the first one's buffers (no growth, on any torch):
    the copies hold the state of the save's step, whatever training does to it later."""
    model, optimizer = model_and_optimizer
    writer = utils.BackgroundWriter(log=lambda message: None)
    staged = []
    for _ in range(3):
        at_save = model.transformer.wte.weight.detach().clone()
        writer.submit("step", staged.append, {"model.pt": model.state_dict(),
                                              "optimizer.pt": optimizer.state_dict(),
                                              "loader.json": {"slots": [{"offset": 5}]}})
        writer.before_update()
        with torch.no_grad():  # the update changes the weights in place
            model.transformer.wte.weight.add_(1.0)
        writer.wait()
    first, last = (s["model.pt"] for s in (staged[0], staged[-1]))
    assert all(first[k].data_ptr() == last[k].data_ptr() for k in first)
    live = model.state_dict()
    wte = live["transformer.wte.weight"].data_ptr()
    tied = [k for k in live if live[k].data_ptr() == wte]  # (lm_head.weight too)
    assert len(tied) == 2 and all(torch.equal(last[k], at_save if k in tied else live[k])
                                  for k in live)
    assert len({last[k].untyped_storage().data_ptr() for k in tied}) == 1  # (written once)
    assert staged[-1]["optimizer.pt"]["param_groups"] == optimizer.state_dict()["param_groups"]
    moments = staged[-1]["optimizer.pt"]["state"][0]
    assert all(torch.equal(moments[k], v) for k, v in optimizer.state_dict()["state"][0].items())
    assert json.loads(staged[-1]["loader.json"]) == {"slots": [{"offset": 5}]}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a GPU's copies run on a side stream")
def test_the_update_after_a_save_waits_for_its_copies_on_the_gpu():
    """A GPU's tensors are copied without the training thread waiting; the update that follows
    before_update() never changes what they copy, and the write sees the copies finished."""
    weights = torch.randn(64 << 20, device="cuda")  # 256 MB: a copy long enough to overlap
    expected = weights.cpu()
    writer = utils.BackgroundWriter(pinned=True, log=lambda message: None)
    written = []
    for _ in range(2):  # the second save into the first one's pinned buffers
        writer.submit("step", lambda staged: written.append(staged["model.pt"]["w"].clone()),
                      {"model.pt": {"w": weights}})
        writer.before_update()
        weights.mul_(2.0)  # the optimizer's update, on the training stream
        writer.wait()
    assert torch.equal(written[0], expected) and torch.equal(written[1], expected * 2)


def test_a_failed_background_write_is_raised_in_the_training_thread():
    def write(files):
        raise OSError("writing x failed (No space left on device); 0.00 GiB free on that disk")

    writer = utils.BackgroundWriter(log=lambda message: None)
    writer.submit("checkpoints/step-000001", write, {"a.json": {"x": 1}})
    writer.thread.join()  # the write has ended (failed); the next check raises its error
    with pytest.raises(OSError, match="No space left"):
        writer.before_update()
    writer.before_update()  # raised once: the run has stopped on it
    with pytest.raises(OSError):
        writer.submit("checkpoints/step-000002", write, {})
        writer.wait()


@pytest.mark.parametrize("refused_from", [0, 2])
def test_a_file_system_that_refuses_direct_writes_gets_buffered_ones(tmp_path, monkeypatch,
                                                                     refused_from):
    """O_DIRECT accepted at open but its writes refused (EINVAL), from the first write or the
    third: the file is written whole through the page cache, and loads equal."""
    import fcntl
    import os
    real_write, calls = os.write, []

    def write(fd, data):
        calls.append(fd)
        if len(calls) > refused_from and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            raise OSError(22, "Invalid argument")
        return real_write(fd, data)
    monkeypatch.setattr(os, "write", write)
    tensors = {"w": torch.randn(5 << 20), "b": torch.arange(5)}  # 20 MB: 2 chunks and a tail
    utils._write_file(tmp_path / "t.pt", lambda f: utils.save_tensors(tensors, f))
    loaded = torch.load(tmp_path / "t.pt", weights_only=True)
    assert all(torch.equal(loaded[k], tensors[k]) for k in tensors)
    assert len(calls) > refused_from + 1


def test_sync_and_background_writes_write_the_same_files(tmp_path, model_and_optimizer):
    model, optimizer = model_and_optimizer
    for sync in (True, False):
        writer = utils.BackgroundWriter(sync=sync, log=lambda message: None)
        exp = tmp_path / f"sync-{sync}"
        files = {"model.pt": model.state_dict(), "optimizer.pt": optimizer.state_dict(),
                 "loader-rank0.json": {"offset": 3}}
        writer.submit("step", lambda staged, exp=exp: utils.write_checkpoint(
            exp, 1, staged, {"global_step": 1, "config": {}, "checkpoint": None}, keep=1),
            files)
        writer.wait()
    a, b = (tmp_path / f"sync-{s}/checkpoints/step-000001" for s in (True, False))
    for name in ("model.pt", "optimizer.pt", "loader-rank0.json"):  # the very same bytes
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    x, y = (torch.load(d / "model.pt", weights_only=True) for d in (a, b))
    assert x.keys() == y.keys() and all(torch.equal(x[k], y[k]) for k in x)
    x, y = (torch.load(d / "optimizer.pt", weights_only=True)["state"] for d in (a, b))
    assert all(torch.equal(x[i][k], y[i][k]) for i in x for k in x[i])
    assert json.loads((a / "loader-rank0.json").read_text()) == {"offset": 3}
    assert (a / "loader-rank0.json").read_bytes() == (b / "loader-rank0.json").read_bytes()


@pytest.mark.parametrize("code, words, not_words", [
    (errno.ENOSPC, "free some space", "ulimit"),
    (errno.EFBIG, "ulimit -f", "free some space"),
    (errno.EPERM, "chattr +i", "free some space"),
    (errno.EACCES, "no permission", "free some space")])
def test_a_failed_write_is_told_by_its_cause_not_always_as_a_full_disk(tmp_path, code, words,
                                                                       not_words):
    """A full disk, a file size limit (ulimit -f), an immutable file, a denied directory: each
    failed checkpoint write names the file and says what to mend."""
    def write(f):
        raise OSError(code, os.strerror(code))

    with pytest.raises(OSError, match=f"writing {tmp_path / 'x.pt'} failed") as failed:
        utils._write_file(tmp_path / "x.pt", write)
    assert words in str(failed.value) and not_words not in str(failed.value)
