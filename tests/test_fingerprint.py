"""The config fingerprint (the flags get_parser declares with fixed()) on resume: a flag that
shapes the run, changed or recorded otherwise in the checkpoint, is refused by name before
anything changes; a flag the saved config lacks counts as its default; paths that name the
same files go on."""

import json
import shutil

import pytest
from helpers import (
    ROOT,
    copy_run,
    refused,
    snapshot,
    train,
    train_args,
)


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


@pytest.mark.slow
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


@pytest.mark.slow
def test_other_data_arguments_are_not_called_damage(ten_steps, tmp_path, tiny_model):
    exp = copy_run(ten_steps, tmp_path)
    before = snapshot(exp)
    result = train(train_args(tmp_path, tiny_model, name="k", max_steps=15, ckpt_freq=5,
                              max_doc_chars=0))
    refused(result, "Cannot resume from", "other data arguments", "max_chars=100000",
            "--max-doc-chars")
    assert "damaged" not in result.stderr and snapshot(exp) == before


@pytest.mark.parametrize("edited", [
    "tokenizer.json",
    pytest.param("config.json", marks=pytest.mark.slow),
])
def test_a_tokenizer_or_model_config_edited_in_place_is_refused_by_name(tmp_path, tiny_model,
                                                                          edited):
    """The same paths, other content (token ids swapped in tokenizer.json, an activation
    changed in config.json): resuming would train another run, so it is refused by name."""
    tokenizer, model = tmp_path / "tokenizer", tmp_path / "model"
    shutil.copytree(ROOT / "assets/tokenizer", tokenizer)
    shutil.copytree(tiny_model, model)
    args = train_args(tmp_path, model, name="k", max_steps=2, ckpt_freq=2, tokenizer=tokenizer)
    assert train(args).returncode == 0
    path = (tokenizer if edited == "tokenizer.json" else model) / edited
    saved = json.loads(path.read_text())
    if edited == "tokenizer.json":
        vocab = saved["model"]["vocab"]
        (a, i), (b, j) = list(vocab.items())[300:302]
        vocab[a], vocab[b] = j, i
    else:
        saved["activation_function"] = "relu"
    path.write_text(json.dumps(saved))
    before = snapshot(tmp_path / "k")
    again = train_args(tmp_path, model, name="k", max_steps=4, ckpt_freq=2, tokenizer=tokenizer)
    refused(train(again), f"{path} changed since", "put the old files back")
    assert snapshot(tmp_path / "k") == before
