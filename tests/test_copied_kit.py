"""The kit copied into a project as a learner copies it: the three files, the script renamed,
its create_model changed (3 transformer blocks where the config says 1), training state of its
own (an EMA of the weights in ``extra``, as the README shows), no assets/ or data/. A start
without the shipped files names every flag to pass and writes nothing; with them the copy
trains and, killed, resumes exactly (its EMA too), and the kit's generate.py and export_hf.py,
and --init-from, rebuild the model of the copy's create_model, from the script the run
recorded."""

import json
import re
import subprocess
import sys

import pytest
import torch
from helpers import EMA_EDITS, ENV, ROOT, copy_kit, kill_at, refused, snapshot, train_args
from transformers import AutoModelForCausalLM

import trained

STEPS = 8
THREE_BLOCKS = """
    def create_model(args):
        config = utils.pretrained(AutoConfig, args.model_name, "--model-name", use_cache=False)
        config.n_layer = 3  # the learner's change
        return AutoModelForCausalLM.from_config(config)
"""
SHIPPED = {"tokenizer": f"{ROOT}/assets/tokenizer",
           "dataset": f"{ROOT}/data/sample/*/train-*.jsonl",
           "val_dataset": f"{ROOT}/data/sample/*/val-*.jsonl"}


def run_in(project, script, args, timeout=120):
    return subprocess.run([sys.executable, script, *map(str, args)], cwd=project, env=ENV,
                          capture_output=True, text=True, timeout=timeout)


def kit_script(name, args):
    return run_in(ROOT, f"scripts/{name}.py", args)


def args_for(save_dir, tiny_model, name="run", **overrides):
    return train_args(save_dir, tiny_model, name=name, **{
        "max_steps": STEPS, "ckpt_freq": 4, "val_freq": 4, "sample_tokens": 4, **SHIPPED,
        **overrides})


def weights(ckpt_dir):
    return torch.load(ckpt_dir / "model.pt", weights_only=True)


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    dest = tmp_path_factory.mktemp("project")
    copy_kit(dest, "my_train.py", THREE_BLOCKS, edits=EMA_EDITS)
    return dest


@pytest.fixture(scope="module")
def straight(tmp_path_factory, project, tiny_model):
    save_dir = tmp_path_factory.mktemp("copied")
    result = run_in(project, "my_train.py", args_for(save_dir, tiny_model))
    assert result.returncode == 0, result.stderr
    return save_dir / "run"


@pytest.mark.slow
def test_without_the_shipped_files_every_missing_flag_is_named_and_nothing_written(project):
    result = run_in(project, "my_train.py", ["--experiment-name", "demo"])
    refused(result, "--tokenizer", "--model-name", "--dataset", "--val-dataset", "Nothing was")
    assert result.stderr.count("name files next to the script") == 1  # one start, not four
    assert not (project / "outputs").exists()


@pytest.mark.slow
def test_a_start_that_fails_before_training_leaves_no_directory(project, tiny_model, tmp_path):
    result = run_in(project, "my_train.py", args_for(tmp_path / "runs", tiny_model,
                                                     tokenizer=tmp_path / "no-such-tokenizer"))
    refused(result, "no-such-tokenizer", "before training began")
    assert "last checkpoint" not in result.stderr  # a new run has none
    assert not (tmp_path / "runs").exists()


def test_the_copy_trains_its_own_model_and_state_and_resumes_them_exactly(straight, project,
                                                                        tiny_model, tmp_path):
    """Killed after step 5, the copy resumes from step 4's checkpoint (its ema.pt too: one
    without it is refused, test_training_state.py) and ends with the very weights and EMA of
    the straight run."""
    state = json.loads((straight / "state.json").read_text())
    assert state["script"] == str(project / "my_train.py")
    final = f"checkpoints/step-{STEPS:06d}"
    model, ema = (torch.load(straight / final / name, weights_only=True)
                  for name in ("model.pt", "ema.pt"))
    assert "transformer.h.2.attn.c_attn.weight" in model  # 3 blocks: the copy's create_model
    assert int(ema["n_averaged"]) == STEPS  # updated at every step
    assert not all(torch.equal(ema[f"module.{k}"], v) for k, v in model.items())
    with open(tmp_path / "log.txt", "ab") as out:
        proc = subprocess.Popen([sys.executable, "my_train.py",
                                 *args_for(tmp_path, tiny_model)], cwd=project, env=ENV,
                                stdout=out, stderr=subprocess.STDOUT)
    kill_at(proc, tmp_path / "run", 5)
    result = run_in(project, "my_train.py", args_for(tmp_path, tiny_model))
    assert result.returncode == 0, result.stderr
    assert "from checkpoints/step-000004" in result.stderr, result.stderr
    for name, expected in (("model.pt", model), ("ema.pt", ema)):
        resumed = torch.load(tmp_path / "run" / final / name, weights_only=True)
        assert resumed.keys() == expected.keys(), name
        assert all(torch.equal(resumed[k], expected[k]) for k in expected), name


@pytest.mark.slow
def test_the_kits_scripts_and_init_from_rebuild_the_copys_model(straight, tiny_model, tmp_path):
    ckpt = straight / "checkpoints/step-000004"  # an older checkpoint: rebuilt, not hf/
    result = kit_script("generate", [ckpt, "--prompt", "def", "--max-new-tokens", "4"])
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    result = kit_script("export_hf", [ckpt, "--out", tmp_path / "out"])
    assert result.returncode == 0, result.stderr
    assert json.loads((tmp_path / "out/config.json").read_text())["n_layer"] == 3
    result = run_in(ROOT, "train_llm.py", args_for(tmp_path, None, name="sft",
                                                   init_from=straight, max_steps=2))
    assert result.returncode == 0, result.stderr
    assert "transformer.h.2.attn.c_attn.weight" in weights(tmp_path / "sft/checkpoints/step-000002")


@pytest.mark.slow
def test_a_run_whose_script_is_gone_says_so_in_one_paragraph(straight, project, tmp_path):
    (project / "my_train.py").rename(project / "moved.py")
    try:
        result = kit_script("generate", [straight / "checkpoints/step-000004", "--prompt", "x"])
    finally:
        (project / "moved.py").rename(project / "my_train.py")
    refused(result, f"was trained by {project / 'my_train.py'}, which is gone")
    assert "damaged" not in result.stderr


@pytest.mark.slow
def test_a_changed_create_model_is_told_apart_from_damage(straight, project, tiny_model,
                                                          tmp_path):
    """The checkpoint loads; the model the script builds now is another one. Neither the
    resume nor generate.py calls the checkpoint damaged."""
    script = project / "my_train.py"
    text = script.read_text()
    script.write_text(text.replace("config.n_layer = 3", "config.n_layer = 2"))
    try:
        result = kit_script("generate", [straight, "--prompt", "x"])
        refused(result, "do not fit", "my_train.py builds now", "not damaged",
                "unexpected (e.g. transformer.h.2.")
        resume = run_in(project, "my_train.py", args_for(straight.parent, tiny_model,
                                                         max_steps=STEPS + 2))
        refused(resume, "loads, but does not fit", "not damaged")
    finally:
        script.write_text(text)
    assert "is damaged" not in result.stderr + resume.stderr


@pytest.mark.slow
def test_a_moved_kit_refuses_to_resume_and_says_how_to_go_on(tiny_model, tmp_path):
    """The whole kit (shipped data and tokenizer included) moved to another directory between
    two starts: its runs recorded the shipped files at the old place, so the resume is refused
    by the flag, with the link that lets it go on."""
    old = copy_kit(tmp_path / "kit", script="train_llm.py").parent
    for name in ("assets", "data"):
        subprocess.run(["cp", "-r", f"{ROOT}/{name}", str(old / name)], check=True)
    args = train_args(tmp_path / "runs", tiny_model, max_steps=2, ckpt_freq=2, val_freq=2)
    first = run_in(old, "train_llm.py", args)
    assert first.returncode == 0, first.stderr[-2000:]
    new = old.rename(tmp_path / "moved-kit")
    before = snapshot(tmp_path / "runs")
    refused(run_in(new, "train_llm.py", [*args, "--max-steps=4"]),
            "Resuming would train a different run", "ln -s NEW OLD")
    assert snapshot(tmp_path / "runs") == before


@pytest.mark.slow
def test_a_flag_that_create_model_reads_outside_the_fingerprint_rebuilds_the_model(
        tiny_model, tmp_path):
    """--blocks, a learner's new flag read by create_model and declared with add (not in the
    fingerprint): the kit's generate.py and --init-from rebuild the model with the value the
    run trained with."""
    script = copy_kit(tmp_path / "proj", "my_train.py", """
        def create_model(args):
            config = utils.pretrained(AutoConfig, args.model_name, "--model-name",
                                      use_cache=False)
            config.n_layer = args.blocks
            return AutoModelForCausalLM.from_config(config)
        """, edits=[('    fixed("--init-from-pretrained"',
                     '    add("--blocks", type=int, default=1)\n'
                     '    fixed("--init-from-pretrained"')])
    result = run_in(script.parent, script.name, args_for(tmp_path, tiny_model, max_steps=2,
                                                        blocks=2))
    assert result.returncode == 0, result.stderr
    result = kit_script("generate", [tmp_path / "run", "--prompt", "def", "--max-new-tokens", "2"])
    assert result.returncode == 0 and result.stdout.strip(), result.stderr
    result = run_in(script.parent, script.name, args_for(tmp_path, None, name="next",
                                                        init_from=tmp_path / "run", max_steps=1))
    assert result.returncode == 0, result.stderr
    assert "transformer.h.1.attn.c_attn.weight" in weights(
        tmp_path / "next/checkpoints/step-000001")


@pytest.mark.slow
def test_the_kits_scripts_work_with_the_copys_own_modules(tiny_model, tmp_path):
    """A project that changed its trained.py: generate.py and export_hf.py of the kit use that
    one (and its utils.py and data.py) for the project's runs, not the kit's."""
    script = copy_kit(tmp_path / "proj", "my_train.py")
    result = run_in(script.parent, script.name, args_for(tmp_path, tiny_model, max_steps=2))
    assert result.returncode == 0, result.stderr
    trained_py = script.parent / "trained.py"
    trained_py.write_text(trained_py.read_text().replace(
        '    device = next(model.parameters()).device\n    text = prompt_text(',
        '    return " (the project\'s own trained.py)"\n    text = prompt_text(', 1))
    result = kit_script("generate", [tmp_path / "run", "--prompt", "def"])
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "def (the project's own trained.py)"
    trained_py.write_text(re.sub(r"(def load_trained\(.*\):\n)",
                                 r"\1    raise OSError('the project load_trained')\n",
                                 trained_py.read_text(), count=1))
    refused(kit_script("export_hf", [tmp_path / "run", "--out", tmp_path / "out"]),
            "the project load_trained")


def test_a_copys_modules_that_cannot_serve_the_scripts_leave_the_kits_in_place(tmp_path):
    """A copy without data.py, one of an older kit (no trained.py), one that does not import:
    the kit's scripts go on with the kit's modules, which stay the imported ones."""
    import data
    import trained
    import utils
    sys.path.insert(0, str(ROOT / "scripts"))
    import project
    (tmp_path / "train.py").write_text("")
    for files in ({"utils.py": "x = 1"}, {"utils.py": "x = 1", "data.py": ""},
                  {"utils.py": "import nothing_of_that_name", "data.py": "", "trained.py": ""}):
        for name in ("utils.py", "data.py", "trained.py"):
            (tmp_path / name).unlink(missing_ok=True)
        for name, text in files.items():
            (tmp_path / name).write_text(text)
        assert project.project_kit(tmp_path, script=tmp_path / "train.py") is trained
        assert sys.modules["utils"] is utils and sys.modules["data"] is data
        assert sys.modules["trained"] is trained


LORA = """
    class LoRA(torch.nn.Module):
        '''A frozen GPT-2 Conv1D plus a trained low-rank update: x W + b + x A B.'''

        def __init__(self, base, rank=2):
            super().__init__()
            self.base = base.requires_grad_(False)
            self.lora_a = torch.nn.Parameter(torch.randn(base.weight.shape[0], rank) * 0.1)
            self.lora_b = torch.nn.Parameter(torch.zeros(rank, base.weight.shape[1]))

        def forward(self, x):
            return self.base(x) + x @ self.lora_a @ self.lora_b


    class LoRAGPT2(GPT2LMHeadModel):
        def merge_and_unload(self):  # (for export_hf.py: the plain GPT-2, its updates merged)
            for block in self.transformer.h:
                lora = block.attn.c_attn
                lora.base.weight.data += lora.lora_a.data @ lora.lora_b.data
                block.attn.c_attn = lora.base
            return self


    def create_model(args):
        config = utils.pretrained(AutoConfig, args.model_name, "--model-name", use_cache=False)
        model = LoRAGPT2(config)
        for block in model.transformer.h:
            block.attn.c_attn = LoRA(block.attn.c_attn)
        return model
"""


@pytest.mark.slow
def test_a_lora_model_exports_merged_or_is_refused_never_exported_wrong(tiny_model, tmp_path):
    """A model with adapters of its own (LoRA) saves weights that transformers' GPT-2 does not
    know: export_hf.py refuses it by name, writing nothing; with merge_and_unload (the place
    for it, as PEFT's models have) the export is the run's model, logit for logit."""
    script = copy_kit(tmp_path / "proj", "lora.py", LORA, edits=[(
        "from transformers import AutoConfig,",
        "from transformers import GPT2LMHeadModel\nfrom transformers import AutoConfig,")])
    result = run_in(script.parent, script.name, args_for(tmp_path, tiny_model, max_steps=4,
                                                         lr=0.05))
    assert result.returncode == 0, result.stderr
    assert "M of them trained" in result.stderr  # (the frozen base weights are counted apart)
    run = tmp_path / "run"
    result = kit_script("export_hf", [run, "--out", tmp_path / "merged"])
    assert result.returncode == 0, result.stderr
    model = trained.rebuild_model(script, json.loads((run / "state.json").read_text())["args"],
                                  run)
    model.load_state_dict(weights(run / "checkpoints/step-000004"))
    assert any(block.attn.c_attn.lora_b.abs().sum() > 0 for block in model.transformer.h)
    ids = torch.arange(16).view(1, -1)
    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(exported(input_ids=ids).logits,
                                   model.eval()(input_ids=ids).logits, rtol=1e-5, atol=1e-5)
    script.write_text(script.read_text().replace("def merge_and_unload", "def _unmerged"))
    refused(kit_script("export_hf", [run, "--out", tmp_path / "plain"]),
            "transformers loads the export as a model other than the run's", "lora_a",
            "merge_and_unload")
    assert not (tmp_path / "plain").exists() and not (tmp_path / "plain.tmp").exists()


@pytest.mark.slow
def test_a_learners_flag_is_fingerprinted_by_where_it_is_declared(tiny_model, tmp_path):
    """A new flag declared with fixed() shapes the run: resuming with another value is refused
    by name, before anything changes. One declared with add() may change on resume."""
    script = copy_kit(tmp_path / "proj", "my_train.py", edits=[(
        '    fixed("--init-from-pretrained"', '    fixed("--aux-weight", type=float, default=0)\n'
        '    add("--note", default="")\n    fixed("--init-from-pretrained"')])
    result = run_in(script.parent, script.name, args_for(tmp_path, tiny_model, max_steps=2,
                                                        aux_weight=0.5, note="a"))
    assert result.returncode == 0, result.stderr
    result = run_in(script.parent, script.name, args_for(tmp_path, tiny_model, max_steps=3,
                                                        aux_weight=0.5, note="b"))
    assert result.returncode == 0 and "Resuming" in result.stderr, result.stderr
    before = snapshot(tmp_path / "run")
    result = run_in(script.parent, script.name, args_for(tmp_path, tiny_model, max_steps=4,
                                                        aux_weight=0.25, note="b"))
    refused(result, "--aux-weight was 0.5 when", "0.25 now")
    assert snapshot(tmp_path / "run") == before
