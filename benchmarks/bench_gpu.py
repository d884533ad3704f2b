"""Training speed on this machine's GPU: tokens/s, MFU, data wait and peak memory of
train_llm.py, eager and compiled, each with the kit's data pipeline and with random tokens
(no pipeline at all: the baseline the data wait is measured against). One run, one table.
Tokens/s and MFU count the time inside the trainer's timed blocks (data, forward, backward,
update), as its log lines do; peak memory is the CUDA allocator's active peak (reserved memory,
what nvidia-smi shows, is higher), or the process's peak RSS on a CPU.

    python benchmarks/bench_gpu.py                          # GPT-2 124M, seq 1024, 16 x 2 per step
    python benchmarks/bench_gpu.py --cases eager compiled torchrun fsdp --before ../kit-old

--cases: eager, compiled (--compile), torchrun (one rank under torchrun: NCCL), fsdp (the same
with --fsdp); eager and compiled also run on random tokens (benchmarks/premade.py). --before
DIR runs every case with the kit checked out in DIR too (a `git worktree` of an older commit
whose main() takes build_loader), for a before/after table from one run. With eager and
compiled both run, their losses over the first 20 steps are compared (the same data and
weights: they differ only by bf16 rounding).

Each case is a fresh train_llm.py process (its own peak memory) on the shipped sample corpus
and tokenizer, so it runs offline. The first --log-freq steps (compilation, warm-up) are
left out of the averages. On a CPU it runs too (slowly): `--device cpu --model-name
assets/tiny-gpt2 --seq-length 128 --batch-size 8 --cases eager torchrun fsdp` checks the
script itself.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def random_batches_main(kit, argv):
    """train_llm.main() of the kit in ``kit`` with random token ids (benchmarks/premade.py,
    behind the kit's own Prefetch) in place of its pipeline, so that only the data differs."""
    sys.path.insert(0, kit)
    import premade

    import train_llm

    sys.argv = ["train_llm.py", *argv]
    train_llm.main(build_loader=premade.build_loader)


CASES = {  # name: (under torchrun, train_llm.py flags, also on random tokens)
    "eager": (False, [], True),
    "compiled": (False, ["--compile"], True),
    "torchrun": (True, [], False),
    "fsdp": (True, ["--fsdp"], False),
}


def run_case(name, flags, random_data, save_dir, log_freq, kit=ROOT, torchrun=False):
    """One training run: the means of its logged speed metrics after the first interval, and
    its loss at every step."""
    argv = ["-e", name, "--save-dir", str(save_dir), *flags]
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node=1"] if torchrun else [sys.executable])
    command = ([*launcher, __file__, "--random-data-worker", str(kit), "--", *argv]
               if random_data else [*launcher, str(kit / "train_llm.py"), *argv])
    result = subprocess.run(command, cwd=kit, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (save_dir / name / "metrics.jsonl").open()]
    timed = [r for r in rows if "tokens_per_s" in r and r["step"] > log_freq] or \
        [r for r in rows if "tokens_per_s" in r]

    def mean(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    memory = max((v for r in timed for k, v in r.items()
                  if k in ("mem/active_peak_gib", "mem/peak_rss_gib")), default=None)
    return {"tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
            "data_wait": mean("data_wait"), "peak_gib": memory,
            "losses": [r["loss"] for r in rows]}


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-name", default="assets/gpt2-124m")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-freq", type=int, default=10)
    parser.add_argument("--device", default=None)
    parser.add_argument("--cases", nargs="+", choices=list(CASES), default=["eager", "compiled"])
    parser.add_argument("--no-compile", action="store_true", help="leave out the compiled case")
    parser.add_argument("--before", type=Path, default=None, metavar="DIR",
                        help="also run every case with the kit checked out in DIR")
    parser.add_argument("--extra", default="", help="more train_llm.py flags, e.g. "
                        "'--activation-checkpointing'")
    args = parser.parse_args()
    if args.no_compile:
        args.cases = [case for case in args.cases if case != "compiled"]
    if Path(args.model_name).exists():  # the same model for both kits
        args.model_name = str(Path(args.model_name).resolve())
    return args


def run_all(args, tmp):
    """[(kit, case, data, results)] of every run asked for."""
    common = ["--model-name", args.model_name, "--seq-length", str(args.seq_length),
              "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
              "--max-steps", str(args.steps), "--log-freq", str(args.log_freq),
              "--val-freq", str(10**9), "--ckpt-freq", str(10**9), "--val-batches", "1",
              "--sample-tokens", "0", "--wandb", "disabled", "--warmup-steps", "10",
              *(["--device", args.device] if args.device else []), *args.extra.split()]
    kits = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    rows = []
    for kit_name, kit in kits:
        for case in args.cases:
            torchrun, flags, with_random = CASES[case]
            for random_data in (False, True) if with_random else (False,):
                name = f"{kit_name}-{case}-{'random' if random_data else 'kit'}"
                print(f"running {name} ...", file=sys.stderr, flush=True)
                result = run_case(name, common + flags, random_data, tmp, args.log_freq, kit,
                                  torchrun)
                rows.append((kit_name, case, "random tokens" if random_data else "kit pipeline",
                             result))
    return rows


def print_table(args, rows):
    print(f"{args.model_name}, seq {args.seq_length}, {args.batch_size} x {args.grad_accum} per "
          f"step, {args.steps} steps (the first {args.log_freq} not averaged)")
    print("| kit | case | data | tokens/s | MFU | data wait | peak memory, active (GiB) |")
    print("|---|---|---|---|---|---|---|")
    for kit, case, data_name, r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
        print(f"| {kit} | {case} | {data_name} | {r['tokens_per_s']:,.0f} | {mfu} | "
              f"{r['data_wait']:.2%} | {peak} |")
    speed = {(kit, case, data_name): r for kit, case, data_name, r in rows}
    for (kit, case, data_name), r in speed.items():
        if data_name == "random tokens":
            ratio = speed[kit, case, "kit pipeline"]["tokens_per_s"] / r["tokens_per_s"]
            print(f"{kit} {case}: kit pipeline / random tokens = {ratio:.3f} (tokens/s)")
        if kit == "before" and ("after", case, data_name) in speed:
            ratio = speed["after", case, data_name]["tokens_per_s"] / r["tokens_per_s"]
            print(f"{case}, {data_name}: after / before = {ratio:.3f} (tokens/s)")
    for kit in ("after", "before"):
        if (kit, "eager", "kit pipeline") in speed and (kit, "compiled", "kit pipeline") in speed:
            pairs = list(zip(speed[kit, "eager", "kit pipeline"]["losses"][:20],
                             speed[kit, "compiled", "kit pipeline"]["losses"][:20]))
            worst = max(abs(a - b) / abs(a) for a, b in pairs)
            print(f"{kit}: eager vs compiled loss over the first {len(pairs)} steps: "
                  f"largest relative difference {worst:.2e}")


def main():
    if "--random-data-worker" in sys.argv:
        i = sys.argv.index("--random-data-worker")
        return random_batches_main(sys.argv[i + 1], sys.argv[sys.argv.index("--") + 1:])
    args = parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        rows = run_all(args, Path(tmp))
    print_table(args, rows)


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
