"""Paths: the shipped defaults are found next to the script from any directory, a run records
them absolute, and a path that does not exist or does not load is one paragraph naming it."""

import json
import os
import shlex
import subprocess
import sys

import pytest
import torch
from helpers import (
    ENV,
    ROOT,
    refused,
    script,
    small_disk,
    snapshot,
    train,
    train_args,
)
from transformers import AutoTokenizer

import data
import train_llm
import trained
import utils


@pytest.mark.slow
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


@pytest.mark.slow
def test_paths_that_do_not_exist_are_one_paragraph(tmp_path, tiny_model, capsys, monkeypatch):
    missing = str(tmp_path / "no/such/dir")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        utils.pretrained(AutoTokenizer, missing, "--tokenizer")
    with pytest.raises(FileNotFoundError, match="no such file or directory"):
        trained.load_trained(missing)
    for name in ("generate", "export_hf"):
        argv = [missing, "--prompt", "x"] if name == "generate" else [missing, "--out", "o"]
        with pytest.raises(SystemExit) as exit_:
            script(name, argv, capsys, monkeypatch)
        assert "no such file or directory" in str(exit_.value.code), name
    for flag in ("tokenizer", "model_name"):
        args = train_llm.parse_args(train_args(tmp_path, tiny_model, **{flag: missing}))
        with pytest.raises(FileNotFoundError, match="no such file or directory"):
            train_llm.build_model(args, torch.device("cpu"))
    # Through the CLI: one paragraph, naming the flag (not --tokenizer, which follows it).
    result = train(train_args(tmp_path, None, name="i", max_steps=1, init_from=missing))
    refused(result, f"--init-from {missing}: no such file or directory")
    assert "--tokenizer" not in result.stderr.splitlines()[-1]


def test_a_local_model_directory_that_does_not_load_is_called_that(tmp_path):
    (tmp_path / "config.json").write_text("{")
    with pytest.raises(OSError, match="a local directory that does not load"):
        utils.pretrained(AutoTokenizer, str(tmp_path), "--model-name")


def test_a_directory_without_a_tokenizer_is_refused_as_a_tokenizer(tmp_path):
    """A model's directory (config.json, no tokenizer files) as --tokenizer: transformers
    makes a tokenizer of one token from it, which would fail later as "too few tokens"."""
    (tmp_path / "config.json").write_text((ROOT / "assets/tiny-gpt2/config.json").read_text())
    with pytest.raises(OSError, match="--tokenizer .*: holds no tokenizer"):
        utils.pretrained(AutoTokenizer, str(tmp_path), "--tokenizer")


def test_a_kit_in_a_directory_named_like_a_glob_finds_its_data(tmp_path, monkeypatch):
    """A clone in kit[1]/: the shipped data/sample/*/ and a relative glob typed there are that
    directory's files (its name escaped), and --mix finds the shipped domains."""
    kit = tmp_path / "kit[1]"
    kit.mkdir()
    for name in ("assets", "data"):
        (kit / name).symlink_to(ROOT / name)
    monkeypatch.setattr(train_llm, "KIT", kit)
    monkeypatch.setattr(train_llm, "DEFAULT_DATA", {task: str(pattern).replace(str(ROOT), str(
        kit)) for task, pattern in train_llm.DEFAULT_DATA.items()})
    monkeypatch.setattr(train_llm, "DEFAULT_TOKENIZER", f"{kit}/assets/tokenizer")
    monkeypatch.chdir(kit)
    args = train_llm.parse_args(["-e", "x", "--save-dir", str(tmp_path / "out"), "-m",
                                 f"{kit}/assets/tiny-gpt2", "--val-dataset",
                                 "data/sample/*/val-*.jsonl"])
    shipped = sorted((ROOT / "data" / "sample").glob("*/train-*.jsonl"))
    assert data.expand_urls(args.dataset) == [
        str(kit / p.relative_to(ROOT)) for p in shipped]
    assert len(data.expand_urls(args.val_dataset)) > 0
    assert list(data.find_domains(args.dataset)) == sorted(
        p.name for p in (ROOT / "data" / "sample").iterdir() if p.is_dir())


def test_a_tokenizer_trains_on_a_glob_and_no_match_is_one_paragraph(tmp_path, capsys,
                                                                   monkeypatch):
    out = script("train_tokenizer", ["--data", f"{ROOT}/data/sample/prose/train-*.jsonl", "--out",
                                     tmp_path / "tok", "--config-out", tmp_path / "cfg",
                                     "--vocab-size", 400], capsys, monkeypatch)
    assert "tokenizer: 400 tokens" in out and "prose" in out
    assert len(AutoTokenizer.from_pretrained(tmp_path / "tok")) == 400
    with pytest.raises(SystemExit, match="--data nope/.*: no files match"):
        script("train_tokenizer", ["--data", "nope/*.jsonl", "--out", tmp_path / "t2"],
               capsys, monkeypatch)
    assert not (tmp_path / "t2").exists()


def test_train_tokenizer_never_writes_over_a_tokenizer_unless_told(tmp_path, capsys,
                                                                  monkeypatch):
    """Its defaults are outputs/; a directory with files (the shipped assets/ among them) is
    written over only with --overwrite."""
    prose = ["--data", f"{ROOT}/data/sample/prose/train-*.jsonl", "--vocab-size", "400"]
    before = snapshot(ROOT / "assets")
    for argv in (["--out", ROOT / "assets/tokenizer", "--config-out", tmp_path / "c"],
                 ["--out", tmp_path / "t", "--config-out", ROOT / "assets/tiny-gpt2"]):
        with pytest.raises(SystemExit, match="exists and is not empty: nothing written"):
            script("train_tokenizer", [*prose, *argv], capsys, monkeypatch)
    assert snapshot(ROOT / "assets") == before and not (tmp_path / "c").exists()
    monkeypatch.chdir(tmp_path)
    script("train_tokenizer", prose, capsys, monkeypatch)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "outputs/tokenizer")) == 400
    with pytest.raises(SystemExit, match="outputs/tokenizer exists and is not empty"):
        script("train_tokenizer", prose, capsys, monkeypatch)
    script("train_tokenizer", [*prose, "--overwrite"], capsys, monkeypatch)


def test_train_tokenizer_on_a_full_disk_is_one_paragraph_leaves_nothing_and_reruns(
        tmp_path, capsys, monkeypatch):
    """A disk that fills while the tokenizer is written: one paragraph naming --out, no file
    or directory left (no empty tokenizer_config.json), and the same command then works."""
    argv = ["--data", f"{ROOT}/data/sample/prose/train-000.jsonl", "--vocab-size", "300",
            "--out", tmp_path / "out/tok", "--config-out", tmp_path / "out/cfg"]
    with small_disk(2048), pytest.raises(SystemExit) as exit_:  # tokenizer.json does not fit
        script("train_tokenizer", argv, capsys, monkeypatch)
    message = str(exit_.value.code)
    for words in (f"writing {tmp_path / 'out/tok'} failed", "GiB free on that disk",
                  "Nothing was written"):
        assert words in message, (words, message)
    assert list((tmp_path / "out").iterdir()) == []
    assert "tokenizer: 300 tokens" in script("train_tokenizer", argv, capsys, monkeypatch)
    assert len(AutoTokenizer.from_pretrained(tmp_path / "out/tok")) == 300
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["cfg", "tok"]


def test_a_mistyped_run_under_an_existing_directory_is_not_sent_to_the_hub(tmp_path,
                                                                           monkeypatch):
    """outputs/demoo, where outputs/ exists: a path, said at once (the Hub would retry the
    network for half a minute first); a name whose first part is no directory may be the Hub's."""
    (tmp_path / "outputs").mkdir()
    monkeypatch.chdir(tmp_path)
    asked = []
    monkeypatch.setattr(AutoTokenizer, "from_pretrained", lambda name, **_: asked.append(name))
    with pytest.raises(FileNotFoundError, match="outputs/demoo: no such file or directory"):
        trained.load_trained("outputs/demoo")
    utils.pretrained(AutoTokenizer, "someone/model", "--tokenizer")
    assert asked == ["someone/model"]


@pytest.mark.slow
def test_the_export_hint_of_a_run_in_a_path_with_spaces_is_a_command_that_works(tmp_path,
                                                                                tiny_model):
    save_dir = tmp_path / "my runs"
    result = train(train_args(save_dir, tiny_model, name="it's", max_steps=1, val_freq=1))
    assert result.returncode == 0, result.stderr
    hint = result.stderr.split("For transformers: ")[1].splitlines()[0]
    assert shlex.split(hint) == ["python", "scripts/export_hf.py", str(save_dir / "it's")]


@pytest.mark.parametrize("argv, words", [
    (["--vocab-size=-1"], "--vocab-size: must be at least 258"),
    (["--max-length", "0"], "--max-length: must be at least 2"),
    (["--data", "EMPTY"], "hold no text to learn from"),
    (["--data", "BLANK"], "hold no text to learn from"),
])
def test_train_tokenizer_refuses_what_cannot_make_a_tokenizer_and_writes_nothing(
        argv, words, tmp_path, capsys, monkeypatch):
    """A vocabulary or length that cannot work, an empty file, records of empty text: one
    paragraph naming it, and no tokenizer left for a rerun to refuse."""
    (tmp_path / "empty.jsonl").write_text("")
    (tmp_path / "blank.jsonl").write_text('{"text": ""}\n{"text": "  "}\n')
    argv = [str(tmp_path / "empty.jsonl") if a == "EMPTY" else
            str(tmp_path / "blank.jsonl") if a == "BLANK" else a for a in argv]
    with pytest.raises(SystemExit) as exit_:
        script("train_tokenizer", [*argv, "--out", tmp_path / "tok", "--config-out",
                                   tmp_path / "cfg"], capsys, monkeypatch)
    assert words in str(exit_.value.code) + capsys.readouterr().err
    assert not (tmp_path / "tok").exists() and not (tmp_path / "cfg").exists()
