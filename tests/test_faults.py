"""Faults and bad input through the CLI: nothing a run wrote is lost, and every refusal is one
clear paragraph (exit code, the key words of the message, no traceback).

Each case runs train_llm.py as a user would, as a subprocess, on the one-layer model.
"""

import hashlib
import json
import os
import resource
import shlex
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from conftest import refused  # noqa: F401
from test_train import ENV, ROOT, global_step, metrics, train, train_args

import train_llm
import utils


def snapshot(directory):
    """{relative path: sha256} of every file under a directory but train.log (a refused start
    is logged there too)."""
    return {str(p.relative_to(directory)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(directory.rglob("*")) if p.is_file() and p.name != "train.log"}


def jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


@pytest.fixture(scope="module")
def ten_steps(tmp_path_factory, tiny_model):
    """A run of 10 steps with checkpoints at 5 and 10, kept, to copy and break."""
    save_dir = tmp_path_factory.mktemp("ten")
    result = train(train_args(save_dir, tiny_model, name="k", max_steps=10, ckpt_freq=5,
                              val_freq=5, keep_checkpoints=0))
    assert result.returncode == 0, result.stderr
    return save_dir / "k"


def copy_run(run, tmp_path):
    subprocess.run(["cp", "-r", str(run), str(tmp_path / "k")], check=True)
    return tmp_path / "k"


@pytest.mark.parametrize("damage", ["missing", "torn"])
def test_a_lost_state_json_resumes_from_the_newest_checkpoint_and_deletes_nothing(
        ten_steps, tmp_path, tiny_model, damage):
    exp = copy_run(ten_steps, tmp_path)
    if damage == "missing":
        (exp / "state.json").unlink()
    else:
        (exp / "state.json").write_text('{"global_step": 1')
    before = snapshot(exp / "checkpoints")
    # The scenario that used to delete every checkpoint: a rerun with a smaller --max-steps.
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=3, ckpt_freq=5))
    assert result.returncode == 0, result.stderr
    assert "the newest complete checkpoint" in result.stderr and "is done" in result.stderr
    assert snapshot(exp / "checkpoints") == before
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=12, ckpt_freq=5))
    assert result.returncode == 0, result.stderr
    assert "Resuming" in result.stderr and "step 10 of 12" in result.stderr
    assert global_step(exp) == 12 and [r["step"] for r in metrics(exp)] == list(range(1, 13))


def test_resume_from_rolls_back_and_trains_the_same_steps_again(ten_steps, tmp_path, tiny_model):
    exp = copy_run(ten_steps, tmp_path)
    final = torch.load(exp / "checkpoints/step-000010/model.pt", weights_only=True)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=10, ckpt_freq=5,
                              resume_from="step-000005", keep_checkpoints=0))
    assert result.returncode == 0, result.stderr
    assert "as --resume-from asks" in result.stderr
    again = torch.load(exp / "checkpoints/step-000010/model.pt", weights_only=True)
    assert all(torch.equal(final[k], again[k]) for k in final)  # the same steps, bit for bit
    assert [r["step"] for r in metrics(exp)] == list(range(1, 11))  # each step logged once
    result = train(train_args(tmp_path, tiny_model, name="k", resume_from="step-000007"))
    refused(result, "--resume-from step-000007: no complete checkpoint",
            "step-000005, step-000010")


@pytest.mark.parametrize("damage", ["truncated model.pt", "directory gone"])
def test_a_damaged_checkpoint_is_one_paragraph_with_the_way_on(ten_steps, tmp_path, tiny_model,
                                                               damage):
    exp = copy_run(ten_steps, tmp_path)
    model = exp / "checkpoints/step-000010/model.pt"
    if damage == "directory gone":
        subprocess.run(["rm", "-r", str(model.parent)], check=True)
    else:
        model.write_bytes(model.read_bytes()[:1000])
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=15, ckpt_freq=5))
    refused(result, f"The checkpoint {exp}/checkpoints/step-000010 is damaged: {model} does "
            "not load", f"The previous checkpoint {exp}/checkpoints/step-000005 is complete",
            "--resume-from step-000005")
    assert snapshot(exp) == before  # nothing written, nothing deleted
    command = result.stderr.strip().splitlines()[-1].strip()
    assert command.startswith(f"cd {ROOT} && python train_llm.py ")
    command = command.replace(" && python ", f" && {shlex.quote(sys.executable)} ", 1)
    again = subprocess.run(["bash", "-c", command], cwd=tmp_path, env=ENV,  # from elsewhere
                           capture_output=True, text=True, timeout=120)
    assert again.returncode == 0, again.stderr
    assert global_step(exp) == 15


@pytest.mark.parametrize("argv, words", [
    (["--ckpt-freq", "0"], "--ckpt-freq: must be at least 1"),
    (["--val-freq", "0"], "--val-freq: must be at least 1"),
    (["--batch-size", "0"], "--batch-size: must be at least 1"),
    (["--seq-length", "1"], "--seq-length: must be at least 2"),
    (["--mix", "code=-1,docstrings=1,prose=1,reference=1"], "code=-1: a weight is a finite"),
    (["--mix", "code=1,code=2"], "'code' is given twice"),
    (["--mix", "code=0,docstrings=0"], "every weight is 0"),
    (["--mix", "code=inf"], "code=inf: a weight is a finite"),
    (["--mix", "code"], "expected name=weight"),
])
def test_flags_are_checked_when_parsed(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_llm.get_parser().parse_args(["-e", "x", *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_hand_edits_of_args_json_and_metrics_jsonl_give_no_traceback(ten_steps, tmp_path,
                                                                     tiny_model):
    """args.json broken by hand is refused before anything changes; notes a user added to
    metrics.jsonl stay through a resume. A copied run gets a wandb run of its own."""
    exp = copy_run(ten_steps, tmp_path)
    args_json = exp / "args.json"
    good = args_json.read_text()
    args_json.write_text(good.rstrip()[:-1] + ",]")  # a trailing comma
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=12, ckpt_freq=5))
    refused(result, f"{args_json} is not the JSON list of starts", "Nothing was changed")
    assert snapshot(exp) == before
    args_json.write_text(good)
    with open(exp / "metrics.jsonl", "a") as f:
        f.write('"lr looked high here"\n{"note": "try 3e-3"}\n')
    for state in (exp / "state.json", exp / "checkpoints/step-000010/state.json"):
        state.write_text(state.read_text().replace('"wandb_run_id": null',
                                                   '"wandb_run_id": "of-the-original"'))
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=12, ckpt_freq=5))
    assert result.returncode == 0, result.stderr
    lines = (exp / "metrics.jsonl").read_text().splitlines()
    assert '"lr looked high here"' in lines and '{"note": "try 3e-3"}' in lines
    assert f"{exp} is a copy of {ten_steps.resolve()}" in result.stderr
    assert json.loads((exp / "state.json").read_text())["wandb_run_id"] is None


def test_a_failed_metrics_write_is_one_paragraph_and_leaves_no_torn_line(tmp_path):
    args = train_llm.parse_args(["-e", "x", "--wandb", "disabled"])
    log = utils.MetricsLog(tmp_path, args, {"global_step": 0, "wandb_run_id": None}, rank=0)
    log.write({"step": 1, "loss": 1.0, "lr": 0.1})
    real = log.file

    class FullDisk:  # writes half a line, then fails as a full disk does
        name = real.name

        def tell(self):
            return real.tell()

        def write(self, data):
            real.write(data[:len(data) // 2])
            raise OSError(28, "No space left on device")

    log.file = FullDisk()
    with pytest.raises(OSError, match="metrics.jsonl failed .* GiB free on that disk: free"):
        log.write({"step": 2, "loss": 1.0, "lr": 0.1})
    log.file = real
    log.close()
    assert [json.loads(line)["step"] for line in
            (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]


def test_a_checkpoint_of_another_run_is_refused_by_name_and_never_deleted(ten_steps, tmp_path,
                                                                          tiny_model):
    exp = copy_run(ten_steps, tmp_path)
    foreign = exp / "checkpoints/step-000012"  # newer than the run's own: it would be resumed
    shutil.copytree(exp / "checkpoints/step-000005", foreign)
    state = json.loads((foreign / "state.json").read_text())
    (foreign / "state.json").write_text(json.dumps(
        {**state, "run_id": "another-run", "run_dir": "/elsewhere/other-run"}))
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=20, ckpt_freq=5))
    refused(result, "checkpoints that this run did not save: step-000012 was saved by the run "
            "in /elsewhere/other-run", "Nothing was changed")
    assert snapshot(exp) == before


def test_keeping_k_checkpoints_deletes_only_the_runs_own(tmp_path):
    other = tmp_path / "checkpoints/step-000000"
    other.mkdir(parents=True)
    (other / "state.json").write_text('{"run_id": "another-run"}')
    state = {"global_step": 0, "run_id": "this-run"}
    for step in (1, 2, 3):
        utils.write_checkpoint(tmp_path, step, {"a.pt": torch.ones(1)}, state, keep=1)
    utils.discard_after(tmp_path, 3, "this-run")
    names = sorted(p.name for p in (tmp_path / "checkpoints").iterdir()
                   if not p.name.endswith(".deleted"))
    assert names == ["step-000000", "step-000003"]


def test_a_finished_run_without_its_checkpoints_is_not_started_again(ten_steps, tmp_path,
                                                                     tiny_model):
    """The user freed the disk of a finished run (checkpoints/, state.json) and kept its
    metrics.jsonl and hf/: the same command must not start over on top of them."""
    exp = copy_run(ten_steps, tmp_path)
    shutil.rmtree(exp / "checkpoints")
    (exp / "state.json").unlink()
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=10))
    refused(result, "holds what a finished run left", "Nothing was changed")
    assert snapshot(exp) == before


def test_a_checked_mix_keeps_its_text():  # it is part of the fingerprint, as typed
    mix = "code=0.4,docstrings=0.3,prose=0.2,reference=0.1"
    assert train_llm.get_parser().parse_args(["-e", "x", "--mix", mix]).mix == mix


def test_other_data_arguments_are_not_called_damage(ten_steps, tmp_path, tiny_model):
    exp = copy_run(ten_steps, tmp_path)
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=15, ckpt_freq=5,
                              max_doc_chars=0))
    refused(result, "Cannot resume from", "other data arguments", "max_chars=100000",
            "--max-doc-chars")
    assert "damaged" not in result.stderr and snapshot(exp) == before


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
    (tmp_path / "not-a-dir").write_text("")
    refused(train(train_args(tmp_path / "not-a-dir", tiny_model)), "not-a-dir")


def test_a_txt_dataset_trains(tmp_path, tiny_model):
    texts = tmp_path / "texts"
    texts.mkdir()
    for i in range(3):
        (texts / f"part-{i}.txt").write_text("".join(f"line {j} of part {i} in plain text.\n"
                                                     for j in range(200)))
    result = train(train_args(tmp_path, tiny_model, dataset=str(texts), val_dataset=str(texts),
                              max_steps=3))
    assert result.returncode == 0, result.stderr
    assert "in both --dataset and --val-dataset" in result.stderr  # the overlap is flagged


def test_a_full_disk_while_saving_names_the_file_and_keeps_the_last_checkpoint(
        ten_steps, tmp_path, tiny_model):
    exp = copy_run(ten_steps, tmp_path)
    before = snapshot(exp / "checkpoints")
    limit = (exp / "checkpoints/step-000010/model.pt").stat().st_size // 2

    def small_disk():  # files past `limit` bytes fail to write (EFBIG), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        [sys.executable, "train_llm.py", *train_args(tmp_path, tiny_model, name="k",
                                                     max_steps=15, ckpt_freq=5,
                                                     checkpoint_writer="background")],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, preexec_fn=small_disk)
    refused(result, "model.pt failed", "GiB free on that disk", "last checkpoint is untouched")
    assert "step-000015 in the background" in result.stderr  # the write that failed
    assert json.loads((exp / "state.json").read_text())["checkpoint"] == "checkpoints/step-000010"
    assert {k: v for k, v in snapshot(exp / "checkpoints").items() if ".tmp" not in k} == before


def test_no_quiet_oddities(tmp_path, tiny_model):
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


def test_one_huge_document_stays_bounded(tmp_path, tiny_model):
    """A 50 MB line among 20,000 normal ones: cut into pieces before tokenizing, so the first
    steps come soon, memory stays low and the loader state small."""
    path = tmp_path / "huge.jsonl"
    with open(path, "w") as f:
        f.write(json.dumps({"text": "lorem ipsum dolor sit amet " * 1_900_000}) + "\n")
        for i in range(20_000):
            f.write(json.dumps({"text": f"a normal document, number {i}."}) + "\n")
    before = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss
    result = train(train_args(tmp_path, tiny_model, name="huge", dataset=str(path),
                              max_steps=3, ckpt_freq=3, val_batches=1), timeout=60)
    assert result.returncode == 0, result.stderr
    peak_gib = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 2**20
    assert before / 2**20 < 3 and peak_gib < 3, f"peak RSS {peak_gib:.2f} GiB"
    assert "cut a document of 51300000 characters" in result.stderr
    loader = tmp_path / "huge/checkpoints/step-000003/loader-rank0.json"
    assert loader.stat().st_size < 5 * 2**20


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


CRASH_FLAGS = dict(max_steps=6, ckpt_freq=2, keep_checkpoints=1, val_freq=100, log_freq=100,
                   checkpoint_writer="background")


@pytest.fixture(scope="module")
def uncrashed(tmp_path_factory, tiny_model):
    """A run that never crashed: its final weights, and the file-system steps of its save of
    step 4, in order (recorded by tests/crashing_train.py)."""
    tmp = tmp_path_factory.mktemp("uncrashed")
    env = {**ENV, "CRASH_STEP": "4", "CRASH_AT": "0", "CRASH_COUNT_FILE": str(tmp / "steps")}
    subprocess.run([sys.executable, "tests/crashing_train.py",
                    *train_args(tmp, tiny_model, **CRASH_FLAGS)], cwd=ROOT, env=env,
                   check=True, capture_output=True, timeout=120)
    final = torch.load(tmp / "run/checkpoints/step-000006/model.pt", weights_only=True)
    return final, (tmp / "steps").read_text().split(",")


@pytest.mark.parametrize("at", ["fsync", "rename", "replace"])
def test_a_crash_inside_a_save_then_the_rerun_is_bit_identical(tmp_path, tiny_model, uncrashed,
                                                               at):
    """The same end to end, as a SIGKILL would leave it (os._exit), in the background writer
    while training goes on: at the first fsync and just before the rename of step 4's
    directory (the rerun resumes from step 2) and just before state.json is replaced (it
    resumes from step 4); the run then ends with the weights of one that never crashed."""
    final, steps = uncrashed
    env = {**ENV, "CRASH_STEP": "4", "CRASH_AT": str(steps.index(at) + 1)}
    crashed = subprocess.run([sys.executable, "tests/crashing_train.py",
                              *train_args(tmp_path, tiny_model, **CRASH_FLAGS)], cwd=ROOT,
                             env=env, capture_output=True, timeout=120)
    assert crashed.returncode == 137
    result = train(train_args(tmp_path, tiny_model, **CRASH_FLAGS))
    assert result.returncode == 0, result.stderr
    resumed = "step-000004" if at == "replace" else "step-000002"
    assert f"Resuming {tmp_path / 'run'} from checkpoints/{resumed}" in result.stderr
    again = torch.load(tmp_path / "run/checkpoints/step-000006/model.pt", weights_only=True)
    assert all(torch.equal(final[k], again[k]) for k in final)


def test_a_signal_stops_a_run_that_is_still_starting(tmp_path, tiny_model):
    """SIGTERM while the first batch is being read (here: from a server that accepts and never
    answers, which would take minutes of timeouts and retries) ends the start at once."""
    import signal
    import socket

    from test_train import start
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
