"""The second round of faults (what a new user runs into): nothing the kit did not write is
deleted, no run goes on silently wrong, and each mistake ends in one paragraph that says what
to do. Data-level faults (a changed shard, one huge document, formats) are in
test_data_faults.py.
"""

import argparse
import json
import logging
import os
import resource
import shutil
import subprocess
import sys

import pytest
import torch
from test_after_training import script
from test_faults import copy_run, jsonl, refused, snapshot
from test_train import ENV, ROOT, global_step, train, train_args
from transformers import AutoModelForCausalLM, AutoTokenizer

import data
import train_llm
import utils


@pytest.fixture(scope="module")
def four_steps(tmp_path_factory, tiny_model):
    """A finished 4-step run with checkpoints at 2 and 4 and its hf/ export, to copy."""
    save_dir = tmp_path_factory.mktemp("four")
    result = train(train_args(save_dir, tiny_model, name="k", max_steps=4, ckpt_freq=2,
                              val_freq=2, keep_checkpoints=0, sample_tokens=0))
    assert result.returncode == 0, result.stderr
    return save_dir / "k"


def weights(directory):
    return AutoModelForCausalLM.from_pretrained(directory).state_dict()


def same_weights(a, b):
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# -- Nothing the kit did not write is deleted ----------------------------------------------------

def test_an_export_never_replaces_what_it_did_not_write(four_steps, tmp_path, capsys,
                                                        monkeypatch):
    """`export_hf.py RUN --out DIR` used to delete DIR whatever it held: every run under
    outputs/, or a run itself."""
    exp = copy_run(four_steps, tmp_path)
    (tmp_path / "notes.txt").write_text("mine")
    before = snapshot(tmp_path)
    for out in (tmp_path, exp, exp / "checkpoints"):
        with pytest.raises(SystemExit) as exit_:
            script("export_hf", [exp, "--out", out], capsys, monkeypatch)
        assert "is not an export of this kit" in str(exit_.value.code), out
    assert snapshot(tmp_path) == before
    # An earlier export, and the debris of a killed one, are replaced.
    out = tmp_path / "export"
    script("export_hf", [exp, "--out", out], capsys, monkeypatch)
    (tmp_path / "export.tmp").mkdir()
    (tmp_path / "export.tmp" / utils.EXPORT_MARKER).write_text("{}")
    script("export_hf", [exp, "--checkpoint", exp / "checkpoints/step-000002", "--out", out],
           capsys, monkeypatch)
    assert not (tmp_path / "export.tmp").exists()
    assert same_weights(weights(out), utils.load_trained(exp / "checkpoints/step-000002")[0]
                        .state_dict())


def test_resume_from_checks_the_data_before_it_lets_later_checkpoints_go(tmp_path, tiny_model):
    """--resume-from step-000002 after the shards changed (same sizes, lines shuffled): refused
    before the later checkpoints, metrics.jsonl or state.json are touched."""
    lines = [json.dumps({"text": f"document {i} " + "a b c d " * (i % 5 + 1)}) for i in range(400)]
    shards = [tmp_path / "data" / f"{k}.jsonl" for k in range(8)]
    shards[0].parent.mkdir()
    for k, shard in enumerate(shards):
        shard.write_text("".join(line + "\n" for line in lines[50 * k:50 * k + 50]))
    args = train_args(tmp_path, tiny_model, name="r", dataset=str(tmp_path / "data/*.jsonl"),
                      max_steps=6, ckpt_freq=2, val_freq=2, keep_checkpoints=0)
    assert train(args).returncode == 0
    before = snapshot(tmp_path / "r")
    for shard in shards:
        shard.write_text("".join(line + "\n" for line in reversed(shard.read_text().split(
            "\n")[:-1])))
    refused(train([*args, "--resume-from", "step-000002"]), "changed since this run read it")
    assert snapshot(tmp_path / "r") == before


@pytest.mark.parametrize("name", ["", ".", "..", "/tmp/elsewhere", "a/../.."])
def test_the_experiment_name_must_be_a_directory_inside_the_save_dir(name, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_llm.parse_args(["-e", name, "--save-dir", str(tmp_path)])
    assert exit_.value.code == 2
    assert "must name a directory inside --save-dir" in capsys.readouterr().err
    assert train_llm.parse_args(["-e", "group/run", "--save-dir", str(tmp_path)])
    (tmp_path / "elsewhere").mkdir()  # a run directory that links to another disk is fine
    (tmp_path / "big").symlink_to(tmp_path / "elsewhere")
    assert train_llm.parse_args(["-e", "big", "--save-dir", str(tmp_path)])


# -- The export is part of finishing ----------------------------------------------------------

def test_a_finished_run_whose_export_was_cut_short_is_exported_again(four_steps, tmp_path,
                                                                     tiny_model):
    """What a kill during the end-of-run export of a resumed run leaves: the previous end's
    hf/ (of step 2) and a half-written hf.tmp. The rerun that says "is done" writes hf/ of the
    last checkpoint. (No hf/ at all: see the full-disk test below.)"""
    exp = copy_run(four_steps, tmp_path)
    assert utils.export_is_current(exp / "hf", "checkpoints/step-000004")
    shutil.rmtree(exp / "hf")
    model, tokenizer, config = utils.load_trained(exp / "checkpoints/step-000002")
    utils.save_hf(exp / "hf", model, tokenizer, config, checkpoint="checkpoints/step-000002")
    (exp / "hf" / utils.EXPORT_MARKER).unlink()  # as a kill while deleting it could leave it
    (exp / "hf.tmp").mkdir()  # debris of an earlier version, which wrote its marker last
    (exp / "hf.tmp" / "config.json").write_text("{}")
    assert not utils.export_is_current(exp / "hf", "checkpoints/step-000002")
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=4))
    assert result.returncode == 0, result.stderr
    assert "is done" in result.stderr and "exporting it again" in result.stderr
    assert not (exp / "hf.tmp").exists()
    assert same_weights(weights(exp / "hf"),
                        utils.load_trained(exp / "checkpoints/step-000004")[0].state_dict())
    assert utils.export_is_current(exp / "hf", "checkpoints/step-000004")


def test_a_full_disk_during_the_export_is_one_paragraph(four_steps, tmp_path, tiny_model):
    exp = copy_run(four_steps, tmp_path)
    shutil.rmtree(exp / "hf")
    limit = (exp / "checkpoints/step-000004/model.pt").stat().st_size // 2

    def small_disk():  # files past `limit` bytes fail to write (EFBIG), as on a full disk
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    result = subprocess.run(
        [sys.executable, "train_llm.py", *train_args(tmp_path, tiny_model, name="k",
                                                     max_steps=4)],
        cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120, preexec_fn=small_disk)
    refused(result, f"writing {exp / 'hf'} failed", "GiB free on that disk")
    assert not (exp / "hf").exists() and not (exp / "hf.tmp").exists()
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=4))
    assert result.returncode == 0 and "exporting it again" in result.stderr, result.stderr
    assert same_weights(weights(exp / "hf"),
                        utils.load_trained(exp / "checkpoints/step-000004")[0].state_dict())


# -- No silently wrong run ------------------------------------------------------------------------

def test_a_checkpoint_of_another_run_is_refused(four_steps, tmp_path, tiny_model):
    """A checkpoint directory swapped in from a run with another --lr: its own state.json
    says so, and the resume is refused like a changed flag."""
    exp = copy_run(four_steps, tmp_path)
    own = exp / "checkpoints/step-000004/state.json"
    state = json.loads(own.read_text())
    state["config"]["lr"] = 1e-3
    own.write_text(json.dumps(state))
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=6))
    refused(result, "--lr was 0.001 when checkpoints/step-000004 was saved", "0.01 now")
    assert snapshot(exp) == before


def test_a_flag_newer_than_the_run_counts_as_its_default(four_steps, tmp_path, tiny_model):
    """A run saved before --data-format existed (no key in its configs), resumed with a
    non-default --data-format: refused by name, as if the run had had the default."""
    exp = copy_run(four_steps, tmp_path)
    for path in (exp / "state.json", exp / "checkpoints/step-000004/state.json"):
        state = json.loads(path.read_text())
        del state["config"]["data_format"]
        path.write_text(json.dumps(state))
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=6,
                              data_format="jsonl"))
    refused(result, "--data-format was None when", "'jsonl' now")
    assert snapshot(exp) == before
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=6))
    assert result.returncode == 0, result.stderr  # the default: the run goes on


def test_empty_documents_are_refused_at_the_start(tmp_path, tiny_model):
    empty = jsonl(tmp_path / "empty.jsonl", [{"text": ""}] * 100)
    result = train(train_args(tmp_path, tiny_model, name="e", dataset=empty, max_steps=3))
    refused(result, "Nothing to train on", "only special tokens", empty)
    assert not (tmp_path / "e/checkpoints").exists()


@pytest.mark.parametrize("argv, words", [
    (["--lr", "nan"], "--lr: must be a finite number > 0"),
    (["--lr=-1e-3"], "--lr: must be a finite number > 0"),
    (["--lr", "0"], "--lr: must be a finite number > 0"),
    (["--min-lr=-0.004"], "--min-lr: must be a finite number >= 0"),
    (["--min-lr", "inf"], "--min-lr: must be a finite number >= 0"),
    (["--lr", "1e-3", "--min-lr", "2e-3"], "--min-lr 0.002 is above --lr 0.001"),
    (["--profile-steps", "abc"], "expected FIRST,LAST"),
    (["--profile-steps", "5,3"], "expected FIRST,LAST"),
    (["--profile-steps", "0,3"], "expected FIRST,LAST"),
    (["--device", "nonsense"], "is not a torch device"),
    (["--global-batch-size", "10", "-b", "4"], "must be a multiple of world size x --batch-size"),
    (["--global-batch-size", "8", "-b", "4", "--grad-accum", "3"], "(leave it out)"),
    (["--grad-clip=-1"], "--grad-clip: must be a number > 0"),  # gradient ascent
    (["--grad-clip", "0"], "--grad-clip: must be a number > 0"),  # trains nothing
    (["--grad-clip", "nan"], "--grad-clip: must be a number > 0"),
    (["--weight-decay=-1"], "--weight-decay: must be a finite number >= 0"),
    (["--weight-decay", "nan"], "--weight-decay: must be a finite number >= 0"),
    (["--odm-alpha", "2"], "--odm-alpha: must be a finite number >= 0 and <= 1"),
    (["--odm-alpha=-5"], "--odm-alpha: must be a finite number >= 0 and <= 1"),
    (["--odm-alpha", "nan"], "--odm-alpha: must be a finite number >= 0 and <= 1"),
    (["--seed=-1"], "--seed: must be at least 0 and at most 4294967295"),
    (["--seed", "99999999999999"], "--seed: must be at least 0 and at most 4294967295"),
    (["--dist-timeout", "nan"], "--dist-timeout: must be a finite number > 0"),
    (["--dist-timeout=-1"], "--dist-timeout: must be a finite number > 0"),
    (["--shuffle-buffer", "100000000"], "more than half of this machine's"),
])
def test_flags_are_checked_when_parsed(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_llm.parse_args(["-e", "x", *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_an_infinite_grad_clip_means_never_clip():
    assert train_llm.parse_args(["-e", "x", "--grad-clip", "inf"]).grad_clip == float("inf")


@pytest.mark.parametrize("argv, words", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["--max-new-tokens=-5"], "--max-new-tokens: must be at least 1"),
    (["--top-k=-3"], "--top-k: must be at least 1"),
    (["--temperature=-1"], "--temperature: must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature: must be a finite number >= 0"),
    (["--device", "nonsense"], "is not a torch device"),
])
def test_generate_checks_its_flags_when_parsed(argv, words, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        script("generate", ["some-run", "--prompt", "x", *argv], capsys, monkeypatch)
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_a_local_model_directory_that_does_not_load_is_called_that(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(OSError, match="a local directory that does not load"):
        utils.pretrained(AutoTokenizer, str(tmp_path), "--model-name")


@pytest.mark.parametrize("world_size, grad_accum", [(1, 4), (2, 2), (4, 1)])
def test_the_global_batch_size_sets_grad_accum_from_the_world_size(world_size, grad_accum,
                                                                   monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world_size))
    args = train_llm.parse_args(["-e", "x", "--global-batch-size", "16", "-b", "4"])
    assert args.grad_accum == grad_accum


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has a GPU")
def test_a_gpu_device_without_a_gpu_is_refused_when_parsed(capsys):
    with pytest.raises(SystemExit):
        train_llm.parse_args(["-e", "x", "--device", "cuda"])
    assert "no CUDA GPU" in capsys.readouterr().err


# -- Chat data: the template follows the data ---------------------------------------------------

CHAT_TEMPLATE = ("{% for m in messages %}<|endoftext|>[{{ m['role'] }}]\n{{ m['content'] }}\n"
                 "{% endfor %}{% if add_generation_prompt %}<|endoftext|>[assistant]\n"
                 "{% endif %}")


def chat_data(tmp_path):
    return jsonl(tmp_path / "chat.jsonl", [
        {"messages": [{"role": "user", "content": f"Say the number {i} twice."},
                      {"role": "assistant", "content": f"{i} {i}."}]} for i in range(200)])


def test_chat_data_trains_samples_and_generates_with_the_chat_template(
        tmp_path, tiny_model, capsys, monkeypatch):
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
    tokenizer.chat_template = CHAT_TEMPLATE
    tokenizer.save_pretrained(tmp_path / "tok")
    chat = chat_data(tmp_path)
    result = train(train_args(tmp_path, tiny_model, name="c", task="sft", dataset=chat,
                              val_dataset=chat, tokenizer=tmp_path / "tok", max_steps=2,
                              val_freq=2, sample_prompt="Say hi."))
    assert result.returncode == 0, result.stderr
    state = json.loads((tmp_path / "c/state.json").read_text())
    assert state["config"]["prompt_format"] == "chat"
    assert utils.prompt_text(tokenizer, "Say hi.", "chat") == \
        "<|endoftext|>[user]\nSay hi.\n<|endoftext|>[assistant]\n"
    out = script("generate", [tmp_path / "c", "--prompt", "Say hi.", "--max-new-tokens", 3],
                 capsys, monkeypatch)
    assert out.startswith("<|endoftext|>[user]\nSay hi.\n<|endoftext|>[assistant]\n")
    assert "### Instruction" not in out


def test_the_prompt_layout_is_read_from_the_training_split(tmp_path):
    """A save_to_disk dataset with only a train split (the validation split is not asked for)."""
    import datasets
    records = [{"instruction": "a", "output": "b"}] * 4
    datasets.DatasetDict({"train": datasets.Dataset.from_list(records)}).save_to_disk(
        tmp_path / "d")
    args = train_llm.parse_args(["-e", "x", "--task", "sft", "--dataset", str(tmp_path / "d")])
    assert data.sft_format(args.dataset, seed=args.seed) == "instruction"


def test_chat_data_with_a_tokenizer_without_a_chat_template_is_refused(tmp_path, tiny_model):
    chat = chat_data(tmp_path)
    result = train(train_args(tmp_path, tiny_model, name="c", task="sft", dataset=chat,
                              val_dataset=chat, max_steps=2))
    refused(result, "no chat template", chat)


# -- Paths, from any directory --------------------------------------------------------------------

def test_the_defaults_resolve_next_to_the_script_from_any_directory(tmp_path, capsys,
                                                                    monkeypatch):
    """Run from another directory with the shipped defaults: they are found next to
    train_llm.py, and the run records absolute paths, so generate.py works from anywhere."""
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    result = subprocess.run(
        [sys.executable, str(ROOT / "train_llm.py"), "-e", "d", "--save-dir", "runs",
         "--max-steps", "1", "--seq-length", "32", "--batch-size", "2", "--val-batches", "1",
         "--sample-tokens", "0", "--wandb", "disabled"],
        cwd=elsewhere, env=ENV, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    config = json.loads((elsewhere / "runs/d/state.json").read_text())["config"]
    for name in ("dataset", "val_dataset", "tokenizer", "model_name"):
        assert os.path.isabs(config[name]) and config[name].startswith(str(ROOT)), name
    monkeypatch.chdir(tmp_path)
    assert script("generate", [elsewhere / "runs/d", "--prompt", "The", "--max-new-tokens", 2],
                  capsys, monkeypatch).startswith("The")


def test_a_run_of_an_earlier_version_with_relative_paths_still_resumes(four_steps, tmp_path,
                                                                       tiny_model):
    """Earlier versions recorded the shipped defaults as typed (relative): resumed from the
    same directory they name the same files, so the run goes on under its old spelling."""
    exp = copy_run(four_steps, tmp_path)
    for path in [exp / "state.json", *exp.glob("checkpoints/*/*.json")]:
        text = path.read_text()
        assert f'"{ROOT}/' in text
        path.write_text(text.replace(f'"{ROOT}/', '"'))  # as typed, from the kit's directory
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=5))
    assert result.returncode == 0, result.stderr
    assert global_step(exp) == 5
    assert json.loads((exp / "state.json").read_text())["config"]["tokenizer"] == \
        "assets/tokenizer"


def test_paths_that_do_not_exist_are_one_paragraph(four_steps, tmp_path, tiny_model, capsys,
                                                   monkeypatch):
    missing = str(tmp_path / "no/such/dir")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        utils.pretrained(AutoTokenizer, missing, "--tokenizer")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        utils.load_trained(missing)
    for name in ("generate", "export_hf"):
        argv = [missing, "--prompt", "x"] if name == "generate" else [missing, "--out", "o"]
        with pytest.raises(SystemExit) as exit_:
            script(name, argv, capsys, monkeypatch)
        assert "no such file or directory" in str(exit_.value.code), name
    for flag in ("tokenizer", "model_name", "init_from"):
        args = train_llm.parse_args(train_args(tmp_path, tiny_model, **{flag: missing}))
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            train_llm.build_model(args, torch.device("cpu"))
    # Through the CLI: one paragraph (an OSError, like every expected failure).
    result = train(train_args(tmp_path, tiny_model, name="i", max_steps=1, init_from=missing))
    refused(result, missing, "no such file or directory")


def test_a_run_from_another_runs_weights_keeps_that_runs_tokenizer(four_steps, tmp_path,
                                                                    tiny_model):
    """four_steps trained with another tokenizer (the shipped one with two ids swapped): the
    SFT run from it uses that one unless told otherwise, and refuses one that differs."""
    other = tmp_path / "other-tokenizer"
    shutil.copytree(ROOT / "assets/tokenizer", other)
    spec = json.loads((other / "tokenizer.json").read_text())
    vocab = spec["model"]["vocab"]
    a, b = list(vocab)[-2:]
    vocab[a], vocab[b] = vocab[b], vocab[a]
    (other / "tokenizer.json").write_text(json.dumps(spec))
    pre = train(train_args(tmp_path, tiny_model, name="pre", max_steps=2, ckpt_freq=2,
                           tokenizer=str(other)))
    assert pre.returncode == 0, pre.stderr[-2000:]
    args = train_args(tmp_path, tiny_model, name="sft", max_steps=1, task="sft", seq_length=64,
                      init_from=str(tmp_path / "pre"))
    result = train(args)
    assert result.returncode == 0, result.stderr[-2000:]
    state = json.loads((tmp_path / "sft/state.json").read_text())
    assert state["config"]["tokenizer"] == str(other)
    refused(train([*train_args(tmp_path, tiny_model, name="sft2", max_steps=1, task="sft",
                               seq_length=64, init_from=str(tmp_path / "pre")),
                   f"--tokenizer={ROOT / 'assets/tokenizer'}"]),
            "is not the tokenizer that --init-from", str(other))


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
    result = train(train_args(tmp_path, tiny_model, name="sft", max_steps=1, init_from=exp))
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
             "config": config}))
    (run / "checkpoints/step-000002/dcp/.metadata").write_bytes(b"not a checkpoint")
    with pytest.raises(OSError, match="The previous checkpoint .*step-000001 is complete"):
        utils.load_trained(run / "checkpoints/step-000002")


def test_a_shard_named_otherwise_trains_with_data_format(tmp_path, tiny_model):
    """(Without the flag, a DataError names it: test_data_faults.py.)"""
    orig = tmp_path / "one.jsonl.orig"
    orig.write_text("".join(json.dumps({"text": f"document {i} " + "word " * 30}) + "\n"
                            for i in range(50)))
    result = train(train_args(tmp_path, tiny_model, name="o", dataset=orig, max_steps=1,
                              data_format="jsonl"))
    assert result.returncode == 0, result.stderr


# -- Tracebacks that were one paragraph away -----------------------------------------------------

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


def test_out_of_memory_is_one_paragraph(tmp_path, tiny_model):
    """The first backward pass runs out of memory (as a too large --batch-size does on a GPU):
    one paragraph with the way on, no traceback."""
    code = ("import runpy, sys, torch\n"
            "def oom(*a, **k):\n"
            "    raise torch.OutOfMemoryError('CUDA out of memory. Tried to allocate 9.00 GiB')\n"
            "torch.Tensor.backward = oom\n"
            "sys.argv = ['train_llm.py', *sys.argv[1:]]\n"
            "runpy.run_path('train_llm.py', run_name='__main__')\n")
    result = subprocess.run([sys.executable, "-c", code,
                             *train_args(tmp_path, tiny_model, max_steps=2)],
                            cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    refused(result, "Out of memory", "Tried to allocate 9.00 GiB", "--grad-accum")


def test_a_log_file_that_cannot_be_written_says_so_once(capsys):
    """/dev/full fails every write as a full disk does: one line, then silence (it used to be
    a "--- Logging error ---" traceback per record)."""
    handler = utils.QuietFileHandler("/dev/full")
    log = logging.getLogger("test_refusals.full")
    log.addHandler(handler)
    try:
        for i in range(4):
            log.error("record %d", i)
    finally:
        log.removeHandler(handler)
    err = capsys.readouterr().err
    assert "Logging error" not in err and "Traceback" not in err
    assert err.count("cannot write /dev/full") == 1


def test_wandb_online_without_a_login_is_one_paragraph(tmp_path, monkeypatch):
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc, no wandb settings
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(tmp_path / "wandb-config"))
    args = argparse.Namespace(wandb="online", wandb_project="p", experiment_name="e",
                              max_steps=3)
    state = {"global_step": 0, "wandb_run_id": None}
    with pytest.raises(SystemExit) as stop:
        utils.MetricsLog(tmp_path, args, state, rank=0)
    assert "Weights & Biases did not start" in str(stop.value) and "wandb login" in str(
        stop.value) and "--wandb offline" in str(stop.value)
