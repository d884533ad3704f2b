"""Train a causal language model. Stop it at any instant, rerun the same command to continue.

    python train_llm.py --experiment-name demo

A run writes into {save-dir}/{experiment-name}/ (DESIGN.md section 3) and resumes bit-identically
on the same hardware. Read main() first: the functions it calls follow it in that order. This
file is the one to change (model, optimizer, schedule, pipeline, step, loss, metrics, what a
checkpoint holds); utils.py keeps the run directory and checkpoints safe, data.py is the data.
"""

import functools
import math
import os
import random
import shlex
import signal
import sys
from pathlib import Path
from typing import NamedTuple

# Waiting CPU threads sleep, not spin: no collapse beside a busy process (docs/benchmarks.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # (read as torch loads: before its import)
if __name__ == "__main__":  # Ctrl-C while the imports below load: one line, not a traceback
    signal.signal(signal.SIGINT, lambda *_: sys.exit("Stopped while starting: nothing written."))
import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn.functional as F
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import record_function
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import data
import muon
import trained
import utils

LOGGER = utils.LOGGER
# The shipped defaults live next to this file, so the script runs from any directory.
KIT = Path(__file__).resolve().parent
DEFAULT_DATA = {"pretrain": f"{KIT}/data/sample/*/", "sft": f"{KIT}/data/sft/"}
DEFAULT_TOKENIZER = f"{KIT}/assets/tokenizer"

# The flags that may name local files: recorded as absolute paths (a run resumes from anywhere).
LOCAL_PATHS = ("dataset", "val_dataset", "tokenizer", "model_name", "init_from")


def main(build_loader=None):  # build_loader: a stand-in for build_pipeline (benchmarks/)
    args = parse_args()
    # torchrun sets these; a plain `python train_llm.py` is rank 0 of 1.
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # The run directory (locked, checked against its flags, where to resume); None: it is done.
    run = utils.open_run(args, get_parser(), rank, world_size, script=__file__)
    if run is None:
        return
    state = run.state

    ctx = init_distributed(args, rank, world_size)
    # Every global RNG (torch's seeds CUDA too): the same initial weights on every rank.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer, model = build_model(args, ctx.device)
    flops_per_token = utils.flops_per_token(model, args.seq_length)
    model = parallelize(model, args, ctx)  # DDP, or FSDP2 with --fsdp
    optimizers = build_optimizers(model, args)  # Muon and AdamW, or AdamW (--optimizer)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: get_lr(s, args) / args.lr)
                  for o in optimizers]
    # Your training state, checkpointed: name -> object with state_dict(), load_state_dict().
    extra = {}

    domains, weights, mixer = mixture(args, state)  # ([], None, None) without --mix/--odm
    train_loader = (build_loader or build_pipeline)(
        args.dataset, tokenizer, args, rank, world_size, train=True, weights=weights,
        mixer=mixer, pin_memory=ctx.device.type == "cuda")
    if state["checkpoint"]:  # resume: everything that evolves in training comes back
        load_checkpoint(run, model, optimizers, schedulers, extra, train_loader, args, ctx)
    data.start(train_loader)  # its process forked now, before any other thread starts here
    val_batches = validation_batches(args, tokenizer, domains, rank)
    log = utils.MetricsLog(run.dir, args, state, rank)  # metrics.jsonl, wandb, progress bar
    run.discard_after_checkpoint(args, ctx, train_loader, extra)  # what a killed run did later
    loss_fn = compile_model(model, args)  # --compile: the model, in place, and the loss

    stop = utils.stop_on_signals(train_loader)  # SIGTERM, Ctrl-C: finish the step, save, exit
    writer = utils.checkpoint_writer(args.checkpoint_writer, ctx)  # in the background, or here
    validate = functools.partial(validation_metrics, model, val_batches, ctx, domains, tokenizer,
                                 args, trained.prompt_format(state["config"]), stop)
    in_flight = utils.StepNumbers(ctx, run, train_loader, writer)  # read a step late: no wait
    timers = {name: utils.Timer() for name in ("data", "validation", "checkpoint")}
    tokens_per_step = world_size * args.grad_accum * args.batch_size * args.seq_length
    speed = utils.Throughput(timers, state["global_step"], tokens_per_step, flops_per_token, ctx)
    gc_control = utils.GarbageCollection(args.gc_freq)
    stopping = False

    model.train()
    with logging_redirect_tqdm(), utils.Profiler(args.profile_steps, run.dir, ctx) as profiler:
        while state["global_step"] < args.max_steps and not stopping:
            step = state["global_step"] + 1
            profiler.step(step)  # --profile-steps: a trace of the record_function ranges

            # One optimizer step = --grad-accum micro-batches whose gradients add up.
            with timers["data"], record_function("data"):  # next() by hand: the wait is timed
                batches = [next(train_loader, None) for _ in range(args.grad_accum)]
            if utils.out_of_data(batches, step, args, ctx, train_loader):  # --epochs: all ranks
                log_steps(in_flight.ready(wait=True), log, domains, state, args)
                if log.last and "val_loss" not in log.last and not stop.is_set():  # the last step
                    log.rewrite_last(validate())
                state["data_exhausted"] = not stop.is_set()  # the run is done
                save_checkpoint(run, model, optimizers, schedulers, extra, train_loader, args,
                                ctx, writer)
                break
            if step == 1:  # a new run's first batches must hold something to train on
                utils.check_first_batches(batches, tokenizer, args, ctx, train_loader)

            probabilities = list(mixer.probabilities) if mixer else weights  # this step's
            stats = train_step(model, batches, ctx, loss_fn, len(domains))
            log_step = step % args.log_freq == 0 or step == args.max_steps
            stats |= utils.rank_flags(stop, log_step, train_loader, ctx.device)
            with record_function("update"):
                stats["grad_norm"] = clip_gradients(model, args, ctx)
                writer.before_update()  # a failed background save stops the run; copies go first
                lrs = update(optimizers, schedulers)  # the learning rates this step used
            state["global_step"] = step
            state["tokens_seen"] += tokens_per_step
            run.step_taken(step, args, ctx)  # from now on signals wait for the step in flight

            metrics = {"step": step, **lrs, "tokens_seen": state["tokens_seen"],
                       **{f"mix/p_{name}": p for name, p in zip(domains, probabilities or ())}}
            if log_step:  # tokens/s over the wall clock since the last log: everything counts
                metrics |= speed.metrics(step)
            if step % args.val_freq == 0 or step == args.max_steps:
                with timers["validation"]:
                    metrics |= validate()
                stopping |= metrics.pop("stopped", False)  # a signal during validation
            in_flight.add(stats, metrics)  # (its loss and gradient norm: still computing)
            stopping |= log_steps(in_flight.ready(), log, domains, state, args)  # the step before
            stopping |= world_size == 1 and stop.is_set()  # (alone, no need to agree on it)
            data.learn_late(mixer, state.get("domain_losses"), step)  # ODM: the step before's
            if stopping or step % args.ckpt_freq == 0 or step == args.max_steps:
                stopping |= log_steps(in_flight.ready(wait=True), log, domains, state, args)
                with timers["checkpoint"]:
                    log.flush()  # (the lines of the steps the checkpoint holds)
                    save_checkpoint(run, model, optimizers, schedulers, extra, train_loader,
                                    args, ctx, writer)
            gc_control.step(step)
        if stopping:  # decided together, so all ranks saved and all leave here
            LOGGER.info(f"Stopped at step {step}; rerun the same command to resume.")

    train_loader.close()
    writer.wait()  # the last checkpoint is complete before the run ends
    log.close()
    if ctx.distributed:
        dist.destroy_process_group()
    if not stop.is_set():
        LOGGER.info(f"Done: {state['global_step']} steps, {state['tokens_seen']:,} tokens. For "
                    f"transformers: python scripts/export_hf.py {shlex.quote(str(run.dir))}")


def parse_args(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    shipped = DEFAULT_DATA[args.task]  # the shipped sample data of the task
    args.dataset = shipped + "train-*.jsonl" if args.dataset is None else args.dataset
    # A run from another's weights keeps that run's tokenizer, unless told otherwise.
    args.tokenizer = args.tokenizer or trained.tokenizer_of(args.init_from) or DEFAULT_TOKENIZER
    args.val_format = args.val_dataset is not None  # --data-format is for the user's files
    args.val_dataset = shipped + "val-*.jsonl" if args.val_dataset is None else args.val_dataset
    if args.optimizer == "auto":  # a run keeps its own; a new one trains Muon (README: sooner)
        args.optimizer = utils.recorded(args, "optimizer", "adamw") or "muon"
    utils.check_args(parser, args, LOCAL_PATHS, shipped=KIT)
    return args


# --- The device and the process group ---------------------------------------------------------

class Context(NamedTuple):
    """Where this process trains: its rank, the number of ranks, its device."""
    rank: int
    world_size: int
    device: torch.device
    distributed: bool  # a process group exists (several ranks, or --fsdp)
    cpu_group: object = None  # gloo beside NCCL, for flags on the CPU (utils.all_ranks)

    def autocast(self):
        # Mixed precision: bf16 matmuls on a GPU, float32 weights; CPUs run plain float32.
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.device.type == "cuda")


def init_distributed(args, rank, world_size):
    """Pick the device and, under torchrun, join the process group (NCCL for GPU tensors, gloo
    for CPU ones) within --dist-timeout: a rank that cannot join fails, and torchrun restarts."""
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
    else:  # glibc: the memory a step frees is kept for the next (utils.keep_freed_memory)
        utils.keep_freed_memory()
    distributed = world_size > 1 or args.fsdp
    if distributed:
        utils.join_process_group("nccl" if device.type == "cuda" else "gloo", rank, world_size,
                                 args.dist_timeout, device)
    cpu_group = dist.new_group(backend="gloo") if distributed and device.type == "cuda" else None
    LOGGER.info(f"Training on {device}, world size {world_size}")
    return Context(rank, world_size, device, distributed, cpu_group)


# --- Model, optimizer, learning-rate schedule -------------------------------------------------

def create_model(args):
    """The architecture with fresh random weights: --model-name's config, for transformers.

    The one place for a model of your own: any nn.Module whose forward takes ``input_ids=``
    and ``position_ids=`` (and ignores other keywords) and returns an object with ``.logits``.
    A run records this file's path: --init-from, generate.py and export_hf.py rebuild its
    model with this function, from the flags the run recorded (trained.load_trained)."""
    config = utils.pretrained(AutoConfig, args.model_name, "--model-name", use_cache=False)
    return AutoModelForCausalLM.from_config(config)


def build_model(args, device):
    """The tokenizer, and the model: --model-name's config with fresh random weights, its saved
    weights (--init-from-pretrained), or the weights of an earlier run or an HF directory
    (--init-from: pretrain -> SFT). Float32 weights (autocast does bf16 on a GPU)."""
    tokenizer = utils.pretrained(AutoTokenizer, args.tokenizer, "--tokenizer")
    if args.init_from:  # its architecture too: --model-name is not used
        model = trained.load_trained(args.init_from, what="--init-from")[0]
    elif args.init_from_pretrained:
        model = utils.pretrained(AutoModelForCausalLM, args.model_name, "--model-name",
                                 use_cache=False, dtype=torch.float32)
    else:
        model = create_model(args)
    utils.check_model(model, tokenizer, args, trained.tokenizer_of(args.init_from))
    utils.skip_mask_checks(model)  # transformers' checks of each batch: each waits for the GPU
    if args.activation_checkpointing:  # keep each block's input only; recompute the rest
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.to(device)
    LOGGER.info(utils.parameter_count(model))  # "1.92M parameters", and how many are trained
    return tokenizer, model


def parallelize(model, args, ctx):
    """DDP keeps a copy of the model on every rank and averages the gradients in backward.
    FSDP2 (--fsdp) shards each transformer block's weights, gradients and optimizer state
    across ranks and gathers a block just before it runs: for models too big for one GPU."""
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


def compile_model(model, args):
    """--compile: the model in place (its state_dict() keys unchanged) and the loss, whose
    softmax Inductor fuses. Returns train_step's loss (evaluate's is plain cross-entropy)."""
    if args.compile:
        utils.unwrap(model).compile()
    loss = functools.partial(sequence_losses, label_smoothing=args.label_smoothing)
    return torch.compile(loss) if args.compile else loss


def build_optimizers(model, args):
    """The optimizers, a list (each is scheduled, saved, restored). AdamW, fused (DESIGN.md
    section 6), decays the weight matrices only: decaying biases and LayerNorm gains regularizes
    nothing. --optimizer muon: Muon (muon.py) on the hidden matrices, AdamW on the rest."""
    head = getattr(utils.unwrap(model), "get_output_embeddings", lambda: None)()  # (not DDP's)
    outer = {id(p) for m in model.modules() if isinstance(m, torch.nn.Embedding) or m is head
             for p in m.parameters()}
    hidden, matrices, vectors = [], [], []
    for p in model.parameters():
        orthogonal = args.optimizer == "muon" and p.dim() == 2 and id(p) not in outer
        (hidden if orthogonal else matrices if p.dim() >= 2 else vectors).append(p)
    adamw = torch.optim.AdamW([{"params": matrices, "weight_decay": args.weight_decay},
                               {"params": vectors, "weight_decay": 0.0}],
                              lr=args.lr, betas=(0.9, 0.95), fused=True)
    if not hidden:
        return [adamw]
    # Its updates scaled to AdamW's size ("match_rms_adamw"): one --lr and schedule for both.
    return [muon.Muon(hidden, lr=args.lr, weight_decay=args.weight_decay,
                      adjust_lr_fn="match_rms_adamw"), adamw]


def get_lr(step, args):
    """The learning rate of the update after ``step`` steps: a linear warmup to --lr, a cosine
    down to --min-lr at --decay-steps (default: the run's first --max-steps), then --min-lr."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    progress = min(1.0, (step - args.warmup_steps) / max(1, args.decay_steps - args.warmup_steps))
    cosine = 0.5 * (1 + math.cos(math.pi * progress))  # 1 -> 0
    return args.min_lr + (args.lr - args.min_lr) * cosine


# --- Data -------------------------------------------------------------------------------------

def mixture(args, state):
    """(domains, initial weights, mixer) of --mix/--odm, or ([], None, None): the directories the
    first * of --dataset stands for; --odm's bandit (data.OnlineMixer) starts from --mix."""
    if not args.mix and args.odm == "off":
        return [], None, None
    domains = list(data.find_domains(args.dataset))
    given = state["config"].get("mix_weights") or args.mix and utils.parse_mix(args.mix)
    weights = utils.domain_weights(domains, given or None)
    mixer = data.OnlineMixer(weights, variant=args.odm, alpha=args.odm_alpha,
                             warmup_steps=args.odm_warmup_steps) if args.odm != "off" else None
    return domains, weights, mixer


def build_pipeline(urls, tokenizer, args, rank, world_size, *, train, weights=None,
                   mixer=None, pin_memory=False):
    """Documents -> token ids -> chunks of --seq-length -> batches [batch, seq_length]. With
    ``weights`` each domain has a pipeline and Mix draws each sequence's domain, with the
    mixer as it stands at the step's start (--odm: it learns from the losses here)."""
    # --stride: each rank reads all, keeps every world_size-th sequence (DESIGN.md section 4)
    split = (0, 1) if train and args.stride else (rank, world_size)
    if weights is not None:
        pipe = data.Mix({name: sequences(pattern, tokenizer, args, *split, train)
                         for name, pattern in data.find_domains(urls).items()}, weights,
                        seed=args.seed, mixer=mixer)
    else:
        pipe = sequences(urls, tokenizer, args, *split, train)
    if train and args.stride:
        pipe = data.Stride(pipe, world_size, rank)
    pipe = data.Batch(pipe, args.batch_size, drop_last=True)
    # Two steps made ahead in a process of its own (off this GIL), pinned: copies do not wait.
    return data.Prefetch(pipe, depth=2 * args.grad_accum + 1, pin_memory=pin_memory, follow=mixer,
                         every=args.grad_accum) if train else pipe


def sequences(urls, tokenizer, args, rank, world_size, train):
    """The stages up to the shuffle buffer, one --seq-length sequence per item: --active-shards
    splits read round-robin, endlessly (or --epochs); rank r of W reads slots r, r + W, ..."""
    pipe = data.source(urls, train=train, rank=rank, world_size=world_size,
                       slots=args.active_shards if train else 4, epochs=args.epochs,
                       seed=args.seed, sft=args.task == "sft", tokenizer=tokenizer,
                       skip_bad_records=args.skip_bad_records,
                       format=args.data_format if train or args.val_format else None)
    if args.task == "sft":
        # One instruction-answer pair per sample, its prompt masked out of the labels, whole
        # samples packed into sequences (never split; position ids restart at each).
        pipe = data.FormatInstructions(pipe, tokenizer)
        pipe = data.Pack(pipe, args.seq_length, pad_id=tokenizer.pad_token_id or 0)
    else:
        pipe = data.Tokenize(pipe, tokenizer, num_threads=args.tokenizer_threads,
                             max_chars=args.max_doc_chars or None)
        pipe = data.EnsureBosEos(pipe, tokenizer)  # so documents stay separable once concatenated
        pipe = data.ConcatChunk(pipe, args.seq_length)
    if train:
        pipe = data.Shuffle(pipe, args.shuffle_buffer, seed=args.seed)
    return pipe


def validation_batches(args, tokenizer, domains, rank):
    """The validation batches, read once and kept: the same ones whatever the world size
    (each rank scores every world_size-th). With domains, --val-batches of each, tagged."""
    sets = data.find_domains(args.val_dataset, like=domains) if domains else {"": args.val_dataset}
    pipelines = [build_pipeline(urls, tokenizer, args, 0, 1, train=False) for urls in sets.values()]
    return data.validation_set(pipelines, args.val_batches or 16, args.dataset, args.val_dataset,
                               tagged=bool(domains), warn=rank == 0, asked=args.val_batches)


# --- Checkpoints (the layout: DESIGN.md section 3) --------------------------------------------

def load_checkpoint(run, model, optimizers, schedulers, extra, loader, args, ctx):
    """Everything save_checkpoint wrote, the RNG states last (after all else has drawn)."""
    with utils.CheckpointReader(run, ctx) as ckpt:
        if args.fsdp:  # each rank loads its shards; DCP reshards when the world size changed
            model_state, optim_state = get_state_dict(model, optimizers)
            states = {"model": model_state, "optimizer": optim_state,
                      **{name: obj.state_dict() for name, obj in extra.items()}}
            dcp.load(states, checkpoint_id=ckpt.path("dcp"))
            set_state_dict(model, optimizers, model_state_dict=model_state,
                           optim_state_dict=optim_state)
        else:
            utils.unwrap(model).load_state_dict(ckpt.load("model.pt"))
            utils.load_states(optimizers, ckpt.load("optimizer.pt"), "optimizer.pt")
            states = ckpt.load_extras(extra)  # (rank 0's, on every rank)
        for name, obj in extra.items():
            obj.load_state_dict(states[name])
        utils.load_states(schedulers, ckpt.load("lr_scheduler.pt"), "lr_scheduler.pt")
        ckpt.load_loader(loader)  # on another number of ranks, all ranks' states merged
        utils.set_rng_state(ckpt.load_rng())


def save_checkpoint(run, model, optimizers, schedulers, extra, loader, args, ctx, writer):
    """What a checkpoint holds: rank 0's model, optimizers, schedules and ``extra`` (NAME.pt; with
    FSDP each rank's shards, through torch.distributed.checkpoint), every rank's RNG and loader
    state. utils.save_checkpoint writes them so that a kill at any instant leaves a whole one."""
    files = {utils.RNG_FILE.format(ctx.rank): utils.rng_state(ctx.device),
             utils.LOADER_FILE.format(ctx.rank): loader.state_dict()}
    if args.fsdp:  # this rank's shards
        files["dcp"] = dict(zip(("model", "optimizer"), get_state_dict(model, optimizers)))
        files["dcp"] |= {name: obj.state_dict() for name, obj in extra.items()}
    elif ctx.rank == 0:
        files["model.pt"] = utils.unwrap(model).state_dict()
        files["optimizer.pt"] = utils.states(optimizers)  # one state_dict(), or a list
        files |= {f"{name}.pt": obj.state_dict() for name, obj in extra.items()}
    if ctx.rank == 0:
        files["lr_scheduler.pt"] = utils.states(schedulers)
    utils.save_checkpoint(run, files, writer, keep=args.keep_checkpoints, rank=ctx.rank)


# --- The training step ------------------------------------------------------------------------

def train_step(model, batches, ctx, loss_fn, n_domains=0):
    """Forward and backward over one step's micro-batches, whose gradients add up.

    The gradient is that of the step's mean loss per scored token over all micro-batches and
    ranks, however the batch is cut: each micro-batch's summed loss (``loss_fn``) is divided
    by the step's count of scored tokens (one all-reduce), times the world size, which DDP's
    averaging divides out. Returns this rank's numbers as tensors: "loss" (its share of the
    mean) and, with domains, "domain_loss", "domain_tokens", "domain_sequences" per domain."""
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
            with ctx.autocast(), record_function("forward"):
                logits, targets, aux = forward(model, batch, ctx.device)
                sums, counts = loss_fn(logits, targets)
                loss = sums.sum() * ctx.world_size / scored.clamp(min=1)
            # The logits ([batch, seq, vocab], the largest activation) are needed only by the
            # loss's backward, which runs first: without our reference they go right after.
            del logits
            # The model's own loss term: its mean over the micro-batches and ranks, logged apart.
            with record_function("backward"):
                (loss if aux is None else loss + aux / len(batches)).backward()
        stats["loss"] += loss.detach() / ctx.world_size
        if aux is not None:
            stats["aux_loss"] = aux.detach() / len(batches) / ctx.world_size + stats.get(
                "aux_loss", 0)
        if n_domains:
            index = batch["domain"].to(ctx.device, non_blocking=True)  # a copy, no wait
            for key, value in (("loss", sums.detach()), ("tokens", counts),
                               ("sequences", torch.ones_like(counts))):
                stats[f"domain_{key}"].index_add_(0, index, value.float())
    return stats


def update(optimizers, schedulers):
    """Every optimizer's step, then its schedule's. Returns the learning rates the step used:
    "lr" (the first optimizer's), and with several "lr/<class>" of each (numbered if alike)."""
    names = [type(o).__name__.lower() for o in optimizers]
    lrs = {f"lr/{name}{i if names.count(name) > 1 else ''}": o.param_groups[0]["lr"]
           for i, (name, o) in enumerate(zip(names, optimizers))}
    for optimizer, scheduler in zip(optimizers, schedulers):
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)  # frees the gradients' memory
    return {"lr": next(iter(lrs.values())), **(lrs if len(lrs) > 1 else {})}


def clip_gradients(model, args, ctx):
    """Clip the gradients' global norm to --grad-clip. Returns the norm on rank 0 and 0 on the
    others: the step's all-reduce sums what every rank adds, and this is the same on all."""
    norm = utils.plain_tensor(torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip))
    return norm if ctx.rank == 0 else torch.zeros_like(norm)


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
    """The logits of a batch, the token ids they are scored against (every token, or with
    --task sft the ``labels``: prompt and padding -100), and the model's own loss term or None
    (``aux_loss``, weighed as transformers weighs it: utils.aux_loss_weight). Packed
    samples bring ``position_ids`` that restart at each and attend within themselves."""
    # non_blocking: from pinned memory the copy overlaps with work the GPU still has queued.
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    positions = batch.get("position_ids")
    mask = utils.packed_mask(model, positions, device)  # (see utils.skip_mask_checks)
    positions = positions.to(device, non_blocking=True) if positions is not None else None
    output = model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                   use_cache=False)
    aux = getattr(output, "aux_loss", None)
    weight = utils.aux_loss_weight(model) if aux is not None else 1
    return output.logits, (batch["labels"].to(device, non_blocking=True) if "labels" in batch
                           else input_ids), None if aux is None else aux * weight


def sequence_losses(logits, targets, label_smoothing=0.0):
    """Next-token cross-entropy summed over each sequence, and the tokens scored: two [batch]
    tensors, what a mean over tokens, or over a domain's sequences, is made of."""
    targets, flat = next_token_targets(targets), logits.flatten(0, 1)
    # The logits as they come (bf16 under autocast, as nanoGPT's; why: DESIGN.md section 7).
    loss = F.cross_entropy(flat, targets.flatten(), reduction="none",
                           label_smoothing=label_smoothing)
    return loss.view(targets.shape)[:, :-1].sum(dim=1), (targets != -100).sum(dim=1)


# --- Metrics and validation -------------------------------------------------------------------

def log_steps(steps, log, domains, state, args):
    """Each step read (StepNumbers.ready, numbers summed over ranks) as its metrics line: loss,
    gradient norm, records skipped (log steps), each domain's loss and tokens; any signal?"""
    for numbers, metrics in steps:
        metrics = {"step": metrics["step"], **{k: numbers[k] for k in (
            "loss", "aux_loss", "grad_norm") if k in numbers}} | metrics
        if "skipped" in numbers:
            metrics["data/skipped"] = int(numbers["skipped"])
        losses = [total / n if n else None for total, n in
                  zip(numbers.get("domain_loss", ()), numbers.get("domain_tokens", ()))]
        for name, loss, sequences in zip(domains, losses, numbers.get("domain_sequences", ())):
            tokens = state["domain_tokens"].get(name, 0) + int(sequences) * args.seq_length
            metrics[f"mix/tokens_{name}"] = state["domain_tokens"][name] = tokens
            if loss is not None:
                metrics[f"mix/loss_{name}"] = loss
        if domains:  # for the mixer, after the next step (data.learn_late)
            state["domain_losses"] = [metrics["step"], losses]
        log.write(metrics)
    return any(numbers["stop"] > 0 for numbers, _ in steps)


def validation_metrics(model, batches, ctx, domains, tokenizer, args, prompt_format, stop):
    val_loss, per_domain = evaluate(model, batches, ctx, len(domains), stop)
    if val_loss is None:  # a signal: its checkpoint comes first (torchrun kills 30 s after it)
        LOGGER.warning("Validation cut short by the signal: saving now")
        return {"stopped": True}
    metrics = {"val_loss": val_loss,
               **{f"val_loss/{name}": loss for name, loss in zip(domains, per_domain)}}
    if args.sample_tokens:  # remove these two lines and the sample is gone
        metrics["sample"] = trained.sample(model, tokenizer, args, ctx, prompt_format)
    return metrics


@torch.no_grad()
def evaluate(model, batches, ctx, n_domains=0, stop=None):
    """Mean loss per scored token of the validation batches, and of each domain's (no
    dropout). Rank r scores batches r, r + W, ...; a rank short of one scores batch 0 again
    without counting it (every rank runs as many forwards: under FSDP each is a collective);
    (None, None) once ``stop`` (a signal) is set on any rank, agreed every 8th batch."""
    model.eval()
    total = torch.zeros(2, 1 + n_domains, device=ctx.device)  # loss sums, tokens; all, domains
    world_size = ctx.world_size
    for i in range(ctx.rank, -(-len(batches) // world_size) * world_size, world_size):
        if stop is not None and i // world_size % 8 == 0 and utils.any_rank(stop.is_set(), ctx):
            model.train()
            return None, None
        batch = batches[i % len(batches)]
        with ctx.autocast():
            sums, counts = sequence_losses(*forward(model, batch, ctx.device)[:2])
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


# --- Command-line arguments (their types, which check each flag as it is parsed, are in utils) ---

def get_parser():
    parser = utils.ArgumentParser(description=__doc__.split("\n")[0])  # argparse's
    at_least, finite = utils.at_least, utils.finite  # argparse types that check a flag
    # fixed(...): a flag that shapes what a step computes, in the run's fingerprint (a resume with
    # another value is refused); its default does what the script did without it. add: the rest.

    add, fixed = parser.group("run")
    add("-e", "--experiment-name", required=True, help="run name; outputs go to SAVE_DIR/NAME")
    add("--save-dir", default="outputs", help="where experiment directories are created")
    fixed("--task", choices=["pretrain", "sft"], default="pretrain",
        help="pretrain: next-token loss on all text; sft: instruction tuning, answer tokens only")
    add("--resume-from", default=None, metavar="CHECKPOINT",
        help="roll back to this kept checkpoint (e.g. step-000400) instead of the newest one; "
             "the steps logged after it are discarded once it has loaded")
    fixed("--seed", type=at_least(0, 2**32 - 1), default=0, help="seed of weights, data, RNGs")
    add("--max-steps", type=at_least(1), default=600, help="steps (may be raised on resume)")
    add("--device", default=None, type=utils.torch_device,
        help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    add("--deterministic", action="store_true", help="bit-identical GPU runs at half the speed")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--activation-checkpointing", action="store_true",
        help="recompute each block's activations in backward: less memory, ~1/3 more compute")
    add("--gc-freq", type=at_least(1), default=50, help="run Python's GC every N steps")
    add("--debug", action="store_true", help="show the traceback of an expected failure")

    add, fixed = parser.group("data")
    fixed("-d", "--dataset", default=None,
        help="training data: JSONL/Parquet/text shards (paths, globs, {a,b} patterns, "
             "directories, URLs), a save_to_disk directory or a Hub name[:split] "
             "(default: the shipped data/sample/*/train-*.jsonl; --task sft: data/sft/)")
    fixed("--val-dataset", default=None, help="held-out data, the same forms as --dataset")
    fixed("--tokenizer", default=None, help="Hugging Face tokenizer name or path (default: the "
        "one --init-from was trained with, else the shipped one)")
    fixed("-s", "--seq-length", type=at_least(2), default=128, help="tokens per sequence")
    fixed("--shuffle-buffer", type=at_least(1), default=1000, help="sequences shuffled (1: off)")
    fixed("--active-shards", type=at_least(1), default=8,
        help="slots: input splits read at a time, round-robin; a multiple of the world size")
    fixed("--epochs", type=at_least(1), help="passes over --dataset, then stop (default: endless)")
    fixed("--data-format", choices=["jsonl", "parquet", "text", *data.TOKEN_FORMATS], default=None,
        help="how to read shards whose names do not tell (default: by suffix, or header)")
    add("--tokenizer-threads", type=at_least(1), default=2, help="threads that tokenize")
    add("--skip-bad-records", action="store_true",
        help="skip (count and log) malformed records instead of stopping at the first one")
    add("--max-doc-chars", type=at_least(0), default=100_000,
        help="cut longer documents into pieces (at a blank) before tokenizing (0: never)")

    add, fixed = parser.group("model and optimizer")
    fixed("-m", "--model-name", default=f"{KIT}/assets/tiny-gpt2",
        help="Hugging Face model name or path whose config shapes a fresh model "
             "(default: the shipped tiny GPT-2)")
    fixed("--init-from-pretrained", action="store_true", help="start from --model-name's weights")
    fixed("--init-from", default=None, metavar="PATH",
        help="start from the weights and architecture of a run, a checkpoint or a Hugging "
             "Face directory (pretrain -> --task sft)")
    add("-b", "--batch-size", type=at_least(1), default=8, help="sequences per micro-batch")
    add("--grad-accum", type=at_least(1), default=1, help="micro-batches per optimizer step")
    add("--global-batch-size", type=at_least(1), default=None, metavar="N",
        help="sequences per step over all ranks: sets --grad-accum from the world size, so a "
             "run restarted on another number of ranks keeps its batch")
    fixed("--optimizer", choices=["auto", "adamw", "muon"], default="auto",
        help="muon: Muon and AdamW (build_optimizers); auto: a run's own, muon for a new one")
    fixed("--weight-decay", type=finite(0), default=0.1, help="weight decay of the matrices")
    fixed("--label-smoothing", type=finite(0, high=1), default=0.0, help="of the training loss")
    fixed("--grad-clip", type=finite(0, above=True, inf=True), default=1.0,
        help="clip the gradient norm to this (inf: never)")

    add, fixed = parser.group("learning-rate schedule (get_lr)")
    fixed("--lr", type=finite(0, above=True), default=4e-3, help="peak learning rate")
    fixed("--warmup-steps", type=at_least(0), default=60, help="steps of linear warmup")
    fixed("--min-lr", type=finite(0), default=3e-4, help="learning rate at the end of the cosine")
    add("--decay-steps", type=at_least(1), help="cosine's end (default: first --max-steps)")

    add, fixed = parser.group("logging, validation and checkpoints")
    add("--log-freq", type=at_least(1), default=10, help="log speed and MFU every N steps")
    add("--val-freq", type=at_least(1), default=200, help="validate every N steps")
    add("--val-batches", type=at_least(1), help="batches to validate on (default: 16, or all)")
    add("--ckpt-freq", type=at_least(1), default=200, help="save a checkpoint every N steps")
    add("--keep-checkpoints", type=at_least(0), default=2, help="newest ones to keep (0: all)")
    add("--checkpoint-writer", choices=["auto", "background", "sync"], default="auto",
        help="write checkpoints in the background or before training goes on (sync); auto: "
             "background on a GPU, sync on a CPU (whose cores training keeps busy)")
    add("--wandb", choices=["online", "offline", "disabled"], default="offline",
        help="Weights & Biases mode; offline needs no login (upload later with `wandb sync`)")
    add("--wandb-project", default=os.environ.get("WANDB_PROJECT", "train-llm"),
        help="Weights & Biases project (default: $WANDB_PROJECT, else train-llm)")
    add("--sample-prompt", help="continued at each validation (default 'The'; sft: a question)")
    add("--sample-tokens", type=at_least(0), default=32, help="tokens of it (0: no sample)")
    add("--profile-steps", type=utils.step_range, metavar="A:B",
        help="write a torch.profiler trace of steps A to B into SAVE_DIR/NAME/profile/")

    add, fixed = parser.group("distributed (under torchrun)")
    fixed("--fsdp", action="store_true", help="shard weights, gradients, optimizer state (FSDP2)")
    fixed("--stride", action="store_true", help="ranks read all data, keep every W-th sequence")
    add("--dist-timeout", type=finite(0, above=True), default=120,
        help="seconds a collective may wait for the other ranks after the first step")

    add, fixed = parser.group("mixing domains")
    fixed("--mix", default=None, metavar="NAME=W,...", type=utils.mix_weights,
        help="mix the domains of --dataset (the directories its first * stands for) with these "
             "weights (e.g. code=0.4,prose=0.6), or natural: by the bytes of their files")
    fixed("--odm", choices=["off", "exp3", "smoothed-mean"], default="off",
        help="Online Data Mixing: move the mixture toward domains whose loss stays high")
    fixed("--odm-warmup-steps", type=at_least(0), default=50, help="steps before ODM adapts")
    fixed("--odm-alpha", type=finite(0, high=1), default=0.9, help="smoothing of ODM's rewards")
    return parser


if __name__ == "__main__":
    utils.cli(main)  # a failure a user can mend ends in one paragraph; a bug in a traceback
