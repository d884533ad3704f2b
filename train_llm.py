"""Train a causal language model. Stop it at any instant, rerun the same command to continue.

    python train_llm.py --experiment-name demo

Everything a run writes lives in {save-dir}/{experiment-name}/ (DESIGN.md section 3). The
command is also the resume command: if that directory holds a state.json, training continues
from the checkpoint it names, bit-identically on the same hardware. Read main() top to bottom;
utils.py holds the helpers that measure things and move checkpoint bytes.
"""

import argparse
import functools
import json
import logging
import math
import os
import random
import signal
import sys
import threading
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
import tqdm
import wandb
from tqdm.contrib.logging import logging_redirect_tqdm
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

import data
import utils

LOGGER = logging.getLogger("train_llm")

# Arguments that decide what the next step computes: the data stream, the model and the update
# rule (the optimizer and scheduler restore their hyperparameters from the checkpoint, so a
# changed --lr would be silently ignored). Resuming with one of them changed is refused.
# Everything else (--max-steps, logging, checkpointing, --device, threads) may change.
FINGERPRINT = ("dataset", "val_dataset", "tokenizer", "model_name", "init_from_pretrained",
               "seed", "seq_length", "batch_size", "grad_accum", "lr", "min_lr",
               "warmup_steps", "weight_decay")


def main():
    args = get_parser().parse_args()

    # torchrun sets these; a plain `python train_llm.py` is rank 0 of 1. Only rank 0 writes
    # logs, metrics and checkpoints (DESIGN.md section 4 adds the other ranks' parts).
    rank = int(os.environ.get("RANK", 0))
    world_size = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    logging.basicConfig(format=f"[%(asctime)s] [rank={rank}] %(levelname)s: %(message)s",
                        level=logging.INFO)
    LOGGER.info(args)

    # Resume iff state.json exists. It is replaced only after a checkpoint is complete, so it
    # always names one that loads. Check it first: a refusal or "already done" costs nothing.
    exp_dir = Path(args.save_dir) / args.experiment_name
    fingerprint = {name: getattr(args, name) for name in FINGERPRINT}
    if (exp_dir / "state.json").exists():
        state = json.loads((exp_dir / "state.json").read_text())
        for name, saved in state["config"].items():
            if fingerprint.get(name) != saved:
                sys.exit(f"--{name.replace('_', '-')} was {saved!r} when {exp_dir} was started "
                         f"and is {fingerprint.get(name)!r} now. Resuming would train a "
                         "different run: pass the old value, or start a new --experiment-name.")
        if state["global_step"] >= args.max_steps:
            LOGGER.info(f"Resuming {exp_dir} from {state['checkpoint']}: it is done, at step "
                        f"{state['global_step']} of --max-steps {args.max_steps}. Raise "
                        "--max-steps to train further.")
            return
        LOGGER.info(f"Resuming {exp_dir} from {state['checkpoint']} "
                    f"(step {state['global_step']} of {args.max_steps})")
    else:
        state = {"global_step": 0, "epoch": 0, "tokens_seen": 0, "checkpoint": None,
                 "wandb_run_id": None, "config": fingerprint}
        LOGGER.info(f"Starting {exp_dir} from scratch")
    if rank == 0:
        exp_dir.mkdir(parents=True, exist_ok=True)
        # A run killed after its last checkpoint may have logged (and half-saved) later steps.
        # This run redoes them, so drop them: metrics.jsonl then has every step exactly once.
        utils.discard_after(exp_dir, state["global_step"])

    # The run id is kept in state.json, so a resumed run continues the same wandb curve.
    # Offline mode (the default) needs no account: `wandb sync` uploads the run later.
    state["wandb_run_id"] = wandb.init(
        project="train-llm", name=args.experiment_name, id=state["wandb_run_id"],
        resume="allow", dir=exp_dir, config=vars(args),
        mode=args.wandb if rank == 0 else "disabled").id

    # Device: a GPU runs matmuls in bf16 under autocast while weights and optimizer state stay
    # float32 (mixed precision). CPUs run plain float32: bf16 is slow on most of them.
    if args.device:
        device = torch.device(args.device)
    elif torch.cuda.is_available():
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device("cpu")
    if device.type == "cuda":
        torch.cuda.set_device(device)
    autocast = functools.partial(torch.autocast, device.type, dtype=torch.bfloat16,
                                 enabled=device.type == "cuda")
    LOGGER.info(f"Training on {device}, world size {world_size}")

    # Seed every global RNG a library may draw from (torch also seeds CUDA). This fixes the
    # initial weights; a resumed run then restores the RNG states saved in its checkpoint.
    random.seed(args.seed)
    np.random.seed(args.seed)
    torch.manual_seed(args.seed)

    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer)
    config = AutoConfig.from_pretrained(args.model_name, use_cache=False)
    if len(tokenizer) > config.vocab_size:
        sys.exit(f"The tokenizer has {len(tokenizer)} tokens but the model only "
                 f"{config.vocab_size} embeddings: pick a matching --model-name.")
    if args.init_from_pretrained:
        model = AutoModelForCausalLM.from_pretrained(args.model_name, config=config,
                                                     dtype=torch.float32)
    else:  # fresh random weights, shaped by the config
        model = AutoModelForCausalLM.from_config(config)
    model.to(device)
    LOGGER.info(f"{sum(p.numel() for p in model.parameters()) / 1e6:.2f}M parameters")

    # AdamW with weight decay on the weight matrices only: pulling biases and LayerNorm gains
    # towards zero does not regularize anything. The fused kernel is one launch per step.
    matrices = [p for p in model.parameters() if p.dim() >= 2]
    vectors = [p for p in model.parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW(
        [{"params": matrices, "weight_decay": args.weight_decay},
         {"params": vectors, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.95), fused=device.type == "cuda")

    # Linear warmup to --lr, then a cosine down to --min-lr at --max-steps. A pure function
    # of the step: raising --max-steps on resume stretches the rest of the cosine.
    def lr_lambda(step):  # the factor on --lr for the update of optimizer step `step` + 1
        if step < args.warmup_steps:
            return (step + 1) / args.warmup_steps
        progress = min(1.0, (step - args.warmup_steps) / max(1, args.max_steps - args.warmup_steps))
        cosine = 0.5 * (1 + math.cos(math.pi * progress))  # 1 -> 0
        return (args.min_lr + (args.lr - args.min_lr) * cosine) / args.lr

    lr_scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_lambda)

    # Data: a background thread reads, tokenizes and batches ahead, so the GPU never waits.
    train_loader = build_pipeline(args.dataset, tokenizer, args, rank, world_size, train=True)
    # Validation always scores the same held-out batches: read once, kept in memory.
    val_pipeline = build_pipeline(args.val_dataset, tokenizer, args, rank, world_size, train=False)
    val_batches = [batch["input_ids"] for batch in data.Take(val_pipeline, args.val_batches)]
    val_pipeline.close()
    if not val_batches:
        sys.exit(f"--val-dataset {args.val_dataset} has less than one batch of tokens.")

    # Resume: everything that evolves during training comes back from the checkpoint. The RNG
    # states go last, after everything above has drawn from the RNGs.
    if state["checkpoint"]:
        ckpt_dir = exp_dir / state["checkpoint"]
        model.load_state_dict(utils.load(ckpt_dir / "model.pt", device))
        optimizer.load_state_dict(utils.load(ckpt_dir / "optimizer.pt", device))
        lr_scheduler.load_state_dict(utils.load(ckpt_dir / "lr_scheduler.pt", device))
        train_loader.load_state_dict(json.loads((ckpt_dir / f"loader-rank{rank}.json").read_text()))
        utils.set_rng_state(utils.load(ckpt_dir / "rng.pt", "cpu"))

    if args.compile:  # in place, so state_dict() keys stay those of the plain model
        model.compile()

    # SIGTERM (preemption, scancel, docker stop) and Ctrl-C only raise a flag: the step in
    # flight finishes, a checkpoint is saved, and the process exits 0. A second signal kills
    # at once, which is safe too: the last complete checkpoint stays loadable.
    stop = threading.Event()

    def request_stop(signum, frame):
        LOGGER.warning(f"{signal.Signals(signum).name}: saving a checkpoint after this step")
        stop.set()
        signal.signal(signum, signal.SIG_DFL)

    signal.signal(signal.SIGTERM, request_stop)
    signal.signal(signal.SIGINT, request_stop)

    timers = {name: utils.Timer(device) for name in ("data", "forward", "backward", "update")}
    gc_control = utils.GarbageCollection(args.gc_freq)
    tokens_per_step = world_size * args.grad_accum * args.batch_size * args.seq_length
    flops_per_token = utils.flops_per_token(model, config, args.seq_length)
    peak_flops = utils.peak_flops(device)
    metrics_file = open(exp_dir / "metrics.jsonl", "a") if rank == 0 else None
    progress = tqdm.tqdm(initial=state["global_step"], total=args.max_steps, desc="train",
                         disable=rank != 0)
    last_log_step = state["global_step"]
    profiler = utils.profiler(args.profile_steps, exp_dir / "profile", rank, device,
                              next_step=state["global_step"] + 1)

    model.train()
    with logging_redirect_tqdm(), profiler as prof:
        while state["global_step"] < args.max_steps:
            step = state["global_step"] + 1

            # One optimizer step = --grad-accum micro-batches whose gradients add up.
            loss_sum = torch.zeros((), device=device)
            for _ in range(args.grad_accum):
                with timers["data"]:  # next() by hand, so the wait for data is measured
                    input_ids = next(train_loader)["input_ids"].to(device)
                with timers["forward"], autocast():
                    logits = model(input_ids=input_ids).logits
                    loss = per_sequence_loss(logits, input_ids).mean() / args.grad_accum
                # Backward needs no logits ([batch, seq, vocab], the largest activation):
                # dropping our reference lets them be freed before backward's peak.
                del logits
                with timers["backward"]:
                    loss.backward()
                loss_sum += loss.detach()

            with timers["update"]:
                loss_value = loss_sum.item()
                grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(),
                                                           args.grad_clip).item()
                if not (math.isfinite(loss_value) and math.isfinite(grad_norm)):
                    # Do not save: the weights are about to be garbage, and the last good
                    # checkpoint must stay the one state.json names.
                    train_loader.close()
                    sys.exit(f"Step {step}: loss {loss_value}, gradient norm {grad_norm}. "
                             f"Stopping without a checkpoint; the last good one is "
                             f"{state['checkpoint']}. Lower --lr or raise --warmup-steps.")
                lr = optimizer.param_groups[0]["lr"]
                optimizer.step()
                lr_scheduler.step()
                optimizer.zero_grad(set_to_none=True)  # frees the gradients' memory
            state["global_step"] = step
            state["tokens_seen"] += tokens_per_step

            metrics = {"step": step, "loss": loss_value, "lr": lr, "grad_norm": grad_norm,
                       "tokens_seen": state["tokens_seen"]}
            if step % args.log_freq == 0 or step == args.max_steps:
                seconds = {name: timer.pop() for name, timer in timers.items()}
                step_seconds = sum(seconds.values())
                tokens_per_s = (step - last_log_step) * tokens_per_step / step_seconds
                last_log_step = step
                metrics |= {
                    "tokens_per_s": tokens_per_s,
                    # The share of step time spent waiting for data: ideally ~0.
                    "data_wait": seconds["data"] / step_seconds,
                    "mfu": (flops_per_token * tokens_per_s / world_size / peak_flops
                            if peak_flops else None),
                    **utils.memory_stats(device),
                }
            if step % args.val_freq == 0 or step == args.max_steps:
                metrics["val_loss"] = evaluate(model, val_batches, device, autocast)
            if rank == 0:
                metrics_file.write(json.dumps(metrics) + "\n")
                metrics_file.flush()
                wandb.log(metrics, step=step)
            if "tokens_per_s" in metrics or "val_loss" in metrics:
                LOGGER.info(format_metrics(metrics))
            progress.update(1)
            progress.set_postfix(loss=f"{loss_value:.3f}")

            if step % args.ckpt_freq == 0 or step == args.max_steps or stop.is_set():
                loader_state = train_loader.state_dict()
                state["epoch"] = utils.source_epoch(loader_state)
                if rank == 0:
                    utils.save_checkpoint(exp_dir, step, {
                        "model.pt": model.state_dict(),
                        "optimizer.pt": optimizer.state_dict(),
                        "lr_scheduler.pt": lr_scheduler.state_dict(),
                        "rng.pt": utils.rng_state(),
                        f"loader-rank{rank}.json": loader_state,
                    }, state, keep=args.keep_checkpoints)
                    LOGGER.info(f"Saved {state['checkpoint']}")
            gc_control.step(step)
            prof.step()
            if stop.is_set():
                LOGGER.info(f"Stopped at step {step}; rerun the same command to resume.")
                break

    progress.close()
    train_loader.close()
    if metrics_file:
        metrics_file.close()
    wandb.finish()
    if not stop.is_set():
        LOGGER.info(f"Done: {args.max_steps} steps, {state['tokens_seen']:,} tokens.")


def build_pipeline(urls, tokenizer, args, rank, world_size, *, train):
    """JSONL documents -> token ids -> chunks of --seq-length -> batches [batch, seq_length].

    Both read four shards at a time, round-robin, so that a batch mixes domains. Training reads
    the shards forever, in a seeded order reshuffled every epoch, and shuffles chunks in a
    buffer. Validation reads its shards once, in order.
    """
    # Each rank opens only its own shard slots (4 of them in all, so 1, 2 or 4 ranks) and reads
    # documents rank, rank + W, ... of the one global order: nothing read is thrown away.
    pipe = data.Files(urls, repeat=train, shuffle_shards=train, seed=args.seed,
                      n_active_shards=4, required_fields=["text"], rank=rank,
                      world_size=world_size)
    pipe = data.Tokenize(pipe, tokenizer, num_threads=args.tokenizer_threads)
    pipe = data.EnsureBosEos(pipe, tokenizer)  # so documents stay separable once concatenated
    pipe = data.ConcatChunk(pipe, args.seq_length)
    if train:
        pipe = data.Shuffle(pipe, 1000, seed=args.seed)
    pipe = data.Batch(pipe, args.batch_size, drop_last=True)
    return data.Prefetch(pipe) if train else pipe


def per_sequence_loss(logits, input_ids):
    """Mean next-token cross-entropy of each sequence: a [batch] tensor.

    Token t predicts token t + 1. Keeping one loss per sequence (instead of one mean over the
    batch) is what per-domain losses are computed from.
    """
    token_loss = F.cross_entropy(logits[:, :-1].flatten(0, 1), input_ids[:, 1:].flatten(),
                                 reduction="none")
    return token_loss.view(input_ids.shape[0], -1).mean(dim=1)


@torch.no_grad()
def evaluate(model, batches, device, autocast):
    """Mean loss over the validation batches (eval mode: no dropout, no RNG drawn)."""
    model.eval()
    losses = []
    for input_ids in batches:
        input_ids = input_ids.to(device)
        with autocast():
            losses.append(per_sequence_loss(model(input_ids=input_ids).logits, input_ids))
    model.train()
    return torch.cat(losses).mean().item()


def format_metrics(m):
    line = f"step {m['step']} | loss {m['loss']:.4f} | lr {m['lr']:.2e}"
    if "val_loss" in m:
        line += f" | val loss {m['val_loss']:.4f}"
    if "tokens_per_s" in m:
        memory = " ".join(f"{k[4:]} {v:.3g}" for k, v in m.items() if k.startswith("mem/"))
        mfu = f"{m['mfu']:.1%}" if m["mfu"] is not None else "n/a"
        line += (f" | {m['tokens_per_s']:,.0f} tok/s | data wait {m['data_wait']:.1%}"
                 f" | MFU {mfu} | {memory}")
    return line


def get_parser():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add = parser.add_argument
    add("-e", "--experiment-name", required=True, help="run name; outputs go to SAVE_DIR/NAME")
    add("-d", "--dataset", default="data/sample/*/train-*.jsonl",
        help="training JSONL shards: paths, globs, {a,b} brace patterns, directories or URLs")
    add("--val-dataset", default="data/sample/*/val-*.jsonl",
        help="held-out JSONL shards for the validation loss (same forms as --dataset)")
    add("--tokenizer", default="assets/tokenizer", help="Hugging Face tokenizer name or path")
    add("-m", "--model-name", default="assets/tiny-gpt2",
        help="Hugging Face model name or path; its config shapes a freshly initialized model")
    add("--init-from-pretrained", action="store_true",
        help="load the weights of --model-name instead of initializing them randomly")
    add("--save-dir", default="outputs", help="where experiment directories are created")
    add("--seed", type=int, default=0, help="seed for weights, data order and all RNGs")
    add("--max-steps", type=int, default=600,
        help="optimizer steps to train for (may be raised on resume)")
    add("--lr", type=float, default=4e-3, help="peak learning rate, reached after warmup")
    add("--warmup-steps", type=int, default=60, help="steps of linear learning-rate warmup")
    add("--min-lr", type=float, default=3e-4, help="learning rate at the end of the cosine decay")
    add("--weight-decay", type=float, default=0.1, help="AdamW weight decay of weight matrices")
    add("--grad-clip", type=float, default=1.0,
        help="clip the global gradient norm to this (inf: never)")
    add("-b", "--batch-size", type=int, default=8, help="sequences per micro-batch (per rank)")
    add("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    add("-s", "--seq-length", type=int, default=128, help="tokens per sequence")
    add("--log-freq", type=int, default=10, help="print throughput, memory and MFU every N steps")
    add("--ckpt-freq", type=int, default=200, help="save a checkpoint every N steps")
    add("--keep-checkpoints", type=int, default=2,
        help="how many newest checkpoints to keep (0: all)")
    add("--val-freq", type=int, default=200, help="compute the validation loss every N steps")
    add("--val-batches", type=int, default=16, help="batches of --val-dataset to validate on")
    add("--wandb", choices=["online", "offline", "disabled"], default="offline",
        help="Weights & Biases mode; offline needs no login (upload later with `wandb sync`)")
    add("--compile", action="store_true", help="torch.compile the model")
    add("--gc-freq", type=int, default=50, help="run Python's garbage collector every N steps")
    add("--profile-steps", default=None, metavar="FIRST,LAST",
        help="write a torch.profiler trace of steps FIRST to LAST into SAVE_DIR/NAME/profile")
    add("--tokenizer-threads", type=int, default=2, help="threads tokenizing in the background")
    add("--device", default=None,
        help="torch device (default: cuda:LOCAL_RANK if available, else cpu)")
    return parser


if __name__ == "__main__":
    main()
