"""What a rerun finds in a run directory: a resume starts from the newest complete checkpoint,
nothing the run did not write is deleted, and what cannot be resumed is one paragraph with the
way on (exit code, the key words of the message, no traceback)."""

import json
import random
import shlex
import shutil
import subprocess
import sys
import types

import pytest
import torch
from helpers import (
    ENV,
    ROOT,
    copy_run,
    global_step,
    kill_at,
    metrics,
    refused,
    script,
    snapshot,
    start,
    train,
    train_args,
    wandb_history,
)

import trained
import utils


@pytest.mark.slow
@pytest.mark.parametrize("damage", ["missing", "torn"])
def test_a_lost_state_json_resumes_from_the_newest_checkpoint_and_deletes_nothing(
        ten_steps, tmp_path, tiny_model, damage):
    exp = copy_run(ten_steps, tmp_path)
    if damage == "missing":
        (exp / "state.json").unlink()
    else:
        (exp / "state.json").write_text('{"global_step": 1')
    before = snapshot(exp / "checkpoints")
    # A rerun with a smaller --max-steps deletes no checkpoint.
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=3, ckpt_freq=5))
    assert result.returncode == 0, result.stderr
    assert "the newest complete checkpoint" in result.stderr and "is done" in result.stderr
    assert snapshot(exp / "checkpoints") == before
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=12, ckpt_freq=5))
    assert result.returncode == 0, result.stderr
    assert "Resuming" in result.stderr and "step 10 of 12" in result.stderr
    assert global_step(exp) == 12 and [r["step"] for r in metrics(exp)] == list(range(1, 13))


@pytest.mark.slow
def test_a_state_json_without_a_state_resumes_from_the_newest_checkpoint(
        four_steps, tmp_path, tiny_model):
    exp = copy_run(four_steps, tmp_path)
    for content in ("[]", "null", '{"global_step": 4}'):
        (exp / "state.json").write_text(content)
        state, why = utils.run_state(exp)
        assert state["checkpoint"] == "checkpoints/step-000004" and "is unreadable" in why
    (exp / "state.json").write_text("{}")
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=5))
    assert result.returncode == 0, result.stderr
    assert "is unreadable" in result.stderr and global_step(exp) == 5


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_damaged_newest_checkpoint_points_generate_and_init_from_to_the_older_one(
        four_steps, tmp_path, tiny_model, capsys, monkeypatch):
    exp = copy_run(four_steps, tmp_path)
    model = exp / "checkpoints/step-000004/model.pt"
    model.write_bytes(model.read_bytes()[:1000])
    older = exp / "checkpoints/step-000002"
    with pytest.raises(SystemExit) as exit_:
        script("generate", [exp, "--prompt", "The"], capsys, monkeypatch)
    assert f"{model} does not load" in exit_.value.code
    assert f"The previous checkpoint {older} is complete" in exit_.value.code
    result = train(train_args(tmp_path, None, name="sft", max_steps=1, init_from=exp))
    refused(result, f"{model} does not load", f"The previous checkpoint {older} is complete")
    assert script("generate", [older, "--prompt", "The", "--max-new-tokens", 2],
                  capsys, monkeypatch).startswith("The")


def test_a_damaged_sharded_checkpoint_is_one_paragraph_too(tmp_path):
    """--fsdp's dcp/ shards that do not load (torch.distributed.checkpoint raises a
    BaseException, which a plain `except Exception` misses)."""
    run = tmp_path / "run"
    config = {"model_name": str(ROOT / "assets/tiny-gpt2"), "init_from": None,
              "tokenizer": str(ROOT / "assets/tokenizer")}
    for step in (1, 2):
        ckpt = run / f"checkpoints/step-00000{step}"
        (ckpt / "dcp").mkdir(parents=True)
        (ckpt / "state.json").write_text(json.dumps(
            {"global_step": step, "checkpoint": f"checkpoints/step-00000{step}",
             "config": config, "script": str(ROOT / "train_llm.py"), "args": {}}))
    (run / "checkpoints/step-000002/dcp/.metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(OSError, match="The previous checkpoint .*step-000001 is complete"):
        trained.load_trained(run / "checkpoints/step-000002")


@pytest.mark.slow
def test_notes_added_to_metrics_jsonl_stay_through_a_resume(ten_steps, tmp_path, tiny_model):
    """Notes a user added to metrics.jsonl stay through a resume. A copied run gets a wandb
    run of its own."""
    exp = copy_run(ten_steps, tmp_path)
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


@pytest.mark.slow
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


def test_a_users_copy_of_a_checkpoint_under_another_name_is_never_deleted(tmp_path):
    """Backups named by hand (step-2, a copy of step-000002 that carries this run's id) are not
    the kit's: neither keeping k checkpoints nor a resume's discard deletes them."""
    state = {"global_step": 0, "run_id": "this-run"}
    utils.write_checkpoint(tmp_path, 2, {"a.pt": torch.ones(1)}, state, keep=0)
    root = tmp_path / "checkpoints"
    backups = ["step-2", "step-0000002", "step-2.bak"]
    for name in backups:
        shutil.copytree(root / "step-000002", root / name)
    for step in (3, 4, 5):
        utils.write_checkpoint(tmp_path, step, {"a.pt": torch.ones(1)}, state, keep=1)
    utils.discard_after(tmp_path, 1, "this-run")  # (a roll-back to before step 2)
    assert sorted(p.name for p in root.iterdir() if not p.name.endswith(".deleted")) == sorted(
        backups)


@pytest.mark.slow
def test_a_finished_run_without_its_checkpoints_is_not_started_again(four_steps, tmp_path,
                                                                     tiny_model):
    """The user freed the disk of a finished run (checkpoints/, state.json) and kept its
    metrics.jsonl and hf/: the same command must not start over on top of them."""
    exp = copy_run(four_steps, tmp_path)
    shutil.rmtree(exp / "checkpoints")
    (exp / "state.json").unlink()
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=4))
    refused(result, "holds what a finished run left", "Nothing was changed")
    assert snapshot(exp) == before


@pytest.mark.slow
def test_a_start_from_scratch_moves_a_metrics_file_it_did_not_write_aside(tmp_path, tiny_model):
    """A metrics.jsonl in the directory before the run's first start (the user's, or an
    earlier run's whose checkpoints are gone): every line of it kept, in metrics.jsonl.1."""
    exp = tmp_path / "mine"
    exp.mkdir()
    theirs = '{"step": 3, "acc": 0.9}\n{"step": 1, "loss": 5.0}\n'
    (exp / "metrics.jsonl").write_text(theirs)
    result = train(train_args(tmp_path, tiny_model, name="mine", max_steps=2, log_freq=1))
    assert result.returncode == 0, result.stderr[-2000:]
    assert (exp / "metrics.jsonl.1").read_text() == theirs
    assert "moved to metrics.jsonl.1" in result.stderr
    assert [line["step"] for line in metrics(exp)] == [1, 2]


@pytest.mark.slow
def test_a_rollback_that_trains_nothing_changes_nothing(four_steps, tmp_path, tiny_model):
    """--resume-from step 2 with --max-steps 2 on a finished 4-step run: refused, and hf/
    stays the export of step 4 (not step 2's weights beside a state at 4)."""
    exp = copy_run(four_steps, tmp_path)
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=2, ckpt_freq=2,
                              val_freq=2, keep_checkpoints=0, sample_tokens=0,
                              resume_from="step-000002"))
    refused(result, "--resume-from step-000002 with --max-steps 2 trains nothing")
    assert snapshot(exp) == before


@pytest.mark.slow
def test_a_refused_start_in_a_users_directory_leaves_it_as_it_was(tmp_path, tiny_model):
    """A directory of the user's own (here with a state.json that is no run's) is refused, and
    the start leaves no train.log or .lock behind it: "nothing was changed" holds."""
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "state.json").write_text("{my notes, not a run")
    (mine / "notes.txt").write_text("mine")
    before = snapshot(mine)
    result = train(train_args(tmp_path, tiny_model, name="mine", max_steps=2))
    refused(result, "unreadable", "Nothing was changed")
    assert snapshot(mine) == before
    assert sorted(p.name for p in mine.iterdir()) == ["notes.txt", "state.json"]


@pytest.mark.slow
def test_a_killed_resumed_and_rewound_run_holds_every_step_once_in_wandb(tiny_model, tmp_path):
    """wandb's curve equals metrics.jsonl, step by step, after a kill that cost wandb what it
    had not written (sent again), after a kill that left it steps past the checkpoint (not
    sent twice), and after a --resume-from (a wandb run of its own: wandb cannot take back
    what it holds)."""
    exp = tmp_path / "w"
    args = train_args(tmp_path, tiny_model, name="w", wandb="offline", log_freq=1,
                      max_steps=20, ckpt_freq=10, val_freq=10, sample_tokens=0)
    proc = start(args, tmp_path / "log")
    kill_at(proc, exp, 14)  # (wandb writes 32 KiB at a time: this run's steps are not yet)
    for rerun in ("kill", "wrote past the checkpoint", "--resume-from"):
        if rerun == "wrote past the checkpoint":  # killed after step 20's log, before its save
            shutil.rmtree(exp / "checkpoints/step-000020")
            shutil.copy(exp / "checkpoints/step-000010/state.json", exp / "state.json")
        result = train(args + (["--resume-from", "step-000010"] if rerun == "--resume-from"
                               else []))
        assert result.returncode == 0, result.stderr
        run_id = json.loads((exp / "state.json").read_text())["wandb_run_id"]
        assert wandb_history(exp, run_id) == [(m["step"], m["loss"]) for m in metrics(exp)], \
            rerun
    assert "--resume-from: a wandb run of its own" in result.stderr
    result = train(args + ["--resume-from", "step-000010", "--wandb", "disabled"])
    assert result.returncode == 0, result.stderr  # (its wandb run, when logged again, is new)
    assert json.loads((exp / "state.json").read_text())["wandb_run_id"] is None


@pytest.mark.slow
def test_what_wandb_holds_counts_a_segment_that_started_in_the_same_second(tmp_path):
    """wandb names the folder of a second start of a run in the same second ...-ID-1: the
    steps in it count among those the run holds."""
    code = ("import sys, wandb; r = wandb.init(project='p', id='abc', dir=sys.argv[1], "
            "mode='offline'); [r.log({'loss': 1.0}, step=s) for s in (1, 2, 3)]; r.finish()")
    subprocess.run([sys.executable, "-c", code, str(tmp_path)], env=ENV, check=True,
                   capture_output=True, timeout=120)
    [first] = (tmp_path / "wandb").glob("offline-run-*-abc")
    first.rename(first.with_name(first.name + "-1"))
    run = types.SimpleNamespace(offline=True, id="abc",
                                dir=str(tmp_path / "wandb/offline-run-20260101_000000-abc/files"))
    assert utils.wandb_holds(run, tmp_path) == 3


@pytest.mark.slow
def test_a_damaged_offline_wandb_log_is_read_around_and_the_resume_trains_on(tiny_model,
                                                                              tmp_path):
    """Bytes in the middle of an offline run's .wandb overwritten (not cut off): the resume
    warns once, naming the file, and trains on; what the damage left is read (the steps in the
    file's next 32 KiB block count as held: none is sent twice), the file is left as it is, and
    the new segment holds the new steps."""
    exp = tmp_path / "w"

    def args(steps):
        return train_args(tmp_path, tiny_model, name="w", wandb="offline", log_freq=1,
                          max_steps=steps, ckpt_freq=10, val_freq=10, sample_tokens=0)

    result = train(args(20))
    assert result.returncode == 0, result.stderr
    [log] = (exp / "wandb").glob("offline-run-*/run-*.wandb")
    damaged = bytearray(log.read_bytes())
    assert len(damaged) > 32768 + 1000  # (steps past the damage, in the next block)
    damaged[16000:16064] = random.Random(0).randbytes(64)
    log.write_bytes(damaged)
    result = train(args(24))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    [warning] = [line for line in result.stderr.splitlines() if "is damaged" in line]
    assert f"{log} is damaged at byte" in warning, warning
    assert log.read_bytes() == damaged
    [new] = [path for path in (exp / "wandb").glob(f"offline-run-*/{log.name}") if path != log]
    from wandb.proto.wandb_internal_pb2 import Record
    assert [r.history.step.num for r in utils.wandb_records(new, Record)
            if r.HasField("history")] == [21, 22, 23, 24]


def test_a_resume_removes_the_kits_own_debris_and_nothing_of_the_users(tmp_path):
    """A killed save's step-NNNNNN.tmp and a deletion's step-NNNNNN.deleted go at a resume; a
    user's best.tmp, keep.deleted or step-12.tmp in checkpoints/ stay, with their files."""
    root = tmp_path / "checkpoints"
    kits = [root / "step-000012.tmp", root / "step-000004.deleted", root / "step-1234567.tmp"]
    users = [root / "best.tmp", root / "keep.deleted", root / "step-12.tmp", root / "x.tmp"]
    for folder in kits + users:
        folder.mkdir(parents=True)
        (folder / "model.pt").write_bytes(b"x")
    utils.discard_after(tmp_path, 10)
    assert not any(folder.exists() for folder in kits)
    assert all((folder / "model.pt").read_bytes() == b"x" for folder in users)
