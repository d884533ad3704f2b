"""Training state of your own (train_llm.py's ``extra``): an EMA of the weights, added as the
README's "Changing the kit" shows (helpers.EMA_EDITS), is in every checkpoint, is refused by
name where a checkpoint lacks it, and generate.py/export_hf.py read its weights. (That it comes
back exactly after a kill: the copied kit's kill test, test_copied_kit.py, which has it.)"""

import subprocess
import sys

import pytest
import torch
from helpers import EMA, EMA_EDITS, ENV, ROOT, copy_kit, refused, train_args

import utils

SHIPPED = {"tokenizer": f"{ROOT}/assets/tokenizer",
           "dataset": f"{ROOT}/data/sample/*/train-*.jsonl",
           "val_dataset": f"{ROOT}/data/sample/*/val-*.jsonl"}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return copy_kit(tmp_path_factory.mktemp("ema"), script="train_llm.py", edits=EMA_EDITS)


def args_for(save_dir, tiny_model, name, **overrides):
    return train_args(save_dir, tiny_model, name=name, **{
        "max_steps": 8, "ckpt_freq": 2, "val_freq": 4, "sample_tokens": 0, **SHIPPED,
        **overrides})


def run(script, args):
    return subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=ENV,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.slow
def test_generate_and_export_read_the_ema_weights(project, tiny_model, tmp_path):
    """generate.py and export_hf.py read the EMA's weights with --weights ema."""
    straight = run(project, args_for(tmp_path, tiny_model, "straight", max_steps=2))
    assert straight.returncode == 0, straight.stderr[-3000:]
    ema = utils.load(tmp_path / "straight/checkpoints/step-000002/ema.pt", "cpu")
    model = utils.load(tmp_path / "straight/checkpoints/step-000002/model.pt", "cpu")
    assert not all(torch.equal(ema[f"module.{k}"], v) for k, v in model.items())
    sys.path.insert(0, str(ROOT / "scripts"))
    import project
    loaded = project.load_trained(project.trained, tmp_path / "straight", weights="ema")[0]
    loaded = loaded.state_dict()
    assert all(torch.equal(loaded[k], ema[f"module.{k}"]) for k in model)
    out = subprocess.run([sys.executable, "scripts/generate.py", str(tmp_path / "straight"),
                          "--prompt", "The", "--max-new-tokens", "3", "--weights", "ema"],
                         cwd=ROOT, env=ENV, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.startswith("The"), out.stderr[-2000:]


@pytest.mark.slow
def test_a_checkpoint_without_the_state_is_refused_by_name(project, tiny_model, tmp_path):
    """A run saved by the plain script, resumed by the one that adds an EMA: not damage, and
    not a fresh EMA in the middle of a run: refused, naming the state."""
    plain = copy_kit(tmp_path / "plain", script="train_llm.py")
    first = run(plain, args_for(tmp_path, tiny_model, "r", max_steps=2))
    assert first.returncode == 0, first.stderr[-2000:]
    refused(run(project, args_for(tmp_path, tiny_model, "r", max_steps=4)), "holds no ema.pt",
            "'ema'", "Nothing was changed")


@pytest.mark.slow
def test_a_checkpoint_with_state_this_script_lacks_is_resumed_saying_so(project, tiny_model,
                                                                         tmp_path):
    """A run saved with an EMA, resumed by the plain script: the EMA's file is named in a
    warning, never dropped without a word."""
    first = run(project, args_for(tmp_path, tiny_model, "r", max_steps=2))
    assert first.returncode == 0, first.stderr[-2000:]
    plain = copy_kit(tmp_path / "plain", script="train_llm.py")
    resumed = run(plain, args_for(tmp_path, tiny_model, "r", max_steps=4))
    assert resumed.returncode == 0, resumed.stderr[-2000:]
    assert "does not add to extra: ema.pt" in resumed.stderr, resumed.stderr[-2000:]


@pytest.mark.slow
def test_training_state_named_like_a_file_of_the_kit_is_refused_at_start(tiny_model, tmp_path):
    """extra["model"] would overwrite every checkpoint's model.pt with the EMA: refused
    before the first step, naming it."""
    script = copy_kit(tmp_path / "kit", script="train_llm.py", edits=[
        ("    extra = {}\n", EMA.replace('extra["ema"]', 'extra["model"]')), EMA_EDITS[1]])
    refused(run(script, args_for(tmp_path, tiny_model, "r")), "extra['model']", "the kit's own")
    assert not (tmp_path / "r" / "checkpoints").exists()
