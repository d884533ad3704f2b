"""Score a trained model with lm-evaluation-harness: a run directory (its newest checkpoint), a
checkpoint directory, a Hugging Face directory (a run's hf/) or a Hub name.

    python scripts/evaluate.py outputs/demo                       # the kit's offline tasks
    python scripts/evaluate.py outputs/demo/checkpoints/step-000400 --tasks kit_bpb
    python scripts/evaluate.py outputs/demo --tasks hellaswag,arc_easy --limit 500  # internet

The kit ships two tasks made from the sample corpus's validation documents (assets/eval/,
assets/eval/make_eval_tasks.py), which need no internet: kit_cloze (multiple choice: a document's
own continuation among four; accuracy) and kit_bpb (bits per byte of whole documents). Any
other name is an lm-eval task (downloaded from the Hub). A run's or checkpoint's model is
rebuilt as generate.py rebuilds it, no export needed; a --task sft model sees each prompt in
the layout it was trained on (kit_cloze's contexts as instructions; kit_bpb is plain text).
The scores are printed as a table and, for a run or checkpoint, appended to the run's
eval.jsonl (one line per task, with the step) and logged to its wandb run if it has one.
"""

import argparse
import datetime
import json
import os
import sys
from pathlib import Path

import torch
import transformers

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT))
import trained  # noqa: E402  (the kit's own: a copy's trained.py without score() uses it)
import utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run by path, or by runpy)
import project  # noqa: E402  (the run's own trained.py and utils.py)


def record(ckpt, table, args):
    """For the checkpoint scored (load_trained's: its run may have saved newer ones since): a
    line per task in its run's eval.jsonl."""
    if not ckpt.name.startswith("step-") or not (ckpt.parent.parent / "state.json").exists():
        return None  # a Hugging Face directory or a Hub name: printed only
    ckpt, step = ckpt.resolve(), int(ckpt.name.removeprefix("step-"))
    out = ckpt.parent.parent / "eval.jsonl"
    when = datetime.datetime.now().isoformat(timespec="seconds")
    with open(out, "a") as f:
        for task, metrics in table.items():
            f.write(json.dumps({"step": step, "checkpoint": ckpt.name, "task": task,
                                **metrics, "limit": args.limit, "time": when}) + "\n")
    to_wandb(ckpt.parent.parent, step, table)
    return out


def to_wandb(run_dir, step, table):
    """The scores into the run's own wandb run too, when it logs to one: eval/TASK/METRIC and
    eval/step in its summary (a row of its history would take the step number that the run's
    next training step needs: wandb's steps only go up). eval.jsonl keeps every evaluation."""
    state = json.loads((run_dir / "state.json").read_text())
    flags = state.get("args", {})  # (runs of older versions record no flags: not logged)
    if not state.get("wandb_run_id") or flags.get("wandb", "disabled") == "disabled":
        return
    try:
        run = utils.start_wandb(flags, state["wandb_run_id"], run_dir)
    except OSError as e:  # no login, no network: eval.jsonl has the scores
        print(f"(not logged: {e})")
        return
    run.summary.update({"eval/step": step, **{f"eval/{task}/{metric}": value
                                              for task, metrics in table.items()
                                              for metric, value in metrics.items()}})
    run.finish()


def main():
    transformers.utils.logging.disable_progress_bar()
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("model", help="run directory, checkpoint directory, HF directory or name")
    parser.add_argument("--tasks", default="kit_cloze,kit_bpb",
                        help="comma-separated: the kit's (kit_cloze, kit_bpb) or lm-eval's")
    parser.add_argument("--limit", type=utils.at_least(1), default=None,
                        help="at most this many documents per task")
    parser.add_argument("--batch-size", type=utils.at_least(1), default=trained.EVAL_BATCH_SIZE)
    parser.add_argument("--device", type=utils.torch_device,
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--script", default=None,
                        help="the training script whose create_model builds the model "
                             "(default: the one the run recorded)")
    args = parser.parse_args()
    try:  # checked before the model loads
        names = trained.task_names(args.tasks)
    except argparse.ArgumentTypeError as e:
        sys.exit(f"--tasks {e}")
    if all((trained.EVAL_TASKS / f"{name}.yaml").is_file() for name in names):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files: never the network

    kit = project.project_kit(args.model, args.script)
    model, tokenizer, config, scored = kit.load_trained(args.model, script=args.script)
    layout = kit.prompt_format(config)  # pretrained: None, plain text
    if not isinstance(model, transformers.PreTrainedModel):
        sys.exit(f"{args.model} trained {type(model).__name__}, a model of its own: "
                 "lm-evaluation-harness scores transformers models only.")
    # As the run scored itself while training (--eval-tasks): with its own trained.score.
    scorer = kit if hasattr(kit, "score") else trained
    table = scorer.score(model.to(args.device), tokenizer, trained.task_configs(names),
                         limit=args.limit, batch_size=args.batch_size, prompt_format=layout)
    print("| task | metric | value | ± stderr |\n|---|---|---:|---:|")
    for task, metrics in table.items():
        for metric, value in metrics.items():
            if not metric.endswith("_stderr"):
                error = metrics.get(f"{metric}_stderr")
                print(f"| {task} | {metric} | {value:.4f} | "
                      f"{'n/a' if error is None else f'{error:.4f}'} |")
    if (out := record(scored, table, args)) is not None:
        print(f"(appended to {out})")


if __name__ == "__main__":
    try:
        main()
    except OSError as e:  # a missing or damaged run, a name that is neither a path nor on the Hub
        sys.exit(f"{type(e).__name__}: {e}")
