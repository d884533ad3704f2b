"""The config fingerprint (the flags get_parser declares with fixed()) on resume: a flag that
shapes the run, changed or recorded otherwise in the checkpoint, is refused by name before
anything changes; a flag the saved config lacks counts as its default; paths that name the
same files go on."""

import json
import os
import re
import shutil
from unittest import mock

import pytest
from helpers import (
    ROOT,
    copy_run,
    examples,
    refused,
    snapshot,
    train,
    train_args,
)
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

import train_llm
import utils


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


@settings(max_examples=examples(200), deadline=None)
@given(batch=st.integers(1, 96), world_size=st.integers(1, 8), batch_size=st.integers(1, 32))
@example(batch=8, world_size=1, batch_size=16)  # the run had 8; the resume says -b 16
def test_the_advice_on_a_changed_global_batch_is_a_command_that_works(batch, world_size,
                                                                      batch_size):
    """A resume whose global batch is not the run's (``batch``: --batch-size 16 where the run
    had 8 sequences on 1 rank, say) is refused with flags that, added to its command, are
    accepted and make ``batch`` again, at no larger a --batch-size; where no --batch-size can
    on that many ranks, it says so and advises no flags."""
    assume(batch != batch_size * world_size)
    parser = train_llm.get_parser()
    with mock.patch.dict(os.environ, {"WORLD_SIZE": str(world_size)}):
        args = train_llm.parse_args(["-e", "x", "-b", str(batch_size)])
        config = {name: getattr(args, name) for name in parser.fingerprint}
        with pytest.raises(SystemExit) as refusal:
            utils.check_unchanged(args, parser, {**config, "global_batch": batch_size * world_size},
                                  {**config, "global_batch": batch}, "it was started", world_size)
        message = str(refusal.value.code)
        advised = " ".join(re.findall(r"--[a-z-]+ \d+", message)).split()
        if batch % world_size:
            assert not advised, message
            assert f"No --batch-size makes {batch} sequences on {world_size} ranks" in message
            return
        assert advised, message
        again = train_llm.parse_args(["-e", "x", "-b", str(batch_size), *advised])
    assert again.batch_size * again.grad_accum * world_size == batch, message
    assert again.batch_size <= batch_size, message
