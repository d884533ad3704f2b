"""The machinery behind train_llm.py: what keeps a run safe and measures it. Nothing here
decides how training goes (that is the script's), and nothing here imports the script: a run
records its script's path, and the model is rebuilt from it (trained.load_trained). Its
sections, in order: flags, the run directory, how a run ends, measuring, the process,
distributed, a checkpoint's states, models (trained.py: a trained one), checkpoints.
"""

import argparse
import atexit
import concurrent.futures
import contextlib
import ctypes
import datetime
import errno
import fcntl
import gc
import glob
import hashlib
import itertools
import json
import linecache
import logging
import math
import mmap
import os
import pickle
import queue
import random
import re
import resource
import shlex
import shutil
import signal
import struct
import sys
import threading
import time
import traceback
import uuid
import zlib
from pathlib import Path

import braceexpand
import numpy as np
import torch
import torch.distributed.checkpoint as dcp
import tqdm
from torch.distributed.checkpoint._state_dict_stager import StateDictStager

import data

GiB = 2**30
KIT = Path(__file__).resolve().parent  # where the kit and its shipped assets are
LOGGER = logging.getLogger("train_llm")
LOG_FORMAT = "[%(asctime)s] [rank={rank}] %(levelname)s: %(message)s"
# For train.log alone: how a run failed, which the console shows in its own way.
FILE_LOG = logging.getLogger("train_llm.file")
FILE_LOG.propagate = False
FILE_LOG.addHandler(logging.NullHandler())
UNMASKED_SDPA = "sdpa_unmasked"  # transformers' SDPA, no mask made for it (skip_mask_checks)
RUN = None  # the Run this process opened: what cli() tells, or cleans up, when a start fails


# --- Flags: argparse types (each checks one flag as it is parsed) and check_args -----------------

class ArgumentParser(argparse.ArgumentParser):
    """argparse's, its flags in groups (group); refusals reach torchrun's table (tell_torchrun)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.fingerprint = []  # the names of the flags declared with fixed (open_run)

    def group(self, title):
        """(add, fixed) of a new group; fixed's flags shape the run: its fingerprint (open_run)."""
        add = self.add_argument_group(title).add_argument

        def fixed(*flags, **options):
            action = add(*flags, **options)
            self.fingerprint.append(action.dest)
            return action
        return add, fixed

    def error(self, message):
        tell_torchrun(f"{self.prog}: error: {message}")
        super().error(message)


def at_least(low, high=None):
    """An argparse type: an int >= low (0 steps or 0 sequences mean nothing), <= high."""
    def integer(text):
        value = int(text)
        if value < low or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be at least {low}{f' and at most {high}' if high else ''}, got {value}")
        return value
    return integer


def finite(low, above=False, high=None, inf=False):
    """An argparse type: a finite float >= low (> low with ``above``), <= high; ``inf``:
    infinity too (never NaN: a NaN in a flag would only show up as a NaN loss)."""
    def number(text):
        value = float(text)
        if math.isnan(value) or (math.isinf(value) and not inf) or value < low or \
                (above and value == low) or (high is not None and value > high):
            raise argparse.ArgumentTypeError(
                f"must be a {'' if inf else 'finite '}number {'>' if above else '>='} {low:g}"
                f"{f' and <= {high:g}' if high is not None else ''}, got {text}")
        return value
    return number


def step_range(text):
    """--profile-steps A:B: the steps A to B, 1 <= A <= B, as (A, B)."""
    first, colon, last = text.partition(":")
    if not (colon and first.isdigit() and last.isdigit() and 1 <= int(first) <= int(last)):
        raise argparse.ArgumentTypeError(f"{text!r}: expected A:B with 1 <= A <= B, e.g. 5:8")
    return int(first), int(last)


def torch_device(text):
    """--device: a torch device that exists here (a typo or a missing GPU fails at once)."""
    try:
        value = torch.device(text)
    except RuntimeError as e:
        raise argparse.ArgumentTypeError(f"{text!r} is not a torch device ({e})") from e
    gpus = torch.cuda.device_count() if value.type == "cuda" else 0
    if value.type == "cuda" and (value.index or 0) >= gpus:
        raise argparse.ArgumentTypeError(f"{text}: this machine has {gpus or 'no'} CUDA GPU(s) "
                                         "that torch can use; leave --device out to run on the CPU")
    if value.type == "meta" or value.type == "mps" and not torch.backends.mps.is_available():
        raise argparse.ArgumentTypeError(f"{text}: torch cannot train there on this machine; "
                                         "leave --device out to train on a GPU or the CPU")
    return text


def parse_mix(text):
    """--mix name=weight,...: a dict of finite weights >= 0, not all zero, each name once."""
    weights = {}
    for item in text.split(","):
        name, equals, value = item.partition("=")
        weight = None
        with contextlib.suppress(ValueError):
            weight = float(value) if equals and name else None
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


def mix_weights(text):
    """An argparse type: --mix checked by parse_mix, kept as typed (it is in the fingerprint);
    "natural" weighs each domain by its size, measured when the run starts (fresh_state)."""
    if text != "natural":
        parse_mix(text)
    return text


def domain_weights(domains, given=None):
    """The mixture's initial weights in the order of ``domains``, summing to 1: ``given``
    ({domain: weight >= 0}, every domain once), or uniform."""
    if given is None:
        return [1 / len(domains)] * len(domains)
    unknown = set(given) - set(domains)
    if unknown or len(given) != len(domains):
        raise data.DataError(f"--mix gives weights to {sorted(given)}: give a weight to each "
                        f"domain of {domains}; unknown: {sorted(unknown)}")
    weights = [given[name] for name in domains]
    return [w / sum(weights) for w in weights]  # (summed in domain order: the same bits)


# The flags whose defaults are files shipped next to the script (assets/, data/).
SHIPPED = ("tokenizer", "model_name", "dataset", "val_dataset")


def check_args(parser, args, local_paths, shipped):
    """What no single flag's type can check, before anything is written: the shipped files a
    copy of the kit lacks (DESIGN.md section 1), the run directory, flags against each other.
    ``local_paths`` become absolute: a run resumes, and generate.py finds it, from anywhere."""
    missing = [name for name in SHIPPED if not (name == "model_name" and args.init_from)
               and str(getattr(args, name)).startswith(f"{shipped}{os.sep}")
               and _local(getattr(args, name)) is None]
    if missing and missing != ["model_name"]:
        flags = ", ".join(f"--{name.replace('_', '-')} ({getattr(args, name)})" for name in missing)
        sys.exit(f"These flags name files next to the script that are not there: {flags}. The "
                 "defaults are the kit's shipped assets/ and data/, which a copy of the script "
                 "lacks: pass each of these flags (a local path, or a Hugging Face Hub name), "
                 "or copy assets/ and data/ next to the script. Nothing was written.")
    if args.init_from and only_a_path(args.init_from):  # (before --tokenizer, which is its)
        parser.error(f"--init-from {args.init_from}: no such file or directory (a run started "
                     "from it builds its model from it: on resume too, so keep it there)")
    new = not (Path(args.save_dir) / args.experiment_name / "state.json").exists()
    if args.init_from and new and (args.init_from_pretrained or
                                   args.model_name != parser.get_default("model_name")):
        parser.error(f"--init-from {args.init_from} trains the model it names, as it is: "
                     "--model-name and --init-from-pretrained would be ignored (and recorded as "
                     "if they were not). Leave them out.")
    for name in local_paths:
        setattr(args, name, _local(getattr(args, name)) or getattr(args, name))
    save_dir = Path(os.path.abspath(args.save_dir))  # (not resolve(): links may point away)
    exp_dir = Path(os.path.normpath(save_dir / args.experiment_name))
    if save_dir not in exp_dir.parents:  # "", ".", "..", "/abs": a run would write elsewhere
        parser.error(f"--experiment-name {args.experiment_name!r} must name a directory inside "
                     f"--save-dir {args.save_dir}: the run writes (and deletes its own old "
                     "checkpoints) there")
    if getattr(args, "profile_steps", None) and args.profile_steps[1] > args.max_steps:
        parser.error(f"--profile-steps {args.profile_steps[0]}:{args.profile_steps[1]} ends "
                     f"after --max-steps {args.max_steps}: those steps never run")
    if getattr(args, "eval_freq", None) and args.eval_freq % args.val_freq:
        parser.error(f"--eval-freq {args.eval_freq} must be a multiple of --val-freq "
                     f"{args.val_freq}: the scores are taken at validations")
    if not getattr(args, "eval_tasks", True) and (args.eval_freq or args.eval_limit):
        parser.error("--eval-freq and --eval-limit go with --eval-tasks, which names the tasks")
    if args.min_lr > args.lr:
        parser.error(f"--min-lr {args.min_lr} is above --lr {args.lr}: the schedule decays "
                     "from --lr down to --min-lr")
    if args.global_batch_size:
        world_size = int(os.environ.get("WORLD_SIZE", 1))
        per_micro_step = world_size * args.batch_size
        accum, left = divmod(args.global_batch_size, per_micro_step)
        if not left and args.grad_accum not in (1, accum):
            parser.error(f"--grad-accum {args.grad_accum} and --global-batch-size "
                         f"{args.global_batch_size} disagree: --global-batch-size sets "
                         f"--grad-accum ({args.global_batch_size} / ({world_size} x "
                         f"--batch-size {args.batch_size}) = {accum}); pass one of the two.")
        if left:
            parser.error(f"--global-batch-size {args.global_batch_size} must be a multiple of "
                         f"world size x --batch-size = {world_size} x {args.batch_size} = "
                         f"{per_micro_step}: --grad-accum follows from it (leave it out). Pick "
                         f"a --batch-size that divides {args.global_batch_size} / {world_size} "
                         "on every world size the run may see.")
        args.grad_accum = accum


# --- The run directory (DESIGN.md section 3): open_run, Run, the refusals, the logs --------------

class Run:
    """A run directory as this start sees it (DESIGN.md section 3): ``dir``, ``state`` (the
    run state), ``created`` (what this start made, removed if training never began: cli)."""

    def __init__(self, exp_dir, rank):
        self.dir, self.rank, self.created, self.lock_file = exp_dir, rank, [], None
        self.state, self.training = None, False
        if rank != 0:
            return
        self.created = [p for p in (exp_dir / "train.log", exp_dir / ".lock", exp_dir,
                                    *exp_dir.parents) if not p.exists()]
        exp_dir.mkdir(parents=True, exist_ok=True)
        # Locked while this process lives: the kernel drops it however it dies; forks let go.
        self.lock_file = open(exp_dir / ".lock", "w")
        os.register_at_fork(after_in_child=self.lock_file.close)
        try:
            fcntl.flock(self.lock_file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            sys.exit(f"Another process is training in {exp_dir}: stop it first (see `fuser -v "
                     f"{exp_dir / '.lock'}`), or pick another --experiment-name.")
        log_to_file(exp_dir / "train.log", rank)

    def discard_after_checkpoint(self, args, ctx, loader, extra=()):
        """Once the checkpoint is loaded (--resume-from: each rank's first batch too), forget
        what a killed run did after it (DESIGN.md section 3); a failure now keeps the run."""
        taken = [name for name in extra if name in (*KIT_STATES, "dcp", "state") or
                 name.startswith("rng-rank")]
        if taken:
            sys.exit(f"extra[{taken[0]!r}]: a checkpoint's {taken[0]}.pt (or {taken[0]}/) is "
                     "the kit's own; give your training state another name.")
        if args.resume_from:
            try:
                data.first_read(loader)
            except data.DataError:
                any_rank(True, ctx)  # (the other ranks learn of it, and stop)
                raise
            if any_rank(False, ctx):
                sys.exit(f"rank {ctx.rank}: stopped, as another rank's data failed its check")
        if self.rank == 0:
            metrics = self.dir / "metrics.jsonl"
            if not self.state["checkpoint"] and metrics.exists() and metrics.stat().st_size:
                # A start from scratch: what was logged is not its; moved aside, and said.
                n = next(n for n in itertools.count(1)
                         if not (self.dir / f"metrics.jsonl.{n}").exists())
                metrics.rename(self.dir / f"metrics.jsonl.{n}")
                LOGGER.warning(f"{metrics} was there before this run started from scratch: "
                               f"moved to metrics.jsonl.{n}")
            discard_after(self.dir, self.state["global_step"], self.state.get("run_id"))
            if args.resume_from:  # state.json must not name a checkpoint just discarded
                write_atomic(self.dir / "state.json", json.dumps(self.state, indent=2))
        self.state["world_size"] = ctx.world_size
        self.training = True


def open_run(args, parser, rank, world_size, script):
    """The Run to train (fresh, or resumed), or None if it is done: the lock, train.log, the
    refusals, where to resume (DESIGN.md section 3); ``script`` is recorded (rebuild_model)."""
    global RUN
    logging.basicConfig(format=LOG_FORMAT.format(rank=rank),
                        level=logging.INFO if rank == 0 else logging.WARNING)
    exp_dir = Path(args.save_dir) / args.experiment_name
    RUN = run = Run(exp_dir, rank)  # (rank 0: the directory made, locked, logged to)
    LOGGER.info(f"{shlex.join(sys.argv)}\n{args}")  # train.log: each start's command, flags
    FILE_LOG.info(f"Environment: {environment()}")  # (train.log alone)
    if (limit := resource.getrlimit(resource.RLIMIT_AS)[0]) != resource.RLIM_INFINITY:
        LOGGER.warning(f"ulimit -v: this process may map {limit / GiB:.2f} GiB, every mapping "
                       "counted; an allocation refused in the tokenizer (Rust) aborts it at once "
                       "(\"memory allocation of N bytes failed\"): then raise the limit")
    if "LOCAL_RANK" in os.environ:  # every rank dies with torchrun, never orphaned
        die_with_parent()
    config = {name: getattr(args, name) for name in parser.fingerprint}
    config["global_batch"] = args.batch_size * args.grad_accum * world_size
    config["file_digests"] = file_digests(args)  # their content, beside their paths
    state, why = run_state(exp_dir, args.resume_from)
    if state is None:
        state = fresh_state(args, exp_dir, config)
    else:
        refuse_foreign_checkpoints(exp_dir, state)
        # The run's config, then its checkpoint's own (one copied in from elsewhere: refused).
        check_unchanged(args, parser, config, state["config"], f"{exp_dir} was started", world_size)
        own = exp_dir / state["checkpoint"] / "state.json"
        if own.exists():
            check_unchanged(args, parser, config, json.loads(own.read_text())["config"],
                            f"{state['checkpoint']} was saved", world_size)
        if is_done(args, exp_dir, state, why):
            if args.resume_from:  # a rollback that trains nothing changes nothing
                sys.exit(f"--resume-from {args.resume_from} with --max-steps {args.max_steps} "
                         "trains nothing: nothing was changed. Raise --max-steps to train on "
                         "from it.")
            return None
        say_new_cut(args, state, world_size)
    keep_schedule(args, state)
    state["script"] = str(Path(script).resolve())
    state["args"] = dict(vars(args))  # every flag, as create_model may read any (rebuild_model)
    if state.get("run_dir", str(exp_dir.resolve())) != str(exp_dir.resolve()) and \
            Path(state["run_dir"]).exists():  # (a run moved away keeps its wandb run)
        LOGGER.info(f"{exp_dir} is a copy of {state['run_dir']}: a wandb run of its own")
        state["wandb_run_id"] = None  # (else `wandb sync` would merge the two curves)
    if args.resume_from and state["wandb_run_id"]:  # wandb keeps the steps past it
        LOGGER.info("--resume-from: a wandb run of its own, that metrics.jsonl fills")
        state["wandb_run_id"] = None
    state["run_dir"] = str(exp_dir.resolve())
    run.state = state
    return run


def say_new_cut(args, state, world_size):
    """Says so when a resume cuts the global batch another way (DESIGN.md section 7)."""
    old = state.get("args") or {}
    was = (old.get("batch_size"), old.get("grad_accum"), state.get("world_size"))
    if None not in was and was != (args.batch_size, args.grad_accum, world_size):
        LOGGER.warning(
            f"The global batch is cut {args.batch_size} x {args.grad_accum} x {world_size} "
            f"rank(s), where it was {' x '.join(map(str, was))}: the same update up to float "
            "rounding, not bit for bit (DESIGN.md section 7)")


def keep_schedule(args, state):
    """--decay-steps from the run state (the first start's --max-steps past the warmup unless
    given): raising --max-steps later trains on at --min-lr, never up a stretched cosine."""
    kept = state.get("decay_steps") if state.get("decay_steps", 0) > args.warmup_steps else None
    if args.decay_steps and args.decay_steps <= args.warmup_steps:
        sys.exit(f"--decay-steps {args.decay_steps} ends the cosine inside --warmup-steps "
                 f"{args.warmup_steps}: the learning rate would drop from --lr to --min-lr at "
                 "the warmup's end. Pass a --decay-steps above the warmup, or leave it out.")
    if args.decay_steps and kept and args.decay_steps != kept:
        sys.exit(f"--decay-steps {args.decay_steps}: this run's cosine ends at step {kept} "
                 "(state.json), and a resume keeps its schedule. Leave --decay-steps out, or "
                 "start a new run from this one's weights with --init-from.")
    state["decay_steps"] = args.decay_steps = args.decay_steps or kept or args.max_steps
    text = f"Learning rate: warmup over {args.warmup_steps} steps to --lr {args.lr:g}"
    if args.decay_steps <= args.warmup_steps:  # (a short first run: its cosine is set later)
        LOGGER.info(f"{text}; this run ends at step {args.max_steps}, inside it")
    else:
        LOGGER.info(f"{text}, cosine to --min-lr {args.min_lr:g} at step {args.decay_steps}" +
                    (f", then --min-lr to step {args.max_steps}" if args.max_steps >
                     args.decay_steps else ""))


def fresh_state(args, exp_dir, config):
    """The run state of a run that starts from scratch; refused where a finished run left
    its traces (hf/, metrics.jsonl) but no checkpoint (a user freed the disk)."""
    if (exp_dir / "hf").is_dir():  # (scripts/export_hf.py writes it from a checkpoint)
        sys.exit(f"{exp_dir} holds what a finished run left (hf/, metrics.jsonl) but no "
                 "checkpoint to go on from: its state.json and checkpoints/ are gone. "
                 "Nothing was changed: start a new --experiment-name, or move those files "
                 "away to train this name again from scratch.")
    LOGGER.info(f"Starting {exp_dir} from scratch")
    if args.mix == "natural":  # measured once: the run keeps these weights on every resume
        sizes = data.natural_sizes(args.dataset)
        config["mix_weights"] = {name: n / sum(sizes.values()) for name, n in sizes.items()}
        LOGGER.info("--mix natural, by the bytes of each domain's files (as stored): " +
                    ", ".join(f"{name} {weight:.4f} ({sizes[name] / 1e6:.2f} MB)"
                              for name, weight in config["mix_weights"].items()))
    if args.task == "sft":  # the prompt layout follows the data (prompt_format)
        config["prompt_format"] = data.sft_format(
            args.dataset, slots=args.active_shards, epochs=args.epochs, seed=args.seed,
            format=args.data_format, skip_bad_records=args.skip_bad_records)
    return {"global_step": 0, "epoch": 0, "tokens_seen": 0, "checkpoint": None,
            "wandb_run_id": None, "config": config, "domain_tokens": {},
            "run_id": uuid.uuid4().hex}  # what marks its checkpoints as its own


def refuse_foreign_checkpoints(exp_dir, state):
    """Refuse to train beside checkpoints that another run saved (copied in by hand, named by
    their state.json's run_dir): the run deletes its own old checkpoints, never those."""
    own = state.get("run_id")  # the checkpoint's, unless the run's own record is readable
    with contextlib.suppress(OSError, ValueError, TypeError, AttributeError):
        root = json.loads((exp_dir / "state.json").read_text())
        if {"global_step", "checkpoint", "config"} <= set(root):
            own = root.get("run_id")
    foreign = {d.name: saved_by(d) for d in _step_dirs(exp_dir, complete=True).values()
               if saved_by(d)[0] != own}
    if foreign:
        origins = "; ".join(f"{name} was saved by the run in {where or 'another directory'}"
                            for name, (_, where) in sorted(foreign.items()))
        sys.exit(f"{exp_dir / 'checkpoints'} holds checkpoints that this run did not save: "
                 f"{origins}. A run deletes only its own old checkpoints, and trains beside no "
                 "other's: move them out of that directory (or train in a copy of the run they "
                 "came from), then rerun. Nothing was changed.")


def saved_by(ckpt_dir):
    """(run id, run directory) of the run that saved a checkpoint, from its state.json."""
    try:
        state = json.loads((ckpt_dir / "state.json").read_text())
    except (OSError, ValueError):
        return "unknown", None
    return state.get("run_id"), state.get("run_dir")


def is_done(args, exp_dir, state, why):
    """Whether a resumed run has nothing left to train: it logs why, or where it resumes."""
    where = f"{state['checkpoint']}{f' ({why})' if why else ''}"
    if state.get("data_exhausted"):
        LOGGER.info(f"{exp_dir} is done: its data ran out at step {state['global_step']} "
                    f"({where}) after --epochs {args.epochs} passes. --epochs is part of the "
                    "run and cannot change on resume: train on in a new --experiment-name.")
    elif state["global_step"] >= args.max_steps:
        LOGGER.info(f"{exp_dir} is done: step {state['global_step']} of --max-steps "
                    f"{args.max_steps} ({where}). Raise --max-steps to train further.")
    else:
        LOGGER.info(f"Resuming {exp_dir} from {where}, step {state['global_step']} of "
                    f"{args.max_steps}")
        return False
    return True


def check_unchanged(args, parser, config, saved, when, world_size):
    """Refuse to resume with a flag that shapes the run changed since ``saved`` was written; a
    flag added to the script since then counts as its default (DESIGN.md section 3)."""
    saved = {name: parser.get_default(name) for name in parser.fingerprint} | saved
    for name, value in saved.items():
        if name in ("prompt_format", "mix_weights"):  # found in the data --dataset pins
            continue
        if config.get(name) == value or value == "auto":  # (the script chose from the record)
            continue
        if name == "file_digests":
            changed = sorted(k for k in value.keys() & config[name].keys()
                             if value[k] != config[name][k])
            if not changed:
                continue
            sys.exit(f"{', '.join(changed)} changed since {when} (the same path, other "
                     "content). Resuming would train on other token ids or another model: put "
                     "the old files back, or start a new --experiment-name.")
        if name == "global_batch":
            sys.exit(f"The global batch (--batch-size x --grad-accum x world size) was "
                     f"{value} sequences when {when} and is {config[name]} now "
                     f"({args.batch_size} x {args.grad_accum} x {world_size}). "
                     f"{same_global_batch(value, args.batch_size, world_size)}, or start a "
                     "new --experiment-name.")
        gone = isinstance(value, str) and os.path.isabs(value) and _local(value) is None
        sys.exit(f"--{name.replace('_', '-')} was {value!r} when {when} and is "
                 f"{config.get(name)!r} now. Resuming would train a different run: pass "
                 "the old value, or start a new --experiment-name." + (
                     " (Nothing is at the old place now: if its files moved, link the old "
                     "place to the new one, `ln -s NEW OLD`, and pass the old value.)"
                     if gone else ""))


def same_global_batch(batch, batch_size, world_size):
    """The flags under which a resume on ``world_size`` ranks makes ``batch`` sequences a step
    (the largest --batch-size up to ``batch_size`` that divides a rank's share), or why none do."""
    if batch % world_size:
        return (f"No --batch-size makes {batch} sequences on {world_size} ranks: resume on a "
                f"number of ranks that divides {batch}")
    share = batch // world_size
    size = max(d for d in range(1, min(batch_size, share) + 1) if share % d == 0)
    flags = f"--global-batch-size {batch}" if size == batch_size else \
        f"--batch-size {size} --global-batch-size {batch}"
    return (f"Pass `{flags}` without --grad-accum (it sets --grad-accum from the world size; "
            "an elastic torchrun restarts that command on any number of ranks that divides "
            f"{batch // size})")


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "vocab.txt", "tokenizer.model", "spiece.model",
                   "added_tokens.json", "chat_template.jinja")


def file_digests(args):
    """The sha256 of each file of a local --tokenizer and of --model-name's config.json, by
    path: a file edited in place keeps its path (a resume reads its own weights)."""
    wanted = [Path(args.tokenizer, name) for name in TOKENIZER_FILES] if args.tokenizer else []
    wanted += [Path(args.model_name, "config.json")] if args.model_name else []
    return {str(path): hashlib.sha256(path.read_bytes()).hexdigest() for path in wanted
            if path.is_file()}


def log_to_file(path, rank):
    """Everything logged also goes to ``path`` (appended across resumes), and so does the
    traceback of a failure that the console shows as one paragraph (cli)."""
    # A log file that cannot be written (a full disk) is skipped, without a traceback per record.
    logging.raiseExceptions = False
    handler = logging.FileHandler(path, encoding="utf-8")
    handler.setFormatter(logging.Formatter(LOG_FORMAT.format(rank=rank)))
    logging.getLogger().addHandler(handler)
    FILE_LOG.addHandler(handler)


# What in the environment changes a run (train.log holds it): the names that begin with these.
ENVIRONMENT = ("CUDA_", "NCCL_", "OMP_", "PYTORCH_", "TORCH_", "WANDB_", "TORCHELASTIC_", "RANK",
               "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT",
               "GROUP_RANK", "ROLE_RANK")


def environment():
    """NAME=value of each ENVIRONMENT variable, secrets left out (KEY=<set>, https://<set>@host)."""
    return " ".join(f"{name}=" + ("<set>" if any(word in name.upper() for word in (
        "KEY", "TOKEN", "SECRET", "PASS", "CREDENTIAL", "AUTH")) else shlex.quote(
        re.sub(r"//[^/@]*@", "//<set>@", value)))
        for name, value in sorted(os.environ.items()) if name.startswith(ENVIRONMENT))


def start_wandb(flags, run_id, exp_dir):
    """The Weights & Biases run (``run_id``: resumed; None: new), ``flags`` its config; a start
    that fails (no login, no network, a bad WANDB_* setting): an OSError saying what to do."""
    import wandb
    try:
        return wandb.init(project=flags["wandb_project"], name=flags["experiment_name"],
                          id=run_id, resume="allow", dir=exp_dir, config=flags, mode=flags["wandb"])
    except (wandb.errors.Error, ValueError) as e:
        raise OSError(f"--wandb {flags['wandb']}: Weights & Biases did not start ("
                      f"{' '.join(str(e).split())[:300]}). Check the WANDB_* environment "
                      "variables; log in (`wandb login`), or train with --wandb offline and "
                      "upload the run later with `wandb sync`.") from e


def wandb_holds(run, exp_dir):
    """The last step the wandb run ``run`` holds as this start begins: online, the server says;
    offline, what wandb_records reads of its earlier segments here (`wandb sync` joins them)."""
    if not run.offline:
        return max(run.starting_step - 1, 0)
    from wandb.proto.wandb_internal_pb2 import Record
    folders = [*(exp_dir / "wandb").glob(f"offline-run-*-{run.id}"),  # (-N: the same second's)
               *(exp_dir / "wandb").glob(f"offline-run-*-{run.id}-[0-9]*")]
    segments = [s / f"run-{run.id}.wandb" for s in folders if s != Path(run.dir).parent]
    return max((r.history.step.num for path in segments for r in wandb_records(path, Record)
                if r.HasField("history")), default=0)


def wandb_records(path, record):
    """The records of a wandb transaction log (LevelDB's format: 32 KiB blocks of chunks, each
    with a CRC-32, length and type, after the file's own 7 bytes), up to a kill's torn chunk; a
    damaged chunk costs the rest of its block (as LevelDB reads it) and one warning."""
    data = path.read_bytes() if path.exists() else b""
    at, part, damaged = 7, None, None
    while at + 7 <= len(data):
        room = 32768 - at % 32768
        if room < 7:  # a block's tail too short for a header is padding
            at += room
            continue
        crc, length, kind = struct.unpack("<IHB", data[at:at + 7])
        end = at + 7 + length
        if end > len(data) and 7 + length <= room or kind == 0 and not data[at:].strip(b"\0"):
            break  # cut off by a kill, or zeros to the end
        if 7 + length > room or kind > 4 or zlib.crc32(data[at + 6:end]) != crc:
            damaged, part, at = damaged or at, None, at + room
            continue
        chunk, at = data[at + 7:end], end
        part = chunk if kind in (1, 2) else None if part is None else part + chunk
        if kind in (1, 4) and part is not None:  # a whole record, or a record's last chunk
            yield record.FromString(part)
    if damaged:
        LOGGER.warning(f"{path} is damaged at byte {damaged}: the wandb records there are "
                       "skipped, the others read (the file is left as it is)")


def metric_lines(path):
    """metrics.jsonl's lines, each with its step's record (None: a note a user added)."""
    lines = path.read_text(errors="replace").split("\n") if path and path.exists() else [""]
    for line in lines[:-1]:  # (the last: "" after the last newline, or a kill's torn line)
        record = None
        with contextlib.suppress(ValueError):
            record = json.loads(line)
        yield line, record if isinstance(record, dict) and isinstance(
            record.get("step"), int) else None


class MetricsLog:
    """Where each step's metrics go: metrics.jsonl (rank 0), Weights & Biases, the progress bar,
    a log line when there is more than the loss to say. Remove wandb here and only here."""

    def __init__(self, exp_dir, args, state, rank):
        # Opened at the first line, once discard_after_checkpoint has set an old file aside.
        self.path, self.file = exp_dir / "metrics.jsonl" if rank == 0 else None, None
        self.wandb, self.unsent, self.lines, self.last, self.held = None, [], [], None, 0
        self.queue, self.sender = queue.SimpleQueue(), None  # (send)
        if rank == 0 and args.wandb != "disabled":
            import wandb  # here, not at the top: a second of start-up that most tests skip
            self.wandb = wandb
            try:  # (the id in state.json: a resumed run goes on with the same curve)
                run = start_wandb(vars(args), state["wandb_run_id"], exp_dir)
            except OSError as e:
                sys.exit(f"{e} Nothing was changed.")
            state["wandb_run_id"], self.held = run.id, wandb_holds(run, exp_dir)
            # Every step once: what wandb lost is sent again, what it holds not twice (send).
            self.unsent = [r for _, r in metric_lines(self.path)
                           if r and self.held < r["step"] <= state["global_step"]]
            self.send()
        atexit.register(self.close, finish=False)  # a run that dies writes and sends the rest
        self.progress = tqdm.tqdm(initial=state["global_step"], total=args.max_steps,
                                  desc="train", disable=rank != 0, mininterval=0.5)

    def write_steps(self, steps, domains, state):
        """Each step read ([(numbers, metrics)]) as its line: every number but "stop", each
        domain's loss and tokens so far (kept in ``state``, with the losses for the mixer)."""
        for numbers, metrics in steps:
            scalars = {k: v for k, v in numbers.items()
                       if k != "stop" and not k.startswith("domain_")}
            metrics = {"step": metrics["step"], **scalars} | metrics
            losses = [total / n if n else None for total, n in
                      zip(numbers.get("domain_loss", ()), numbers.get("domain_tokens", ()))]
            seq_length = state["config"]["seq_length"]
            for name, loss, n in zip(domains, losses, numbers.get("domain_sequences", ())):
                tokens = state["domain_tokens"].get(name, 0) + int(n) * seq_length
                metrics[f"mix/tokens_{name}"] = state["domain_tokens"][name] = tokens
                if loss is not None:
                    metrics[f"mix/loss_{name}"] = loss
            if domains:  # for the mixer, after the next step (data.learn_late)
                state["domain_losses"] = [metrics["step"], losses]
            self.write(metrics)

    def write(self, metrics):
        """A step's line, kept until flush(): at each log line and before each checkpoint."""
        self.lines.append(json.dumps(metrics) + "\n")
        self.unsent.append(metrics)
        self.last = metrics
        if "tokens_per_s" in metrics or "val_loss" in metrics:
            self.flush()
            LOGGER.info(format_metrics(metrics))
        self.progress.set_postfix(loss=f"{metrics['loss']:.3f}", refresh=False)
        self.progress.update(1)  # (redrawn at most twice a second: mininterval)

    def flush(self):
        """The lines kept so far to metrics.jsonl and the metrics to wandb."""
        lines, self.lines = self.lines, []  # (tried once, even at exit)
        if self.path and lines:
            self.file = self.file or open(self.path, "ab", buffering=0)
            data, size = "".join(lines).encode(), os.fstat(self.file.fileno()).st_size
            self.last_at = size + len(data) - len(lines[-1].encode())  # (for rewrite_last)
            try:
                while data:
                    data = data[self.file.write(data):]
            except OSError as e:  # no torn line stays behind; the failure is one paragraph
                with contextlib.suppress(OSError):
                    os.truncate(self.file.name, size)
                raise write_failure(self.file.name, e) from e
        self.send()

    def send(self):
        """Every step's metrics to wandb by a thread of ours, an interval's at a time (DESIGN 6)."""
        if self.wandb and self.sender is None:
            self.sender = threading.Thread(target=self.send_queued, name="wandb", daemon=True)
            self.sender.start()
        for metrics in self.unsent if self.wandb else ():
            if metrics["step"] > self.held:
                self.queue.put({k: v for k, v in metrics.items() if v is not None})
        self.unsent = []

    def send_queued(self):
        """The sender thread: each step's metrics, no None (MFU on a CPU), to wandb in order."""
        while (metrics := self.queue.get()) is not None:
            try:
                self.wandb.log(metrics, step=metrics["step"])
            except Exception as e:  # (metrics.jsonl has every step: training goes on)
                LOGGER.warning(f"wandb did not take step {metrics['step']}: {first_line(e)}")

    def rewrite_last(self, more):
        """The last step's line again, now with ``more`` in it (a late validation)."""
        self.last = self.last | {k: v for k, v in more.items() if k != "stopped"}  # (cut short)
        if not self.lines and self.file:  # written: cut off, to be written again
            os.truncate(self.file.name, self.last_at)
        self.lines[-1:] = [json.dumps(self.last) + "\n"]
        self.unsent[-1:] = [self.last]
        self.flush()
        LOGGER.info(format_metrics(self.last))

    def close(self, finish=True):
        """Writes and sends what is left (at exit after a failure, wandb's own handler finishes)."""
        self.flush()
        self.progress.close()
        if self.file:
            self.file.close()
        if self.wandb:
            self.queue.put(None)
            self.sender.join()
            if finish:
                self.wandb.finish()
            self.wandb = None


# --- How a run ends: signals, the loop's reasons, a failure in one paragraph (cli) ---------------

def done_message(state, run_dir):
    """What a run that trained to its end says last."""
    return (f"Done: {state['global_step']} steps, {state['tokens_seen']:,} tokens. For "
            f"transformers: python scripts/export_hf.py {shlex.quote(str(run_dir))}")


def stop_on_signals(stop):
    """From here on SIGTERM and Ctrl-C only set ``stop`` (DESIGN.md section 7)."""
    def handler(signum, frame):
        stop.set()
        signal.signal(signum, signal.SIG_DFL)

    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, handler)


def nothing_to_train(batches, tokenizer, args, ctx):
    """Why a new run's first step has nothing to learn (only special tokens: empty documents,
    or records whose text is not where the kit reads it), or None. Agreed by all ranks."""
    special = torch.tensor(sorted(set(tokenizer.all_special_ids)), dtype=torch.long)
    targets = [b["labels"] if "labels" in b else b["input_ids"] for b in batches]
    scored = [t[:, 1:][t[:, 1:] != -100] for t in targets]  # each token's next one
    if any_rank(any((~torch.isin(t, special)).any() for t in scored), ctx):
        return None
    return (f"Nothing to train on: the first step's sequences hold only special tokens "
            f"({tokenizer.convert_ids_to_tokens(special.tolist())}). The records of "
            f"--dataset {args.dataset} are empty, or their text is not where the kit "
            "reads it ('text'; with --task sft 'instruction'/'output' or 'messages'), "
            "or (--task sft) --seq-length cuts every answer off.")


def too_little_data(args):
    """Why a new run whose data ran out before its first step stops."""
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    tokens = world_size * args.grad_accum * args.batch_size * args.seq_length
    return (f"The data ran out before the first step: --dataset {args.dataset} holds fewer "
            f"than the {tokens:,} tokens of one step ({args.batch_size} x {args.grad_accum} x "
            f"{world_size} sequences of {args.seq_length} tokens) per pass (--epochs "
            f"{args.epochs}). Use more data, more --epochs, or a smaller "
            "--batch-size/--seq-length.")


def diverged(step, numbers, last):
    """Why a run stops at a loss or gradient norm that is not finite (``last``: its newest
    checkpoint): its weights are garbage, the last good checkpoint is the one to go on from."""
    last = f"the last good one is {last}" if last else "none was saved yet"
    return (f"Step {step}: loss {numbers['loss']}, gradient norm {numbers['grad_norm']}. "
            f"Stopping without a checkpoint (the weights are garbage now); {last}. Lower --lr "
            "or raise --warmup-steps.")


def cli(main):
    """Run ``main``: a failure the user can mend ends in one paragraph, a bug in a traceback
    (train.log gets both); a start that fails before training leaves no new run directory."""
    try:
        main()
    except SystemExit as e:  # a refusal (its paragraph) or a plain exit
        if isinstance(e.code, str):
            FILE_LOG.error(e.code)
            tell_torchrun(e.code)
        if e.code:
            forget_failed_start()
        raise
    except BaseException as e:  # (BaseException: Ctrl-C before training has begun too)
        message = expected_failure(e)
        FILE_LOG.error(message or "Failed", exc_info=True)
        forget_failed_start()
        if message is None or "--debug" in sys.argv[1:]:
            raise
        tell_torchrun(message, cause=not peer_gone(e))
        sys.exit(message)
    finally:  # leaving: a signal now (torchrun stopping the other ranks) ends the exit as it is
        for signum in (signal.SIGTERM, signal.SIGINT):
            signal.signal(signum, signal.SIG_DFL)


def expected_failure(error):
    """The paragraph that ends a run on a failure the user can mend, or None for a bug (which
    keeps its traceback): bad data, a missing or unreadable file, a full disk, no memory."""
    before = RUN is None or not RUN.training
    if before and (RUN is None or RUN.dir in RUN.created):
        stopped = "Stopped before training began; nothing was kept"
    elif RUN.dir.is_dir() and _step_dirs(RUN.dir, complete=True):
        stopped = "Stopped; the last checkpoint is untouched"
    else:
        stopped = "Stopped before " + ("training began" if before else "the first checkpoint")
    if peer_gone(error):  # the rank that failed says why in its own paragraph
        return (f"rank {os.environ.get('RANK', 0)}: stopped because another rank failed or "
                "stopped answering (see its message; --debug shows this rank's traceback)")
    if memory := out_of_memory(error, stopped):
        return memory
    if isinstance(error, (data.DataError, OSError)):  # bad data, a file, a full disk
        where = "--debug" if before else "--debug, or rank 0's train.log,"
        return (f"{type(error).__name__}: {error}\n({stopped}. {where} shows where this came "
                "from.)")
    if before and isinstance(error, ValueError) and any(  # a model's own check of its config
            f"transformers{os.sep}models{os.sep}" in f.filename for f in
            traceback.extract_tb(error.__traceback__)[-1:]):
        return (f"The model's config is one transformers cannot build: {error} (--model-name, "
                f"or --init-from's config.json)\n({stopped}.)")
    return None


def out_of_memory(error, stopped):
    """The paragraph of an allocation that failed, or None: what was asked for, where (the kit's
    innermost frame), the limit it ran into (ulimit -v counts every mapping), the way on."""
    text = (str(error).strip() or type(error).__name__).splitlines()[-1][:300]
    gpu = isinstance(error, torch.OutOfMemoryError)  # (on the CPU torch's is a RuntimeError)
    if isinstance(error, RuntimeError) and "can't start new thread" in text:
        text = f"a new thread's stack could not be allocated ({text})"
    elif not (gpu or "can't allocate memory" in text or isinstance(error, (
            MemoryError, OSError)) and getattr(error, "errno", errno.ENOMEM) == errno.ENOMEM):
        return None
    if kit := [(f.f_code, n) for f, n in traceback.walk_tb(error.__traceback__)
               if Path(f.f_code.co_filename).resolve().parent == KIT]:
        code, line = kit[-1]  # the kit's innermost frame
        name, qualname = Path(code.co_filename), getattr(code, "co_qualname", code.co_name)
        if "mmap(" in linecache.getline(code.co_filename, line):
            text = f"a shared memory mapping could not be made ({text})"
        text += f", in {name.stem}.{qualname} ({name.name}:{line})"
    limit = resource.getrlimit(resource.RLIMIT_AS)[0]
    way = "Use less memory" if gpu or limit == resource.RLIM_INFINITY else (
        f"This process may map {limit / GiB:.2f} GiB at most (ulimit -v), every mapping "
        "counted (threads' stacks, shared memory), not only memory in use: raise that limit (a "
        "container's memory limit bounds the memory itself), or use less")
    return (f"Out of memory: {text}.\n({stopped}. {way}: halve --batch-size and double "
            "--grad-accum (the global batch, and so the run, stays the same), or pass "
            "--activation-checkpointing, or a smaller --seq-length.)")


def peer_gone(error):
    """Whether ``error`` is a collective that failed because another rank exited or hung: gloo
    says so in a RuntimeError, NCCL (ncclRemoteError) and the TCP store in a DistError."""
    return int(os.environ.get("WORLD_SIZE", 1)) > 1 and isinstance(error, RuntimeError) and \
        any(words in str(error).lower() for words in (
            "connection closed by peer", "connection reset by peer", "broken pipe", "timed out",
            "remote process exited"))


def tell_torchrun(message, cause=True):
    """Under torchrun, ``message`` into this rank's error file, for torchrun's table of failures;
    a rank stopped by another's failure dates it a second later: never taken for the cause."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    when = str(int(time.time()) + (0 if cause else 1))
    if path:  # (the format of torch.distributed.elastic's ErrorHandler.record_exception)
        with contextlib.suppress(OSError):
            Path(path).write_text(json.dumps(
                {"message": {"message": message, "extraInfo": {"timestamp": when}}}))


def forget_failed_start():
    """Remove what a start that failed before training made (train.log, the lock, each new
    directory while it is empty): a mistyped flag leaves nothing behind."""
    if RUN is None or not RUN.created or RUN.training:
        return
    for path in RUN.created:  # its new files, the run's own directory, then its new parents
        try:
            path.rmdir() if path.is_dir() else path.unlink()
        except FileNotFoundError:
            continue
        except OSError:  # not empty: someone else's now
            return


# --- Measuring: time, memory, MFU, the profiler, the step's numbers ------------------------------

class Timer:
    """Adds up the wall-clock seconds that the training thread spends in ``with timer:``."""
    total = 0.0

    def __enter__(self):
        self.start = time.perf_counter()

    def __exit__(self, *exc):
        self.total += time.perf_counter() - self.start

    def pop(self):  # the seconds since the last pop()
        total, self.total = self.total, 0.0
        return total


class Throughput:
    """tokens/s, MFU, data wait, ``timers``, memory: since the last call (DESIGN.md 7)."""

    def __init__(self, timers, tokens_seen, flops_per_token, ctx):
        name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
        peak = next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in name), None)
        self.most = peak and peak * ctx.world_size / flops_per_token  # tokens/s at 100% MFU
        self.timers, self.device = timers, ctx.device
        self.tokens, self.start = tokens_seen, time.perf_counter()
        if ctx.device.type == "cuda":  # the peaks of training alone, from an empty cache
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(ctx.device)

    def metrics(self, tokens_seen):
        now, spent = time.perf_counter(), {name: t.pop() for name, t in self.timers.items()}
        seconds, tokens = now - self.start, tokens_seen - self.tokens
        self.tokens, self.start = tokens_seen, now
        return {"tokens_per_s": tokens / seconds, "data_wait": spent.pop("data") / seconds,
                "mfu": tokens / seconds / self.most if self.most else None,
                **{f"time/{k}_s": v for k, v in spent.items()}, **memory_stats(self.device)}


def memory_stats(device):
    """Peak memory since the last call, in GiB, and allocator trouble counters on CUDA."""
    if device.type == "cuda":
        stats = torch.cuda.memory_stats(device)
        torch.cuda.reset_peak_memory_stats(device)
        return {
            "mem/active_peak_gib": stats["active_bytes.all.peak"] / GiB,
            "mem/reserved_peak_gib": stats["reserved_bytes.all.peak"] / GiB,
            # Retries: the allocator freed its cache to try again (fragmentation, near OOM).
            "mem/alloc_retries": stats["num_alloc_retries"],
            "mem/ooms": stats["num_ooms"],
        }
    # On CPU: the peak resident set size of the process (kilobytes on Linux, bytes on macOS).
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"mem/peak_rss_gib": peak * (1 if sys.platform == "darwin" else 1024) / GiB}


# Dense bf16 tensor-core peaks in FLOP/s (vendors' data sheets, no sparsity), matched against the
# device's name in this order: specific names first ("H100 NVL" before "H100", "L40S" before "L4").
PEAK_BF16_FLOPS = {
    "B200": 2250e12,
    "GH200": 989e12,
    "H200 NVL": 835e12,
    "H200": 989e12,  # SXM
    "H100 NVL": 835e12,
    "H100 PCIe": 756e12,
    "H100": 989e12,  # SXM
    "A100": 312e12,
    "L40S": 362e12,
    "L40": 181e12,
    "L4": 121e12,
    "RTX 4090": 165e12,
}


def format_metrics(m):
    """One log line of a metrics dict."""
    line = f"step {m['step']} | loss {m['loss']:.4f} | lr {m['lr']:.2e}"
    if "val_loss" in m:
        line += f" | val loss {m['val_loss']:.4f}"
    if "tokens_per_s" in m:
        memory = " ".join(f"{k[4:]} {v:.3g}" for k, v in m.items() if k.startswith("mem/"))
        mfu = f"{m['mfu']:.1%}" if m["mfu"] is not None else "n/a"
        spent = "".join(f" | {k[5:-2]} {v:.2f} s" for k, v in m.items() if k[:5] == "time/" and v)
        line += (f" | {m['tokens_per_s']:,.0f} tok/s | data wait {m['data_wait']:.1%}{spent}"
                 f" | MFU {mfu} | {memory}")
    line += "".join(f" | {k[5:]} {v:.4g}" for k, v in m.items()
                    if k[:5] == "eval/" and not k.endswith("_stderr"))
    if "sample" in m:
        line += f" | sample {m['sample']!r}"
    return line


def flops_per_token(model, seq_length):
    """Training FLOPs per token: 6N + 12·L·H·Q·T (PaLM, appendix B; N without an untied input
    embedding; L layers, H heads of size Q, T tokens). No transformers config: 6N."""
    n = sum(p.numel() for p in model.parameters())
    config = getattr(model, "config", None)
    if config is None or not hasattr(model, "get_input_embeddings"):
        return 6 * n
    embedding = model.get_input_embeddings().weight
    output = model.get_output_embeddings()
    if output is None or output.weight is not embedding:
        n -= embedding.numel()
    heads = config.num_attention_heads
    head_dim = config.hidden_size // heads
    return 6 * n + 12 * config.num_hidden_layers * heads * head_dim * seq_length


class Profiler(contextlib.AbstractContextManager):
    """--profile-steps A:B: each rank's trace in RUN/profile/ (DESIGN.md section 7)."""

    def __init__(self, steps, run_dir, ctx):
        self.first, self.last = steps or (0, -1)
        self.dir, self.ctx, self.prof = Path(run_dir) / "profile", ctx, None

    def step(self, step):
        if self.prof is not None:
            self.prof.step()
            self.prof = self.prof if step <= self.last else None
        elif self.first - 1 <= step <= self.last:
            warmup = int(step < self.first)  # (a run resumed inside A..B records the rest)
            self.steps = step + warmup, self.last
            cuda = [torch.profiler.ProfilerActivity.CUDA] if self.ctx.device.type == "cuda" else []
            self.prof = torch.profiler.profile(
                activities=[torch.profiler.ProfilerActivity.CPU, *cuda], on_trace_ready=self.write,
                schedule=torch.profiler.schedule(wait=0, warmup=warmup, repeat=1,
                                                 active=self.last - step + 1 - warmup))
            self.prof.start()

    def __exit__(self, error, *_):
        if self.prof is not None and error is None:  # the loop ended inside A..B
            self.prof.stop()

    def write(self, prof):
        """The trace; rank 0 logs each rank's seconds to write it, each range's ms per step."""
        path = self.dir / "rank{}-steps{}-{}.json".format(self.ctx.rank, *self.steps)
        start = time.perf_counter()
        self.dir.mkdir(parents=True, exist_ok=True)
        prof.export_chrome_trace(str(path))
        seconds = [time.perf_counter() - start] * self.ctx.world_size
        if self.ctx.distributed:
            torch.distributed.monitored_barrier(self.ctx.cpu_group, datetime.timedelta(minutes=30))
            torch.distributed.all_gather_object(seconds, seconds[0], group=self.ctx.cpu_group)
        gpu, ranges = self.ctx.device.type == "cuda", {e.key: e for e in prof.key_averages()}
        ranges["step"] = ranges.get("ProfilerStep*")  # (torch.profiler's range of each step)
        table = [f"{'ms per step':12}{'host':>8}" + ("     GPU" if gpu else "")]
        for phase in ("data", "forward", "backward", "update", "step"):
            if ranges.get(phase):
                times = [ranges[phase].cpu_time_total, ranges[phase].device_time_total][:1 + gpu]
                table.append(f"{phase:12}" + "".join(
                    f"{t / ranges['step'].count / 1e3:8.2f}" for t in times))
        LOGGER.info(f"Profile of steps {self.steps[0]} to {self.steps[1]} in {self.dir}, written "
                    "in " + ", ".join(f"{s:.2f} s (rank {r})" for r, s in enumerate(seconds)) +
                    "\n" + "\n".join(table))


class StepNumbers:
    """Each step's numbers, all-reduced and read a step late: no GPU wait (DESIGN.md 7)."""

    def __init__(self, ctx):
        self.world_size, self.device, self.queue = ctx.world_size, ctx.device, []

    def add(self, stats, metrics):  # (once the step's work is queued)
        flat = torch.cat([value.detach().float().reshape(-1) for value in stats.values()])
        if self.world_size > 1:
            torch.distributed.all_reduce(flat)
        host = flat.to("cpu", non_blocking=True)  # from a GPU: into pinned memory, no wait
        done = torch.Event(self.device) if self.device.type != "cpu" else None
        if done:
            done.record()  # (after the copy, on its stream)
        self.queue.append((host, done, {k: v.shape for k, v in stats.items()}, metrics))

    def ready(self, wait=False):
        """[(numbers, metrics)] of every step but the newest (its numbers may be computing
        still), or of all if ``wait``, oldest first; a vector's numbers are a list."""
        steps, self.queue = (self.queue, []) if wait else (self.queue[:-1], self.queue[-1:])
        return [self.read(*step) for step in steps]

    def read(self, host, done, shapes, metrics):
        if done:
            done.synchronize()  # (a step late: long done, unless the host is far ahead)
        parts = host.split([shape.numel() for shape in shapes.values()])
        return {name: part.view(shape).tolist()
                for (name, shape), part in zip(shapes.items(), parts)}, metrics


# --- The process: deterministic kernels, freed memory kept, garbage collection -------------------

def deterministic():
    """Deterministic CUDA kernels (DESIGN.md section 3): cuBLAS's fixed workspace, set before
    its first use; attention on the math kernel (the fast ones add up in a varying order)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True, warn_only=True)
    for kernel in ("flash", "mem_efficient", "cudnn"):
        getattr(torch.backends.cuda, f"enable_{kernel}_sdp")(False)


def keep_freed_memory():
    """glibc keeps freed blocks for the next step, none unmapped (DESIGN.md section 6)."""
    mallopt = getattr(ctypes.CDLL(None), "mallopt", None) if sys.platform == "linux" else None
    if mallopt:
        mallopt(-4, 0)  # M_MMAP_MAX: no block from mmap
        mallopt(-1, 2**31 - 1)  # M_TRIM_THRESHOLD: never shrink the heap's free top


class GarbageCollection:
    """Python's automatic GC off (a pause in a random step; with many ranks, a straggler all
    others wait for), and a full collection every ``freq`` steps instead."""

    def __init__(self, freq):
        self.freq = freq
        gc.disable()
        gc.collect()
        gc.freeze()  # what exists now lives for the whole run: no later collection scans it

    def step(self, step):
        if step % self.freq == 0:
            gc.collect()  # all generations: what survives long enough to be old is still freed


# --- Distributed: torchrun, the process group, collectives ---------------------------------------

def die_with_parent():
    """Ask Linux to kill this rank with torchrun (its ranks run in sessions of their own): else a
    killed torchrun would leave them training on as orphans, beside the run that resumes it."""
    if sys.platform.startswith("linux"):
        parent = os.getppid()
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # 1 = PR_SET_PDEATHSIG
        if os.getppid() != parent:  # the parent died before we asked
            os._exit(1)


def gradient_sync(model, enabled):
    """Backward averages gradients across ranks iff ``enabled`` (DDP: no_sync(), FSDP2)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(enabled)
    elif hasattr(model, "no_sync") and not enabled:  # DDP
        return model.no_sync()
    return contextlib.nullcontext()


def rehearse(model, ctx, step):
    """``step()`` (a forward and backward) run and undone where DDP resumes: it lays its buckets out
    as that backward readies them, and 3+ ranks' sums round by the layout (DESIGN.md 7)."""
    if isinstance(model, torch.nn.parallel.DistributedDataParallel):
        with torch.random.fork_rng([ctx.device] if ctx.device.type == "cuda" else []):
            step()
        model.zero_grad(set_to_none=True)


def any_rank(flag, ctx):
    """True on every rank iff ``flag`` is true on some rank: one all-reduce on the CPU."""
    if not ctx.distributed:
        return bool(flag)
    flag = torch.tensor(float(bool(flag)))
    torch.distributed.all_reduce(flag, op=torch.distributed.ReduceOp.MAX, group=ctx.cpu_group)
    return bool(flag.item())


def plain_tensor(tensor):
    """A plain tensor of a DTensor (what FSDP2's gradient norm is), else the tensor itself."""
    return tensor.full_tensor() if hasattr(tensor, "full_tensor") else tensor


def join_process_group(backend, rank, world_size, dist_timeout, device):
    """torch.distributed.init_process_group, bounded by ``dist_timeout`` (30 s at least) under
    torchrun (DESIGN.md section 4). Until the first step collectives wait 30 minutes."""
    env = os.environ
    if "MASTER_ADDR" not in env:
        sys.exit("--fsdp needs torchrun: torchrun --nproc-per-node N train_llm.py ...")
    timeout = datetime.timedelta(seconds=max(dist_timeout, 30))
    device_id = device if device.type == "cuda" else None
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        torch.distributed.init_process_group(backend, timeout=timeout, device_id=device_id)
    else:
        store = torch.distributed.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]),
                                           is_master=False, timeout=timeout)
        prefix = f"train_llm/restart-{env.get('TORCHELASTIC_RESTART_COUNT', 0)}/world-{world_size}"
        torch.distributed.init_process_group(
            backend, store=torch.distributed.PrefixStore(prefix, store), rank=rank,
            world_size=world_size, timeout=timeout, device_id=device_id)
    set_collective_timeout(30 * 60)


def set_collective_timeout(seconds):
    """How long a collective waits for the other ranks before the process fails (if any)."""
    if torch.distributed.is_initialized():
        from torch.distributed.distributed_c10d import _set_pg_timeout  # (torch 2.13: private)
        _set_pg_timeout(datetime.timedelta(seconds=seconds))


# --- A checkpoint's states besides the model: RNGs, lists of state_dicts -------------------------

def rng_state(device):
    """Every global RNG state in types weights_only loads; on a GPU this rank's device's only."""
    name, keys, *rest = np.random.get_state()  # rest: position, the cached gaussian
    return {
        "python": random.getstate(),  # a tuple of ints
        "numpy": (name, torch.from_numpy(keys.astype(np.int64)), *rest),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state(device) if device.type == "cuda" else None,
    }


def set_rng_state(state):
    random.setstate(state["python"])
    name, keys, *rest = state["numpy"]
    np.random.set_state((name, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])  # the current device's


def states(objs):
    """The state_dict() of ``objs``: of one alone as torch.optim saves it; of several, a list."""
    return objs[0].state_dict() if len(objs) == 1 else [obj.state_dict() for obj in objs]


def load_states(objs, saved, name):
    """Loads into ``objs`` what ``states`` saved (checkpoint file ``name``): as many of them."""
    saved = saved if isinstance(saved, list) else [saved]
    if len(saved) != len(objs):
        sys.exit(f"The checkpoint's {name} holds {len(saved)} state(s) and the script builds "
                 f"{len(objs)}: it was saved by another build_optimizers. Put that one back, or "
                 "start a new --experiment-name. Nothing was changed.")
    for obj, state in zip(objs, saved):
        obj.load_state_dict(state)


# --- Models: unwrap, the checks before training, a pretrained model (trained.py: a trained one) --

def unwrap(model):
    """The model itself, without DDP's wrapper: its state_dict() keys are the plain ones."""
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def parameter_count(model):
    """Every parameter (all experts, frozen ones), and the trained ones where some are frozen."""
    total = sum(p.numel() for p in model.parameters())
    trained = sum(p.numel() for p in model.parameters() if p.requires_grad)
    return f"{total / 1e6:.2f}M parameters" + (
        f", {trained / 1e6:.2f}M of them trained" if trained != total else "")


def aux_loss_weight(model):
    """The weight of a model's own loss term (its output's aux_loss), which transformers' MoE
    models keep unapplied: router_aux_loss_coef (JetMoE: aux_loss_coef), else 1."""
    holders = (unwrap(model), getattr(unwrap(model), "config", None))
    return next((getattr(h, name) for h in holders for name in ("router_aux_loss_coef",
                 "aux_loss_coef") if getattr(h, name, None) is not None), 1)


def check_model(model, tokenizer, args, trained=None):
    """What the tokenizer, --seq-length and the flags need of the model, before any training
    (``trained``: --init-from's tokenizer); a model of your own is told what needs transformers."""
    config = getattr(model, "config", None)
    if config is not None:
        config.use_cache = False  # training never reads a KV cache: none is built
    vocab = getattr(config, "vocab_size", None)
    if trained and trained != args.tokenizer and tokenizer.get_vocab() != pretrained(
            type(tokenizer), trained, "the tokenizer of --init-from").get_vocab():
        sys.exit(f"--tokenizer {args.tokenizer} is not the tokenizer that --init-from "
                 f"{args.init_from} was trained with ({trained}): their tokens differ, so its "
                 "weights would read other words. Leave --tokenizer out (a run from another's "
                 "weights uses that run's tokenizer), or pass that one.")
    if vocab and len(tokenizer) > vocab:
        sys.exit(f"The tokenizer has {len(tokenizer)} tokens but the model only {vocab} "
                 "embeddings: pick a matching --model-name.")
    if getattr(config, "output_router_logits", False) and args.task == "sft":
        sys.exit("--task sft packs samples into sequences, and the load-balancing loss of "
                 f"{type(model).__name__} (output_router_logits) does not take their attention "
                 "mask. Set output_router_logits to false in the model's config for SFT, or "
                 "train with --task pretrain.")
    positions = getattr(config, "max_position_embeddings", None)
    if positions and args.seq_length > positions:
        sys.exit(f"--seq-length {args.seq_length} is longer than the {positions} positions "
                 f"of --model-name {args.model_name}")
    from transformers import PreTrainedModel  # (imported by then: the script uses it)
    if args.activation_checkpointing and not isinstance(model, PreTrainedModel):
        sys.exit("--activation-checkpointing uses transformers' activation_checkpointing_enable"
                 f", which {type(model).__name__} (create_model) has not: wrap its blocks in "
                 "torch.utils.checkpoint.checkpoint instead, or leave the flag out.")


def skip_mask_checks(model):
    """Skip transformers' two GPU reads each forward (padding, packing; DESIGN.md 7)."""
    config = getattr(model, "config", None)
    layers = getattr(config, "layer_types", None) or (
        ["sliding_attention"] if getattr(config, "sliding_window", None) else ["full_attention"])
    if getattr(config, "_attn_implementation", None) != "sdpa" or set(layers) != {
            "full_attention"} or not getattr(config, "is_causal", True):
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS as ATTENTION
    ATTENTION.register(UNMASKED_SDPA, ATTENTION["sdpa"])
    model.set_attn_implementation(UNMASKED_SDPA)
    config.pad_token_id = None


def packed_mask(model, positions, device):
    """A packed batch's attention mask, made on the device as transformers makes it, for a
    model that skip_mask_checks switched; None for others, and for rows of one sample each."""
    config = getattr(unwrap(model), "config", None)
    if positions is None or getattr(config, "_attn_implementation", None) != UNMASKED_SDPA or \
            bool((positions.diff(dim=-1) == 1).all()):
        return None
    positions = positions.to(device, non_blocking=True)
    sample = (torch.diff(positions, prepend=positions[:, :1] - 1, dim=-1) != 1).cumsum(-1)
    causal = torch.ones(positions.shape[1], positions.shape[1], dtype=torch.bool,
                        device=device).tril()
    return (sample[:, None, :, None] == sample[:, None, None, :]) & causal


def _local(value):
    """The absolute path or pattern of local files ``value`` names, else None; the directories
    that exist escaped (a kit in kit[1]/: its data/sample/*/, not a glob's "k, i, t or 1")."""
    if not value or "://" in value:
        return None
    slash = "/" if value.endswith("/") else ""  # (abspath drops it)
    path = head = os.path.abspath(value) + slash
    if os.path.exists(value):
        return path
    while not os.path.isdir(head):
        head = os.path.dirname(head)
    for pattern in (glob.escape(head) + path[len(head):], path):
        if any(glob.glob(v) for v in braceexpand.braceexpand(pattern)):
            return pattern
    return None


def damaged(ckpt_dir, path, error, resume=False):
    """The paragraph for a checkpoint file that does not load, with the newest older complete
    checkpoint to pass instead, or (``resume``) the command that resumes from it."""
    text = (f"The checkpoint {ckpt_dir} is damaged: {path} does not load "
            f"({type(error).__name__}: {first_line(error)}). Nothing was changed or deleted.")
    step = int(ckpt_dir.name.removeprefix("step-"))
    older = [d for s, d in sorted(_step_dirs(ckpt_dir.parent.parent, True).items()) if s < step]
    if not older:
        return text + " No older complete checkpoint is left." + (
            " Start a new --experiment-name." if resume else "")
    text += f" The previous checkpoint {older[-1]} is complete."
    if not resume:
        return text + " Pass it instead."
    argv = [a for i, a in enumerate(sys.argv[1:], 1) if not a.startswith("--resume-from")
            and sys.argv[i - 1] != "--resume-from"]
    launcher = ["torchrun", "--nproc-per-node", os.environ["WORLD_SIZE"]] \
        if "LOCAL_RANK" in os.environ else ["python"]
    command = shlex.join([*launcher, sys.argv[0], *argv, "--resume-from", older[-1].name])
    return text + (" Resume from it (this discards what was logged after it) with:\n  "
                   f"cd {shlex.quote(os.getcwd())} && {command}")


def pretrained(cls, name, what, **kwargs):
    """``cls.from_pretrained(name)``, one clear error if it fails; a name that can only be a path
    (only_a_path) is not sent to the Hub: it would only wait for the network to fail."""
    if only_a_path(name):
        raise FileNotFoundError(f"{what} {name}: no such file or directory (looked from "
                                f"{os.getcwd()}; a name that begins with a directory there is "
                                "a path, not a Hub name)")
    try:
        loaded = cls.from_pretrained(name, **kwargs)
    except (OSError, ValueError) as e:  # ValueError: huggingface_hub's HFValidationError
        first = first_line(e) or type(e).__name__
        if os.path.exists(name):
            raise OSError(f"{what} {name}: a local directory that does not load ({first})") from e
        raise OSError(f"{what} {name!r}: not a local directory, and loading it as a Hugging "
                      f"Face Hub name failed ({first})") from e
    if hasattr(loaded, "get_vocab") and len(loaded) < 2:  # (a model's directory, say)
        raise OSError(f"{what} {name}: holds no tokenizer (no tokenizer.json, vocab.json or "
                      f"tokenizer.model: transformers made one of {len(loaded)} token)")
    return loaded


def only_a_path(name):
    """Whether ``name`` can only be a missing path (absolute, ./, ~, two /, outputs/typo)."""
    return not os.path.exists(name) and (os.path.isabs(name) or name.startswith((".", "~")) or
                                         name.count("/") > 1 or os.path.isdir(name.split("/")[0]))


# --- Checkpoints: the bytes written, and read back (layout: DESIGN.md section 3) -----------------

def load(path, device):
    # weights_only: a checkpoint is data, and unpickling arbitrary objects could run code.
    return torch.load(path, map_location=device, weights_only=True)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class DirectFile(contextlib.AbstractContextManager):
    """A file written past the page cache: O_DIRECT (how and why: DESIGN.md section 3)."""

    BLOCK, CHUNK = 4096, 8 << 20

    @classmethod
    def open(cls, path):
        try:
            return cls(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_DIRECT, 0o644))
        except (AttributeError, OSError):  # no O_DIRECT here, or not on this file system
            return open(path, "wb")

    def __init__(self, fd):
        self.fd, self.size, self.fill = fd, 0, 0
        self.buffers = [mmap.mmap(-1, self.CHUNK) for _ in range(2)]  # anonymous: page-aligned
        self.writer = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="direct-io")
        self.pending = None  # the helper's write in flight

    def write(self, data):
        data = memoryview(data).cast("B")
        done = 0
        while done < len(data):
            n = min(self.CHUNK - self.fill, len(data) - done)
            self.buffers[0][self.fill:self.fill + n] = data[done:done + n]
            self.fill, done = self.fill + n, done + n
            if self.fill == self.CHUNK:  # full: the helper writes it, the other one fills
                self._wait()
                self.pending = self.writer.submit(self._write_out, self.buffers[0], self.CHUNK)
                self.buffers.reverse()
                self.fill = 0
        self.size += done
        return done

    def _write_out(self, buffer, n):
        view = memoryview(buffer)[:n]
        while view:  # a short write is followed by one that raises (a full disk, say)
            try:
                view = view[os.write(self.fd, view):]
            except OSError as e:
                flags = fcntl.fcntl(self.fd, fcntl.F_GETFL)
                if e.errno != errno.EINVAL or not flags & os.O_DIRECT:
                    raise
                # O_DIRECT opened, other alignments wanted (some network file systems): cached
                fcntl.fcntl(self.fd, fcntl.F_SETFL, flags & ~os.O_DIRECT)

    def _wait(self):
        """Wait for the helper's write; raise its error."""
        pending, self.pending = self.pending, None
        if pending is not None:
            pending.result()

    def flush(self):
        """Write out what is gathered (padded to a block) and cut the file to its size."""
        self._wait()
        if self.fill:
            padded = -(-self.fill // self.BLOCK) * self.BLOCK
            self.buffers[0][self.fill:padded] = bytes(padded - self.fill)
            self._write_out(self.buffers[0], padded)
            self.fill = 0
            os.ftruncate(self.fd, self.size)

    def fileno(self):
        return self.fd

    def __exit__(self, *exc):
        self.writer.shutdown(wait=True)  # never a write in flight on a closed descriptor
        os.close(self.fd)  # (not the buffers: a failed write's traceback may hold a view)


def _write_file(path, write):
    """Write a file and push it to disk before anyone can rely on it."""
    try:
        with DirectFile.open(path) as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
    except (OSError, RuntimeError) as e:  # torch.save reports a full disk as a RuntimeError
        if (failure := write_failure(path, e)) is None:
            raise
        raise failure from e


def write_failure(path, error):
    """The OSError to raise for a write of ``path`` that failed, naming it, the cause and the
    free space; None if ``error`` is no failed write (a bug, which keeps its traceback)."""
    chain = [error]
    while chain[-1].__context__ is not None:
        chain.append(chain[-1].__context__)
    # torch.save says "write", safetensors "I/O error: ... (os error 28)".
    cause = next((c for c in chain if isinstance(c, OSError) or "write" in str(c)
                  or "os error" in str(c)), None)
    if cause is None:
        return None
    existing = next(p for p in [Path(path), *Path(path).parents] if p.exists())
    free = shutil.disk_usage(existing).free / GiB
    reason = str(cause).strip().splitlines()[-1] if str(cause).strip() else type(error).__name__
    mend = {errno.ENOSPC: "free some space", errno.EDQUOT: "free some space (a disk quota)",
            errno.EFBIG: "the file is larger than this process may write (ulimit -f) or the "
            "file system holds", errno.EACCES: "no permission to write there",
            errno.EPERM: "the file system refuses the write (a read-only or immutable file: "
            "chattr +i)", errno.EROFS: "the file system is read-only"}.get(
        getattr(cause, "errno", None), "free some space" if free < 1 else
        "check what the disk refuses (space, permissions, a file size limit: ulimit -f)")
    return OSError(f"writing {path} failed ({reason}); {free:.2f} GiB free on that disk: "
                   f"{mend}, and rerun the same command")


def save_tensors(obj, f):
    """torch.save without its zip's CRC-32s (0.6 s of CPU per 1.3 GB; DESIGN.md section 3)."""
    crc = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(False)
    try:
        torch.save(obj, f)
    finally:
        torch.serialization.set_crc32_options(crc)


def write_atomic(path, text):
    """Replace ``path`` with ``text`` so a reader sees the old or the new file, never half."""
    tmp = path.with_name(path.name + ".tmp")
    _write_file(tmp, lambda f: f.write(text.encode()))
    os.replace(tmp, path)
    _fsync_dir(path.parent)


def _step_dirs(exp_dir, complete=False):
    """{step: directory} of the checkpoints named as the kit names them (step-000400: a copy
    named step-400 is never deleted); ``complete``: those that carry their run state."""
    named = {d.name[5:]: d for d in (exp_dir / "checkpoints").glob("step-*")}
    return {int(n): d for n, d in named.items() if n.isascii() and n.isdigit() and
            n == f"{int(n):06d}" and (not complete or (d / "state.json").exists())}


# The per-rank files of a checkpoint (DESIGN.md section 3).
RNG_FILE, LOADER_FILE = "rng-rank{}.pt", "loader-rank{}.json"
KIT_STATES = ("model", "optimizer", "lr_scheduler")  # NAME.pt in a checkpoint (not FSDP's)


def checkpoint_writer(mode, ctx):
    """The BackgroundWriter that --checkpoint-writer asks for (DESIGN.md section 3)."""
    group = None
    if ctx.distributed:  # rank 0 may write for minutes while the others wait at a barrier
        group = torch.distributed.new_group(backend="gloo", timeout=datetime.timedelta(minutes=30))
    sync = mode == "sync" or (mode == "auto" and ctx.device.type != "cuda")
    return BackgroundWriter(sync=sync, pinned=ctx.device.type == "cuda", group=group,
                            log=LOGGER.info)


def save_checkpoint(run, files, writer, keep, rank):
    """Save this rank's ``files`` ({name: object}; "dcp": a state dict that every rank writes its
    shards of) as the checkpoint of the run's current step, through ``writer``."""
    state = run.state
    step, name = state["global_step"], f"checkpoints/step-{state['global_step']:06d}"
    if state["checkpoint"] == name:
        writer.wait()  # (that save may still be writing its own state.json)
        if rank == 0:
            write_atomic(run.dir / "state.json", json.dumps(state, indent=2))
        return
    if LOADER_FILE.format(rank) in files:
        state["epoch"] = data.source_epoch(files[LOADER_FILE.format(rank)])
    saved = json.loads(json.dumps(state))  # as of this step: the loop goes on changing `state`

    def write(files):  # (in the writer's thread)
        if "dcp" in files:
            shards = files.pop("dcp")
            files["dcp"] = lambda path: dcp.save(shards, checkpoint_id=path,
                                                 process_group=writer.group)
        write_checkpoint(run.dir, step, files, saved, keep=keep, rank=rank, barrier=writer.barrier)

    writer.submit(name, write, files)
    state["checkpoint"] = name  # complete once the writer is done (writer.wait)


class CheckpointReader(contextlib.AbstractContextManager):
    """The checkpoint a run resumes from (``with CheckpointReader(run, ctx) as ckpt:``); a file
    that does not load is one paragraph (DESIGN.md section 3), one that does is never damaged."""

    def __init__(self, run, ctx):
        self.run, self.ctx = run, ctx
        self.dir = run.dir / run.state["checkpoint"]
        self.name, self.loaded = None, False

    def path(self, name):
        self.name, self.loaded = name, False
        return self.dir / name

    def load(self, name, device=None):
        obj = load(self.path(name), device or self.ctx.device)
        self.loaded = True  # what fails from here on is the object it goes into
        return obj

    def load_loader(self, loader):
        """This rank's loader state; on another number of ranks, all ranks' merged (reshard)."""
        saved_world, ctx = self.run.state.get("world_size", 1), self.ctx
        ranks = [ctx.rank] if saved_world == ctx.world_size else range(saved_world)
        states = [json.loads(self.path(LOADER_FILE.format(r)).read_text()) for r in ranks]
        self.loaded = True
        if saved_world == ctx.world_size:  # (a changed --batch-size is fine: Batch has no state)
            return loader.load_state_dict(states[0])
        try:
            report = data.reshard(loader, states)
        except data.ConfigMismatch:
            raise  # __exit__ names the flag
        except ValueError as e:
            sys.exit(f"Cannot resume on {ctx.world_size} ranks what {saved_world} saved: {e}")
        LOGGER.info(f"Data of {saved_world} rank(s) moved to {ctx.world_size}: no document "
                    f"skipped or repeated; {report}")

    def load_extras(self, names):
        """The states of your own saved as NAME.pt (extra in train_llm.py). One of ``names`` that
        the checkpoint lacks is refused by name; one it holds that ``names`` lacks, a warning."""
        missing = [name for name in names if not (self.dir / f"{name}.pt").exists()]
        if missing:
            sys.exit(f"Cannot resume from {self.dir}: it holds no {missing[0]}.pt, the training "
                     f"state '{missing[0]}' that this script adds (it was saved without it). "
                     "Resume with the script that saved it, or start a new --experiment-name "
                     f"(--init-from {self.dir} keeps the weights). Nothing was changed.")
        dropped = sorted(p.stem for p in self.dir.glob("*.pt") if p.stem not in
                         (*KIT_STATES, *names) and not p.name.startswith("rng-rank"))
        if dropped:
            LOGGER.warning(f"{self.dir} holds training state that this script does not add "
                           f"to extra: {', '.join(f'{n}.pt' for n in dropped)}. Resuming "
                           "without it; the next checkpoints will not hold it.")
        return {name: self.load(f"{name}.pt", "cpu") for name in names}

    def load_rng(self):
        """This rank's RNG states (a rank that did not exist when it was saved: rank 0's)."""
        name = RNG_FILE.format(self.ctx.rank)
        return self.load(name if (self.dir / name).exists() else RNG_FILE.format(0), "cpu")

    def __exit__(self, kind, error, traceback):
        if isinstance(error, data.FilesChanged):  # the same flags, other files
            sys.exit(f"Cannot resume from {self.dir}: the files of --dataset changed since it "
                     f"was saved: {error}. Resuming would read the documents in another order "
                     "than the run's: put the old files back (or give a --dataset pattern that "
                     "matches only them), or train the new ones in a new --experiment-name. "
                     "Nothing was changed.")
        if isinstance(error, data.ConfigMismatch):  # not damage: a flag that shapes the data
            sys.exit(f"Cannot resume from {self.dir}: its loader state was made with other "
                     f"data arguments. {error} (In train_llm.py flags: max_chars is "
                     "--max-doc-chars, 0 for None; n_active_shards is --active-shards.)")
        if isinstance(error, data.DataError) or not isinstance(error, LOAD_ERRORS):
            return False
        if self.loaded and self.name.endswith(".pt"):  # the file is fine; the model differs
            sys.exit(f"Cannot resume from {self.dir}: {self.name} loads, but does not fit what "
                     f"this script built ({type(error).__name__}: {first_line(error)}). The "
                     "checkpoint is not damaged and nothing was changed: resume with the "
                     "create_model (and flags) that trained it, or start a new "
                     "--experiment-name.")
        sys.exit(damaged(self.dir, self.dir / self.name, error, resume=True))


# What a checkpoint file that does not load raises (dcp's is a BaseException).
LOAD_ERRORS = (OSError, RuntimeError, ValueError, EOFError, KeyError, pickle.UnpicklingError,
               dcp.CheckpointException)


def first_line(error):
    return str(error).strip().splitlines()[0] if str(error).strip() else ""


def write_checkpoint(exp_dir, step, files, state, keep, rank=0, barrier=lambda: None):
    """Write ``files`` ({name: object}; a function is called with its path: dcp.save) as
    checkpoints/step-NNNNNN in the order of DESIGN.md section 3 (every rank calls it)."""
    final = exp_dir / "checkpoints" / f"step-{step:06d}"
    tmp = final.with_name(final.name + ".tmp")
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)  # debris of a save that was killed
        tmp.mkdir(parents=True)
    barrier()
    for name, obj in files.items():
        if callable(obj):
            obj(tmp / name)
        elif name.endswith(".json"):
            text = obj if isinstance(obj, str) else json.dumps(obj)  # (staged: already text)
            _write_file(tmp / name, lambda f, text=text: f.write(text.encode()))
        else:
            _write_file(tmp / name, lambda f, obj=obj: save_tensors(obj, f))
    barrier()
    state = {**state, "checkpoint": str(final.relative_to(exp_dir))}
    if rank == 0:
        # Its own run state: a run whose state.json is lost or torn resumes from it alone.
        _write_file(tmp / "state.json", lambda f: f.write(json.dumps(state, indent=2).encode()))
        shutil.rmtree(final, ignore_errors=True)  # (a killed save's that state.json never named)
        os.rename(tmp, final)
        _fsync_dir(final.parent)
        write_atomic(exp_dir / "state.json", json.dumps(state, indent=2))
        own = {s: d for s, d in _step_dirs(exp_dir).items()
               if saved_by(d)[0] == state.get("run_id")}  # never another run's
        for _, old in sorted(own.items())[:-keep]:
            # Renamed at once, deleted by a thread: 1.3 GB took 0.2 s on a disk with discard.
            gone = old.rename(old.with_name(old.name + ".deleted"))
            threading.Thread(target=shutil.rmtree, args=(gone, True)).start()  # (exit waits)
    barrier()  # no rank runs ahead into a checkpoint that is not complete


class BackgroundWriter:
    """Writes checkpoints off the training path, one at a time (DESIGN.md section 3)."""

    def __init__(self, sync=False, pinned=False, group=None, log=print):
        # torch's stager keeps the CPU copies (pinned: a GPU's) from save to save, keyed by
        # storage (tied weights stay shared); its DefaultStager empties it (before torch 2.13).
        self.stager = StateDictStager(pin_memory=pinned)
        self.stager.pin_memory_min_bytes = 1  # (fused AdamW's steps too: unpinned, a copy blocks)
        self.stream = torch.cuda.Stream() if pinned and not sync else None  # the copies'
        self.sync, self.log, self.copied = sync, log, None  # copied: the event the copies end at
        self.group = group  # a process group for the writes' barriers (None: one process)
        self.thread, self.error = None, None

    def barrier(self):
        if self.group is not None:
            torch.distributed.barrier(group=self.group)

    def submit(self, name, write, files):
        """Write ``files`` with ``write``: here if ``sync``, else in the writer's thread, from CPU
        copies (a GPU's: made on a side stream while the next step computes)."""
        start = time.perf_counter()
        self.wait()
        staging = time.perf_counter()
        if self.sync:
            write(files)
            held = time.perf_counter() - start
            self.log(f"Saved {name} in {held:.2f} s (synchronously: training waited)")
            return
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream())  # this step's weights
        with torch.cuda.stream(self.stream):  # (None: a no-op)
            # JSON files go as text: the stager copies Python slowly (0.7 s, not 0.03 s).
            staged = self.stager.stage({name: json.dumps(obj) if name.endswith(".json") else obj
                                        for name, obj in files.items()},
                                       non_blocking=self.stream is not None)
        self.copied = self.stream and self.stream.record_event()
        held, now = time.perf_counter() - start, time.perf_counter()
        # The rest of the wait was for the save before (--ckpt-freq steps took less than it).
        self.log(f"Saving {name} in the background (training waited {held:.2f} s, "
                 f"{now - staging:.2f} s of it to stage the copies)")
        self.thread = threading.Thread(target=self._write, name="checkpoint-writer", daemon=True,
                                       args=(name, write, staged, self.copied, files))
        self.thread.start()

    def before_update(self):
        """Raise a failed write's error; hold the update (on the GPU) until the copies end."""
        if self.thread is not None and not self.thread.is_alive():
            self.wait()
        if self.copied is not None:
            torch.cuda.current_stream().wait_event(self.copied)
            self.copied = None

    def _write(self, name, write, staged, copied, files):
        start = time.perf_counter()
        try:
            if copied is not None:
                copied.synchronize()  # the copies are done (``files`` kept their sources alive)
            write(staged)
            self.log(f"Saved {name} (written in the background in "
                     f"{time.perf_counter() - start:.2f} s)")
        except BaseException as e:  # raised in the training thread (before_update, wait)
            self.error = e

    def wait(self):
        """Wait for the write in flight; raise its error if it failed."""
        if self.thread is not None:
            self.thread.join()
            self.thread = None
        error, self.error = self.error, None
        if error is not None:
            raise error


def recorded(args, name, before):
    """Flag ``name`` as recorded in the state open_run will resume from (``before``: the run
    predates the flag), or None: a new run, or a run that open_run will refuse."""
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError, SystemExit):
        state = run_state(Path(args.save_dir) / args.experiment_name, args.resume_from)[0]
        return state and state["config"].get(name, before)


def run_state(exp_dir, resume_from=None):
    """(the run state to resume from, or None to start afresh; why, for the log), as DESIGN.md
    section 3 says; ``resume_from`` picks an older one. A state not found is a refusal."""
    complete = _step_dirs(exp_dir, complete=True)
    if resume_from:
        path = exp_dir / "checkpoints" / Path(resume_from).name  # a name, or a path to it
        if Path(resume_from).name != resume_from and Path(resume_from).resolve() != path.resolve():
            sys.exit(f"--resume-from {resume_from}: not a checkpoint of {exp_dir}; pass one of "
                     f"its own (e.g. {path.name}).")
        if not (path / "state.json").exists():
            sys.exit(f"--resume-from {resume_from}: no complete checkpoint there. The complete "
                     f"checkpoints of {exp_dir} are: "
                     f"{', '.join(d.name for d in complete.values()) or 'none'}.")
        return json.loads((path / "state.json").read_text()), "as --resume-from asks"
    root, state, why = exp_dir / "state.json", None, None
    if root.exists():
        try:
            state = json.loads(root.read_text())
            missing = {"global_step", "checkpoint", "config"} - set(state)
            if missing:
                raise ValueError(f"it lacks {sorted(missing)}")
        except (ValueError, TypeError) as e:  # TypeError: JSON that is not an object
            state, why = None, f"{root} is unreadable ({e})"
    elif _step_dirs(exp_dir):
        why = f"{root} is missing"
    newest = max(complete, default=None)
    if newest is not None and (state is None or newest > state["global_step"]):
        state = json.loads((complete[newest] / "state.json").read_text())
        return state, f"{why or 'state.json names an older one'}: the newest complete checkpoint"
    if why:
        sys.exit(f"{why}, and {exp_dir} holds no checkpoint that carries its run state "
                 "(checkpoints of this kit's earlier versions do not). Nothing was changed. "
                 "Start a new --experiment-name, or move the old files away.")
    return state, ""


def discard_after(exp_dir, step, run_id=None):
    """Forget what a killed run did after ``step``: its log lines, this run's later checkpoints."""
    for dir_step, path in _step_dirs(exp_dir).items():
        if dir_step > step and saved_by(path)[0] == run_id:
            shutil.rmtree(path)
    for debris in (exp_dir / "checkpoints").glob("step-*"):  # the kit's own debris alone
        if re.fullmatch(r"step-\d{6,}\.(tmp|deleted)", debris.name):
            shutil.rmtree(debris, ignore_errors=True)  # (a deletion may still be under way)
    metrics = exp_dir / "metrics.jsonl"
    if metrics.exists():  # (a note a user added stays)
        write_atomic(metrics, "".join(line + "\n" for line, record in metric_lines(metrics)
                                      if record is None or record["step"] <= step))
