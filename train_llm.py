"""Train a causal language model. Stop it at any time, rerun the same command to go on.

    python train_llm.py --experiment-name demo    # writes outputs/demo/ (DESIGN.md 3)

Read main() first; the functions it calls follow it, in order. Change this file (model,
optimizer, schedule, data, step, loss, metrics, checkpoints): utils.py keeps runs safe.
"""

import functools
import itertools
import math
import os
import random
import signal
import sys
import threading
from pathlib import Path
from typing import NamedTuple

# Idle CPU threads sleep instead of spin (docs/benchmarks.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
if __name__ == "__main__":
    # SIGTERM or Ctrl-C before the first step stops at once.
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda signum, _: sys.exit(
            f"{signal.Signals(signum).name} before the first step:"
            " stopped. Rerun the same command to go on from the"
            " last checkpoint."))
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
# The shipped data and tokenizer, found from any directory.
KIT = Path(__file__).resolve().parent
DEFAULT_DATA = {"pretrain": f"{KIT}/data/sample/*/", "sft": f"{KIT}/data/sft/"}
DEFAULT_TOKENIZER = f"{KIT}/assets/tokenizer"
# Flags naming local files: recorded as absolute paths.
LOCAL_PATHS = ("dataset", "val_dataset", "tokenizer", "model_name", "init_from")


def main(build_loader=None):  # (benchmarks/ pass their own)
    args = parse_args()
    # torchrun sets these; plain `python` is rank 0 of 1.
    rank, world_size = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    # The run directory: locked, its flags checked; None: done.
    run = utils.open_run(args, get_parser(), rank, world_size, __file__)
    if run is None:
        return
    state = run.state

    ctx = init_distributed(args, rank, world_size)
    random.seed(args.seed)  # the same initial weights on every rank
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)  # (CUDA's too)

    tokenizer, model = build_model(args, ctx.device)
    flops = utils.flops_per_token(model, args.seq_length)
    model = parallelize(model, args, ctx)  # DDP or FSDP2
    optimizers = build_optimizers(model, args)
    schedulers = [torch.optim.lr_scheduler.LambdaLR(
        o, lambda s: get_lr(s, args) / args.lr) for o in optimizers]
    # Your own training state, checkpointed: name -> has state_dict().
    extra = {}

    stop = threading.Event()  # set by SIGTERM and Ctrl-C
    domains, weights, mixer = mixture(args, state)  # --mix, --odm
    train_loader = (build_loader or build_pipeline)(
        args.dataset, tokenizer, args, rank, world_size, train=True, weights=weights,
        mixer=mixer, until=stop, pin_memory=ctx.device.type == "cuda")
    if state["checkpoint"]:  # resume
        load_checkpoint(run, model, optimizers, schedulers, extra, train_loader, args, ctx)
    data.start(train_loader)  # (forked before other threads start)
    val_batches = validation_batches(args, tokenizer, domains, rank)
    log = utils.MetricsLog(run.dir, args, state, rank)
    # Forget what a killed run did after its last checkpoint.
    run.discard_after_checkpoint(args, ctx, train_loader, extra)
    loss_fn = compile_model(model, args)  # --compile

    writer = utils.checkpoint_writer(args.checkpoint_writer, ctx)
    validate = functools.partial(validation_metrics, model, val_batches,
                                 ctx, domains, tokenizer, args, state, stop)
    in_flight = utils.StepNumbers(ctx)  # read a step late
    timers = {k: utils.Timer() for k in ("data", "validation", "checkpoint")}
    speed = utils.Throughput(timers, state["tokens_seen"], flops, ctx)
    gc_control = utils.GarbageCollection(args.gc_freq)
    first_step, failure = state["global_step"] + 1, None

    model.train()
    with logging_redirect_tqdm(), utils.Profiler(args.profile_steps, run.dir, ctx) as profiler:
        for step in itertools.count(first_step):
            profiler.step(step)  # --profile-steps
            with timers["data"], record_function("data"):
                batches = fetch(train_loader, args, ctx)  # None: no more
            if step == 1 and batches and (failure := utils.nothing_to_train(
                    batches, tokenizer, args, ctx)):
                break
            metrics = {}
            if batches:
                p = mixer.probabilities if mixer else weights or ()
                stats, lrs = optimizer_step(
                    model, batches, optimizers, schedulers, loss_fn,
                    len(domains), writer, args, ctx, step == first_step > 1)
                stats["stop"] = on_device(stop.is_set(), ctx)  # all ranks learn it
                state["global_step"] = step
                # The tokens this step took (each rank's alike: DDP steps together).
                state["tokens_seen"] += world_size * sum(b["input_ids"].numel() for b in batches)
                if step == first_step:  # (slow on some rank: compiling)
                    utils.stop_on_signals(stop)  # now: save, then stop
                    utils.set_collective_timeout(args.dist_timeout)

                # Each key of metrics and number of stats: logged (metrics.jsonl, wandb).
                metrics = {"step": step, **lrs,
                           "tokens_seen": state["tokens_seen"],
                           **{f"mix/p_{d}": x for d, x in zip(domains, p)}}
                if step % args.log_freq == 0 or step == args.max_steps:
                    metrics |= speed.metrics(state["tokens_seen"])  # (the wall clock)
                    for name, n in train_loader.counters.items():  # skipped, your stage's
                        stats[f"data/{name}"] = on_device(n, ctx)
                if step % args.val_freq == 0 or step == args.max_steps:
                    with timers["validation"]:
                        metrics |= validate()
                in_flight.add(stats, metrics)  # (still computing)

            stop_now = metrics.pop("stopped", False) or world_size == 1 and stop.is_set()
            move = decide(step, in_flight, state, args, batches is None, stop_now)
            log.write_steps(move.late, domains, state)  # (the steps read now)
            data.learn_late(mixer, state.get("domain_losses"), step)  # --odm
            log.write_steps(move.own, domains, state)
            if failure := move.failure:
                break
            if state["data_exhausted"] and log.last and "val_loss" not in log.last:
                log.rewrite_last(validate())  # the last step taken
            if move.save:
                with timers["checkpoint"]:
                    log.flush()  # (the lines of the steps it holds)
                    save_checkpoint(run, model, optimizers, schedulers,
                                    extra, train_loader, args, ctx, writer)
            if move.end:
                break
            gc_control.step(step)

    train_loader.close()
    writer.wait()  # the last checkpoint is complete
    log.close()
    if ctx.distributed:
        dist.destroy_process_group()
    if failure:  # no checkpoint of this step; one paragraph
        sys.exit(failure)
    if not stop.is_set():
        LOGGER.info(utils.done_message(state, run.dir))


def parse_args(argv=None):
    parser = get_parser()
    args = parser.parse_args(argv)
    shipped = DEFAULT_DATA[args.task]  # the task's sample data
    args.dataset = shipped + "train-*.jsonl" if args.dataset is None else args.dataset
    # A run from another's weights keeps its tokenizer.
    args.tokenizer = args.tokenizer or trained.tokenizer_of(args.init_from) or DEFAULT_TOKENIZER
    args.val_format = args.val_dataset is not None  # (--data-format)
    args.val_dataset = shipped + "val-*.jsonl" if args.val_dataset is None else args.val_dataset
    if args.optimizer == "auto":  # a run keeps its own
        args.optimizer = utils.recorded(args, "optimizer", "adamw") or "muon"
    utils.check_args(parser, args, LOCAL_PATHS, shipped=KIT)
    return args


# --- The device and the process group --------------------------

class Context(NamedTuple):
    """Where this process trains."""
    rank: int
    world_size: int
    device: torch.device
    distributed: bool  # a process group exists
    cpu_group: object = None  # gloo beside NCCL, for flags on the CPU

    def autocast(self):
        # bf16 matmuls on a GPU (the weights stay float32); float32 on a CPU.
        return torch.autocast(self.device.type, dtype=torch.bfloat16,
                              enabled=self.device.type == "cuda")


def init_distributed(args, rank, world_size):
    """Pick the device; under torchrun, join the process group."""
    if args.deterministic:  # bit-identical GPU runs (CPU runs are)
        utils.deterministic()
    if args.device:
        device = torch.device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:  # the memory a step frees is kept for the next
        utils.keep_freed_memory()
    distributed = world_size > 1 or args.fsdp
    if distributed:  # NCCL for GPU tensors, gloo for CPU ones
        backend = "nccl" if device.type == "cuda" else "gloo"
        utils.join_process_group(backend, rank, world_size, args.dist_timeout, device)
    cpu_group = dist.new_group(backend="gloo") if distributed and device.type == "cuda" else None
    LOGGER.info(f"Training on {device}, world size {world_size}")
    return Context(rank, world_size, device, distributed, cpu_group)


# --- Model, optimizer, learning-rate schedule ------------------

def create_model(args):
    """The architecture, with random weights: the place for a model
    of your own (forward(input_ids=, position_ids=) -> .logits).
    export_hf.py and generate.py rebuild a run's model with it."""
    config = utils.pretrained(AutoConfig, args.model_name, "--model-name", use_cache=False)
    return AutoModelForCausalLM.from_config(config)


def build_model(args, device):
    """The tokenizer and the model: new, --model-name's weights, or
    an earlier run's (--init-from: pretrain, then SFT)."""
    tokenizer = utils.pretrained(AutoTokenizer, args.tokenizer, "--tokenizer")
    if args.init_from:  # its architecture too
        model = trained.load_trained(args.init_from, what="--init-from")[0]
    elif args.init_from_pretrained:
        model = utils.pretrained(AutoModelForCausalLM, args.model_name, "--model-name",
                                 use_cache=False, dtype=torch.float32)
    else:
        model = create_model(args)
    utils.check_model(model, tokenizer, args, trained.tokenizer_of(args.init_from))
    utils.skip_mask_checks(model)  # (each waits for the GPU)
    if args.activation_checkpointing:  # recomputed in backward
        model.activation_checkpointing_enable({"use_reentrant": False})
    model.to(device)
    LOGGER.info(utils.parameter_count(model))
    return tokenizer, model


def parallelize(model, args, ctx):
    """DDP, or FSDP2 (--fsdp): each block sharded across ranks."""
    if args.fsdp:
        policy = MixedPrecisionPolicy()
        if ctx.device.type == "cuda":  # bf16 blocks, float32 gradients
            policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                          reduce_dtype=torch.float32)
        blocks = getattr(model, "_no_split_modules", None) or ()
        for module in model.modules():
            if type(module).__name__ in blocks:
                fully_shard(module, mp_policy=policy)
        return fully_shard(model, mp_policy=policy)
    if ctx.world_size > 1:
        ids = [ctx.device] if ctx.device.index is not None else None
        return DistributedDataParallel(model, device_ids=ids)
    return model


def compile_model(model, args):
    """--compile: the model, in place, and the training loss."""
    if args.compile:
        utils.unwrap(model).compile()
    loss = functools.partial(sequence_losses, label_smoothing=args.label_smoothing)
    return torch.compile(loss) if args.compile else loss


def build_optimizers(model, args):
    """AdamW, decaying the weight matrices only; with --optimizer
    muon, Muon on the hidden matrices and AdamW on the rest."""
    head = getattr(utils.unwrap(model), "get_output_embeddings", lambda: None)()
    outer = {id(p) for m in model.modules()  # embeddings and head
             if isinstance(m, torch.nn.Embedding) or m is head for p in m.parameters()}
    hidden, matrices, vectors = [], [], []
    for p in model.parameters():
        if args.optimizer == "muon" and p.dim() == 2 and id(p) not in outer:
            hidden.append(p)
        else:
            (matrices if p.dim() >= 2 else vectors).append(p)
    adamw = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": args.weight_decay},
         {"params": vectors, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=True)
    if not hidden:
        return [adamw]
    # Its updates scaled to AdamW's size: one --lr for both.
    return [muon.Muon(hidden, lr=args.lr, weight_decay=args.weight_decay,
                      adjust_lr_fn="match_rms_adamw"), adamw]


def get_lr(step, args):
    """A linear warmup, a cosine to --min-lr at --decay-steps."""
    if step < args.warmup_steps:
        return args.lr * (step + 1) / args.warmup_steps
    span = max(1, args.decay_steps - args.warmup_steps)
    progress = min(1.0, (step - args.warmup_steps) / span)
    cosine = 0.5 * (1 + math.cos(math.pi * progress))  # 1 -> 0
    return args.min_lr + (args.lr - args.min_lr) * cosine


# --- Data ------------------------------------------------------

def mixture(args, state):
    """(domains, weights, mixer) of --mix and --odm, or ([], None, None). The domains: the
    directories the first * of --dataset stands for."""
    if not args.mix and args.odm == "off":
        return [], None, None
    domains = list(data.find_domains(args.dataset))
    given = state["config"].get("mix_weights") or args.mix and utils.parse_mix(args.mix)
    weights = utils.domain_weights(domains, given or None)
    mixer = None
    if args.odm != "off":  # a bandit that starts from the weights
        mixer = data.OnlineMixer(weights, variant=args.odm, alpha=args.odm_alpha,
                                 warmup_steps=args.odm_warmup_steps)
    return domains, weights, mixer


def build_pipeline(urls, tokenizer, args, rank, world_size, *, train,
                   weights=None, mixer=None, pin_memory=False, until=None):
    """Documents -> token ids -> sequences -> batches. With weights,
    a pipeline per domain, and Mix draws each sequence's domain."""
    # --stride: ranks read all, keep every world_size-th sequence.
    split = (0, 1) if train and args.stride else (rank, world_size)
    if weights is not None:
        pipe = data.Mix({name: sequences(glob, tokenizer, args, *split, train)
                         for name, glob in data.find_domains(urls).items()},
                        weights, seed=args.seed, mixer=mixer)
    else:
        pipe = sequences(urls, tokenizer, args, *split, train)
    if train and args.stride:
        pipe = data.Stride(pipe, world_size, rank)
    pipe = data.Batch(pipe, args.batch_size, drop_last=True)
    if not train:
        return pipe
    # Two steps made ahead in a process; alone, a hung read gives up once `until` is set.
    return data.Prefetch(pipe, depth=2 * args.grad_accum + 1, pin_memory=pin_memory,
                         follow=mixer, every=args.grad_accum,
                         until=until if world_size == 1 else None)


def sequences(urls, tokenizer, args, rank, world_size, train):
    """The stages up to the shuffle buffer. Rank r of W reads slots r, r + W, ..."""
    pipe = data.source(
        urls, train=train, rank=rank, world_size=world_size,
        slots=args.active_shards if train else 4, epochs=args.epochs,
        seed=args.seed, sft=args.task == "sft", tokenizer=tokenizer,
        skip_bad_records=args.skip_bad_records,
        format=args.data_format if train or args.val_format else None)
    if args.task == "sft":
        # Prompts masked out of the labels; whole samples packed.
        pipe = data.FormatInstructions(pipe, tokenizer)
        pipe = data.Pack(pipe, args.seq_length, pad_id=tokenizer.pad_token_id or 0)
    else:
        pipe = data.Tokenize(pipe, tokenizer, num_threads=args.tokenizer_threads,
                             max_chars=args.max_doc_chars or None)
        pipe = data.EnsureBosEos(pipe, tokenizer)  # documents apart
        pipe = data.ConcatChunk(pipe, args.seq_length)
    if train:
        pipe = data.Shuffle(pipe, args.shuffle_buffer, seed=args.seed)
    return pipe


def validation_batches(args, tokenizer, domains, rank):
    """Read once: the same on any number of ranks; per domain."""
    sets = data.find_domains(args.val_dataset, like=domains) if domains else {"": args.val_dataset}
    pipelines = [build_pipeline(urls, tokenizer, args, 0, 1, train=False)
                 for urls in sets.values()]
    return data.validation_set(
        pipelines, args.val_batches or 16, args.dataset, args.val_dataset,
        tagged=bool(domains), warn=rank == 0, asked=args.val_batches)


def fetch(loader, args, ctx):
    """A step's micro-batches; None: out of data (on any rank), or a read hung."""
    batches = [next(loader, None) for _ in range(args.grad_accum)]
    ran_out = utils.any_rank(None in batches, ctx) if args.epochs else None in batches
    return None if ran_out else batches


# --- Checkpoints (their layout: DESIGN.md section 3) -----------

def load_checkpoint(run, model, optimizers, schedulers, extra, loader, args, ctx):
    """All that save_checkpoint wrote; the RNG states last."""
    with utils.CheckpointReader(run, ctx) as ckpt:
        if args.fsdp:  # each rank its shards (resharded if need be)
            model_state, optim_state = get_state_dict(model, optimizers)
            states = {"model": model_state, "optimizer": optim_state,
                      **{k: obj.state_dict() for k, obj in extra.items()}}
            dcp.load(states, checkpoint_id=ckpt.path("dcp"))
            set_state_dict(model, optimizers, model_state_dict=model_state,
                           optim_state_dict=optim_state)
        else:
            utils.unwrap(model).load_state_dict(ckpt.load("model.pt"))
            utils.load_states(optimizers, ckpt.load("optimizer.pt"), "optimizer.pt")
            states = ckpt.load_extras(extra)
        for name, obj in extra.items():
            obj.load_state_dict(states[name])
        utils.load_states(schedulers, ckpt.load("lr_scheduler.pt"), "lr_scheduler.pt")
        ckpt.load_loader(loader)  # (merged, on another number of ranks)
        utils.set_rng_state(ckpt.load_rng())


def save_checkpoint(run, model, optimizers, schedulers, extra, loader, args, ctx, writer):
    """What a checkpoint holds: the model, optimizers, schedules and `extra` (rank 0's;
    --fsdp: each rank's shards), and each rank's RNG and data loader states."""
    files = {utils.RNG_FILE.format(ctx.rank): utils.rng_state(ctx.device),
             utils.LOADER_FILE.format(ctx.rank): loader.state_dict()}
    if args.fsdp:
        model_state, optim_state = get_state_dict(model, optimizers)
        files["dcp"] = {"model": model_state, "optimizer": optim_state,
                        **{k: obj.state_dict() for k, obj in extra.items()}}
    elif ctx.rank == 0:
        files["model.pt"] = utils.unwrap(model).state_dict()
        files["optimizer.pt"] = utils.states(optimizers)
        files |= {f"{k}.pt": obj.state_dict() for k, obj in extra.items()}
    if ctx.rank == 0:
        files["lr_scheduler.pt"] = utils.states(schedulers)
    # Written so that a kill at any time leaves a whole checkpoint.
    utils.save_checkpoint(run, files, writer, keep=args.keep_checkpoints, rank=ctx.rank)


# --- The training step -----------------------------------------

def optimizer_step(model, batches, optimizers, schedulers, loss_fn, n_domains, writer,
                   args, ctx, resumed=False):
    """Forward and backward, the gradient clipped, the update: the step's numbers, its lrs."""
    if resumed:  # DDP's buckets as the run had them (bit-identical sums of 3+ ranks)
        utils.rehearse(model, ctx, lambda: train_step(model, batches, ctx, loss_fn))
    stats = train_step(model, batches, ctx, loss_fn, n_domains)
    with record_function("update"):
        norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
        norm = utils.plain_tensor(norm)  # (FSDP's is a DTensor)
        stats["grad_norm"] = norm if ctx.rank == 0 else torch.zeros_like(norm)  # (summed)
        writer.before_update()  # (a failed background save: raised)
        lrs = update(optimizers, schedulers)
    return stats, lrs


def train_step(model, batches, ctx, loss_fn, n_domains=0):
    """Forward and backward: the gradient of the step's mean loss per scored token, however
    it is cut into micro-batches and ranks. Returns this rank's share of the "loss", and
    with domains each one's loss, tokens and sequences."""
    targets = [next_token_targets(b.get("labels", b["input_ids"])) for b in batches]
    scored = on_device(sum((t != -100).sum() for t in targets), ctx)  # (on the CPU)
    if ctx.distributed:
        dist.all_reduce(scored)
    stats = {"loss": on_device(0, ctx)}
    if n_domains:
        stats |= {f"domain_{k}": torch.zeros(n_domains, device=ctx.device)
                  for k in ("loss", "tokens", "sequences")}
    for i, batch in enumerate(batches):
        # Gradients are averaged across ranks in the last backward.
        with utils.gradient_sync(model, enabled=i == len(batches) - 1):
            with ctx.autocast(), record_function("forward"):
                logits, targets, aux = forward(model, batch, ctx.device)
                sums, counts = loss_fn(logits, targets)
                loss = sums.sum() * ctx.world_size / scored.clamp(min=1)
            del logits  # (the largest activation: freed early)
            with record_function("backward"):  # aux: the model's own term
                (loss if aux is None else loss + aux / len(batches)).backward()
        stats["loss"] += loss.detach() / ctx.world_size
        if aux is not None:
            share = aux.detach() / len(batches) / ctx.world_size
            stats["aux_loss"] = stats.get("aux_loss", 0) + share
        if n_domains:
            index = batch["domain"].to(ctx.device, non_blocking=True)
            for key, value in (("loss", sums.detach()), ("tokens", counts),
                               ("sequences", torch.ones_like(counts))):
                stats[f"domain_{key}"].index_add_(0, index, value.float())
    return stats


def update(optimizers, schedulers):
    """Each optimizer's and schedule's step; the lrs it used (each group's, where they differ:
    named by the group's "name", else its index)."""
    names, lrs = [type(o).__name__.lower() for o in optimizers], {}
    for i, (name, o) in enumerate(zip(names, optimizers)):
        key = f"lr/{name}{i if names.count(name) > 1 else ''}"
        groups = {f"{key}/{g.get('name', j)}": g["lr"] for j, g in enumerate(o.param_groups)}
        lrs |= groups if len(set(groups.values())) > 1 else {key: o.param_groups[0]["lr"]}
    for optimizer, scheduler in zip(optimizers, schedulers):
        optimizer.step()
        scheduler.step()
        optimizer.zero_grad(set_to_none=True)  # frees their memory
    return {"lr": next(iter(lrs.values())), **(lrs if len(lrs) > 1 else {})}


def next_token_targets(targets):
    """The next token of each position (the last and -100s: none)."""
    return F.pad(targets[:, 1:], (0, 1), value=-100)


def forward(model, batch, device):
    """A batch's logits, targets (the tokens, or "labels") and the model's own loss term
    or None. Packed samples' position_ids restart at each: each attends to itself."""
    # non_blocking: from pinned memory, the copy does not wait.
    input_ids = batch["input_ids"].to(device, non_blocking=True)
    positions = batch.get("position_ids")
    mask = utils.packed_mask(model, positions, device)
    if positions is not None:
        positions = positions.to(device, non_blocking=True)
    output = model(input_ids=input_ids, position_ids=positions, attention_mask=mask,
                   use_cache=False)
    targets = batch["labels"].to(device, non_blocking=True) if "labels" in batch else input_ids
    aux = getattr(output, "aux_loss", None)
    if aux is not None:
        aux = aux * utils.aux_loss_weight(model)
    return output.logits, targets, aux


def sequence_losses(logits, targets, label_smoothing=0.0):
    """Each sequence's summed loss and tokens scored: [batch] each."""
    targets, flat = next_token_targets(targets), logits.flatten(0, 1)
    # The logits as they come: bf16 under autocast (DESIGN.md 7).
    loss = F.cross_entropy(flat, targets.flatten(), reduction="none",
                           label_smoothing=label_smoothing)
    loss = loss.view(targets.shape)[:, :-1].sum(dim=1)
    return loss, (targets != -100).sum(dim=1)


def on_device(number, ctx):
    """A number as a tensor filled in on the device: no copy, no
    wait. A new metric: stats["name"] = on_device(value, ctx)."""
    return torch.full((), float(number), device=ctx.device)


# --- What a step leads to, and its metrics ---------------------

class Move(NamedTuple):
    """What a step leads to (decide)."""
    late: list = []  # earlier steps' numbers, read now, to log
    own: list = []  # this step's, read at once, to log
    save: bool = False  # a checkpoint of this step
    end: bool = False  # the loop ends after it
    failure: str = None  # the run ends without a checkpoint


def decide(step, in_flight, state, args, ran_out, stop_now):
    """What a step leads to: the one place that decides. A step's numbers (loss, ...,
    "stop": a signal on a rank) are read a step late, when the GPU is done. A checkpoint
    comes every --ckpt-freq steps, at --max-steps, and when the run stops: a signal, or
    the data ran out (no step taken). A save reads its own step's numbers first: a loss
    that is not finite ends the run, and no checkpoint holds it."""
    late = [] if ran_out else in_flight.ready()
    signal_came = stop_now or any(n["stop"] for n, _ in late)
    end = ran_out or signal_came or step >= args.max_steps
    save = end or step % args.ckpt_freq == 0
    own = in_flight.ready(wait=True) if save else []
    for numbers, metrics in late + own:
        if not math.isfinite(numbers["loss"] + numbers["grad_norm"]):
            return Move(failure=utils.diverged(metrics["step"], numbers, state["checkpoint"]))
    if ran_out and step == 1:
        return Move(failure=utils.too_little_data(args))
    if ran_out and stop_now:
        LOGGER.warning("The signal came while the data loader waited on a "
                       f"read: saving step {step - 1}, the last one taken")
    elif ran_out:
        LOGGER.info(f"The data ran out (--epochs {args.epochs}) before step {step}.")
    elif signal_came:
        LOGGER.info(f"Stopping at step {step}: rerun the same command to resume.")
    state["data_exhausted"] = ran_out and not stop_now  # done
    return Move(late, own, save, end)


def validation_metrics(model, batches, ctx, domains, tokenizer, args, state, stop):
    val_loss, per_domain = evaluate(model, batches, ctx, len(domains), stop)
    if val_loss is None:  # a signal: save first (torchrun waits 30 s)
        LOGGER.warning("Validation cut short by the signal: saving now")
        return {"stopped": True}
    metrics = {"val_loss": val_loss, **{f"val_loss/{d}": x for d, x in zip(domains, per_domain)}}
    if args.sample_tokens:  # a sample of text, logged
        metrics["sample"] = trained.sample(model, tokenizer, args, ctx, state["config"])
    return metrics | trained.eval_metrics(model, tokenizer, args, ctx, state)


@torch.no_grad()
def evaluate(model, batches, ctx, n_domains=0, stop=None):
    """Mean loss per scored token, of all and of each domain. Rank r scores batches r, r + W,
    ...; a rank short of one scores batch 0 again, uncounted (FSDP: each forward is a
    collective). (None, None) once `stop` is set on any rank (checked every 8th batch)."""
    model.eval()
    total = torch.zeros(2, 1 + n_domains, device=ctx.device)  # sums, counts
    world_size = ctx.world_size
    rounds = -(-len(batches) // world_size)
    for i in range(ctx.rank, rounds * world_size, world_size):
        if stop is not None and i // world_size % 8 == 0 and (
                utils.any_rank(stop.is_set(), ctx)):
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


# --- Command-line flags (their checking types: utils) ----------

def get_parser():
    parser = utils.ArgumentParser(description=__doc__.split("\n")[0])
    at_least, finite = utils.at_least, utils.finite
    # fixed: a flag that shapes the steps (a resume may not change it); add: the others.
    add, fixed = parser.group("run")
    add("-e", "--experiment-name", required=True, help="writes SAVE_DIR/NAME")
    add("--save-dir", default="outputs")
    fixed("--task", choices=["pretrain", "sft"], default="pretrain", help="sft: answers' loss")
    add("--resume-from", metavar="CHECKPOINT", help="roll back to it (e.g. step-000400)")
    fixed("--seed", type=at_least(0, 2**32 - 1), default=0)
    add("--max-steps", type=at_least(1), default=600, help="may grow on resume")
    add("--device", type=utils.torch_device, help="default: cuda if any")
    add("--deterministic", action="store_true", help="GPU runs bit-identical")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--activation-checkpointing", action="store_true", help="less memory, 1/3 more compute")
    add("--gc-freq", type=at_least(1), default=50, help="collect garbage")
    add("--debug", action="store_true", help="tracebacks of expected failures")

    add, fixed = parser.group("data")
    fixed("-d", "--dataset", help="JSONL/Parquet/text shards (paths, globs, URLs), "
          "a save_to_disk directory or a Hub name[:split]")
    fixed("--val-dataset", help="held-out data, in the same forms")
    fixed("--tokenizer", help="default: --init-from's, or the shipped one")
    fixed("-s", "--seq-length", type=at_least(2), default=128)
    fixed("--shuffle-buffer", type=at_least(1), default=1000, help="1: off")
    fixed("--active-shards", type=at_least(1), default=8, help="read at once: k x world size")
    fixed("--epochs", type=at_least(1), help="default: endless")
    fixed("--data-format", choices=["jsonl", "parquet", "text", *data.TOKEN_FORMATS])
    add("--tokenizer-threads", type=at_least(1), default=2)
    add("--skip-bad-records", action="store_true", help="count them, go on")
    add("--max-doc-chars", type=at_least(0), default=100_000, help="cut longer ones (0: never)")

    add, fixed = parser.group("model and optimizer")
    fixed("-m", "--model-name", default=f"{KIT}/assets/tiny-gpt2", help="its config shapes it")
    fixed("--init-from-pretrained", action="store_true", help="start from its weights")
    fixed("--init-from", metavar="PATH", help="start from a run's weights")
    add("-b", "--batch-size", type=at_least(1), default=8, help="a micro-batch's")
    add("--grad-accum", type=at_least(1), default=1, help="micro-batches a step")
    add("--global-batch-size", type=at_least(1), metavar="N", help="sets --grad-accum")
    fixed("--optimizer", choices=["auto", "adamw", "muon"], default="auto", help="new runs: muon")
    fixed("--weight-decay", type=finite(0), default=0.1)
    fixed("--label-smoothing", type=finite(0, high=1), default=0.0)
    fixed("--grad-clip", type=finite(0, above=True, inf=True), default=1.0, help="inf: none")

    add, fixed = parser.group("learning-rate schedule (get_lr)")
    fixed("--lr", type=finite(0, above=True), default=4e-3)
    fixed("--warmup-steps", type=at_least(0), default=60)
    fixed("--min-lr", type=finite(0), default=3e-4)
    add("--decay-steps", type=at_least(1), help="default: the first --max-steps past the warmup")

    add, fixed = parser.group("logging, validation, checkpoints")
    add("--log-freq", type=at_least(1), default=10)
    add("--val-freq", type=at_least(1), default=200)
    add("--val-batches", type=at_least(1), help="default: 16, or all")
    add("--ckpt-freq", type=at_least(1), default=200)
    add("--keep-checkpoints", type=at_least(0), default=2, help="0: all")
    add("--checkpoint-writer", choices=["auto", "background", "sync"],
        default="auto", help="auto: background on a GPU, sync on a CPU")
    add("--wandb", choices=["online", "offline", "disabled"], default="offline")
    add("--wandb-project", default=os.environ.get("WANDB_PROJECT", "train-llm"))
    add("--sample-prompt", type=trained.utf8, help="continued at each validation")
    add("--sample-tokens", type=at_least(0), default=32, help="0: no sample")
    add("--eval-tasks", type=trained.task_names, help="kit_cloze,kit_bpb or lm-eval's")
    add("--eval-freq", type=at_least(1), help="a multiple of --val-freq (default: it)")
    add("--eval-limit", type=at_least(1), help="documents per task (default: all)")
    add("--profile-steps", type=utils.step_range, metavar="A:B", help="torch.profiler trace")

    add, fixed = parser.group("distributed (under torchrun)")
    fixed("--fsdp", action="store_true", help="shard the model (FSDP2)")
    fixed("--stride", action="store_true", help="ranks read all, keep every W-th sequence")
    add("--dist-timeout", type=finite(0, above=True), default=120, help="collectives' wait, s")

    add, fixed = parser.group("mixing domains")
    fixed("--mix", metavar="NAME=W,...", type=utils.mix_weights, help="weights of the "
          "domains (the directories of --dataset's first *), or natural: their sizes")
    fixed("--odm", choices=["off", "exp3", "smoothed-mean"], default="off",
          help="Online Data Mixing: toward domains of high loss")
    fixed("--odm-warmup-steps", type=at_least(0), default=50)
    fixed("--odm-alpha", type=finite(0, high=1), default=0.9)
    return parser


if __name__ == "__main__":
    utils.cli(main)  # a failure a user can mend: one paragraph
