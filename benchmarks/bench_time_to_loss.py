"""Time to a target loss: the kit as shipped beside the kit with AdamW, on the demo's tokens.

    python benchmarks/bench_time_to_loss.py            # 2 seeds x 2 runs of 600 steps, ~6 min
    python benchmarks/bench_time_to_loss.py --steps 100 --seeds 0   # a smoke run

Each seed trains the demo twice (python train_llm.py -e NAME: the tiny GPT-2, 600 steps of 8 x
128 tokens of the sample corpus), as shipped (from scratch: Muon on the hidden matrices) and with
--optimizer adamw, nanoGPT's optimizer, as the stand-in for nanoGPT's train.py (per step the two
learn alike: docs/benchmarks.md). Both validate every --val-freq steps on the same 16 batches.
The target is the AdamW run's final validation loss; each run's time to it is its training wall
clock (validations and saves taken out) until its validation loss first reaches it. A seed's
two runs follow each other, so that what else the machine does falls on both alike.
"""

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = {"shipped": [], "adamw": ["--optimizer=adamw"]}


def train(name, flags, seed, args):
    """[(step, training seconds so far, val_loss)] of a run (trained unless it is there)."""
    exp_dir = args.out / f"{name}-seed{seed}"
    if not (exp_dir / "metrics.jsonl").exists():
        subprocess.run([sys.executable, "train_llm.py", f"--experiment-name={exp_dir.name}",
                        f"--save-dir={args.out}", f"--seed={seed}", f"--max-steps={args.steps}",
                        f"--val-freq={args.val_freq}", "--log-freq=5", "--ckpt-freq=100000",
                        "--sample-tokens=0", "--wandb=disabled", *flags],
                       cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]
    points, seconds, last = [], 0.0, 0
    tokens_per_step = rows[0]["tokens_seen"]
    for row in rows:
        if "tokens_per_s" in row:  # a log step: the wall clock since the last one, less the
            wall = (row["step"] - last) * tokens_per_step / row["tokens_per_s"]  # other work
            seconds += wall - row["time/validation_s"] - row["time/checkpoint_s"]
            last = row["step"]
        if "val_loss" in row:  # (a validation step is a log step: --val-freq % 5 == 0)
            points.append((row["step"], seconds, row["val_loss"]))
    return points


def reached(points, target):
    """(step, seconds) of the first validation at or below ``target``, or None."""
    return next(((step, s) for step, s, loss in points if loss <= target), None)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--val-freq", type=int, default=25)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs/bench-time-to-loss")
    args = parser.parse_args()
    assert args.val_freq % 5 == 0 and args.steps % args.val_freq == 0
    print("| seed | target (AdamW's final val loss) | AdamW: step, s | shipped: step, s | "
          "shipped's final val loss | sooner |")
    print("|---:|---:|---:|---:|---:|---:|")
    for seed in args.seeds:
        runs = {name: train(name, flags, seed, args) for name, flags in RUNS.items()}
        target = runs["adamw"][-1][2]
        (a_step, a_s), shipped = reached(runs["adamw"], target), reached(runs["shipped"], target)
        s_step, s_s = shipped or (None, float("nan"))
        print(f"| {seed} | {target:.3f} | {a_step}, {a_s:.1f} | {s_step}, {s_s:.1f} | "
              f"{runs['shipped'][-1][2]:.3f} | {a_s / s_s:.1f}x |")


if __name__ == "__main__":
    main()
