"""Train a causal language model. Stop it at any instant, rerun the same command to continue.

    python train_llm.py --experiment-name demo

Everything a run writes lives in {save-dir}/{experiment-name}/ (DESIGN.md section 3). The
command is also the resume command: if that directory holds a state.json, training continues
from the checkpoint it names, bit-identically on the same hardware.

Read main() first: it is the table of contents, and each function it calls comes below it in
the order it is called. utils.py holds the helpers that measure things and move checkpoint
bytes; data.py the data pipeline.
"""

import argparse
import contextlib
import datetime
import functools
import glob
import json
import logging
import math
import os
import pickle
import random
import shlex
import signal
import sys
import threading
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
import tqdm
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PreTrainedModel

import data
import utils

LOGGER = logging.getLogger("train_llm")
LOG_FORMAT = "[%(asctime)s] [rank={rank}] %(levelname)s: %(message)s"
# For train.log alone: how a run failed, which the console shows in its own way.
FILE_LOG = logging.getLogger("train_llm.file")
FILE_LOG.propagate = False
FILE_LOG.addHandler(logging.NullHandler())
# The shipped defaults live next to this file, so the script runs from any directory.
KIT = Path(__file__).resolve().parent
DEFAULT_DATA = {"pretrain": f"{KIT}/data/sample/*/", "sft": f"{KIT}/data/sft/"}
DEFAULT_SAMPLE_PROMPT = {"pretrain": "The", "sft": "What does the function os.path.join do?"}

# Arguments that decide what the next step computes: the data stream, the model and the update
# rule (the optimizer and scheduler restore their hyperparameters from the checkpoint, so a
# changed --lr would be silently ignored). Resuming with one of them changed is refused. The
# batch counts as one number, the global batch: --batch-size and --grad-accum may change with
# the world size. Everything else (--max-steps, logging, checkpointing, threads) may change.
# A flag added here later must default to what the kit did before it existed: a run saved
# without its key counts as having had the default (check_unchanged).
FINGERPRINT = ("dataset", "val_dataset", "tokenizer", "model_name", "init_from_pretrained",
               "init_from",
               "seed", "seq_length", "lr", "min_lr", "warmup_steps", "weight_decay",
               "active_shards", "shuffle_buffer", "epochs", "fsdp", "task", "mix", "odm",
               "odm_warmup_steps", "odm_alpha", "data_format")
# The flags that may name local files: recorded as absolute paths (see parse_args).
LOCAL_PATHS = ("dataset", "val_dataset", "tokenizer", "model_name", "init_from")

# The per-rank files of a checkpoint (DESIGN.md section 3); only save_checkpoint and
# load_checkpoint read or write checkpoint files.
RNG_FILE, LOADER_FILE = "rng-rank{}.pt", "loader-rank{}.json"


def main():
    args = parse_args()
    # torchrun sets these; a plain `python train_llm.py` is rank 0 of 1. Only rank 0 logs
    # at INFO level and writes logs, metrics and state.json; every rank writes its loader state.
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    logging.basicConfig(format=LOG_FORMAT.format(rank=rank),
                        level=logging.INFO if rank == 0 else logging.WARNING)

    # One run per directory: rank 0 holds a lock on it for as long as it lives (a second run
    # would overwrite this one's checkpoints). Every rank dies with torchrun, never orphaned.
    exp_dir = Path(args.save_dir) / args.experiment_name
    if rank == 0:
        exp_dir.mkdir(parents=True, exist_ok=True)
        lock = utils.lock(exp_dir)  # noqa: F841 (held until the process exits)
        log_to_file(exp_dir / "train.log", rank)
    LOGGER.info(args)
    if "LOCAL_RANK" in os.environ:
        utils.die_with_parent()
    state = open_run(args, exp_dir, world_size, rank)  # before heavy work: a refusal is quick
    if state is None:  # done already: nothing to train
        return

    ctx = init_distributed(args, rank, world_size)
    # Seed every global RNG a library may draw from (torch also seeds CUDA). The same seed on
    # every rank gives every rank the same initial weights; a resumed run then restores the
    # RNG states saved in its checkpoint.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer, model = build_model(args, ctx.device)
    flops_per_token = utils.flops_per_token(model, args.seq_length)
    model = parallelize(model, args, ctx)  # DDP, or FSDP2 with --fsdp
    optimizer = build_optimizer(model, args, ctx.device)
    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: get_lr(step, args) / args.lr)

    domains, weights, mixer = mixture(args)  # ([], None, None) without --mix/--odm
    train_loader = build_pipeline(args.dataset, tokenizer, args, rank, world_size, train=True,
                                  weights=weights, mixer=mixer,
                                  pin_memory=ctx.device.type == "cuda")
    val_batches = validation_batches(args, tokenizer, domains, rank)

    # Resume: everything that evolves during training comes back from the checkpoint. Only
    # once it has loaded does a resume forget what a killed run did after it (later metrics,
    # debris of unfinished saves), so that metrics.jsonl then has every step exactly once.
    if state["checkpoint"]:
        load_checkpoint(exp_dir, state, model, optimizer, lr_scheduler, train_loader, args, ctx)
    if rank == 0:
        utils.discard_after(exp_dir, state["global_step"])
        record_args(exp_dir / "args.json", args, world_size)  # a start that trains
        if args.resume_from:  # state.json must not name a checkpoint that was just discarded
            utils.write_atomic(exp_dir / "state.json", json.dumps(state, indent=2))
    state["world_size"] = world_size
    if args.compile:  # in place, so state_dict() keys stay those of the plain model
        unwrap(model).compile()

    log = MetricsLog(exp_dir, args, state, rank)
    stop = stop_on_signals()
    writer = checkpoint_writer(args, ctx)  # in the background, or here (--checkpoint-writer)
    save = functools.partial(save_checkpoint, exp_dir, state, model, optimizer, lr_scheduler,
                             train_loader, args, ctx, writer)
    validate = functools.partial(validation_metrics, model, val_batches, ctx, domains,
                                 tokenizer, args, utils.prompt_format(state["config"]))
    timers = {name: utils.Timer(ctx.device, name) for name in ("data", "forward", "backward",
                                                               "update")}
    gc_control = utils.GarbageCollection(args.gc_freq)
    tokens_per_step = world_size * args.grad_accum * args.batch_size * args.seq_length
    peak_flops = utils.peak_flops(ctx.device)
    progress = tqdm.tqdm(initial=state["global_step"], total=args.max_steps, desc="train",
                         disable=rank != 0)
    last_log_step = first_step = state["global_step"]
    metrics = {}  # the last step's, for a validation when the data runs out after it
    profiler = utils.profiler(args.profile_steps, exp_dir / "profile", rank, ctx.device,
                              next_step=state["global_step"] + 1)

    model.train()
    with logging_redirect_tqdm(), profiler as prof:
        while state["global_step"] < args.max_steps:
            step = state["global_step"] + 1
            writer.check()  # a background save that failed stops the run here

            # One optimizer step = --grad-accum micro-batches whose gradients add up.
            with timers["data"]:  # next() by hand, so the wait for data is measured
                batches = [next(train_loader, None) for _ in range(args.grad_accum)]
            if not data_left(batches, step, args, ctx, train_loader, tokenizer):
                LOGGER.info(f"The data ran out (--epochs {args.epochs}) before step {step}.")
                if metrics and "val_loss" not in metrics:  # validate the last step anyway
                    log.rewrite_last(metrics | validate())
                state["data_exhausted"] = True
                save()
                break

            probabilities = list(mixer.probabilities) if mixer else weights  # this step's
            stats = train_step(model, batches, ctx, timers, len(domains))
            log_step = step % args.log_freq == 0 or step == args.max_steps
            stats |= rank_flags(stop, log_step, train_loader, ctx)
            with timers["update"]:
                # One all-reduce, and one wait for the GPU, for all the step's numbers: loss,
                # gradient norm (the same on every rank: rank 0's is added), per-domain sums,
                # and the flags (all ranks stop where any of them saw a signal).
                norm = utils.full(torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                                 args.grad_clip))
                stats["grad_norm"] = norm if ctx.rank == 0 else torch.zeros_like(norm)
                stats = utils.all_reduce_sum(stats, world_size)
                loss = stats["loss"]  # the shares of the ranks add up to the mean
                grad_norm = stats["grad_norm"]
                if not (math.isfinite(loss) and math.isfinite(grad_norm)):
                    train_loader.close()
                    writer.wait()  # the last good checkpoint may still be being written
                    sys.exit(f"Step {step}: loss {loss}, gradient norm {grad_norm}. Stopping "
                             f"without a checkpoint (the weights are about to be garbage); the "
                             f"last good one is {state['checkpoint']}. Lower --lr or raise "
                             "--warmup-steps.")
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)  # frees the gradients' memory
            state["global_step"] = step
            state["tokens_seen"] += tokens_per_step
            if step == first_step + 1 and ctx.distributed:  # past the slow first step
                utils.set_collective_timeout(datetime.timedelta(seconds=args.dist_timeout))

            metrics = {"step": step, "loss": loss, "lr": lr, "grad_norm": grad_norm,
                       "tokens_seen": state["tokens_seen"]}
            if domains:
                metrics |= mixing_metrics(stats, domains, probabilities, mixer, state, args)
            if log_step:
                metrics |= speed_metrics(timers, (step - last_log_step) * tokens_per_step,
                                         flops_per_token, peak_flops, ctx)
                metrics["data/skipped"] = int(stats["skipped"])
                last_log_step = step
            if step % args.val_freq == 0 or step == args.max_steps or stats["stop"]:
                metrics |= validate()
            log.write(metrics)
            progress.update(1)
            progress.set_postfix(loss=f"{loss:.3f}")
            if step % args.ckpt_freq == 0 or step == args.max_steps or stats["stop"]:
                save()
            gc_control.step(step)
            prof.step()
            if stats["stop"]:  # decided together, so all ranks saved and all leave here
                LOGGER.info(f"Stopped at step {step}; rerun the same command to resume.")
                break

    progress.close()
    train_loader.close()
    writer.wait()  # the last checkpoint is complete before it is exported and the run ends
    export_hf(model, tokenizer, exp_dir / "hf", state, ctx)
    log.close()
    if ctx.distributed:
        dist.destroy_process_group()
    if not stop.is_set():
        LOGGER.info(f"Done: {state['global_step']} steps, {state['tokens_seen']:,} tokens.")


def parse_args(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    if args.dataset is None:  # the shipped sample data of the task
        args.dataset = DEFAULT_DATA[args.task] + "train-*.jsonl"
    if args.val_dataset is None:
        args.val_dataset = DEFAULT_DATA[args.task] + "val-*.jsonl"
    if args.sample_prompt is None:
        args.sample_prompt = DEFAULT_SAMPLE_PROMPT[args.task]
    # A run records where its local files are, so that it resumes, and generate.py finds its
    # tokenizer, from any directory. Hub names ("gpt2") stay as they are.
    for name in LOCAL_PATHS:
        setattr(args, name, utils.local_path(getattr(args, name)))
    check_args(parser, args)
    return args


def check_args(parser, args):
    """What no single flag's type can check: flags against each other, the run directory."""
    save_dir = Path(os.path.abspath(args.save_dir))  # (not resolve(): links may point away)
    exp_dir = Path(os.path.normpath(save_dir / args.experiment_name))
    if save_dir not in exp_dir.parents:  # "", ".", "..", "/abs": a run would write elsewhere
        parser.error(f"--experiment-name {args.experiment_name!r} must name a directory inside "
                     f"--save-dir {args.save_dir}: the run writes (and deletes its own old "
                     "checkpoints) there")
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} is above --lr {args.lr}: the schedule decays "
                     "from --lr down to --min-lr")
    if args.global_batch_size:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        per_micro_step = world_size * args.batch_size
        accum, left = divmod(args.global_batch_size, per_micro_step)
        if left or args.grad_accum not in (1, accum):
            parser.error(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"world size x --batch-size = {world_size} x {args.batch_size} = "
                         f"{per_micro_step}: --grad-accum follows from it (leave it out). Pick "
                         f"a --batch-size that divides {args.global_batch_size} / {world_size} "
                         "on every world size the run may see.")
        args.grad_accum = accum


# ----------------------------------------------------------------------------------------------
# Setup: the run directory, the device and the process group
# ----------------------------------------------------------------------------------------------

def log_to_file(path, rank):
    """Everything logged also goes to ``path`` (appended across resumes), and so does the
    traceback of a failure that the console shows as one paragraph (see the end of the file)."""
    handler = QuietFileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank)))
    logging.getLogger().addHandler(handler)
    FILE_LOG.addHandler(handler)


class QuietFileHandler(logging.FileHandler):
    """A log file that, once it cannot be written (a full disk), says so in one line and is
    skipped from then on, instead of printing a traceback for every record it drops: the
    console still has every line, and the failure that follows gets its own paragraph."""

    def handleError(self, record):
        if self.stream is not None:
            sys.stderr.write(f"(cannot write {self.baseFilename} any more; logging to the "
                             f"console only: {sys.exc_info()[1]})\n")
        self.setLevel(logging.CRITICAL + 1)
        stream, self.stream = self.stream, None  # what emit() finds: no stream (and level)
        if stream is not None:
            with contextlib.suppress(OSError):  # closing flushes, which fails again
                stream.close()


def record_args(path, args, world_size):
    """Append this start's full arguments to args.json, and what changed since the last one
    (--max-steps raised on resume, say): a run's history of how it was called."""
    starts = json.loads(path.read_text()) if path.exists() else []
    now = {**vars(args), "world_size": world_size}
    before = starts[-1]["args"] if starts else now
    starts.append({"started": datetime.datetime.now().isoformat(timespec="seconds"),
                   "command": shlex.join(sys.argv), "args": now,
                   "changed": {k: [before.get(k), v] for k, v in now.items()
                               if before.get(k) != v}})
    utils.write_atomic(path, json.dumps(starts, indent=2))


def open_run(args, exp_dir, world_size, rank):
    """The run state to continue from (a fresh one for a new run), or None if it is done.

    A run resumes iff its directory holds a complete checkpoint (utils.run_state: the one
    state.json names, or the newest one if state.json is lost). Checked first, so a refusal or
    "already done" costs nothing; every rank reads the same files and decides alike. A run
    that is done but whose hf/ export is missing or stale (a kill during the export) is
    exported again here: the export is part of finishing.
    """
    fingerprint = {name: getattr(args, name) for name in FINGERPRINT}
    fingerprint["global_batch"] = args.batch_size * args.grad_accum * world_size
    state, why = utils.run_state(exp_dir, args.resume_from)
    if state is None:
        LOGGER.info(f"Starting {exp_dir} from scratch")
        if args.task == "sft":  # the prompt layout follows the data (utils.prompt_format)
            fingerprint["prompt_format"] = sft_format(args)
        return {"global_step": 0, "epoch": 0, "tokens_seen": 0, "checkpoint": None,
                "wandb_run_id": None, "config": fingerprint, "domain_tokens": {}}
    # The checkpoint carries the config it was saved with: one copied in from another run
    # (or another run's directory) is refused like a changed flag.
    check_unchanged(args, fingerprint, state["config"], f"{exp_dir} was started", world_size)
    own = exp_dir / state["checkpoint"] / "state.json"
    if own.exists():
        own_config = json.loads(own.read_text())["config"]
        check_unchanged(args, fingerprint, own_config, f"{state['checkpoint']} was saved",
                        world_size)
    where = f"{state['checkpoint']}{f' ({why})' if why else ''}"
    done = None
    if state.get("data_exhausted"):
        done = (f"{exp_dir} is done: its data ran out at step {state['global_step']} ({where}) "
                f"after --epochs {args.epochs} passes. --epochs is part of the run and cannot "
                "change on resume: train on in a new --experiment-name.")
    elif state["global_step"] >= args.max_steps:
        done = (f"{exp_dir} is done: step {state['global_step']} of --max-steps "
                f"{args.max_steps} ({where}). Raise --max-steps to train further.")
    if done:
        LOGGER.info(done)
        if rank == 0:
            export_again_if_stale(exp_dir, state["checkpoint"])
        return None
    LOGGER.info(f"Resuming {exp_dir} from {where}, step {state['global_step']} of "
                f"{args.max_steps}")
    return state


def export_again_if_stale(exp_dir, checkpoint):
    """A finished run whose hf/ is missing, half-written or of an older checkpoint (a kill or a
    full disk during the export at its end) is exported from its last checkpoint."""
    if utils.export_is_current(exp_dir / "hf", checkpoint):
        return
    model, tokenizer, config = utils.load_trained(exp_dir / checkpoint)
    if not isinstance(model, PreTrainedModel):  # a model of your own: nothing to export
        return
    LOGGER.info(f"Its export {exp_dir / 'hf'} is missing or not of {checkpoint}: exporting it "
                "again")
    utils.save_hf(exp_dir / "hf", model, tokenizer, config, checkpoint=checkpoint, owned=True)
    LOGGER.info(f"Exported the model for transformers: {exp_dir / 'hf'}")


def check_unchanged(args, fingerprint, saved, when, world_size):
    """Refuse to resume with a flag that shapes the run changed since ``saved`` was written.
    A local path that an earlier version recorded as typed (relative) counts as unchanged if
    it names the same files: the run then keeps its old spelling. A flag of the FINGERPRINT
    that ``saved`` lacks (added to the kit after the run started) counts as its default."""
    parser = get_parser()
    saved = {name: parser.get_default(name) for name in FINGERPRINT} | saved
    for name, value in saved.items():
        if name == "prompt_format":  # found in the data, which --dataset already pins
            continue
        if name in LOCAL_PATHS and value and utils.local_path(value) == fingerprint.get(name):
            setattr(args, name, value)
            fingerprint[name] = value
        if fingerprint.get(name) == value:
            continue
        if name == "global_batch":
            sys.exit(f"The global batch (--batch-size x --grad-accum x world size) was "
                     f"{value} sequences when {when} and is {fingerprint[name]} now "
                     f"({args.batch_size} x {args.grad_accum} x {world_size}). Pass "
                     f"--global-batch-size {value} (it sets --grad-accum from the world size, "
                     "and an elastic torchrun restarts the same command), or pick --batch-size "
                     "and --grad-accum so that it stays the same, or start a new "
                     "--experiment-name.")
        sys.exit(f"--{name.replace('_', '-')} was {value!r} when {when} and is "
                 f"{fingerprint.get(name)!r} now. Resuming would train a different run: pass "
                 "the old value, or start a new --experiment-name.")


class Context(NamedTuple):
    """Where this process trains: its rank, the number of ranks, its device."""
    rank: int
    world_size: int
    device: torch.device
    distributed: bool  # a process group exists (several ranks, or --fsdp)
    # Where flags that live on the CPU meet (utils.all_ranks): a gloo group beside NCCL, so that
    # agreeing on them never waits for the GPU. None: the default group (gloo already).
    cpu_group: object = None

    def autocast(self):
        # A GPU runs matmuls in bf16 while weights and optimizer state stay float32 (mixed
        # precision). CPUs run plain float32: bf16 is slow on most of them.
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.device.type == "cuda")

    def barrier(self):
        if self.distributed:
            dist.barrier()


def init_distributed(args, rank, world_size):
    """Pick the device and, under torchrun, join the process group.

    NCCL moves GPU tensors, gloo CPU ones. Joining waits at most --dist-timeout (30 s at
    least). Every collective (all-reduce, barrier) waits for all ranks; the first step may
    take long (compile, loading), later ones not, so the timeout is shortened after it
    (--dist-timeout) and a hung rank fails fast.
    """
    if args.deterministic:  # GPU kernels too, for bit-identical GPU runs (CPU ones already are)
        utils.deterministic()
    if args.device:
        device = torch.device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    distributed = world_size > 1 or args.fsdp
    if distributed:
        if "MASTER_ADDR" not in os.environ:
            sys.exit("--fsdp needs torchrun: torchrun --nproc-per-node N train_llm.py ...")
        # A bounded join: a rank that cannot reach the others (one died while the group was
        # forming) fails within --dist-timeout, not NCCL's or gloo's default 10 or 30
        # minutes, so that torchrun restarts the group instead of the job hanging.
        utils.join_process_group("nccl" if device.type == "cuda" else "gloo", rank, world_size,
                                 datetime.timedelta(seconds=max(args.dist_timeout, 30)),
                                 device_id=device if device.type == "cuda" else None)
        # The first step may be slow on some rank (compiling, loading): until it is done,
        # collectives wait long (the timeout drops to --dist-timeout after it).
        utils.set_collective_timeout(datetime.timedelta(minutes=30))
    cpu_group = dist.new_group(backend="gloo") if distributed and device.type == "cuda" else None
    LOGGER.info(f"Training on {device}, world size {world_size}")
    return Context(rank, world_size, device, distributed, cpu_group)


# ----------------------------------------------------------------------------------------------
# Model, optimizer, learning-rate schedule
# ----------------------------------------------------------------------------------------------

def create_model(args):
    """The architecture with fresh random weights: --model-name's config, for transformers.

    The one place for a model of your own: any nn.Module whose forward takes ``input_ids=``
    and ``position_ids=`` (and ignores other keywords) and returns an object with ``.logits``.
    The trainer builds the model here, and --init-from, scripts/generate.py and
    scripts/export_hf.py rebuild a run's model here, from the arguments the run recorded
    (utils.load_trained), so they rebuild what the run trained."""
    config = utils.pretrained(AutoConfig, args.model_name, "--model-name", use_cache=False)
    return AutoModelForCausalLM.from_config(config)


def build_model(args, device):
    """The tokenizer, and the model: --model-name's config with fresh random weights, its saved
    weights (--init-from-pretrained), or the weights of an earlier run or an HF directory
    (--init-from: pretrain -> SFT). Float32 weights (autocast does bf16 on a GPU)."""
    # (utils.pretrained: from_pretrained, with one clear paragraph for a name that is neither
    # a local directory nor on the Hub.)
    tokenizer = utils.pretrained(AutoTokenizer, args.tokenizer, "--tokenizer")
    if args.init_from:  # its architecture too: --model-name is not used
        model = utils.load_trained(args.init_from)[0]
    elif args.init_from_pretrained:
        model = utils.pretrained(AutoModelForCausalLM, args.model_name, "--model-name",
                                 use_cache=False, dtype=torch.float32)
    else:
        model = create_model(args)
    check_model(model, tokenizer, args)
    if args.activation_checkpointing:  # keep each block's input only; recompute the rest
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.to(device)
    LOGGER.info(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")
    return tokenizer, model


def check_model(model, tokenizer, args):
    """What the tokenizer, --seq-length and the flags need of the model, checked before any
    training; a model of your own (create_model) is told what needs transformers."""
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False  # training never reads a KV cache: none is built
    vocab = getattr(config, "vocab_size", None)
    if vocab and len(tokenizer) > vocab:
        sys.exit(f"The tokenizer has {len(tokenizer)} tokens but the model only {vocab} "
                 "embeddings: pick a matching --model-name.")
    positions = getattr(config, "max_position_embeddings", None)
    if positions and args.seq_length > positions:
        sys.exit(f"--seq-length {args.seq_length} is longer than the {positions} positions "
                 f"of --model-name {args.model_name}")
    if isinstance(model, PreTrainedModel):
        return
    if args.activation_checkpointing:
        sys.exit("--activation-checkpointing uses transformers' activation_checkpointing_enable"
                 f", which {type(model).__name__} (create_model) has not: wrap its blocks in "
                 "torch.utils.checkpoint.checkpoint instead, or leave the flag out.")
    LOGGER.info(f"{type(model).__name__} is no transformers model: no hf/ export when the run "
                "ends (its checkpoints hold its weights; generate.py and --init-from rebuild it "
                "with create_model)")


def parallelize(model, args, ctx):
    """Data parallelism. DDP keeps a full copy of the model on every rank and averages the
    gradients during backward. FSDP2 (--fsdp) shards every transformer block's weights,
    gradients and optimizer state across ranks and gathers a block's weights just before it
    runs: for models whose training state does not fit one GPU."""
    if args.fsdp:
        # On a GPU, FSDP's own mixed precision: blocks gathered and run in bf16 (half the
        # traffic), gradients reduced in float32; the sharded weights stay float32.
        policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
                  if ctx.device.type == "cuda" else MixedPrecisionPolicy())
        for module in model.modules():  # HF models name their transformer block classes
            if type(module).__name__ in (getattr(model, "_no_split_modules", None) or ()):
                fully_shard(module, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)  # in place: the model is its shards now
    if ctx.world_size > 1:
        return DistributedDataParallel(
            model, device_ids=[ctx.device] if ctx.device.index is not None else None)
    return model


def unwrap(model):
    """The model itself, without DDP's wrapper: its state_dict() keys are the plain ones."""
    return model.module if isinstance(model, DistributedDataParallel) else model


def build_optimizer(model, args, device):
    """AdamW with weight decay on the weight matrices only: pulling biases and LayerNorm gains
    towards zero does not regularize anything. The fused kernel is one launch per step."""
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    return torch.optim.AdamW(
        [{"params": matrices, "weight_decay": args.weight_decay},
         {"params": vectors, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")


def get_lr(step, args):
    """The learning rate of the update after ``step`` steps: a linear warmup to --lr, then a
    cosine down to --min-lr at --max-steps. A pure function of the step, so raising
    --max-steps on resume stretches the rest of the cosine."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))  # 1 -> 0
    return args.min_lr + (args.lr - args.min_lr) * cosine


# ----------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------

def mixture(args):
    """Mixing domains (--mix, --odm): (domains, initial weights, mixer), or ([], None, None).

    The mixer's probabilities decide each sequence's domain. With --odm they follow the
    per-domain training losses (a bandit: data.OnlineMixer); without it they stay the --mix
    weights (uniform if --mix is not given).
    """
    if not args.mix and args.odm == "off":
        return [], None, None
    domains = list(find_domains(args.dataset))
    if args.mix:
        given = parse_mix(args.mix)  # (checked when parsed: finite, >= 0, not all 0, once each)
        unknown = set(given) - set(domains)
        if unknown or len(given) != len(domains):
            sys.exit(f"--mix {args.mix}: give a weight to each domain of {domains}; "
                     f"unknown: {sorted(unknown)}")
        weights = [float(given[name]) for name in domains]
    else:
        weights = [1.0] * len(domains)
    weights = [w / sum(weights) for w in weights]
    mixer = None
    if args.odm != "off":
        mixer = data.OnlineMixer(weights, variant=args.odm, alpha=args.odm_alpha,
                                 warmup_steps=args.odm_warmup_steps)
    return domains, weights, mixer


def build_pipeline(urls, tokenizer, args, rank, world_size, *, train, weights=None,
                   mixer=None, pin_memory=False):
    """JSONL documents -> token ids -> chunks of --seq-length -> batches [batch, seq_length].

    Training reads --active-shards shards at a time, round-robin, so that a batch mixes
    domains; it reads them forever (or for --epochs passes), in a seeded order reshuffled every
    epoch, and shuffles chunks in a buffer. Validation reads its shards once, in order.

    With ``weights`` (--mix, --odm), every domain (see find_domains) gets a pipeline of its
    own, and Mix draws each sequence's domain from the weights, or from the mixer's
    probabilities. Those depend on the training losses, so Mix and Batch run in the training
    loop's thread; each domain's pipeline is prefetched in the background.
    """
    if weights is not None:
        domains = find_domains(urls)
        pipes = {name: sequences(pattern, tokenizer, args, rank, world_size, train)
                 for name, pattern in domains.items()}
        pipe = data.Mix({name: data.Prefetch(p) for name, p in pipes.items()}, weights,
                        seed=args.seed, mixer=mixer)
        return data.Batch(pipe, args.batch_size, drop_last=True, pin_memory=pin_memory)
    pipe = sequences(urls, tokenizer, args, rank, world_size, train)
    # In pinned memory, so that copies to the GPU do not make the training thread wait.
    pipe = data.Batch(pipe, args.batch_size, drop_last=True, pin_memory=pin_memory)
    # A whole step's micro-batches ready ahead.
    return data.Prefetch(pipe, depth=args.grad_accum + 1) if train else pipe


def sequences(urls, tokenizer, args, rank, world_size, train):
    """The stages up to (and with) the shuffle buffer: one --seq-length sequence per item."""
    pipe = source(urls, args, rank, world_size, train, tokenizer)
    if args.task == "sft":
        # One instruction-answer pair per sample, its prompt masked out of the labels, whole
        # samples packed into sequences (never split; position ids restart at each).
        pipe = data.FormatInstructions(pipe, tokenizer)
        pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        pipe = data.Pack(pipe, args.seq_length, pad_id=pad_id)
    else:
        pipe = data.Tokenize(pipe, tokenizer, num_threads=args.tokenizer_threads,
                             max_chars=args.max_doc_chars or None)
        pipe = data.EnsureBosEos(pipe, tokenizer)  # so documents stay separable once concatenated
        pipe = data.ConcatChunk(pipe, args.seq_length)
    if train:
        pipe = data.Shuffle(pipe, args.shuffle_buffer, seed=args.seed)
    return pipe


def sft_format(args):
    """"chat" if --dataset holds conversations (records with 'messages', laid out by the
    tokenizer's chat template), else "instruction" (instruction/output records): its first
    record tells."""
    first = source(args.dataset, args, 0, 1, train=True)  # (its split: train)
    try:
        record = next(first, {})
    finally:
        first.close()
    return "chat" if "messages" in record else "instruction"


def source(spec, args, rank, world_size, train, tokenizer=None):
    """The documents of --dataset (or --val-dataset): shards of JSONL/Parquet (paths, globs,
    {a,b} patterns, directories, s3:// gs:// https:// URLs) go to data.Files; a directory made
    by save_to_disk, or a Hugging Face Hub name, to data.HFDataset. NAME:SPLIT picks a split
    (default: train for --dataset, validation for --val-dataset)."""
    required = [] if args.task == "sft" else ["text"]
    local = os.path.exists(spec) or glob.has_magic(spec) or "{" in spec
    name, split = spec, ""
    if not local and "://" not in spec and ":" in spec:
        name, _, split = spec.rpartition(":")
    split = split or ("train" if train else "validation")
    saved = any(os.path.exists(os.path.join(name, f))  # what save_to_disk writes
                for f in ("dataset_info.json", "dataset_dict.json"))
    if not saved and (local or "://" in spec or data.shard_format(name)):
        # The global document order is a round-robin over --active-shards slots, each reading
        # its own input splits (a shard, or a piece of one: see data.Files). Rank r reads only
        # slots r, r + W, ..., so it reads documents r, r + W, ... of that order and nothing it
        # would throw away. Validation reads its splits once, 4 at a time (fewer if the data
        # cannot be cut into 4, e.g. one compressed file).
        slots = args.active_shards if train else 4
        if slots % world_size:
            sys.exit(f"--active-shards {slots} is not a multiple of the world size "
                     f"{world_size}: every rank reads whole slots. Pass a multiple of it "
                     "(and keep it on resume: it shapes the data order).")
        check = data.Tokenize.check_record  # checked here, where shard and line are known
        if args.task == "sft":  # (with the tokenizer: has it the chat template 'messages' need?)
            check = (data.FormatInstructions(None, tokenizer).check if tokenizer else
                     data.FormatInstructions.check_record)
        make = functools.partial(data.Files, spec, repeat=train, epochs=args.epochs,
                                 shuffle_shards=train, seed=args.seed, rank=rank,
                                 world_size=world_size, required_fields=required, check=check,
                                 skip_bad_records=args.skip_bad_records,
                                 format=args.data_format)
        try:
            return make(n_active_shards=slots)
        except data.SplitError as e:
            if train:
                sys.exit(f"--dataset {spec}: {e}")
            return make(n_active_shards=e.n_splits)
    import datasets  # here, not at the top: only these sources need the library
    import datasets.distributed
    try:
        if saved:  # a map-style dataset on disk: read by index, so resuming is one lookup
            dataset = datasets.load_from_disk(name)
            if isinstance(dataset, datasets.DatasetDict):
                dataset = dataset[split]
        else:  # streamed from the Hub as it trains; sequences()' Shuffle shuffles it
            dataset = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as e:  # a typo'd local path lands here too: say both readings
        sys.exit(f"{spec!r} is no local file, pattern or URL, and reading it as a Hugging "
                 f"Face dataset (split {split!r}) failed: {type(e).__name__}: {e}")
    if world_size > 1:  # whole shards per rank where they divide evenly, else every W-th row
        dataset = datasets.distributed.split_dataset_by_node(dataset, rank, world_size)
    return data.HFDataset(dataset, repeat=train, epochs=args.epochs, required_fields=required,
                          shuffle=train and saved, seed=args.seed)


def warn_if_overlapping(train_spec, val_spec):
    """A validation loss measured on training data says nothing: warn if shards are shared."""
    try:
        train_urls, val_urls = data.expand_urls(train_spec), data.expand_urls(val_spec)
    except OSError:  # not shards (a Hub name): nothing to compare
        return
    if not all(map(data.shard_format, train_urls + val_urls)):
        return  # a Hub name, or a save_to_disk directory: data.Files does not read them
    shared = set(train_urls) & set(val_urls)
    if shared:
        LOGGER.warning(f"{len(shared)} shard(s) are in both --dataset and --val-dataset (e.g. "
                       f"{sorted(shared)[0]}): the validation loss will look better than it is")


def find_domains(pattern):
    """{domain: its shards}: the directories that the first * of ``pattern`` stands for, so
    "data/sample/*/train-*.jsonl" has the domains code, docstrings, prose and reference."""
    root, _, rest = pattern.partition("/*/")
    if not rest:
        sys.exit(f"--mix/--odm need domains as directories: a --dataset like root/*/shards, "
                 f"not {pattern!r}")
    names = sorted(p.name for p in Path(root).iterdir() if p.is_dir() and any(p.glob(rest)))
    if not names:
        sys.exit(f"--mix/--odm: no directory of {root}/ holds files matching {rest!r}, so "
                 f"{pattern!r} has no domains to mix.")
    return {name: f"{root}/{name}/{rest}" for name in names}


def validation_batches(args, tokenizer, domains, rank):
    """The fixed list of validation batches, read once and kept in memory.

    Validation always scores the same held-out batches, whatever the world size: all ranks
    read them and each scores every world_size-th one. With domains, --val-batches of every
    domain, each batch tagged with its domain.
    """
    val_sets = find_domains(args.val_dataset) if domains else {}
    if domains and list(val_sets) != domains:
        sys.exit(f"--val-dataset has the domains {list(val_sets)}, --dataset {domains}")
    batches = []
    for i, urls in enumerate(val_sets.values() if domains else [args.val_dataset]):
        pipeline = build_pipeline(urls, tokenizer, args, 0, 1, train=False)
        for batch in data.Take(pipeline, args.val_batches):
            batches.append(batch | ({"domain": torch.full((len(batch["input_ids"]),), i)}
                                    if domains else {}))
        pipeline.close()
    wanted = args.val_batches * max(1, len(domains))
    if not batches:
        sys.exit(f"--val-dataset {args.val_dataset} has less than one batch of tokens.")
    if len(batches) < wanted and rank == 0:
        LOGGER.warning(f"--val-dataset holds only {len(batches)} batches of the {wanted} "
                       "asked for: validating on those")
    if rank == 0:
        warn_if_overlapping(args.dataset, args.val_dataset)
    return batches


# ----------------------------------------------------------------------------------------------
# Checkpoints (the layout: DESIGN.md section 3)
# ----------------------------------------------------------------------------------------------

def checkpoint_writer(args, ctx):
    """What writes the checkpoints: a background thread (utils.BackgroundWriter), or the
    training thread itself (sync). By default (auto) the background on a GPU, whose training
    thread mostly waits for the GPU, and sync on a CPU, whose training threads use every core:
    there a writer can only take its CPU time from them, and measured it cost more than
    writing in place (README, "Checkpoints off the training path").

    Under torchrun the writer's barriers run on a gloo group of their own: collectives from
    another thread must not interleave with the training loop's on the default group (every
    rank must issue those in the same order).
    """
    group = None
    if ctx.distributed:  # rank 0 may write for minutes while the others wait at a barrier
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
    sync = args.checkpoint_writer == "sync" or (args.checkpoint_writer == "auto"
                                                and ctx.device.type != "cuda")
    return utils.BackgroundWriter(sync=sync, group=group, log=LOGGER.info,
                                  pin_memory=ctx.device.type == "cuda")


def save_checkpoint(exp_dir, state, model, optimizer, lr_scheduler, loader, args, ctx, writer):
    """Save checkpoints/step-NNNNNN and point state.json at it (utils.save_checkpoint: the
    write order that survives a kill at any instant).

    Rank 0 writes the model, optimizer and schedule; every rank its RNG and loader state. With
    FSDP every rank writes its shards of model and optimizer (torch.distributed.checkpoint).
    The writer copies all of it to CPU memory and writes it in the background while training
    goes on; the checkpoint is complete (and state.json names it) once that write has ended.
    If this step's checkpoint exists already (the data ran out right after a save), only
    state.json is rewritten.
    """
    step = state["global_step"]
    name = f"checkpoints/step-{step:06d}"
    if state["checkpoint"] == name:
        writer.wait()  # (that save may still be writing its own state.json)
        if ctx.rank == 0:
            utils.write_atomic(exp_dir / "state.json", json.dumps(state, indent=2))
        return
    loader_state = loader.state_dict()
    state["epoch"] = utils.source_epoch(loader_state)
    files = {RNG_FILE.format(ctx.rank): utils.rng_state(ctx.device),
             LOADER_FILE.format(ctx.rank): loader_state}
    if args.fsdp:  # this rank's shards, written by dcp.save below
        files["dcp"] = dict(zip(("model", "optimizer"), get_state_dict(model, optimizer)))
    elif ctx.rank == 0:
        files |= {"model.pt": unwrap(model).state_dict(), "optimizer.pt": optimizer.state_dict()}
    if ctx.rank == 0:
        files["lr_scheduler.pt"] = lr_scheduler.state_dict()
    saved = json.loads(json.dumps(state))  # as of this step: the loop goes on changing `state`

    def write(files):  # (in the writer's thread)
        if "dcp" in files:
            shards = files.pop("dcp")
            files["dcp"] = lambda path: dcp.save(shards, checkpoint_id=path,
                                                 process_group=writer.group)
        utils.save_checkpoint(exp_dir, step, files, saved, keep=args.keep_checkpoints,
                              rank=ctx.rank, barrier=writer.barrier)

    writer.submit(name, write, files)
    state["checkpoint"] = name  # complete once the writer is done (writer.wait)


def load_checkpoint(exp_dir, state, model, optimizer, lr_scheduler, loader, args, ctx):
    """Model, optimizer, schedule, loader state and, last (after everything else has drawn
    from them), the RNG states, from the checkpoint that ``state`` names. A file that does not
    load ends the run with one paragraph that names it and the older checkpoint to use."""
    ckpt_dir = exp_dir / state["checkpoint"]
    name = "dcp" if args.fsdp else "model.pt"
    try:
        if args.fsdp:  # each rank loads its shards; DCP reshards when the world size changed
            model_state, optim_state = get_state_dict(model, optimizer)
            dcp.load({"model": model_state, "optimizer": optim_state},
                     checkpoint_id=ckpt_dir / name)
            set_state_dict(model, optimizer, model_state_dict=model_state,
                           optim_state_dict=optim_state)
        else:
            unwrap(model).load_state_dict(utils.load(ckpt_dir / name, ctx.device))
            name = "optimizer.pt"
            optimizer.load_state_dict(utils.load(ckpt_dir / name, ctx.device))
        name = "lr_scheduler.pt"
        lr_scheduler.load_state_dict(utils.load(ckpt_dir / name, ctx.device))
        saved_world = state.get("world_size", 1)
        states = []  # the loader state of every rank that saved, or only ours
        for r in range(saved_world) if saved_world != ctx.world_size else [ctx.rank]:
            name = LOADER_FILE.format(r)
            states.append(json.loads((ckpt_dir / name).read_text()))
        restore_loader(loader, states, saved_world, ctx)
        name = RNG_FILE.format(ctx.rank)
        if not (ckpt_dir / name).exists():  # a new rank after a resharding: rank 0's states
            name = RNG_FILE.format(0)
        utils.set_rng_state(utils.load(ckpt_dir / name, "cpu"))
    except data.ConfigMismatch as e:  # not damage: a flag that shapes the data differs
        sys.exit(f"Cannot resume from {ckpt_dir}: its loader state was made with other data "
                 f"arguments. {e} (In train_llm.py flags: max_chars is --max-doc-chars, 0 for "
                 "None; n_active_shards is --active-shards; urls and split_plan come from "
                 "--dataset and the files it names.)")
    except (OSError, RuntimeError, ValueError, EOFError, KeyError, pickle.UnpicklingError,
            dcp.CheckpointException) as e:  # (dcp's is a BaseException)
        sys.exit(damaged_checkpoint(exp_dir, ckpt_dir, ckpt_dir / name, e))


def restore_loader(loader, states, saved_world, ctx):
    """Load this rank's loader state; on another number of ranks, the states of all the ranks
    that saved, merged by data.reshard (no document skipped or repeated)."""
    if saved_world == ctx.world_size:  # (a changed --batch-size is fine: Batch has no state)
        loader.load_state_dict(states[0])
        return
    try:
        report = data.reshard(loader, states)
    except data.ConfigMismatch:
        raise  # load_checkpoint names the flag
    except ValueError as e:
        sys.exit(f"Cannot resume on {ctx.world_size} ranks what {saved_world} saved: {e}")
    LOGGER.info(f"Data of {saved_world} rank(s) moved to {ctx.world_size}: no document "
                f"skipped or repeated; {report}")


def export_hf(model, tokenizer, out, state, ctx):
    """The trained model in the Hugging Face layout (safetensors) with its tokenizer, so that
    AutoModelForCausalLM.from_pretrained(out) works anywhere. Written when a run ends, from the
    weights of its last checkpoint; ``train_llm.json`` beside it records the run's config.
    With FSDP every rank takes part in gathering the full weights; rank 0 writes them. A model
    of your own (create_model) has no such layout: its checkpoints are its export."""
    if not isinstance(unwrap(model), PreTrainedModel):
        return
    weights = None
    if isinstance(model, FSDPModule):  # the full weights, gathered from every rank's shards
        weights = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True,
                                                                       cpu_offload=True))
    if ctx.rank == 0:
        utils.save_hf(out, unwrap(model), tokenizer, state["config"], weights,
                      checkpoint=state["checkpoint"], owned=True)
        LOGGER.info(f"Exported the model for transformers: {out}")
    ctx.barrier()


def damaged_checkpoint(exp_dir, ckpt_dir, path, error):
    """The paragraph for a checkpoint that does not load: which file, and how to go on."""
    text, older = utils.damaged(ckpt_dir, path, error), utils.older_checkpoint(ckpt_dir)
    if older is None:
        return text + " Start a new --experiment-name."
    argv = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--resume-from")
            and sys.argv[i - 1] != "--resume-from"]
    launcher = ["torchrun", "--nproc-per-node", os.environ["WORLD_SIZE"]] \
        if "LOCAL_RANK" in os.environ else ["python"]
    command = shlex.join([*launcher, "train_llm.py", *argv, "--resume-from", older.name])
    return text + f" Resume from it (this discards what was logged after it) with:\n  {command}"


# ----------------------------------------------------------------------------------------------
# The training step
# ----------------------------------------------------------------------------------------------

def stop_on_signals():
    """SIGTERM (preemption, scancel, docker stop) and Ctrl-C only set the returned flag: the
    step in flight finishes, a checkpoint is saved, and the process exits 0. A second signal
    kills at once, which is safe too: the last complete checkpoint stays loadable. (torchrun
    forwards SIGTERM to every rank; the ranks agree on stopping at the same step.)"""
    stop = threading.Event()

    def request_stop(signum, frame):
        LOGGER.warning(f"{signal.Signals(signum).name}: saving a checkpoint after this step")
        stop.set()
        signal.signal(signum, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)
    return stop


def data_left(batches, step, args, ctx, loader, tokenizer):
    """Whether every rank got its micro-batches for this step (only --epochs ends the data).

    With finite data ranks run out at different steps (their shards differ); all stop
    together, or the others would wait forever in the next all-reduce. A new run's first step
    must also hold something to train on (refuse_untrainable).
    """
    left = None not in batches
    if args.epochs and ctx.world_size > 1:
        left = utils.all_ranks(left, ctx.cpu_group)
    if not left and step == 1:
        loader.close()
        tokens = ctx.world_size * args.grad_accum * args.batch_size * args.seq_length
        sys.exit(f"The data ran out before the first step: --dataset {args.dataset} holds fewer "
                 f"than the {tokens:,} tokens of one step ({args.batch_size} x {args.grad_accum} x "
                 f"{ctx.world_size} sequences of {args.seq_length} tokens) per pass (--epochs "
                 f"{args.epochs}). Use more data, more --epochs, or a smaller "
                 "--batch-size/--seq-length.")
    if left and step == 1:  # empty documents would train on BOS and EOS alone, for ever
        refuse_untrainable(batches, tokenizer, args, ctx, loader)
    return left


def refuse_untrainable(batches, tokenizer, args, ctx, loader):
    """End a new run whose first step scores nothing but special tokens: its documents are
    empty ("text": ""), or their field holds nothing the tokenizer keeps."""
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    targets = [next_token_targets(b["labels"] if "labels" in b else b["input_ids"])
               for b in batches]
    learnable = any((~torch.isin(t[t != -100], special)).any() for t in targets)
    if ctx.world_size > 1:
        learnable = not utils.all_ranks(not learnable, ctx.cpu_group)  # any rank has some
    if not learnable:
        loader.close()
        sys.exit(f"Nothing to train on: the first step's sequences hold only special tokens "
                 f"({tokenizer.convert_ids_to_tokens(special.tolist())}). The records of "
                 f"--dataset {args.dataset} are empty, or their text is not where the kit "
                 "reads it ('text'; with --task sft 'instruction'/'output' or 'messages'), "
                 "or (--task sft) --seq-length cuts every answer off.")


def train_step(model, batches, ctx, timers, n_domains=0):
    """Forward and backward over one step's micro-batches, whose gradients add up.

    The gradient is that of the step's mean loss per scored token, over all micro-batches and
    ranks, however the global batch is cut: each micro-batch's summed loss is divided by the
    step's total count of scored tokens (counted before any backward, one all-reduce), times
    the world size, which the ranks' gradient averaging divides out again. (A mean per
    micro-batch would let a micro-batch with few answer tokens weigh as much as one with many:
    with --task sft, 8 x 1 and 4 x 2 would train differently.)

    Returns the step's numbers on this rank, as named tensors: "loss" (this rank's share of
    the step's mean loss, already divided by the world size: summed over ranks, the mean) and,
    with domains, per domain the summed loss, the tokens scored and the sequences ("domain_loss",
    "domain_tokens", "domain_sequences"), for the mixer and the logs.
    """
    scored = torch.full((), float(sum(scored_tokens(batch) for batch in batches)),
                        device=ctx.device)  # counted on the CPU, filled in on the device
    if ctx.distributed:
        dist.all_reduce(scored)
    stats = {"loss": torch.zeros((), device=ctx.device)}
    if n_domains:
        stats |= {f"domain_{k}": torch.zeros(n_domains, device=ctx.device)
                  for k in ("loss", "tokens", "sequences")}
    for i, batch in enumerate(batches):
        # Gradients are averaged across ranks once per step, in the last backward.
        with utils.gradient_sync(model, enabled=i == len(batches) - 1):
            with timers["forward"], ctx.autocast():
                logits, targets = forward(model, batch, ctx.device)
                sums, counts = sequence_losses(logits, targets)
                loss = sums.sum() * ctx.world_size / scored.clamp(min=1)
            # The logits ([batch, seq, vocab], the largest activation) are needed only by the
            # loss's backward, which runs first: without our reference they go right after.
            del logits
            with timers["backward"]:
                loss.backward()
        stats["loss"] += loss.detach() / ctx.world_size
        if n_domains:
            index = batch["domain"].to(ctx.device, non_blocking=True)  # a copy, no wait
            for key, value in (("loss", sums.detach()), ("tokens", counts),
                               ("sequences", torch.ones_like(counts))):
                stats[f"domain_{key}"].index_add_(0, index, value.float())
    return stats


def rank_flags(stop, log_step, loader, ctx):
    """What this rank adds to the step's all-reduce besides its losses: whether it got a
    signal, and on a logging step the bad records it has skipped so far (the sum is the
    run's). torch.full fills on the device: no host-to-device copy, no wait for the GPU."""
    flags = {"stop": torch.full((), float(stop.is_set()), device=ctx.device)}
    if log_step:
        skipped = utils.skipped_records(loader.state_dict())
        flags["skipped"] = torch.full((), float(skipped), device=ctx.device)
    return flags


def scored_tokens(batch):
    """How many tokens of a batch the loss scores (see next_token_targets)."""
    targets = batch["labels"] if "labels" in batch else batch["input_ids"]
    return (next_token_targets(targets) != -100).sum()


def next_token_targets(targets):
    """What each position is scored against: the next token, shifted in place of slicing the
    [batch, seq, vocab] logits (a slice would be copied whole); the last position, which
    predicts nothing, and targets of -100 (a prompt, padding) are not scored."""
    return F.pad(targets[:, 1:], (0, 1), value=-100)


def forward(model, batch, device):
    """The logits of a batch and the token ids they are scored against.

    Pretraining scores every token. Fine-tuning scores ``labels``: the answer's tokens, with
    the prompt and the padding set to -100. Packed sequences bring ``position_ids`` that
    restart at every sample; transformers turns those into a causal mask per sample, so packed
    samples do not see each other (tests/test_step.py checks it), but only without a KV cache:
    hence use_cache=False, which also saves building a cache that training never reads. A
    model whose attention ignores packed positions lets a sample see the earlier ones of its
    sequence; use data.Pad instead of data.Pack for such a model.
    """
    # non_blocking: from pinned memory the copy overlaps with work the GPU still has queued.
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    positions = batch.get("position_ids")
    positions = positions.to(device, non_blocking=True) if positions is not None else None
    logits = model(input_ids=input_ids, position_ids=positions, use_cache=False).logits
    return logits, (batch["labels"].to(device, non_blocking=True) if "labels" in batch
                    else input_ids)


def sequence_losses(logits, targets):
    """Next-token cross-entropy summed over each sequence, and how many tokens were scored:
    two [batch] tensors.

    Token t predicts target t + 1 (next_token_targets). Sums and counts per sequence are what
    a mean over tokens, or over a domain's sequences, is made of.
    """
    targets = next_token_targets(targets)
    # F.cross_entropy(..., reduction="none") without float32 copies of all the logits.
    token_loss = utils.cross_entropy(logits.flatten(0, 1),
                                     targets.flatten()).view(targets.shape)[:, :-1]  # last: 0
    return token_loss.sum(dim=1), (targets != -100).sum(dim=1)


# ----------------------------------------------------------------------------------------------
# Metrics and validation
# ----------------------------------------------------------------------------------------------

def mixing_metrics(stats, domains, probabilities, mixer, state, args):
    """With domains: feed the step's per-domain losses (all ranks) to the ODM mixer, count each
    domain's tokens in the run state, and return the mixture's numbers for the log."""
    losses = {i: stats["domain_loss"][i] / stats["domain_tokens"][i]
              for i in range(len(domains)) if stats["domain_tokens"][i]}
    if mixer:
        mixer.update(losses, state["global_step"])
    metrics = {}
    for i, name in enumerate(domains):
        tokens = int(stats["domain_sequences"][i]) * args.seq_length
        state["domain_tokens"][name] = state["domain_tokens"].get(name, 0) + tokens
        metrics[f"mix/p_{name}"] = probabilities[i]
        metrics[f"mix/tokens_{name}"] = state["domain_tokens"][name]
        if i in losses:
            metrics[f"mix/loss_{name}"] = losses[i]
    return metrics


def speed_metrics(timers, tokens, flops_per_token, peak_flops, ctx):
    """Throughput since the last call (``tokens`` trained by all ranks meanwhile), the share of
    it spent waiting for data, MFU (per GPU; None without a known peak) and memory."""
    seconds = {name: timer.pop() for name, timer in timers.items()}
    step_seconds = sum(seconds.values())
    tokens_per_s = tokens / step_seconds
    return {
        "tokens_per_s": tokens_per_s,  # all ranks together
        "data_wait": seconds["data"] / step_seconds,  # ideally ~0
        "mfu": (flops_per_token * tokens_per_s / ctx.world_size / peak_flops
                if peak_flops else None),
        **utils.memory_stats(ctx.device),
    }


def validation_metrics(model, batches, ctx, domains, tokenizer, args, prompt_format=None):
    val_loss, per_domain = evaluate(model, batches, ctx, len(domains))
    metrics = {"val_loss": val_loss,
               **{f"val_loss/{name}": loss for name, loss in zip(domains, per_domain)}}
    if args.sample_tokens:  # remove these two lines and the sample is gone
        metrics["sample"] = sample(model, tokenizer, args, ctx, prompt_format)
    return metrics


@torch.no_grad()
def sample(model, tokenizer, args, ctx, prompt_format):
    """A continuation of --sample-prompt, so a learner sees the model learn to write.

    The same seed at every validation: the text changes only because the weights do. Every
    rank generates; under FSDP, where each forward pass is a collective, all to the full
    length (EOS does not end them). The sampling has its own RNG, so the training stream is
    not disturbed.
    """
    model.eval()
    # Eager even under --compile: each new length would otherwise compile the model again.
    with ctx.autocast(), torch.compiler.set_stance("force_eager"):
        out = utils.generate(unwrap(model), tokenizer, args.sample_prompt,
                             max_new_tokens=args.sample_tokens, seed=args.seed,
                             fixed_length=isinstance(model, FSDPModule),
                             prompt_format=prompt_format)  # the template the model learns
    model.train()
    return out


@torch.no_grad()
def evaluate(model, batches, ctx, n_domains=0):
    """Mean loss per scored token of the validation batches, and of each domain's batches
    (eval mode: no dropout).

    Rank r scores batches r, r + W, ...; the sums meet in an all-reduce. Every rank runs the
    same number of forward passes (under FSDP each is a collective): a rank short of a batch
    scores batch 0 again and does not count it.
    """
    model.eval()
    total = torch.zeros(2, 1 + n_domains, device=ctx.device)  # loss sums, tokens; all, domains
    world_size = ctx.world_size
    for i in range(ctx.rank, -(-len(batches) // world_size) * world_size, world_size):
        batch = batches[i % len(batches)]
        with ctx.autocast():
            sums, counts = sequence_losses(*forward(model, batch, ctx.device))
        if i < len(batches):
            total[:, 0] += torch.stack([sums.sum(), counts.sum().float()])
            if n_domains:
                index = batch["domain"].to(ctx.device, non_blocking=True) + 1
                total[0].index_add_(0, index, sums.float())
                total[1].index_add_(0, index, counts.float())
    if world_size > 1:
        dist.all_reduce(total)
    model.train()
    losses = (total[0] / total[1].clamp(min=1)).tolist()
    return losses[0], losses[1:]


class MetricsLog:
    """Where each step's metrics go: a line in metrics.jsonl (rank 0), Weights & Biases, and
    a log line when there is more than the loss to say. Remove wandb here and only here."""

    def __init__(self, exp_dir, args, state, rank):
        self.file = open(exp_dir / "metrics.jsonl", "a") if rank == 0 else None
        self.wandb = None
        if rank == 0 and args.wandb != "disabled":
            import wandb  # here, not at the top: a second of start-up that most tests skip
            self.wandb = wandb
            # The run id is kept in state.json, so a resumed run continues the same curve.
            # Offline mode (the default) needs no account: `wandb sync` uploads the run later.
            state["wandb_run_id"] = wandb.init(
                project=args.wandb_project, name=args.experiment_name, id=state["wandb_run_id"],
                resume="allow", dir=exp_dir, config=vars(args), mode=args.wandb).id

    def write(self, metrics):
        if self.file:
            self.file.write(json.dumps(metrics) + "\n")
            self.file.flush()
        if self.wandb:
            self.wandb.log(metrics, step=metrics["step"])
        if "tokens_per_s" in metrics or "val_loss" in metrics:
            LOGGER.info(utils.format_metrics(metrics))

    def rewrite_last(self, metrics):
        """The last step's line again, now with more in it (a late validation)."""
        if self.file:
            utils.rewrite_last_line(self.file, json.dumps(metrics))
        if self.wandb:
            self.wandb.log(metrics, step=metrics["step"])
        LOGGER.info(utils.format_metrics(metrics))

    def close(self):
        if self.file:
            self.file.close()
        if self.wandb:
            self.wandb.finish()


# ----------------------------------------------------------------------------------------------
# Command-line arguments
# ----------------------------------------------------------------------------------------------

def parse_mix(text):
    """--mix name=weight,...: a dict of finite weights >= 0, not all zero, each name once."""
    weights = {}
    for item in text.split(","):
        name, equals, value = item.partition("=")
        try:
            weight = float(value) if equals and name else None
        except ValueError:
            weight = None
        if weight is None:
            raise argparse.ArgumentTypeError(f"{item!r}: expected name=weight,name=weight,...")
        if not (math.isfinite(weight) and weight >= 0):
            raise argparse.ArgumentTypeError(f"{name}={value}: a weight is a finite number >= 0")
        if name in weights:
            raise argparse.ArgumentTypeError(f"{name!r} is given twice")
        weights[name] = weight
    if not any(weights.values()):
        raise argparse.ArgumentTypeError("every weight is 0: nothing to draw from")
    return weights


def checked(parse):
    """An argparse type that checks a flag with ``parse`` but keeps its text (as given, it is
    part of the run's fingerprint)."""
    def check(text):
        parse(text)
        return text
    return check


def finite(low, above=False):
    """An argparse type: a finite float >= low (> low with ``above``)."""
    def number(text):
        value = float(text)
        if not math.isfinite(value) or value < low or (above and value == low):
            raise argparse.ArgumentTypeError(
                f"must be a finite number {'>' if above else '>='} {low:g}, got {text}")
        return value
    return number


def step_range(text):
    """--profile-steps FIRST,LAST: two step numbers, 1 <= FIRST <= LAST."""
    first, comma, last = text.partition(",")
    try:
        first, last = int(first), int(last)
    except ValueError:
        first = last = None
    if not comma or first is None or not 1 <= first <= last:
        raise argparse.ArgumentTypeError(f"{text!r}: expected FIRST,LAST with 1 <= FIRST <= "
                                         "LAST, e.g. 10,12")


def torch_device(text):
    """--device: a torch device that exists here (a typo or a missing GPU fails at once)."""
    try:
        value = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({e})") from e
    if value.type == "cuda" and not torch.cuda.is_available():
        raise argparse.ArgumentTypeError(f"{text}: this machine has no CUDA GPU that torch "
                                         "can use; leave --device out to train on the CPU")
    if value.type == "cuda" and (value.index or 0) >= torch.cuda.device_count():
        raise argparse.ArgumentTypeError(f"{text}: there are only {torch.cuda.device_count()} "
                                         "GPU(s)")
    return text


def at_least(low):
    """An argparse type: an int >= low (0 steps or 0 sequences mean nothing)."""
    def integer(text):
        value = int(text)
        if value < low:
            raise argparse.ArgumentTypeError(f"must be at least {low}, got {value}")
        return value
    return integer


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])

    run = parser.add_argument_group("run")
    add = run.add_argument
    add("-e", "--experiment-name", required=True,
        help="run name; outputs go to SAVE_DIR/NAME")
    add("--save-dir", default="outputs", help="where experiment directories are created")
    add("--task", choices=["pretrain", "sft"], default="pretrain",
        help="pretrain: next-token loss on all text; sft: instruction tuning, "
             "answer tokens only")
    add("--resume-from", default=None, metavar="CHECKPOINT",
        help="resume from this kept checkpoint (e.g. step-000400) instead of the "
             "newest one: a rollback; the steps logged after it are discarded "
             "once it has loaded")
    add("--seed", type=int, default=0, help="seed for weights, data order and all RNGs")
    add("--max-steps", type=at_least(1), default=600,
        help="optimizer steps to train for (may be raised on resume)")
    add("--device", default=None, type=torch_device,
        help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    add("--deterministic", action="store_true",
        help="deterministic GPU kernels: bit-identical runs at about half the "
             "speed (a kernel without a deterministic version warns)")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward instead of keeping them: less "
             "memory (a bigger batch or model) for about a third more compute")
    add("--gc-freq", type=at_least(1), default=50,
        help="run Python's garbage collector every N steps")
    add("--debug", action="store_true",
        help="show the traceback of an expected failure (bad data, a missing "
             "file, a full disk)")

    data_args = parser.add_argument_group("data")
    add = data_args.add_argument
    add("-d", "--dataset", default=None,
        help="training JSONL shards: paths, globs, {a,b} brace patterns, directories or URLs "
             "(default: data/sample/*/train-*.jsonl, with --task sft data/sft/train-*.jsonl)")
    add("--val-dataset", default=None,
        help="held-out JSONL shards for the validation loss (same forms as --dataset)")
    add("--tokenizer", default=f"{KIT}/assets/tokenizer",
        help="Hugging Face tokenizer name or path (default: the shipped one)")
    add("-s", "--seq-length", type=at_least(2), default=128, help="tokens per sequence")
    add("--shuffle-buffer", type=at_least(1), default=1000,
        help="sequences in the shuffle buffer (1: off)")
    add("--active-shards", type=at_least(1), default=8,
        help="slots: input splits (shards, or pieces of them) read at a time, round-robin; a "
             "multiple of the number of ranks")
    add("--epochs", type=at_least(1), default=None,
        help="stop after this many passes over --dataset (default: endless; see --max-steps)")
    add("--data-format", choices=["jsonl", "parquet", "text"], default=None,
        help="how to read shards whose names do not tell (default: by suffix: .jsonl .json "
             ".ndjson .parquet .txt, optionally .gz .zst .bz2 .xz)")
    add("--tokenizer-threads", type=at_least(1), default=2,
        help="threads tokenizing in the background")
    add("--skip-bad-records", action="store_true",
        help="skip (count and log) records that are malformed or lack a field, instead of "
             "stopping at the first one")
    add("--max-doc-chars", type=at_least(0), default=100_000,
        help="cut longer documents into pieces of at most this many characters (at a blank) "
             "before tokenizing, so one huge document cannot blow up memory or the loader "
             "state (0: never cut)")

    model = parser.add_argument_group("model and optimizer")
    add = model.add_argument
    add("-m", "--model-name", default=f"{KIT}/assets/tiny-gpt2",
        help="Hugging Face model name or path; its config shapes a freshly initialized model "
             "(default: the shipped tiny GPT-2)")
    add("--init-from-pretrained", action="store_true",
        help="load the weights of --model-name instead of initializing them randomly")
    add("--init-from", default=None, metavar="PATH",
        help="start a new run from the weights (and architecture) of a run directory, a "
             "checkpoint directory or a Hugging Face directory, e.g. pretrain -> --task sft")
    add("-b", "--batch-size", type=at_least(1), default=8,
        help="sequences per micro-batch (per rank)")
    add("--grad-accum", type=at_least(1), default=1, help="micro-batches per optimizer step")
    add("--global-batch-size", type=at_least(1), default=None, metavar="N",
        help="sequences per optimizer step over all ranks; sets --grad-accum to N / (world size "
             "x --batch-size), so a run restarted on another number of ranks (torchrun "
             "elastic) keeps its batch")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay of weight matrices")
    add("--grad-clip", type=float, default=1.0,
        help="clip the global gradient norm to this (inf: never)")

    schedule = parser.add_argument_group("learning-rate schedule (get_lr)")
    add = schedule.add_argument
    add("--lr", type=finite(0, above=True), default=4e-3,
        help="peak learning rate, reached after warmup")
    add("--warmup-steps", type=at_least(0), default=60, help="steps of linear learning-rate warmup")
    add("--min-lr", type=finite(0), default=3e-4,
        help="learning rate at the end of the cosine decay (at most --lr)")

    logs = parser.add_argument_group("logging, validation and checkpoints")
    add = logs.add_argument
    add("--log-freq", type=at_least(1), default=10,
        help="print throughput, memory and MFU every N steps")
    add("--val-freq", type=at_least(1), default=200,
        help="compute the validation loss every N steps")
    add("--val-batches", type=at_least(1), default=16,
        help="batches of --val-dataset to validate on")
    add("--ckpt-freq", type=at_least(1), default=200, help="save a checkpoint every N steps")
    add("--keep-checkpoints", type=at_least(0), default=2,
        help="how many newest checkpoints to keep (0: all)")
    add("--checkpoint-writer", choices=["auto", "background", "sync"], default="auto",
        help="background: copy each checkpoint to CPU memory and write it while training goes "
             "on; sync: write it before training goes on; auto: background on a GPU, sync on "
             "a CPU (whose cores training keeps busy)")
    add("--wandb", choices=["online", "offline", "disabled"], default="offline",
        help="Weights & Biases mode; offline needs no login (upload later with `wandb sync`)")
    add("--wandb-project", default=os.environ.get("WANDB_PROJECT", "train-llm"),
        help="Weights & Biases project (default: $WANDB_PROJECT if set, else train-llm)")
    add("--sample-prompt", default=None,
        help="at each validation, log a continuation of this text (default: 'The'; with "
             "--task sft an instruction, in the template)")
    add("--sample-tokens", type=at_least(0), default=32,
        help="tokens of that continuation (0: no sample)")
    add("--profile-steps", default=None, metavar="FIRST,LAST", type=checked(step_range),
        help="write a torch.profiler trace of steps FIRST to LAST into SAVE_DIR/NAME/profile")

    distributed = parser.add_argument_group("distributed (under torchrun)")
    add = distributed.add_argument
    add("--fsdp", action="store_true",
        help="shard weights, gradients and optimizer state across ranks (FSDP2; needs torchrun)")
    add("--dist-timeout", type=float, default=120,
        help="seconds a collective may wait for the other ranks after the first step")

    mixing = parser.add_argument_group("mixing domains")
    add = mixing.add_argument
    add("--mix", default=None, metavar="NAME=W,...", type=checked(parse_mix),
        help="mix the domains of --dataset (the directories its first * stands for) with these "
             "weights, e.g. code=0.4,docstrings=0.3,prose=0.2,reference=0.1")
    add("--odm", choices=["off", "exp3", "smoothed-mean"], default="off",
        help="Online Data Mixing: move the mixture toward domains whose loss stays high")
    add("--odm-warmup-steps", type=at_least(0), default=50,
        help="steps with the initial weights before ODM starts to adapt")
    add("--odm-alpha", type=float, default=0.9, help="smoothing of ODM's per-domain rewards")
    return parser


# Failures a user can mend (bad data, a missing or unreadable file, a full disk) end in one
# paragraph; anything else is a bug and keeps its traceback.
EXPECTED = (data.DataError, OSError)

def expected_failure(error):
    """The paragraph that ends a run on a failure the user can mend, or None for a bug (which
    keeps its traceback): bad data, a missing or unreadable file, a full disk, no memory."""
    if isinstance(error, EXPECTED):
        return (f"{type(error).__name__}: {error}\n(Stopped; the last checkpoint is untouched. "
                "--debug, or rank 0's train.log, shows where this came from.)")
    # A failed allocation: torch.OutOfMemoryError on a GPU, a RuntimeError on the CPU.
    if isinstance(error, torch.OutOfMemoryError) or "can't allocate memory" in str(error):
        return (f"Out of memory: {str(error).strip().splitlines()[-1][:300]}\n(Stopped; the "
                "last checkpoint is untouched. Halve --batch-size and double --grad-accum: the "
                "global batch, and so the run, stays the same. Or pass "
                "--activation-checkpointing, or a smaller --seq-length.)")
    return None


def cli():
    """main(), with the failures a user can mend as one paragraph (expected_failure)."""
    try:
        main()
    except (*EXPECTED, RuntimeError) as e:
        message = expected_failure(e)
        if message is None or "--debug" in sys.argv[1:]:
            FILE_LOG.error("Failed", exc_info=True)
            raise
        FILE_LOG.error(message, exc_info=True)
        sys.exit(message)
    except SystemExit as e:  # a refusal (its paragraph) or a plain exit
        if isinstance(e.code, str):
            FILE_LOG.error(e.code)
        raise
    except BaseException:  # a bug (or Ctrl-C before training has begun)
        FILE_LOG.error("Failed", exc_info=True)
        raise


if __name__ == "__main__":
    cli()
