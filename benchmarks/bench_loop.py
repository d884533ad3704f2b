"""The kit's training step beside a bare training loop: the same model, batch, optimizer,
schedule and gradient clipping, on the same pre-made token tensors. It prints tokens/s of each
and their ratio, so the loop's overhead (kit ÷ bare, same model) and a model's (bare loop,
shipped model ÷ plain GPT of the same shape) are each one number.

    python benchmarks/bench_loop.py                          # the demo's defaults, shipped model
    python benchmarks/bench_loop.py --models shipped plain   # and a plain GPT of the same shape
    python benchmarks/bench_loop.py --apart --rounds 3 --steps 100 --warmup 10 -- \
        --model-name assets/gpt2-124m --seq-length 1024 --batch-size 16 --grad-accum 2  # a GPU

"kit" is train_llm.main() as a user runs it, with the demo's defaults (wandb offline, the
progress bar, metrics.jsonl, the log every --log-freq steps, Python's GC every --gc-freq), its
data pipeline replaced by the pre-made batches behind the kit's own Prefetch; validation
and checkpoints are put past the measured steps. "bare" is a loop of forward, F.cross_entropy,
backward, clip_grad_norm_, the kit's optimizers (train_llm.build_optimizers) with the lr set by
hand, and the loss read: the loop of nanoGPT's train.py without its extras. Its model is the
kit's, with the kit's skipping of transformers' mask checks (utils.skip_mask_checks), so both
loops run the same model code. "plain" is a GPT written here in 40 lines: token and position
embeddings, pre-norm blocks of causal scaled_dot_product_attention and a 4x MLP with tanh GELU,
a tied output layer.

Taking turns (the default, for a CPU): the loops share a process, a step each, so that they
share its settings (OMP_WAIT_POLICY=PASSIVE, utils.keep_freed_memory) and the machine's drift:
before each of the kit's steps, its loader runs one step of every bare loop (its own model and
optimizer, the same batches; the loss read at once). The kit's step is timed from the end of
those to the start of the next ones, its data fetch included. Tokens/s is the mean over the
steps after --warmup. A ratio compares the loops over blocks of --log-freq steps, each holding
one log step (so the loop's periodic costs count), and is the median block of all --rounds
processes: a stall of the machine, which this one has every few seconds, spoils one block, not
the figure.

--apart (for a GPU): each loop in a process of its own, alternated kit, bare, kit, bare, ...
(--rounds pairs, so that drift hits both), since taking turns would empty the GPU's queue of
work before each of the kit's steps: each loop here keeps its queue one step deep, reading its
loss a step late, as it runs alone. Each process's figure is its mean step over the --steps
steps after --warmup, the GPU waited for at both ends of them; a round's ratio is its kit's
tokens/s ÷ its bare loop's, printed with the spread (min / median / max) of the rounds' ratios
and of each loop's step time. The figure is the median round.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import types
from pathlib import Path

# The workers' OpenMP as the kit's (train_llm.py): read as torch loads, which premade imports.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
ROOT = Path(__file__).resolve().parent.parent
MODELS = ("shipped", "plain")
LOOPS = ("kit", "bare")


def plain_gpt(config):
    """A plain GPT of the shape of a transformers GPT-2 ``config``."""
    import torch
    import torch.nn.functional as F
    from torch import nn

    dim, heads = config.n_embd, config.n_head

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
            self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(approximate="tanh"),
                                     nn.Linear(4 * dim, dim))

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = (z.view(b, t, heads, -1).transpose(1, 2)
                       for z in self.qkv(self.ln1(x)).split(dim, dim=2))
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            x = x + self.proj(y.transpose(1, 2).reshape(b, t, dim))
            return x + self.mlp(self.ln2(x))

    class GPT(nn.Module):
        def __init__(self):
            super().__init__()
            self.tokens = nn.Embedding(config.vocab_size, dim)
            self.positions = nn.Embedding(config.n_positions, dim)
            self.blocks = nn.ModuleList(Block() for _ in range(config.n_layer))
            self.ln = nn.LayerNorm(dim)
            for module in self.modules():  # GPT-2's initialization
                if isinstance(module, (nn.Linear, nn.Embedding)):
                    nn.init.normal_(module.weight, std=0.02)
                if isinstance(module, nn.Linear):
                    nn.init.zeros_(module.bias)

        def forward(self, input_ids, position_ids=None, **unused):
            if position_ids is None:
                position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
            x = self.tokens(input_ids) + self.positions(position_ids)
            for block in self.blocks:
                x = block(x)
            return types.SimpleNamespace(logits=self.ln(x) @ self.tokens.weight.T)

    return GPT()


class BareLoop:
    """The bare loop: its own copy of a model and optimizer, one step per call on the same
    batches as the kit's. ``late``: the loss read a step late, as the kit reads its own (a GPU's
    queue of work kept one step deep); else at once, so that each step's time is its own."""

    def __init__(self, model_kind, args, device, items, create_model, late=False):
        import torch
        import torch.nn.functional as F
        from transformers import AutoConfig

        import train_llm
        import utils
        torch.manual_seed(args.seed)
        self.model = (create_model(args) if model_kind == "shipped"
                      else plain_gpt(AutoConfig.from_pretrained(args.model_name)))
        utils.skip_mask_checks(self.model)  # as the kit's build_model: the same model code
        self.model.to(device)
        # The kit's optimizers (AdamW, or --optimizer's), each group's lr set by hand each step
        # as the kit's LambdaLR sets it: its first lr times get_lr's factor.
        self.optimizers = train_llm.build_optimizers(self.model, args)
        self.base_lrs = [[group["lr"] for group in o.param_groups] for o in self.optimizers]
        self.inputs = [ids.to(device) for ids in items]
        self.targets = [F.pad(ids[:, 1:], (0, 1), value=-100) for ids in self.inputs]
        self.autocast = lambda: torch.autocast(device.type, dtype=torch.bfloat16,
                                               enabled=device.type == "cuda")
        self.args, self.late, self.n, self.times, self.pending = args, late, 0, [], None

    def step(self):
        import torch
        import torch.nn.functional as F

        import train_llm
        start = time.perf_counter()
        factor = train_llm.get_lr(self.n // self.args.grad_accum, self.args) / self.args.lr
        for optimizer, base_lrs in zip(self.optimizers, self.base_lrs):
            for group, base in zip(optimizer.param_groups, base_lrs):
                group["lr"] = base * factor
        for _ in range(self.args.grad_accum):
            i = self.n % len(self.inputs)
            with self.autocast():
                logits = self.model(input_ids=self.inputs[i], use_cache=False).logits
                loss = F.cross_entropy(logits.flatten(0, 1), self.targets[i].flatten())
            loss.backward()
            self.n += 1
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.args.grad_clip)
        for optimizer in self.optimizers:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        if not self.late:
            loss.item()
        elif self.pending is not None:
            self.pending.item()  # the step before's: this one's work stays queued
        self.pending = loss.detach()
        self.times.append(time.perf_counter() - start)


class Interleaved:
    """The kit's loader: before each of the kit's steps, one step of every bare loop; then the
    next batch, through the kit's own Prefetch. The kit's step is timed from the end of
    the bare steps to the start of the next ones (its data fetch included). On a GPU, the kit's
    queued work is waited for before each timing, or with ``edges`` (step boundaries, the
    first 0) only at those: with no bare loop beside it, the kit runs as it runs alone."""

    def __init__(self, inner, bare, grad_accum, cuda, edges=None):
        self.inner, self.bare, self.grad_accum, self.cuda = inner, bare, grad_accum, cuda
        self.edges, self.calls, self.times, self.resumed = edges, 0, [], None

    def __next__(self):
        if self.calls % self.grad_accum == 0:
            boundary = self.calls // self.grad_accum
            if self.cuda and (self.edges is None or boundary in self.edges):
                synchronize()  # the kit's last kernels (its optimizer step) count as its own
            now = time.perf_counter()
            if self.resumed is not None:
                self.times.append(now - self.resumed)
            for loop in self.bare:
                loop.step()
            self.resumed = time.perf_counter() if self.bare else now
        self.calls += 1
        return next(self.inner)

    def __getattr__(self, name):
        return getattr(self.inner, name)


def synchronize():
    __import__("torch").cuda.synchronize()


def run_kit(kit_model, bare_models, steps, edges, flags, out):
    """train_llm.main() with ``kit_model`` on the pre-made batches for ``steps`` steps, a step
    of each bare loop before each of its steps (none: ``edges``, the kit alone); every loop's
    step times to ``out``."""
    sys.path.insert(0, str(ROOT))
    import premade

    import train_llm

    loaders, shipped = [], train_llm.create_model
    if kit_model == "plain":
        train_llm.create_model = lambda args: plain_gpt(
            __import__("transformers").AutoConfig.from_pretrained(args.model_name))

    def build_loader(urls, tokenizer, args, rank, world_size, *, train, pin_memory, **kwargs):
        items = premade.random_batches(args, len(tokenizer))
        device = torch_device(args)
        bare = [BareLoop(kind, args, device, items, shipped) for kind in bare_models]
        loaders.append(Interleaved(premade.loader(items, args, pin_memory), bare,
                                   args.grad_accum, device.type == "cuda", edges))
        return loaders[-1]

    with tempfile.TemporaryDirectory() as tmp:
        sys.argv = ["train_llm.py", "-e", "bench", "--save-dir", tmp, "--max-steps", str(steps),
                    "--val-freq", str(10**9), "--ckpt-freq", str(10**9), "--val-batches", "1",
                    *flags]
        train_llm.main(build_loader=build_loader)
    loader = loaders[0]
    times = {f"kit/{kit_model}": loader.times}
    times |= {f"bare/{kind}": loop.times[:len(loader.times)]
              for kind, loop in zip(bare_models, loader.bare)}
    Path(out).write_text(json.dumps(times))


def run_bare(model_kind, steps, edges, flags, out):
    """The bare loop alone for ``steps`` steps, its loss read a step late, in this process set
    up as the kit sets up its own (the seed, the device, keep_freed_memory on a CPU); its step
    times (between the starts of its steps, the GPU waited for at ``edges``) to ``out``."""
    sys.path.insert(0, str(ROOT))
    import premade
    import torch
    from transformers import AutoTokenizer

    import train_llm
    import utils

    args = train_llm.parse_args(["-e", "bench", *flags])
    device = torch_device(args)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        utils.keep_freed_memory()
    vocab = len(utils.pretrained(AutoTokenizer, args.tokenizer, "--tokenizer"))  # the kit's
    loop = BareLoop(model_kind, args, device, premade.random_batches(args, vocab),
                    train_llm.create_model, late=True)
    starts = []
    for boundary in range(steps + 1):  # the last: the end of the last step
        if device.type == "cuda" and boundary in edges:
            synchronize()
        starts.append(time.perf_counter())
        if boundary < steps:
            loop.step()
    times = [b - a for a, b in zip(starts, starts[1:])]
    Path(out).write_text(json.dumps({f"bare/{model_kind}": times}))


def torch_device(args):
    import torch
    return torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))


def measure(loop, model, args):
    """One process: each loop's step times over the --steps steps after the warm-up ones."""
    total = args.warmup + args.steps  # the steps measured end where the last step starts
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        cmd = [sys.executable, __file__, "--case", loop, model, out.name,
               "--models", *args.models, "--steps", str(total + 1),
               "--warmup", str(args.warmup), *(["--apart"] if args.apart else []),
               "--", *args.flags]
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if result.returncode:
            sys.exit(f"{loop}/{model} failed:\n{result.stderr[-3000:]}")
        times = json.loads(Path(out.name).read_text())
    return {name: values[args.warmup:total] for name, values in times.items()}


def block_ratios(a, b, block):
    """a's tokens/s ÷ b's in each run of ``block`` steps taken in turn: each block holds one
    log step, so the loop's periodic costs count, and a stall of the machine stays in one."""
    block = min(block, len(a))  # (a short run: one block)
    return [sum(b[i:i + block]) / sum(a[i:i + block])
            for i in range(0, len(a) - block + 1, block)]


def spread(values, form):
    """min / median / max of ``values``, each written with ``form``."""
    return " / ".join(format(f(values), form) for f in (min, statistics.median, max))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=["shipped"],
                        help="the kit runs each in turn; the bare loop runs all beside it")
    parser.add_argument("--apart", action="store_true",
                        help="each loop in a process of its own, kit and bare alternated (GPU)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="processes per kit model (--apart: kit and bare pairs)")
    parser.add_argument("--steps", type=int, default=150, help="measured steps per process")
    parser.add_argument("--warmup", type=int, default=20, help="steps left out first")
    parser.add_argument("--case", nargs=3, help=argparse.SUPPRESS)  # a worker process
    parser.add_argument("flags", nargs="*", help="train_llm.py flags, after --")
    args = parser.parse_args()
    if args.case:
        loop, model, out = args.case
        edges = {args.warmup, args.steps - 1} if args.apart else None
        if loop == "bare":
            return run_bare(model, args.steps - 1, edges, args.flags, out)
        return run_kit(model, [] if args.apart else args.models, args.steps, edges,
                       args.flags, out)

    sys.path.insert(0, str(ROOT))
    import train_llm
    defaults = train_llm.parse_args(["-e", "bench", *args.flags])
    tokens = defaults.batch_size * defaults.seq_length * defaults.grad_accum
    cases = [(loop, model) for model in args.models for loop in LOOPS] if args.apart else [
        ("kit", model) for model in args.models]
    rounds = []  # {loop/model: its step times} per round, of its one process or two
    for r in range(args.rounds):
        rounds.append({})
        for loop, model in cases:  # --apart: kit, bare, kit, bare, ...
            times = measure(loop, model, args)
            rounds[-1] |= times
            print(f"round {r + 1}, {loop}/{model} process: " + ", ".join(
                f"{name} {tokens / statistics.mean(s):,.0f}" for name, s in times.items())
                + " tokens/s", flush=True)

    how = "each loop in a process of its own" if args.apart else "the loops taking turns"
    print(f"\n{tokens} tokens a step ({defaults.batch_size} x {defaults.grad_accum} sequences "
          f"of {defaults.seq_length}), {args.steps} steps after {args.warmup} of warm-up, "
          f"{args.rounds} rounds, {how}; the kit's wandb {defaults.wandb}; train_llm.py flags: "
          f"{' '.join(args.flags) or 'the defaults'}")
    for name in sorted({name for r in rounds for name in r}):
        values = [tokens / statistics.mean(r[name]) for r in rounds if name in r]
        print(f"{name:14} {statistics.median(values):10,.0f} tokens/s (median; each process: "
              + ", ".join(f"{v:,.0f}" for v in values) + ")")
        if args.apart:
            steps = [1000 * statistics.mean(r[name]) for r in rounds if name in r]
            print(f"{'':14} step ms, min / median / max of the processes: "
                  f"{spread(steps, '.2f')}")

    if args.apart:  # each round's ratio of its two processes' mean steps
        def ratios(a, b):
            return [statistics.mean(r[b]) / statistics.mean(r[a]) for r in rounds]
        print("ratios: each round's kit process ÷ its bare process; the median round")
    else:
        def ratios(a, b):  # the blocks of all processes that ran both
            return [x for r in rounds if a in r and b in r
                    for x in block_ratios(r[a], r[b], defaults.log_freq)]
        print(f"ratios: the median over blocks of {defaults.log_freq} steps (--log-freq)")
    for model in args.models:
        values = ratios(f"kit/{model}", f"bare/{model}")
        print(f"kit ÷ bare, {model} model: {statistics.median(values):.3f} (goal ≥ 0.97)"
              + (f"; min / median / max of {len(values)} rounds: {spread(values, '.3f')}"
                 if args.apart else ""))
    if len(args.models) == 2:
        print(f"bare loop, shipped ÷ plain model: "
              f"{statistics.median(ratios('bare/shipped', 'bare/plain')):.3f} (goal ≥ 1)")


if __name__ == "__main__":
    main()
