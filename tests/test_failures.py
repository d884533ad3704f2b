"""Failures during a run: bad or too little data, a full disk under the metrics, out of memory,
a log file that cannot be written, wandb without a login, a signal while starting. Each ends in
one paragraph (exit code, the key words of the message, no traceback on the console), and
nothing a run wrote is lost."""

import argparse
import json
import logging
import mmap
import os
import resource
import subprocess
import sys
import textwrap
import threading

import pytest
from helpers import (
    ENV,
    ROOT,
    copy_kit,
    jsonl,
    last_step,
    metrics,
    refused,
    start,
    train,
    train_args,
    train_patched,
    wait_for,
)

import train_llm
import utils


@pytest.mark.slow
def test_expected_failures_end_in_one_paragraph(tmp_path, tiny_model):
    def run(*flags, **overrides):
        name = f"r{len(list(tmp_path.iterdir()))}"
        return train([*train_args(tmp_path, tiny_model, name=name, **{"max_steps": 4,
                                                                      **overrides}), *flags])

    refused(run(seq_length=1024), "--seq-length 1024 is longer than the 64 positions")
    refused(run(dataset=str(tmp_path / "nothing-*.jsonl")), "no files match")
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    refused(run(dataset=str(empty)), "hold no records")
    bad = jsonl(tmp_path / "bad.jsonl", [{"text": "fine " * 30}] * 5 + [{"text": 42}])
    refused(run(dataset=bad, shuffle_buffer=1), f"shard {bad}, line 6: bad record",
            "field 'text' is int", "--skip-bad-records")
    result = run("--skip-bad-records", dataset=bad, shuffle_buffer=1, max_steps=2, log_freq=1)
    assert result.returncode == 0, result.stderr
    assert "skipped (1 so far)" in result.stderr
    sft = jsonl(tmp_path / "sft.jsonl", [{"instruction": "a", "output": "b"}] * 3
                + [{"instruction": "no answer"}])
    refused(run(task="sft", dataset=sft, val_dataset=sft), f"shard {sft}, line 4",
            "needs string fields 'instruction' and 'output'")
    refused(run(odm="exp3", dataset="data/sample/*/nothing-*.jsonl"), "has no domains to mix")
    tiny_val = jsonl(tmp_path / "val.jsonl", [{"text": "short"}] * 3)
    refused(run(val_dataset=tiny_val), "less than one batch of tokens", "lower --batch-size")
    (tmp_path / "not-a-dir").write_text("")
    refused(train(train_args(tmp_path / "not-a-dir", tiny_model)), "not-a-dir")


@pytest.mark.slow
def test_empty_documents_are_refused_at_the_start(tmp_path, tiny_model):
    empty = jsonl(tmp_path / "empty.jsonl", [{"text": ""}] * 100)
    result = train(train_args(tmp_path, tiny_model, name="e", dataset=empty, max_steps=3))
    refused(result, "Nothing to train on", "only special tokens", empty)
    assert not (tmp_path / "e/checkpoints").exists()


@pytest.mark.slow
def test_too_little_data_or_an_edited_shard_is_said_not_passed_over(tmp_path, tiny_model):
    small = jsonl(tmp_path / "small.jsonl", [{"text": "a b c"}] * 3)
    refused(train(train_args(tmp_path, tiny_model, name="tiny", dataset=small, epochs=1)),
            "The data ran out before the first step", "holds fewer than the 128 tokens")
    assert not (tmp_path / "tiny/state.json").exists()

    docs = jsonl(tmp_path / "docs.jsonl", [{"text": f"document {i} " + "word " * 40}
                                           for i in range(60)])
    result = train(train_args(tmp_path, tiny_model, name="epochs", dataset=docs, epochs=1,
                              max_steps=1000, val_freq=1000, val_batches=100, val_dataset=docs))
    assert result.returncode == 0, result.stderr
    assert "holds only" in result.stderr and "batches of the 100 asked for" in result.stderr
    rows = metrics(tmp_path / "epochs")
    assert "val_loss" in rows[-1] and [r["step"] for r in rows] == list(range(1, len(rows) + 1))

    # A shard edited after the run read it is refused on resume, not read at wrong offsets.
    result = train(train_args(tmp_path, tiny_model, name="edit", dataset=docs, max_steps=4,
                              ckpt_freq=2))
    assert result.returncode == 0, result.stderr
    with open(docs, "a") as f:
        f.write(json.dumps({"text": "one more"}) + "\n")
    refused(train(train_args(tmp_path, tiny_model, name="edit", dataset=docs, max_steps=6,
                             ckpt_freq=2)), "files of --dataset changed", "changed size", docs)


@pytest.mark.slow
def test_a_failure_is_one_paragraph_on_the_console_and_a_traceback_in_train_log(tmp_path,
                                                                                tiny_model):
    shard = tmp_path / "bad.jsonl"  # read by the first step: a failure once training began
    shard.write_text('{"text": "a b c"}\n' * 3 + "not json\n")
    result = train(train_args(tmp_path, tiny_model, dataset=shard))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "bad.jsonl" in result.stderr and "before the first checkpoint" in result.stderr
    log = (tmp_path / "run/train.log").read_text()
    assert "bad.jsonl" in log and "Traceback" in log


@pytest.mark.slow
def test_a_start_that_fails_before_training_leaves_nothing_and_says_so(tmp_path, tiny_model):
    result = train(train_args(tmp_path / "runs", tiny_model, dataset=tmp_path / "missing.jsonl"))
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert "missing.jsonl" in result.stderr and "nothing was kept" in result.stderr
    assert "last checkpoint" not in result.stderr
    assert not (tmp_path / "runs").exists()


def test_a_failed_metrics_write_is_one_paragraph_and_leaves_no_torn_line(tmp_path):
    args = train_llm.parse_args(["-e", "x", "--wandb", "disabled"])
    log = utils.MetricsLog(tmp_path, args, {"global_step": 0, "wandb_run_id": None}, rank=0)
    log.write({"step": 1, "loss": 1.0, "lr": 0.1})
    log.flush()  # (lines are kept until a log line or a checkpoint)
    real = log.file

    class FullDisk:  # writes half a line, then fails as a full disk does
        name = real.name

        def fileno(self):
            return real.fileno()

        def write(self, data):
            real.write(data[:len(data) // 2])
            raise OSError(28, "No space left on device")

    log.file = FullDisk()
    with pytest.raises(OSError, match="metrics.jsonl failed .* GiB free on that disk: free"):
        log.write({"step": 2, "loss": 1.0, "lr": 0.1})
        log.flush()
    log.file = real
    log.close()
    assert [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


@pytest.mark.slow
def test_out_of_memory_is_one_paragraph(tmp_path, tiny_model):
    """The first backward pass runs out of memory (as a too large --batch-size does on a GPU):
    one paragraph with the way on, no traceback."""
    prelude = ("import torch\n"
               "def oom(*a, **k):\n"
               "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate '\n"
               "                                 '9.00 GiB')\n"
               "torch.Tensor.backward = oom\n")
    result = train_patched(prelude, train_args(tmp_path, tiny_model, max_steps=2))
    refused(result, "Out of memory", "Tried to allocate 9.00 GiB", "--grad-accum")


def test_a_failed_allocation_says_memory_ran_out_which_and_the_way_on():
    """Real failures under a real ulimit -v (1 TiB, far above what this process maps): a thread
    that cannot have its stack, a mapping refused (ENOMEM), a MemoryError. Each is one paragraph
    that says memory ran out, which allocation, the limit and the way on; errors that are no
    failed allocation are not taken for one."""
    def failure(allocate):
        try:
            allocate()
        except BaseException as e:
            return e

    def thread():
        threading.stack_size(2**41)
        try:
            threading.Thread(target=lambda: None).start()
        finally:
            threading.stack_size(0)

    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    limit = 2**40 if hard == resource.RLIM_INFINITY else min(2**40, hard)
    resource.setrlimit(resource.RLIMIT_AS, (limit, hard))
    try:
        messages = {what: utils.expected_failure(failure(allocate)) for what, allocate in (
            ("a new thread's stack could not be allocated", thread),
            ("Cannot allocate memory", lambda: mmap.mmap(-1, 2**41)),
            ("MemoryError", lambda: bytearray(2**41)))}
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))
    for what, message in messages.items():
        for words in ("Out of memory: ", what, f"may map {limit / 2**30:.2f} GiB at most "
                      "(ulimit -v)", "nothing was kept", "--grad-accum"):
            assert message and words in message, (words, message)
    assert "Out of memory" not in utils.expected_failure(FileNotFoundError(2, "gone", "x"))
    assert utils.expected_failure(RuntimeError("can't start the engine")) is None


@pytest.mark.slow
def test_a_run_out_of_address_space_at_the_loaders_mapping_says_so(tmp_path, tiny_model):
    """ulimit -v set (1 TiB: said as the run starts), then lowered to a little above what the
    run maps as its loader starts: the loader's shared memory mapping is refused (ENOMEM), and
    the run ends in one paragraph naming it, the limit and the way on, leaving nothing."""
    prelude = ("import re, resource\n"
               "import data\n"
               "resource.setrlimit(resource.RLIMIT_AS, (2**40, resource.RLIM_INFINITY))\n"
               "start = data.start\n"
               "def capped(loader):\n"
               "    status = open('/proc/self/status').read()\n"
               "    mapped = int(re.search(r'VmSize:\\s+(\\d+) kB', status)[1]) << 10\n"
               "    resource.setrlimit(resource.RLIMIT_AS, (mapped + (16 << 20), 2**40))\n"
               "    start(loader)\n"
               "data.start = capped\n")
    result = train_patched(prelude, train_args(tmp_path, tiny_model, max_steps=2))
    assert "ulimit -v: this process may map 1024.00 GiB" in result.stderr, result.stderr
    refused(result, "Out of memory: a shared memory mapping could not be made",
            "in data.Prefetch._start (data.py:", "GiB at most (ulimit -v)", "raise that limit",
            "nothing was kept")
    assert not (tmp_path / "run").exists()


def test_a_log_file_that_cannot_be_written_is_skipped_without_tracebacks(capsys, monkeypatch):
    """/dev/full fails every write as a full disk does: no "--- Logging error ---" traceback
    per record."""
    root = logging.getLogger()
    for log in (root, utils.FILE_LOG):  # the test's handler goes after it
        monkeypatch.setattr(log, "handlers", list(log.handlers))
    monkeypatch.setattr(logging, "raiseExceptions", True)
    utils.log_to_file("/dev/full", 0)
    for i in range(4):
        root.error("record %d", i)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err


def test_wandb_online_without_a_login_is_one_paragraph(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    args = argparse.Namespace(wandb="online", wandb_project="p", experiment_name="e",
                              max_steps=3, resume_from=None)
    state = {"global_step": 0, "wandb_run_id": None}
    with pytest.raises(SystemExit) as stop:
        utils.MetricsLog(tmp_path, args, state, rank=0)
    assert "Weights & Biases did not start" in str(stop.value) and "wandb login" in str(
        stop.value) and "--wandb offline" in str(stop.value)


@pytest.mark.slow
def test_a_signal_stops_a_run_that_is_still_starting(tmp_path, tiny_model):
    """SIGTERM while the first batch is being read (here: from a server that accepts and never
    answers, which would take minutes of timeouts and retries) ends the start at once."""
    import signal
    import socket

    listener = socket.create_server(("127.0.0.1", 0))
    listener.settimeout(120)
    port = listener.getsockname()[1]
    args = train_args(tmp_path, tiny_model, name="sig",
                      dataset=f"http://127.0.0.1:{port}/{{0,1,2,3,4,5,6,7}}.jsonl")
    proc = start(args, tmp_path / "log.txt")
    try:
        connection, _ = listener.accept()  # the run is now waiting for its first record
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) != 0
    finally:
        proc.kill()
        listener.close()
    log = (tmp_path / "log.txt").read_text()
    assert "SIGTERM before the first step: stopped" in log and "Traceback" not in log, log
    connection.close()


@pytest.mark.slow
def test_a_run_whose_loader_process_is_stopped_ends_in_seconds_naming_it(tmp_path, tiny_model):
    """kill -STOP of the loader's process (data.Prefetch's child): the run fails within seconds
    naming it, and so does a SIGTERM sent then (whose save needs the loader's state)."""
    import glob
    import signal
    import time

    exp_dir, log = tmp_path / "stopped", tmp_path / "log.txt"
    proc = start(train_args(tmp_path, tiny_model, name="stopped", max_steps=10**6,
                            ckpt_freq=10**6, log_freq=1), log)
    try:
        wait_for(lambda: last_step(exp_dir) >= 2, proc)
        children = {int(pid) for path in glob.glob(f"/proc/{proc.pid}/task/*/children")
                    for pid in open(path).read().split()}
        for pid in children:
            os.kill(pid, signal.SIGSTOP)
        proc.send_signal(signal.SIGTERM)
        began = time.monotonic()
        assert proc.wait(timeout=60) == 1
        assert time.monotonic() - began < 15
    finally:
        proc.kill()
    text = log.read_text()
    assert "data.Prefetch's process" in text and "is stopped (SIGSTOP" in text, text
    assert "Traceback" not in text, text


def test_a_signal_while_a_failed_rank_exits_ends_it_without_a_traceback():
    """torchrun sends SIGTERM to the ranks left when one fails; one that is already leaving
    (here: in an exit handler, after its own paragraph) ends there, with no traceback of the
    handler that stops a start."""
    code = f"""if True:
        import atexit, os, signal, sys
        sys.path.insert(0, {str(ROOT)!r})
        import utils

        def main():
            signal.signal(signal.SIGTERM, lambda *_: sys.exit("stopped"))  # as a run starts
            atexit.register(lambda: os.kill(os.getpid(), signal.SIGTERM))
            sys.exit("stopped: another rank failed")

        utils.cli(main)"""
    result = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True,
                            text=True, timeout=60)
    assert result.returncode != 0 and "another rank failed" in result.stderr, result.stderr
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.slow
def test_a_signal_during_validation_ends_it_at_once_and_saves(tmp_path, tiny_model):
    """SIGTERM as step 3's validation starts (sent by the script itself, so it lands there):
    no more validation batches, no step 4; step 3 is saved and the run exits 0, to resume."""
    script = copy_kit(tmp_path / "kit", script="train_llm.py", edits=[(
        "    val_loss, per_domain = evaluate(",
        "    os.kill(os.getpid(), __import__('signal').SIGTERM)\n"
        "    val_loss, per_domain = evaluate(")])
    args = train_args(tmp_path, tiny_model, name="r", max_steps=10, val_freq=3, ckpt_freq=100,
                      log_freq=1, tokenizer=ROOT / "assets/tokenizer",
                      dataset=f"{ROOT}/data/sample/*/train-*.jsonl",
                      val_dataset=f"{ROOT}/data/sample/*/val-*.jsonl")
    result = subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=ENV,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "Validation cut short by the signal" in result.stderr
    logged = metrics(tmp_path / "r")
    assert [line["step"] for line in logged] == [1, 2, 3] and "val_loss" not in logged[-1]
    assert (tmp_path / "r/checkpoints/step-000003").is_dir()


def test_ctrl_c_while_the_script_imports_is_one_line(tmp_path):
    """SIGINT as `import torch` begins (sent by an import hook, so it lands there)."""
    code = textwrap.dedent(f"""
        import os, runpy, signal, sys

        class Interrupt:
            def find_spec(self, name, path=None, target=None):
                if name == "torch":
                    os.kill(os.getpid(), signal.SIGINT)

        sys.meta_path.insert(0, Interrupt())
        sys.argv = ["train_llm.py", "-e", "x", "--save-dir", {str(tmp_path)!r}]
        runpy.run_path("train_llm.py", run_name="__main__")""")
    result = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=60)
    refused(result, "SIGINT before the first step: stopped")
    assert len(result.stderr.strip().splitlines()) == 1 and not list(tmp_path.iterdir())


@pytest.mark.slow
def test_a_bad_wandb_setting_in_the_environment_is_one_paragraph_and_leaves_nothing(
        tmp_path, tiny_model):
    args = train_args(tmp_path / "runs", tiny_model, name="w", wandb="offline", max_steps=2)
    result = subprocess.run([sys.executable, "train_llm.py", *map(str, args)], cwd=ROOT,
                            env={**ENV, "WANDB_MODE": ""}, capture_output=True, text=True,
                            timeout=120)
    refused(result, "Weights & Biases did not start", "WANDB_* environment variables")
    assert not (tmp_path / "runs").exists()
