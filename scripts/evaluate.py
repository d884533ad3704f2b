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
import math
import os
import sys
from pathlib import Path

import torch
import transformers
import yaml
from lm_eval import simple_evaluate
from lm_eval.models.huggingface import HFLM
from lm_eval.tasks import TaskManager

KIT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(KIT))
import utils  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # (run by path, or by runpy)
import project  # noqa: E402  (the run's own trained.py and utils.py)

SHIPPED = KIT / "assets/eval"  # kit_NAME.yaml: a task lm_eval reads from the kit's root


class KitLM(HFLM):
    """lm-eval's transformers model, with BOS before each context of a choice, as training put
    one before every document and instruction (data.EnsureBosEos, FormatInstructions); not for
    a chat template, which places its own. (Whole documents get it from lm-eval already.)"""

    def __init__(self, *args, bos_first=True, **kwargs):
        super().__init__(*args, **kwargs)
        self.bos_first = bos_first

    def _encode_pair(self, context, continuation):
        context_enc, continuation_enc = super()._encode_pair(context, continuation)
        bos = self.tokenizer.bos_token_id
        if self.bos_first and bos is not None and context_enc[:1] != [bos]:
            context_enc = [bos] + context_enc
        return context_enc, continuation_enc


def task_configs(names):
    """Each name as lm_eval takes it: a shipped task as its config (its data file made
    absolute, so that any directory works), any other as its name."""
    tasks = []
    for name in names:
        path = SHIPPED / f"{name}.yaml"
        if not path.is_file():
            tasks.append(name)
            continue
        config = yaml.safe_load(path.read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {k: str(KIT / v) for k, v in files.items()}
        tasks.append(config)
    return tasks


def laid_out(tokenizer, layout, data):
    """A --task sft model's prompts as it was trained on them (trained.prompt_format): through
    lm-eval's chat-template path, with its tokenizer's chat template ("chat") or the kit's
    instruction template written as one ("instruction"). Returns whether to take that path."""
    if layout == "instruction":
        prompt = data.PROMPT.format(preamble=data.PREAMBLE, instruction="{{ message['content'] }}")
        tokenizer.chat_template = ("{% for message in messages %}{% if message['role'] == 'user' "
                                   "%}" + prompt + "{% endif %}{% endfor %}")
    return layout is not None


def scores(results):
    """{task: {metric: value}} of lm_eval's results, its ",none" filter suffix dropped; each
    score's standard error beside it as METRIC_stderr (a difference of less than about two
    of them between two runs is noise), the per-token and per-byte ones' from ratio_stderr."""
    table = {task: {k.removesuffix(",none"): v for k, v in metrics.items()
                    if "," in k and isinstance(v, (int, float))}
             for task, metrics in results["results"].items()}
    for task, samples in results.get("samples", {}).items():
        for metric, error in RATIO_STDERR.items():
            pairs = [sample[metric] for sample in samples if metric in sample]
            if metric in table.get(task, {}) and f"{metric}_stderr" not in table[task] \
                    and len(pairs) > 1:
                table[task][f"{metric}_stderr"] = error(table[task][metric], ratio_stderr(pairs))
    return table


def ratio_stderr(pairs):
    """The standard error of sum(-log-likelihood) / sum(units) over documents ((log-likelihood,
    units) pairs: tokens, bytes, words), a ratio of two means: the delta method's."""
    y, x = [-ll for ll, _ in pairs], [units for _, units in pairs]
    n, ratio = len(pairs), sum(y) / sum(x)
    spread = sum((a - ratio * b) ** 2 for a, b in zip(y, x)) / (n - 1)
    return math.sqrt(spread / n) / (sum(x) / n)


# lm-eval's scores of whole documents (a ratio over them) that it gives no standard error:
# from ratio_stderr's, in nats per unit (bits per byte: / ln 2; a perplexity exp(r): its x).
RATIO_STDERR = {"bits_per_byte": lambda score, se: se / math.log(2),
                "byte_perplexity": lambda score, se: score * se,
                "word_perplexity": lambda score, se: score * se}


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
    parser.add_argument("--batch-size", type=utils.at_least(1), default=8)
    parser.add_argument("--device", type=utils.torch_device,
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--script", default=None,
                        help="the training script whose create_model builds the model "
                             "(default: the one the run recorded)")
    args = parser.parse_args()
    names = [name for name in args.tasks.split(",") if name]
    if not names:
        sys.exit("--tasks names no task: pass the kit's (kit_cloze, kit_bpb) or lm-eval's")
    if all((SHIPPED / f"{name}.yaml").is_file() for name in names):
        os.environ.setdefault("HF_DATASETS_OFFLINE", "1")  # local files: never the network
    tasks = TaskManager()  # lm-eval's index of its tasks, before the model loads
    unknown = [name for name in names
               if not (SHIPPED / f"{name}.yaml").is_file() and name not in tasks.all_tasks]
    if unknown:
        sys.exit(f"--tasks: no task is named {', '.join(unknown)}. The kit ships kit_cloze and "
                 "kit_bpb; `lm_eval --tasks list` lists lm-eval's.")

    kit = project.project_kit(args.model, args.script)
    model, tokenizer, config, scored = kit.load_trained(args.model, script=args.script)
    layout = kit.prompt_format(config)  # pretrained: None, plain text
    if not isinstance(model, transformers.PreTrainedModel):
        sys.exit(f"{args.model} trained {type(model).__name__}, a model of its own: "
                 "lm-evaluation-harness scores transformers models only.")
    chat = laid_out(tokenizer, layout, kit.data)
    if any(hasattr(model.config, a) for a in ("n_positions", "max_position_embeddings", "n_ctx")):
        # lm-eval cuts documents into windows of the model's positions after encoding them
        # whole: the tokenizer's own limit would warn of indexing errors that never happen.
        tokenizer.model_max_length = transformers.tokenization_utils_base.VERY_LARGE_INTEGER
    lm = KitLM(pretrained=model.to(args.device).eval(), tokenizer=tokenizer,
               batch_size=args.batch_size, device=str(args.device), bos_first=layout != "chat")
    results = simple_evaluate(model=lm, tasks=task_configs(names), limit=args.limit,
                              apply_chat_template=chat, task_manager=tasks)
    table = scores(results)
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
