"""--eval-tasks: lm-evaluation-harness scores a run while it trains, every --eval-freq steps and
at the last, as scripts/evaluate.py scores that step's checkpoint; the run takes the very same
steps as one without scores, and a killed run's scores after its resume are an uninterrupted
run's."""

import json

import pytest
from helpers import digest, metrics, straight_and_killed, train, train_args


def eval_lines(exp_dir):
    """{step: its eval/ metrics} of the steps that were scored."""
    return {row["step"]: {k: v for k, v in row.items() if k.startswith("eval/")}
            for row in metrics(exp_dir) if any(k.startswith("eval/") for k in row)}


@pytest.mark.slow
def test_a_run_scored_while_training_trains_as_one_without_and_logs_evaluate_pys_scores(
        tiny_model, tmp_path):
    """One run without scores, one scored (kit_cloze, kit_bpb) straight, one scored, killed
    and resumed: the scores of a step are logged with their standard errors and seconds, the
    same after a resume and the same as evaluate.py's of the step's checkpoint; the weights,
    losses and RNG states are those of the run without scores (the model has dropout: a model
    left in eval mode, or an RNG that lm-eval reseeded, would train otherwise)."""
    def args(name, **scored):
        return train_args(tmp_path, tiny_model, name=name, max_steps=10, val_freq=2,
                          ckpt_freq=2, keep_checkpoints=0, **scored)

    def scored(name):
        return args(name, eval_tasks="kit_cloze,kit_bpb", eval_freq=4, eval_limit=4)

    result = train(args("plain"))
    assert result.returncode == 0, result.stderr[-3000:]
    straight, killed, resumed = straight_and_killed(scored, tmp_path, at=5)
    assert resumed == [4]  # the resumed run scored steps 8 and 10 itself

    # Every --eval-freq steps and the last one, with standard errors and seconds.
    lines = {row["step"]: row for row in metrics(straight)}
    assert sorted(eval_lines(straight)) == [4, 8, 10]
    for step in (4, 8, 10):
        assert {"eval/kit_cloze/acc", "eval/kit_cloze/acc_stderr", "eval/kit_cloze/acc_norm",
                "eval/kit_bpb/bits_per_byte"} <= set(lines[step])
        assert lines[step]["eval/kit_cloze/acc_stderr"] >= 0 and lines[step]["time/eval_s"] > 0
    assert not any("time/eval_s" in lines[step] for step in lines if step not in (4, 8, 10))
    # lm-eval's own output (its log, its progress bars) stays off the console.
    console = (tmp_path / "log.txt").read_text()  # (the killed run's first start: step 4 scored)
    assert "kit_cloze/acc" in console  # (the run's own line of step 4)
    assert "Running loglikelihood" not in console and "`pretrained` model kwarg" not in console

    # Training as without scores: weights, RNG states, every loss.
    for step in (4, 10):
        for name in ("model.pt", "rng-rank0.pt"):  # (the same bytes: the same state)
            a, b = (digest(run / f"checkpoints/step-{step:06d}" / name)
                    for run in (straight, tmp_path / "plain"))
            assert a == b, (step, name)
    keys = ("step", "loss", "grad_norm", "val_loss")
    assert [[row.get(k) for k in keys] for row in metrics(straight)] == [
        [row.get(k) for k in keys] for row in metrics(tmp_path / "plain")]

    # Killed and resumed: the same scores.
    assert eval_lines(killed) == eval_lines(straight)

    # evaluate.py on the checkpoint of a step that the resumed run scored: the same numbers.
    result = train([killed / "checkpoints/step-000008", "--limit", 4, "--tasks",
                    "kit_cloze,kit_bpb"], timeout=300, script="scripts/evaluate.py")
    assert result.returncode == 0, result.stderr[-3000:]
    evaluated = {f"eval/{row['task']}/{metric}": value
                 for row in map(json.loads, (killed / "eval.jsonl").read_text().splitlines())
                 for metric, value in row.items()
                 if metric not in ("step", "checkpoint", "task", "limit", "time")}
    assert evaluated == eval_lines(killed)[8]
