"""A trained model, for the scripts (generate.py, export_hf.py, evaluate.py) and train_llm.py's
--init-from, samples and scores: load_trained reads what a user calls "my model" (a run, a
checkpoint, a Hugging Face directory or Hub name), rebuilt by the create_model of the script
that trained it (rebuild_model); generate samples from it, its prompt laid out as it was trained
(prompt_format); score scores it with lm-evaluation-harness (evaluate.py, and --eval-tasks
during training: eval_metrics). Like utils.py it never imports the script."""

import argparse
import contextlib
import copy
import errno
import functools
import importlib.util
import io
import itertools
import json
import logging
import math
import os
import sys
import tempfile
import time
import types
from pathlib import Path

import torch

import data
import utils


def checkpoint_weights(ckpt_dir, name="model"):
    """A full state dict of a checkpoint: NAME.pt, or NAME's part of the DCP shards that --fsdp
    writes (merged here into one file first, then loaded)."""
    if (ckpt_dir / f"{name}.pt").exists() or not (ckpt_dir / "dcp").is_dir():
        return utils.load(ckpt_dir / f"{name}.pt", "cpu")
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    metadata = ckpt_dir / "dcp" / ".metadata"
    if not metadata.is_file():  # (dcp would print tracebacks first, on the root logger)
        raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), str(metadata))
    with tempfile.TemporaryDirectory() as tmp:
        dcp_to_torch_save(ckpt_dir / "dcp", Path(tmp) / "full.pt")
        return utils.load(Path(tmp) / "full.pt", "cpu")[name]


def find_checkpoint(path):
    """The checkpoint directory that ``path`` means: a checkpoint directory itself, or the one
    a run directory resumes from (see run_state)."""
    path = Path(path)
    if path.name.startswith("step-") and (path / "state.json").exists():
        return path
    state, _ = utils.run_state(path)
    if state is None:
        raise OSError(f"{path} is neither a run directory with a checkpoint nor a checkpoint")
    return path / state["checkpoint"]


def tokenizer_of(path):
    """The tokenizer that a run, checkpoint or Hugging Face directory was trained with (a path
    or Hub name), or None where ``path`` is none of those (load_trained then says why)."""
    if not path:
        return None
    if utils.only_a_path(path):  # (load_trained says that it is missing)
        return None
    if not Path(path).exists() or (Path(path) / "config.json").exists():
        return str(path)  # a Hugging Face layout (or Hub name) holds its tokenizer
    try:
        return read_checkpoint(path, lambda ckpt: json.loads((ckpt / "state.json").read_text()))[
            "config"]["tokenizer"]
    except (OSError, ValueError, KeyError, SystemExit):
        return None


def read_checkpoint(path, read):
    """``read(the checkpoint that path means)`` (find_checkpoint). A run that keeps only its
    newest checkpoints may delete that one while it is read (not a damaged checkpoint): then
    its newer one is read; one named by its own path is gone, which is said."""
    for tries in itertools.count(1):
        ckpt_dir = find_checkpoint(path)
        try:
            return read(ckpt_dir)
        except OSError as e:
            if ckpt_dir.exists():  # damaged, or not the model of that script: said as it is
                raise
            if ckpt_dir != Path(path) and tries < 10:  # its newer one has replaced it
                continue
            raise FileNotFoundError(
                f"{ckpt_dir} was deleted while it was read: its run went on and deleted it "
                "(--keep-checkpoints). Pass the run directory, whose newest checkpoint is "
                "read, or raise --keep-checkpoints.") from e


# An export's own file (scripts/export_hf.py writes it): the run's config and the checkpoint
# it came from.
EXPORT_MARKER = "train_llm.json"


def load_trained(path, script=None, what="run, checkpoint or Hugging Face model"):
    """(model, tokenizer, the run's config or None, the checkpoint or directory read) from what
    a user calls "my model": a run directory (its newest checkpoint), a checkpoint directory, a
    Hugging Face directory (such as a run's hf/) or a Hub name. The model is float32, on the
    CPU, generating with its KV cache (with_cache). A checkpoint's model is built by the
    create_model of the script that trained the run (rebuild_model), or of ``script`` if
    given. ``what``: how errors name ``path``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    path = Path(path)
    if script is not None and not Path(script).is_file():
        raise OSError(f"--script {script}: no such file. Pass the training script that trained "
                      "the run, or leave --script out (a run records its own).")
    if not path.exists() or (path / "config.json").exists():  # Hugging Face layout, or Hub
        record = path / EXPORT_MARKER  # what hf/ says about the run that made it
        config = json.loads(record.read_text()) if record.exists() else None
        model, info = utils.pretrained(AutoModelForCausalLM, str(path), what,
                                       dtype=torch.float32, output_loading_info=True)
        if info["missing_keys"]:  # (it would run, as another model)
            raise OSError(f"{what} {path}: transformers makes {len(info['missing_keys'])} of its "
                          f"weights at random and drops {len(info['unexpected_keys'])} (e.g. "
                          f"{sorted({*info['missing_keys'], *info['unexpected_keys']})[:3]}): it "
                          "is not the model it was saved from")
        return (with_cache(model), utils.pretrained(AutoTokenizer, str(path),
                                                    f"the tokenizer of {what}"), config, path)
    model, config, ckpt_dir = read_checkpoint(path, lambda ckpt: from_checkpoint(
        ckpt, script))
    tokenizer = utils.pretrained(AutoTokenizer, config["tokenizer"], "the run's --tokenizer")
    return with_cache(model), tokenizer, config, ckpt_dir


def with_cache(model):
    """``model`` set to generate with its KV cache (use_cache on in its config and generation
    config), which training turns off (utils.check_model). A model without that notion (one of
    your own, without a transformers config) is returned as it is."""
    if hasattr(getattr(model, "config", None), "use_cache"):
        model.config.use_cache = True
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.use_cache = True
    return model


def from_checkpoint(ckpt_dir, script=None):
    """(model, the run's config, ``ckpt_dir``) of load_trained. The weights are read first:
    once their file is open, a run that deletes the checkpoint meanwhile takes nothing away."""
    saved = json.loads((ckpt_dir / "state.json").read_text())
    config = saved["config"]
    try:
        state = checkpoint_weights(ckpt_dir)
    except utils.LOAD_ERRORS as e:
        if not ckpt_dir.exists():  # (not damaged: its run deleted it; read_checkpoint says so)
            raise FileNotFoundError(errno.ENOENT, "deleted while it was read", ckpt_dir) from e
        name = "dcp" if (ckpt_dir / "dcp").is_dir() else "model.pt"
        raise OSError(utils.damaged(ckpt_dir, ckpt_dir / name, e)) from e
    if config.get("init_from") and not script:  # the architecture it started from
        model = load_trained(init_source(ckpt_dir, config))[0]
        builder = f"the model of --init-from {config['init_from']}"
    else:
        script = script or saved["script"]
        model = rebuild_model(script, {**saved["args"], **config}, ckpt_dir)
        builder = f"create_model of {script}"
    try:
        model.load_state_dict(state)
    except RuntimeError as e:  # the weights loaded: the model built is another one
        raise OSError(f"{ckpt_dir} holds weights that do not fit the {type(model).__name__} "
                      f"that {builder} builds now ({misfit(model.state_dict(), state)}). The "
                      "checkpoint is not damaged: " + (
                          "put back the create_model that trained it." if "create_model" in
                          builder else "a run started with --init-from is rebuilt as its "
                          "source's model, and this one was changed after that (adapters?): "
                          "pass --script with a script whose create_model builds it.")) from e
    return model, config, ckpt_dir


def init_source(ckpt_dir, config):
    """The --init-from source that a run started from it is rebuilt as (from_checkpoint); one
    moved or deleted since is a FileNotFoundError that says so and what to do."""
    source = config["init_from"]
    if not utils.only_a_path(source):  # (there, or a Hub name)
        return source
    tokenizer = Path(config["tokenizer"]).is_relative_to(source)  # (an hf/ source's own)
    raise FileNotFoundError(
        f"{ckpt_dir} is of a run that started from {source} (--init-from), which is gone "
        "(moved or deleted): such a run's model is built as its source's, the architecture "
        "read from there" + (", and its tokenizer is the source's too" if tokenizer else "")
        + f". Put {source} back (or a link to where it is now)" + ("." if tokenizer else
        ", or pass --script with a training script whose create_model builds the source's "
        "architecture (the kit's create_model builds --model-name's, not the source's)."))


def misfit(expected, state):
    """What keeps ``state`` from loading into a model whose own state is ``expected``."""
    missing, unexpected = sorted(set(expected) - set(state)), sorted(set(state) - set(expected))
    shapes = [k for k in sorted(set(state) & set(expected))
              if tuple(state[k].shape) != tuple(expected[k].shape)]
    return "; ".join(f"{len(keys)} {what} (e.g. {', '.join(keys[:3])})" for what, keys in (
        ("missing", missing), ("unexpected", unexpected), ("of another shape", shapes)) if keys)


def rebuild_model(script, config, ckpt_dir):
    """The model of a run, fresh: built by create_model of ``script`` (the training script
    the run recorded, under any name and in any directory) from the flags the run recorded
    (``config``: all of them as the checkpoint's start had them, the fingerprint's over them)."""
    if not Path(script).is_file():
        raise OSError(f"{ckpt_dir} was trained by {script}, which is gone: its create_model "
                      "builds the model these weights belong to. Put the script back there, or "
                      "pass a copy of it to generate.py or export_hf.py with --script.")
    path = Path(script).resolve()  # loaded as a module of its own: its main() does not run
    if str(path.parent) not in sys.path:  # its neighbours (a module with the model, say)
        sys.path.append(str(path.parent))
    spec = importlib.util.spec_from_file_location(f"_training_script_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "create_model", None)):
        raise OSError(f"{script} has no create_model: pass the training script (a copy of "
                      "train_llm.py) whose create_model builds the run's model.")
    return module.create_model(types.SimpleNamespace(**config))


def prompt_format(config):
    """How a run's model expects a prompt: "chat" (trained on conversations, through the
    tokenizer's chat template), "instruction" (data.instruction_prompt) or None (pretrained:
    plain text)."""
    return (config or {}).get("prompt_format")


def prompt_text(tokenizer, text, prompt_format=None):
    """``text`` laid out the way a model trained with ``prompt_format`` saw its prompts."""
    if prompt_format == "chat":
        return tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                             add_generation_prompt=True, tokenize=False)
    if prompt_format == "instruction":
        return data.instruction_prompt(text)
    return text


# What a run continues at each validation unless --sample-prompt says: a pretrained run's
# text, a fine-tuned one's question (in its instruction or chat prompt_format).
SAMPLE_TEXT, SAMPLE_QUESTION = "The", "What does the function os.path.join do?"


def utf8(text):
    """An argparse type: text a tokenizer can take (a byte that is no UTF-8 in the command line
    reaches Python as a lone surrogate, which no tokenizer encodes): refused as it is parsed."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not UTF-8 text ({e.reason} at character "
                                         f"{e.start}): pass it as UTF-8") from None
    return text


@torch.no_grad()
def sample(model, tokenizer, args, ctx, config):
    """A continuation of --sample-prompt at validation, to see the model learn to write (laid
    out as the run's ``config`` says: prompt_format): the same seed each time, so only the
    weights change it (generate's RNG is its own: training is not disturbed). Eager even under
    --compile: each new length would compile the model again. Under FSDP every forward is a
    collective: all ranks generate the full length."""
    layout = prompt_format(config)
    text = args.sample_prompt if args.sample_prompt is not None else (
        SAMPLE_QUESTION if layout else SAMPLE_TEXT)
    model.eval()
    with ctx.autocast(), torch.compiler.set_stance("force_eager"):
        out = generate(utils.unwrap(model), tokenizer, text,
                       max_new_tokens=args.sample_tokens, seed=args.seed,
                       fixed_length=args.fsdp, prompt_format=layout)
    model.train()
    return out


def generate(model, tokenizer, text, *, max_new_tokens, temperature=0.8, top_k=50, seed=0,
             fixed_length=False, prompt_format=None):
    """The continuation of ``text`` (without it), laid out first as ``prompt_format`` says
    (prompt_text). The sampling draws from a seeded RNG of its
    own (fork_rng puts the global ones back after), so a training run that samples now and
    then takes the very same steps as one that does not. ``fixed_length``: never stop early
    at EOS, so that ranks generating together (FSDP) run the same number of forward passes."""
    device = next(model.parameters()).device
    text = prompt_text(tokenizer, text, prompt_format)
    # Training put BOS before every document and instruction (data.EnsureBosEos,
    # FormatInstructions): so does the prompt here. A chat template places its own.
    bos = [tokenizer.bos_token_id] if tokenizer.bos_token_id is not None and \
        prompt_format != "chat" else []
    ids = torch.tensor([bos + tokenizer.encode(text, add_special_tokens=False, verbose=False)],
                       device=device)
    limit = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if limit and ids.shape[1] + max_new_tokens > limit:  # past the positions: an IndexError
        asked, prompt = max_new_tokens, ids.shape[1]
        max_new_tokens = min(max_new_tokens, limit - 1)
        ids = ids[:, -(limit - max_new_tokens):]  # the prompt's end is what counts
        utils.LOGGER.warning(
            f"The prompt's {prompt:,} tokens and {asked:,} new ones pass the model's {limit:,} "
            f"positions: generating {max_new_tokens:,} after the prompt's last {ids.shape[1]:,}")
    sample = temperature > 0
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        if not hasattr(model, "generate"):  # a model of your own (create_model): a forward
            out = ids  # pass over the whole sequence per new token (no KV cache), top-k
            for _ in range(max_new_tokens):
                logits = torch.nan_to_num(model(input_ids=out).logits[:, -1, :].float())
                if sample:
                    logits = logits / temperature
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    next_id = torch.multinomial(torch.softmax(
                        logits.masked_fill(logits < kth, -math.inf), dim=-1), 1)
                else:
                    next_id = logits.argmax(dim=-1, keepdim=True)
                out = torch.cat([out, next_id], dim=1)
                if not fixed_length and next_id.item() == tokenizer.eos_token_id:
                    break
            return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        out = model.generate(ids, attention_mask=torch.ones_like(ids),
                             max_new_tokens=max_new_tokens, do_sample=sample,
                             min_new_tokens=max_new_tokens if fixed_length else None,
                             temperature=temperature if sample else None,
                             top_k=top_k if sample else None,
                             pad_token_id=tokenizer.eos_token_id,
                             remove_invalid_values=True)  # broken weights: nonsense, no crash
    return tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)


# --- Scores: lm-evaluation-harness (scripts/evaluate.py; --eval-tasks while training) -----------

EVAL_TASKS = utils.KIT / "assets/eval"  # kit_NAME.yaml: the kit's offline tasks (DESIGN.md 12)
EVAL_BATCH_SIZE = 8  # evaluate.py's default --batch-size, and --eval-tasks': batched alike


def task_names(text):
    """An argparse type (--eval-tasks; evaluate.py's --tasks): the comma-separated names of the
    kit's offline tasks (kit_cloze, kit_bpb: EVAL_TASKS) or lm-eval's, as a list. A name that is
    neither is refused before anything starts (lm-eval's own names: its index, once, ~15 s)."""
    names = [name for name in text.split(",") if name]
    if not names:
        raise argparse.ArgumentTypeError(
            "names no task: pass the kit's (kit_cloze, kit_bpb) or lm-eval's")
    others = [name for name in names if not (EVAL_TASKS / f"{name}.yaml").is_file()]
    unknown = [name for name in others if name not in task_manager(True).all_tasks]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"no task is named {', '.join(unknown)}. The kit ships kit_cloze and kit_bpb; "
            "`lm_eval --tasks list` lists lm-eval's.")
    return names


@functools.cache
def task_manager(lm_eval_tasks):
    """lm-eval's index of tasks, made once: with its own (``lm_eval_tasks``, ~15 s) or none
    (the kit's tasks go to lm-eval as their configs: task_configs)."""
    from lm_eval.tasks import TaskManager
    return TaskManager(include_defaults=lm_eval_tasks)


def task_configs(names):
    """Each name as lm_eval takes it: a shipped task as its config (its data file made
    absolute, so that any directory works), any other as its name."""
    import yaml
    tasks = []
    for name in names:
        path = EVAL_TASKS / f"{name}.yaml"
        if not path.is_file():
            tasks.append(name)
            continue
        config = yaml.safe_load(path.read_text())
        files = config["dataset_kwargs"]["data_files"]
        config["dataset_kwargs"]["data_files"] = {k: str(utils.KIT / v) for k, v in files.items()}
        tasks.append(config)
    return tasks


@functools.cache
def kit_lm():
    """The class KitLM, made at the first score (lm-eval takes seconds to import)."""
    from lm_eval.models.huggingface import HFLM

    class KitLM(HFLM):
        """lm-eval's transformers model, with BOS before each context of a choice, as training
        put one before every document and instruction (data.EnsureBosEos, FormatInstructions);
        not for a chat template, which places its own. (Whole documents get it from lm-eval.)"""

        def __init__(self, *args, bos_first=True, **kwargs):
            super().__init__(*args, **kwargs)
            self.bos_first = bos_first

        def _encode_pair(self, context, continuation):
            context_enc, continuation_enc = super()._encode_pair(context, continuation)
            bos = self.tokenizer.bos_token_id
            if self.bos_first and bos is not None and context_enc[:1] != [bos]:
                context_enc = [bos] + context_enc
            return context_enc, continuation_enc

    return KitLM


def laid_out(tokenizer, layout):
    """A --task sft model's prompts as it was trained on them (prompt_format): through
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


def score(model, tokenizer, tasks, *, limit=None, batch_size=EVAL_BATCH_SIZE, prompt_format=None):
    """lm-evaluation-harness's scores of ``model`` (a transformers model, on its device; left in
    eval mode) on ``tasks`` (task_configs'), at most ``limit`` documents each, a --task sft
    model's prompts laid out as it was trained (``prompt_format``): scores(), or {} under torchrun
    but on each node's first rank. evaluate.py scores a checkpoint so, and a run with
    --eval-tasks its model as it trains (eval_metrics)."""
    from lm_eval import simple_evaluate
    from transformers.tokenization_utils_base import VERY_LARGE_INTEGER
    tokenizer = copy.deepcopy(tokenizer)  # (set up for lm-eval here: the caller's stays)
    chat = laid_out(tokenizer, prompt_format)
    if any(hasattr(model.config, a) for a in ("n_positions", "max_position_embeddings", "n_ctx")):
        # lm-eval cuts documents into windows of the model's positions after encoding them
        # whole: the tokenizer's own limit would warn of indexing errors that never happen.
        tokenizer.model_max_length = VERY_LARGE_INTEGER
    lm = kit_lm()(pretrained=model, tokenizer=tokenizer, batch_size=batch_size,
                  bos_first=prompt_format != "chat")
    lm_eval_tasks = any(isinstance(task, str) for task in tasks)  # (not only the kit's)
    results = simple_evaluate(model=lm, tasks=tasks, limit=limit, apply_chat_template=chat,
                              task_manager=task_manager(lm_eval_tasks))
    return scores(results) if results is not None else {}  # (lm-eval's: on local rank 0 only)


def eval_metrics(model, tokenizer, args, ctx, state):
    """train_llm.py's --eval-tasks, at a validation: every --eval-freq steps (default: at each
    validation) and at the last step, the model's scores as score() gives them, as evaluate.py
    gives them for this step's checkpoint: eval/TASK/METRIC, eval/TASK/METRIC_stderr and
    time/eval_s; {} at other steps. Every rank scores, the same (FSDP's forwards are
    collectives, and a rank that waited minutes for rank 0 would pass --dist-timeout); rank 0
    logs. Training is left as it was: the RNGs that lm-eval seeds put back (a run with scores
    takes the same steps as one without), the model back in train mode, lm-eval's output kept
    off the console (quietly). A failure (a task's download) is a warning: training goes on."""
    step = state["global_step"]
    due = args.eval_freq is None or step % args.eval_freq == 0
    if not args.eval_tasks or not (due or step == args.max_steps or state.get("data_exhausted")):
        return {}
    start, rng = time.perf_counter(), utils.rng_state(ctx.device)
    try:  # eager even under --compile: each new length would compile the model again
        with quietly(), torch.compiler.set_stance("force_eager"):
            table = score(utils.unwrap(model), tokenizer, task_configs(args.eval_tasks),
                          limit=args.eval_limit, prompt_format=prompt_format(state["config"]))
    except Exception as e:  # (not worth a run: the checkpoints can be scored later)
        utils.LOGGER.warning(f"--eval-tasks: step {step} was not scored, training goes on "
                             f"(evaluate.py scores its checkpoints): {utils.first_line(e)}")
        return {}
    finally:
        utils.set_rng_state(rng)
        model.train()
    return {**{f"eval/{task}/{metric}": value for task, metrics in table.items()
               for metric, value in metrics.items()}, "time/eval_s": time.perf_counter() - start}


@contextlib.contextmanager
def quietly():
    """lm-eval's output kept off a training run's console and progress bar: its log (and that
    of datasets, which it reads with) below errors, its progress bars and prints (sys.stderr,
    sys.stdout: the run's own log and bar hold the streams they were made with)."""
    loggers = [logging.getLogger(name) for name in ("lm_eval", "datasets")]
    levels = [logger.level for logger in loggers]
    try:
        for logger in loggers:
            logger.setLevel(logging.ERROR)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)
