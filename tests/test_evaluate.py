"""scripts/evaluate.py: lm-evaluation-harness scores a run offline on the kit's own tasks
(assets/eval), the same from the run directory as from its hf/ export, and a run's or
checkpoint's scores go into the run's eval.jsonl with their step."""

import json
import math
import random
import shutil
import statistics
import subprocess
import sys

import pytest
from helpers import (
    ENV,
    ROOT,
    copy_run,
    script,
    train,
    train_args,
    wandb_history,
)
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import data
import trained


def table(out, stderr=False):
    """{(task, metric): value (or its standard error)} of evaluate.py's printed table."""
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| kit")]
    return {(task.strip(), metric.strip()): error.strip() if stderr else float(value)
            for task, metric, value, error in rows}


@pytest.mark.slow
def test_a_run_is_scored_offline_as_its_export_is_and_the_scores_are_kept(
        four_steps, tmp_path, capsys, monkeypatch):
    exp = copy_run(four_steps, tmp_path)
    out = script("evaluate", [exp, "--limit", 6], capsys, monkeypatch)
    scores, errors = table(out), table(out, stderr=True)
    assert {("kit_cloze", "acc"), ("kit_bpb", "bits_per_byte")} <= set(scores)
    assert float(errors["kit_cloze", "acc"]) > 0  # runs are compared with their noise
    assert math.isfinite(float(errors["kit_bpb", "bits_per_byte"]))
    assert 0 <= scores["kit_cloze", "acc"] <= 1 and scores["kit_bpb", "bits_per_byte"] > 0
    assert table(script("evaluate", [exp / "hf", "--limit", 6], capsys, monkeypatch)) == scores
    script("evaluate", [exp / "checkpoints/step-000002", "--limit", 6, "--tasks", "kit_bpb"],
           capsys, monkeypatch)
    lines = [json.loads(line) for line in (exp / "eval.jsonl").read_text().splitlines()]
    assert [(line["task"], line["step"]) for line in lines] == [
        ("kit_cloze", 4), ("kit_bpb", 4), ("kit_bpb", 2)]  # (hf/ is no run: not kept)
    assert lines[1]["bits_per_byte"] == pytest.approx(scores["kit_bpb", "bits_per_byte"], abs=1e-4)
    assert lines[0]["acc_stderr"] == pytest.approx(float(errors["kit_cloze", "acc"]), abs=1e-4)


def test_bits_per_byte_has_a_standard_error_over_documents():
    """kit_bpb's scores (a ratio over documents: their log-likelihoods over their bytes or
    words), which lm-eval gives no standard error, get a finite one: with documents of equal
    length, the sd of the per-document bits per byte over sqrt(n); with unequal ones, about
    the sd of a bootstrap over the documents."""
    rng = random.Random(0)

    def document(equal):  # (log-likelihood, bytes)
        n = 400 if equal else rng.randint(50, 800)
        return -rng.uniform(0.3, 2.0) * n, n

    for equal in (True, False):
        pairs = [document(equal) for _ in range(60)]
        bpb = -sum(ll for ll, _ in pairs) / sum(n for _, n in pairs) / math.log(2)
        results = {"results": {"kit_bpb": {"bits_per_byte,none": bpb,
                                           "bits_per_byte_stderr,none": "N/A",
                                           "byte_perplexity,none": 2 ** bpb}},
                   "samples": {"kit_bpb": [{"doc_id": i, "bits_per_byte": p,
                                            "byte_perplexity": p} for i, p in enumerate(pairs)]}}
        table = trained.scores(results)["kit_bpb"]
        error = table["bits_per_byte_stderr"]
        assert math.isfinite(error) and error > 0
        assert table["byte_perplexity_stderr"] == pytest.approx(
            2 ** bpb * error * math.log(2))  # the same ratio, through exp
        if equal:
            per_document = [-ll / n / math.log(2) for ll, n in pairs]
            assert error == pytest.approx(statistics.stdev(per_document) / math.sqrt(60))
        else:
            boot = [(lambda draw: -sum(ll for ll, _ in draw) / sum(n for _, n in draw) /
                     math.log(2))(rng.choices(pairs, k=60)) for _ in range(2000)]
            assert error == pytest.approx(statistics.stdev(boot), rel=0.15)


@pytest.mark.parametrize("tasks", ["", ","])
def test_a_tasks_flag_that_names_no_task_is_refused(tasks, tmp_path, capsys, monkeypatch):
    with pytest.raises(SystemExit, match="--tasks names no task"):
        script("evaluate", [tmp_path / "no-run-here", "--tasks", tasks], capsys, monkeypatch)


@pytest.mark.slow
def test_tasks_that_do_not_exist_are_refused_by_name_before_the_model_loads(
        tmp_path, capsys, monkeypatch):
    """An unknown --tasks name is one paragraph naming it (no KeyError traceback from
    lm-eval), said before any model is looked for; known ones (the kit's, lm-eval's) pass."""
    with pytest.raises(SystemExit, match="no task is named nonexistent_task, no_such[.] The kit"):
        script("evaluate", [tmp_path / "no-run-here", "--tasks",
                            "kit_bpb,nonexistent_task,arc_easy,no_such"], capsys, monkeypatch)


def test_an_instruction_tuned_model_is_scored_in_the_layout_it_was_trained_on():
    """The kit's instruction template, given to lm-eval as a chat template, lays a prompt out
    exactly as FormatInstructions trained it (and as generate.py prompts), text taken as is."""
    tokenizer = AutoTokenizer.from_pretrained(ROOT / "assets/tokenizer")
    assert not trained.laid_out(tokenizer, None)
    assert trained.laid_out(tokenizer, "instruction")
    for text in ("Name three colors.", "a {{ jinja }} {% if %} 'quoted' \\n line\nbreak"):
        assert tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], tokenize=False,
            add_generation_prompt=True) == data.instruction_prompt(text)
    # BOS before each context, once (as training had it), and none for a chat template's.
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(
        ROOT / "assets/tiny-gpt2"))
    bos = tokenizer.bos_token_id
    for bos_first, text in ((True, "The river"), (True, tokenizer.bos_token + "The river"),
                            (False, "The river")):
        lm = trained.kit_lm()(pretrained=model, tokenizer=tokenizer, batch_size=1,
                              bos_first=bos_first)
        context, _ = lm._encode_pair(text, " runs")
        assert context[:2].count(bos) == bos_first, (bos_first, text)


@pytest.mark.slow
def test_an_sft_run_is_scored_through_its_template(tiny_model, tmp_path, capsys, monkeypatch):
    result = train(train_args(tmp_path, tiny_model, name="sft", task="sft", seq_length=64,
                              max_steps=2, val_freq=2, ckpt_freq=2, sample_tokens=0))
    assert result.returncode == 0, result.stderr
    out = script("evaluate", [tmp_path / "sft", "--limit", 4, "--tasks", "kit_cloze"], capsys,
                 monkeypatch)
    assert 0 <= table(out)["kit_cloze", "acc"] <= 1
    assert json.loads((tmp_path / "sft/eval.jsonl").read_text())["step"] == 2


@pytest.mark.slow
def test_the_scores_of_a_run_that_logs_to_wandb_go_to_its_wandb_run(tiny_model, tmp_path):
    result = train(train_args(tmp_path, tiny_model, name="w", max_steps=2, val_freq=2,
                              ckpt_freq=2, sample_tokens=0, wandb="offline"))
    assert result.returncode == 0, result.stderr
    run_id = json.loads((tmp_path / "w/state.json").read_text())["wandb_run_id"]
    result = subprocess.run([sys.executable, "scripts/evaluate.py", str(tmp_path / "w"),
                             "--limit", "2", "--tasks", "kit_bpb"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    logged = b"".join(p.read_bytes() for p in (tmp_path / "w/wandb").glob(f"*{run_id}/*.wandb"))
    assert b"eval/kit_bpb/bits_per_byte" in logged and b"eval/step" in logged
    assert [step for step, _ in wandb_history(tmp_path / "w", run_id)] == [1, 2]  # its summary


@pytest.mark.slow
def test_documents_longer_than_the_tokenizers_limit_are_scored_without_a_false_warning(
        tiny_model, tmp_path):
    """lm-eval encodes a document whole, then windows it by the model's positions: a tokenizer
    whose model_max_length is shorter than the documents causes no indexing error, and
    evaluate.py prints no transformers warning that it would."""
    tokenizer = tmp_path / "tokenizer"
    shutil.copytree(ROOT / "assets/tokenizer", tokenizer)
    config = json.loads((tokenizer / "tokenizer_config.json").read_text())
    (tokenizer / "tokenizer_config.json").write_text(json.dumps({**config,
                                                                 "model_max_length": 8}))
    result = train(train_args(tmp_path, tiny_model, name="w", max_steps=2, val_freq=2,
                              ckpt_freq=2, sample_tokens=0, tokenizer=tokenizer))
    assert result.returncode == 0, result.stderr
    result = subprocess.run([sys.executable, "scripts/evaluate.py", str(tmp_path / "w"),
                             "--limit", "2", "--tasks", "kit_bpb"], cwd=ROOT, env=ENV,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    assert table(result.stdout)["kit_bpb", "bits_per_byte"] > 0
    assert "Token indices sequence length is longer" not in result.stderr
