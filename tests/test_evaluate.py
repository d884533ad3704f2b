"""scripts/evaluate.py: lm-evaluation-harness scores a run offline on the kit's own tasks
(assets/eval), the same from the run directory as from its hf/ export, and a run's or
checkpoint's scores go into the run's eval.jsonl with their step."""

import json

import pytest
from helpers import copy_run, script


def table(out):
    """{(task, metric): value} of evaluate.py's printed table."""
    rows = [line.strip("|").split("|") for line in out.splitlines() if line.startswith("| kit")]
    return {(task.strip(), metric.strip()): float(value) for task, metric, value in rows}


@pytest.mark.slow
def test_a_run_is_scored_offline_as_its_export_is_and_the_scores_are_kept(
        four_steps, tmp_path, capsys, monkeypatch):
    exp = copy_run(four_steps, tmp_path)
    scores = table(script("evaluate", [exp, "--limit", 6], capsys, monkeypatch))
    assert {("kit_cloze", "acc"), ("kit_bpb", "bits_per_byte")} <= set(scores)
    assert 0 <= scores["kit_cloze", "acc"] <= 1 and scores["kit_bpb", "bits_per_byte"] > 0
    assert table(script("evaluate", [exp / "hf", "--limit", 6], capsys, monkeypatch)) == scores
    script("evaluate", [exp / "checkpoints/step-000002", "--limit", 6, "--tasks", "kit_bpb"],
           capsys, monkeypatch)
    lines = [json.loads(line) for line in (exp / "eval.jsonl").read_text().splitlines()]
    assert [(line["task"], line["step"]) for line in lines] == [
        ("kit_cloze", 4), ("kit_bpb", 4), ("kit_bpb", 2)]  # (hf/ is no run: not kept)
    assert lines[1]["bits_per_byte"] == pytest.approx(scores["kit_bpb", "bits_per_byte"], abs=1e-4)
