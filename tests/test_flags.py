"""Flags checked when parsed: a value that cannot work is one line naming the flag (exit 2)
before anything starts; flags that set others (--global-batch-size) set them right."""


import json

import pytest
import torch
from helpers import (
    script,
)

import train_llm


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
def test_counts_and_mix_weights_are_checked_by_the_parser(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_llm.get_parser().parse_args(["-e", "x", *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--lr", "nan"], "--lr: must be a finite number > 0"),
    (["--lr=-1e-3"], "--lr: must be a finite number > 0"),
    (["--lr", "0"], "--lr: must be a finite number > 0"),
    (["--min-lr=-0.004"], "--min-lr: must be a finite number >= 0"),
    (["--min-lr", "inf"], "--min-lr: must be a finite number >= 0"),
    (["--lr", "1e-3", "--min-lr", "2e-3"], "--min-lr 0.002 is above --lr 0.001"),
    (["--device", "nonsense"], "is not a torch device"),
    (["--sample-prompt", "caf\udce9"], "--sample-prompt: 'caf\\udce9' is not UTF-8 text"),
    (["--global-batch-size", "10", "-b", "4"], "must be a multiple of world size x --batch-size"),
    (["--global-batch-size", "8", "-b", "4", "--grad-accum", "3"], "= 2); pass one of the two"),
    (["--global-batch-size", "8", "-b", "2", "--grad-accum", "3"],
     "--grad-accum 3 and --global-batch-size 8 disagree"),  # 8 is a multiple of 2
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
    (["--profile-steps", "5"], "--profile-steps: '5': expected A:B"),
    (["--profile-steps", "a:b"], "--profile-steps: 'a:b': expected A:B"),
    (["--profile-steps", "0:3"], "with 1 <= A <= B"),
    (["--profile-steps", "5:3"], "with 1 <= A <= B"),
    (["--profile-steps", "2.5:3"], "expected A:B"),
    (["--profile-steps", "5:8", "--max-steps", "6"], "5:8 ends after --max-steps 6"),
    (["--eval-tasks", ","], "--eval-tasks: names no task"),
    (["--eval-tasks", "kit_cloze", "--eval-freq", "300"], "must be a multiple of --val-freq 200"),
    (["--eval-limit", "5"], "--eval-freq and --eval-limit go with --eval-tasks"),
])
def test_flags_are_checked_when_parsed(argv, words, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_llm.parse_args(["-e", "x", *argv])
    assert exit_.value.code == 2 and words in capsys.readouterr().err


def test_a_flag_refused_when_parsed_reaches_torchruns_table_of_failures(tmp_path, monkeypatch,
                                                                        capsys):
    """Under torchrun, a refusal at parse time goes into the rank's error file too (torchrun's
    closing table shows it, not "error_file: <N/A>"), like the refusals after parsing."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "error.json"))
    for argv, words in ((["-e", "x", "--lr", "nan"], "--lr: must be a finite number > 0"),
                        (["-e", "x", "--min-lr", "1", "--lr", "0.1"], "--min-lr 1.0 is above")):
        with pytest.raises(SystemExit):
            train_llm.parse_args(argv)
        error = json.loads((tmp_path / "error.json").read_text())["message"]["message"]
        assert words in error and words in capsys.readouterr().err


@pytest.mark.parametrize("extra", [["--model-name", "gpt2"], ["--init-from-pretrained"]])
def test_init_from_with_a_model_of_its_own_is_refused_not_recorded(extra, tmp_path, capsys):
    """--init-from trains the model it names: a --model-name beside it would be ignored, and
    state.json would record it as the run's model."""
    with pytest.raises(SystemExit):
        train_llm.parse_args(["-e", "x", "--init-from", str(tmp_path), *extra])
    assert "--model-name and --init-from-pretrained would be ignored" in capsys.readouterr().err


def test_an_infinite_grad_clip_means_never_clip():
    assert train_llm.parse_args(["-e", "x", "--grad-clip", "inf"]).grad_clip == float("inf")


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


@pytest.mark.parametrize("device", ["meta", pytest.param("mps", marks=pytest.mark.skipif(
    torch.backends.mps.is_available(), reason="this machine has MPS"))])
def test_a_device_torch_cannot_train_on_here_is_refused_when_parsed(device, capsys):
    with pytest.raises(SystemExit) as exit_:
        train_llm.parse_args(["-e", "x", "--device", device])
    assert exit_.value.code == 2 and "torch cannot train there" in capsys.readouterr().err


@pytest.mark.parametrize("argv, words", [
    (["--max-new-tokens", "0"], "--max-new-tokens: must be at least 1"),
    (["--max-new-tokens=-5"], "--max-new-tokens: must be at least 1"),
    (["--top-k=-3"], "--top-k: must be at least 1"),
    (["--temperature=-1"], "--temperature: must be a finite number >= 0"),
    (["--temperature", "nan"], "--temperature: must be a finite number >= 0"),
    (["--device", "nonsense"], "is not a torch device"),
    (["--prompt", "caf\udce9"], "is not UTF-8 text"),  # (a non-UTF-8 byte in the command)
    pytest.param(["--device", "cuda"], "leave --device out to run on the CPU",
                 marks=pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here")),
])
def test_generate_checks_its_flags_when_parsed(argv, words, capsys, monkeypatch):
    with pytest.raises(SystemExit) as exit_:
        script("generate", ["some-run", "--prompt", "x", *argv], capsys, monkeypatch)
    assert exit_.value.code == 2 and words in capsys.readouterr().err
