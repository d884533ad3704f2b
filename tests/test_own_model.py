"""A model of one's own: tests/own_model.py's TinyGPT (no transformers) returned by create_model
of a copy of the kit, as a learner would write it. It trains, resumes bit-identically after a
SIGKILL, samples at validation, and the kit's generate.py and --init-from rebuild it from the
run; what needs transformers (export_hf.py, activation checkpointing) says so in one
paragraph."""

import shutil
import subprocess
import sys

import pytest
import torch
from helpers import ENV, ROOT, copy_kit, kill_at, metrics, refused, train, train_args

STEPS = 8
CREATE_MODEL = """
    def create_model(args):
        from my_model import TinyGPT  # (my_model.py, next to this script)
        return TinyGPT(len(AutoTokenizer.from_pretrained(args.tokenizer)))
"""


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    dest = tmp_path_factory.mktemp("project")
    copy_kit(dest, "train_own.py", CREATE_MODEL)
    shutil.copy(ROOT / "tests/own_model.py", dest / "my_model.py")
    return dest


def own(project, args, timeout=120):
    """The copy's script, run in its project."""
    return subprocess.run([sys.executable, "train_own.py", *map(str, args)], cwd=project,
                          env=ENV, capture_output=True, text=True, timeout=timeout)


def kit_script(name, args):
    """One of the kit's scripts/, run from the kit's directory."""
    return subprocess.run([sys.executable, f"scripts/{name}.py", *map(str, args)], cwd=ROOT,
                          env=ENV, capture_output=True, text=True, timeout=120)


def args_for(save_dir, name="run", **overrides):
    # (--model-name is not read by TinyGPT's create_model, but is recorded like any flag.)
    flags = {"max_steps": STEPS, "ckpt_freq": 4, "val_freq": 4, "log_freq": 1,
             "sample_tokens": 8, "tokenizer": f"{ROOT}/assets/tokenizer",
             "dataset": f"{ROOT}/data/sample/*/train-*.jsonl",
             "val_dataset": f"{ROOT}/data/sample/*/val-*.jsonl", **overrides}
    return train_args(save_dir, f"{ROOT}/assets/tiny-gpt2", name=name, **flags)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, project):
    save_dir = tmp_path_factory.mktemp("own")
    result = own(project, args_for(save_dir))
    assert result.returncode == 0, result.stderr
    return save_dir / "run", result.stderr


def final_weights(exp_dir):
    return torch.load(exp_dir / f"checkpoints/step-{STEPS:06d}/model.pt", weights_only=True)


@pytest.mark.slow
def test_it_trains_and_samples(straight):
    exp_dir, _ = straight
    rows = metrics(exp_dir)
    assert [row["step"] for row in rows] == list(range(1, STEPS + 1))
    assert rows[-1]["loss"] < rows[0]["loss"]
    assert "tokens.weight" in final_weights(exp_dir)  # TinyGPT's, not GPT2LMHeadModel's
    assert all(isinstance(row.get("sample", ""), str) for row in rows)
    assert any(row.get("sample") for row in rows)


@pytest.mark.slow
def test_killed_and_resumed_it_ends_bit_identical(straight, project, tmp_path):
    exp_dir = tmp_path / "run"
    args = args_for(tmp_path)
    with open(tmp_path / "log.txt", "ab") as out:
        proc = subprocess.Popen([sys.executable, "train_own.py", *map(str, args)], cwd=project,
                                env=ENV, stdout=out, stderr=subprocess.STDOUT)
    kill_at(proc, exp_dir, 5)
    result = own(project, args)
    assert result.returncode == 0, result.stderr
    assert "Resuming" in result.stderr
    ours, theirs = final_weights(exp_dir), final_weights(straight[0])
    assert ours.keys() == theirs.keys()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours)
    rerun = own(project, args)  # done: no export to redo, no traceback
    assert rerun.returncode == 0 and "Traceback" not in rerun.stderr, rerun.stderr


@pytest.mark.slow
def test_generate_and_init_from_rebuild_it_from_the_run(straight, project, tmp_path):
    exp_dir = straight[0]
    result = kit_script("generate", [exp_dir, "--prompt", "def", "--max-new-tokens", "8"])
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    result = own(project, [a for a in args_for(tmp_path, name="next", init_from=exp_dir,
                                               max_steps=2) if not a.startswith("--model-name")])
    assert result.returncode == 0, result.stderr
    weights = tmp_path / "next/checkpoints/step-000002/model.pt"
    assert "tokens.weight" in torch.load(weights, weights_only=True)


@pytest.mark.slow
def test_what_needs_transformers_refuses_at_start(straight, project, tmp_path):
    result = kit_script("export_hf", [straight[0], "--out", tmp_path / "out"])
    refused(result, "a model of its own", "no Hugging Face layout")
    assert not (tmp_path / "out").exists()
    result = own(project, [*args_for(tmp_path), "--activation-checkpointing"])
    refused(result, "--activation-checkpointing", "TinyGPT")
    assert not (tmp_path / "run").exists()  # a start that fails before training keeps nothing


@pytest.mark.slow
def test_it_needs_no_model_name_that_exists(project, tmp_path):
    """create_model reads no --model-name: the shipped default, absent from the project, is
    not asked for (a copy of the kit's own create_model is: test_copied_kit)."""
    args = [a for a in args_for(tmp_path, max_steps=1) if not str(a).startswith("--model-name")]
    assert not any("tiny-gpt2" in str(a) for a in args) and not (project / "assets").exists()
    result = own(project, args)
    assert result.returncode == 0, result.stderr
    assert (tmp_path / "run/checkpoints/step-000001").is_dir()


@pytest.mark.slow
def test_a_llama_config_as_model_name_trains_and_loads_as_llama(tmp_path):
    """No code: a Llama-style config (RoPE, RMSNorm, SwiGLU, 4 heads of which 2 key-value)
    saved in a directory is --model-name; the run trains and loads back as that model."""
    from transformers import LlamaConfig

    import trained
    LlamaConfig(vocab_size=8192, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                bos_token_id=0, eos_token_id=0, pad_token_id=1).save_pretrained(tmp_path / "llama")
    result = train(train_args(tmp_path, tmp_path / "llama", max_steps=4, ckpt_freq=4,
                              val_freq=4, sample_tokens=4))
    assert result.returncode == 0, result.stderr[-2000:]
    model = trained.load_trained(tmp_path / "run")[0]
    assert type(model).__name__ == "LlamaForCausalLM"
    assert model.config.num_key_value_heads == 2 and len(metrics(tmp_path / "run")) == 4
