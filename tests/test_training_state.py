"""Training state of your own (train_llm.py's ``extra``): an EMA of the weights, added as the
README's "Changing the kit" shows, is in every checkpoint, comes back exactly after a kill,
is refused by name where a checkpoint lacks it, and generate.py/export_hf.py read its weights."""

import subprocess
import sys

import pytest
import torch
from helpers import ENV, ROOT, copy_kit, kill_at, refused, train_args

import utils

EMA = """    extra = {}
    ema = AveragedModel(utils.unwrap(model), multi_avg_fn=get_ema_multi_avg_fn(0.9))
    optimizers[-1].register_step_post_hook(lambda *_: ema.update_parameters(utils.unwrap(model)))
    extra["ema"] = ema
"""
IMPORT = "from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn\n"
SHIPPED = {"tokenizer": f"{ROOT}/assets/tokenizer",
           "dataset": f"{ROOT}/data/sample/*/train-*.jsonl",
           "val_dataset": f"{ROOT}/data/sample/*/val-*.jsonl"}


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return copy_kit(tmp_path_factory.mktemp("ema"), script="train_llm.py", edits=[
        ("    extra = {}\n", EMA), ("import data\n", IMPORT + "\nimport data\n")])


def args_for(save_dir, tiny_model, name, **overrides):
    return train_args(save_dir, tiny_model, name=name, **{
        "max_steps": 8, "ckpt_freq": 2, "val_freq": 4, "sample_tokens": 0, **SHIPPED,
        **overrides})


def start(script, args, log):
    with open(log, "ab") as out:
        return subprocess.Popen([sys.executable, str(script), *args], cwd=script.parent,
                                env=ENV, stdout=out, stderr=subprocess.STDOUT)


def run(script, args):
    return subprocess.run([sys.executable, str(script), *args], cwd=script.parent, env=ENV,
                          capture_output=True, text=True, timeout=300)


def test_an_ema_of_the_weights_resumes_exactly_after_a_kill(project, tiny_model, tmp_path):
    straight = run(project, args_for(tmp_path, tiny_model, "straight"))
    assert straight.returncode == 0, straight.stderr[-3000:]
    proc = start(project, args_for(tmp_path, tiny_model, "killed"), tmp_path / "log")
    kill_at(proc, tmp_path / "killed", 5)
    resumed = run(project, args_for(tmp_path, tiny_model, "killed"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    for name in ("ema.pt", "model.pt"):
        a, b = (utils.load(tmp_path / run_name / "checkpoints/step-000008" / name, "cpu")
                for run_name in ("straight", "killed"))
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), name
    ema = utils.load(tmp_path / "straight/checkpoints/step-000008/ema.pt", "cpu")
    model = utils.load(tmp_path / "straight/checkpoints/step-000008/model.pt", "cpu")
    assert int(ema["n_averaged"]) == 8
    assert not all(torch.equal(ema[f"module.{k}"], v) for k, v in model.items())


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
        ("    extra = {}\n", EMA.replace('extra["ema"]', 'extra["model"]')),
        ("import data\n", IMPORT + "\nimport data\n")])
    refused(run(script, args_for(tmp_path, tiny_model, "r")), "extra['model']", "the kit's own")
    assert not (tmp_path / "r" / "checkpoints").exists()
