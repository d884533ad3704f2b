"""Fault tolerance under torchrun: a group restarted after a worker dies (--max-restarts), and
elastic membership (--nnodes MIN:MAX) that goes on with fewer ranks when a node is lost.

The runs use the `corpus` fixture's fixed-length documents (one document per sequence, no
shuffle buffer), so which documents a run trained on can be read off its loader states.
"""

import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from helpers import (
    CORPUS_STEPS,
    ENV,
    ROOT,
    assert_same_weights,
    consumed,
    corpus_args,
    final_model,
    last_step,
    loader_states,
    metrics,
    resumable_step,
    wait_for,
)

JOIN_BOUND = 30  # seconds: init_process_group's timeout with --dist-timeout below 30


def workers(parent):
    """{rank: pid} of the worker processes that ``parent`` (a torchrun agent) started."""
    found = {}
    for proc in Path("/proc").iterdir():
        try:
            if int((proc / "stat").read_text().rpartition(")")[2].split()[1]) != parent:
                continue
            env = (proc / "environ").read_bytes().split(b"\0")
            rank = next(int(v[5:]) for v in env if v.startswith(b"RANK="))
            found[rank] = int(proc.name)
        except (OSError, ValueError, IndexError, StopIteration):  # not ours, or gone
            continue
    return found


def starts(log_text):
    """The step each start of the run began at: 0 from scratch, else the one it resumed."""
    return [int(m.group(1) or 0) for m in
            re.finditer(r"Resuming .* from .*, step (\d+) of|Starting .* from scratch", log_text)]


def wait_for_starts(log, n, proc, timeout):
    wait_for(lambda: len(starts(log.read_text())) >= n, proc, timeout)


@pytest.mark.slow
def test_torchrun_restarts_each_killed_worker_and_ends_bit_identical(
        two_ranks, tiny_model, corpus, tmp_path):
    """One torchrun --max-restarts 5 run, a worker (rank 1, then 0, ...) SIGKILLed after each
    of 5 logged steps: every restart comes back within the bounded join (none hangs), resumes
    from the newest complete checkpoint (or a newer one its survivor completed), and the
    final weights equal the uninterrupted run's."""
    kills = [(2, 1), (4, 0), (6, 1), (8, 0), (10, 1)]  # (after step, rank)
    args = corpus_args(tmp_path, tiny_model, corpus, ckpt_freq=2, dist_timeout=10)
    exp_dir, log = tmp_path / "run", tmp_path / "log.txt"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "torch.distributed.run", "--standalone",
             "--nproc-per-node=2", f"--max-restarts={len(kills)}", "train_llm.py", *args],
            cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        newest, restart_seconds = [], []
        wait_for_starts(log, 1, proc, 60)
        for n, (step, rank) in enumerate(kills, start=2):
            wait_for(lambda: last_step(exp_dir) >= step, proc, 120)  # noqa: B023
            newest.append(resumable_step(exp_dir))
            os.kill(workers(proc.pid)[rank], signal.SIGKILL)
            killed = time.monotonic()
            wait_for_starts(log, n, proc, 2 * JOIN_BOUND + 30)
            restart_seconds.append(time.monotonic() - killed)
        assert proc.wait(timeout=120) == 0, log.read_text()[-3000:]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    resumed = starts(log.read_text())[1:]
    print("restarts: killed after", [k for k, _ in kills], "resumed from", resumed,
          "seconds from kill to resume", [round(s, 1) for s in restart_seconds])
    assert max(restart_seconds) < JOIN_BOUND  # none waited for a dead peer
    for old, new in zip(newest, resumed, strict=True):
        assert old <= new and new % 2 == 0, (newest, resumed)
    assert_same_weights(final_model(exp_dir), final_model(two_ranks))
    assert [row["step"] for row in metrics(exp_dir)] == list(range(1, CORPUS_STEPS + 1))


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.slow
def test_elastic_membership_finishes_alone_with_every_document_once(
        two_ranks, tiny_model, corpus, tmp_path):
    """Two torchrun agents (--nnodes 1:2, c10d rendezvous on 127.0.0.1), --global-batch-size
    8 (2 ranks x 4, then 1 rank x 4 x 2 micro-batches). The second agent is SIGKILLed with
    its worker after step 5; the first restarts alone, reshards the loader from the 2 ranks'
    states and finishes. Over the run, the documents consumed are exactly those of the
    uninterrupted 2-rank run: none lost, none repeated."""
    port = free_port()
    args = corpus_args(tmp_path, tiny_model, corpus, global_batch_size=8, dist_timeout=10)
    exp_dir = tmp_path / "run"
    agents, logs = [], []
    for node in range(2):
        logs.append(tmp_path / f"node{node}.txt")
        with open(logs[-1], "wb") as out:
            agents.append(subprocess.Popen(
                [sys.executable, "-m", "torch.distributed.run", "--nnodes=1:2",
                 "--nproc-per-node=1", "--rdzv-backend=c10d",
                 f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=elastic-test",
                 "--rdzv-conf=last_call_timeout=5,join_timeout=60,keep_alive_interval=1",
                 "--max-restarts=3", "train_llm.py", *args],
                cwd=ROOT, env=ENV, stdout=out, stderr=subprocess.STDOUT, start_new_session=True))
        if node == 0:  # the first agent hosts the rendezvous store: it must be the survivor
            time.sleep(1)
    survivor, lost = agents
    try:
        wait_for(lambda: "world size 2" in (logs[0].read_text() + logs[1].read_text()),
                 survivor, 120)
        wait_for(lambda: last_step(exp_dir) >= 5, survivor, 120)
        killed = time.monotonic()
        os.killpg(lost.pid, signal.SIGKILL)
        assert survivor.wait(timeout=240) == 0, logs[0].read_text()[-3000:]
        seconds = time.monotonic() - killed
    finally:
        for agent in agents:
            if agent.poll() is None:
                os.killpg(agent.pid, signal.SIGKILL)
    text = logs[0].read_text()
    print(f"elastic: the survivor finished {seconds:.1f} s after the other node was killed")
    assert "Data of 2 rank(s) moved to 1" in text, text[-3000:]
    assert [row["step"] for row in metrics(exp_dir)] == list(range(1, CORPUS_STEPS + 1))
    assert consumed(loader_states(exp_dir)) == consumed(loader_states(two_ranks))
