"""Uniform mixing vs Online Data Mixing (exp3, smoothed-mean) on the sample corpus's domains.

    python scripts/odm_experiment.py                 # 9 runs of the tiny model, ~12 min on 2 cores
    python scripts/odm_experiment.py --steps 100 --seeds 0   # a smoke run

Each variant trains the tiny model from the same start with the same per-domain pipelines;
only the sampling probabilities differ. The score is the one of the ODM paper: how many steps
a variant needs to reach the uniform run's final mean validation loss (the mean over domains
of each domain's validation loss), per seed. It also times OnlineMixer.update against a
training step, and draws the probabilities over time (odm_probabilities.png).
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import data  # noqa: E402

DOMAINS = ["code", "docstrings", "prose", "reference"]
VARIANTS = {"uniform": ["--mix", ",".join(f"{d}=1" for d in DOMAINS)],
            "exp3": ["--odm", "exp3"], "smoothed-mean": ["--odm", "smoothed-mean"]}


def run(variant, seed, args):
    name = f"{variant}-seed{seed}"
    exp_dir = args.out / name
    if not (exp_dir / "state.json").exists() or json.loads(
            (exp_dir / "state.json").read_text())["global_step"] < args.steps:
        subprocess.run([sys.executable, "train_llm.py", f"--experiment-name={name}",
                        f"--save-dir={args.out}", f"--seed={seed}", f"--max-steps={args.steps}",
                        f"--val-freq={args.val_freq}", f"--log-freq={args.val_freq}",
                        f"--val-batches={args.val_batches}",
                        f"--odm-warmup-steps={args.warmup}", f"--ckpt-freq={args.steps}",
                        "--wandb=disabled", *VARIANTS[variant]],
                       cwd=ROOT, check=True, capture_output=True)
    return [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]


def mean_val(row):
    return statistics.mean(row[f"val_loss/{d}"] for d in DOMAINS)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--val-freq", type=int, default=25)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--val-batches", type=int, default=8, help="per domain")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs/odm-experiment")
    args = parser.parse_args()

    results = {v: {s: run(v, s, args) for s in args.seeds} for v in VARIANTS}
    print(f"{args.steps} steps of 8 x 128 tokens, validation every {args.val_freq}, "
          f"ODM warm-up {args.warmup}, seeds {args.seeds}\n")
    print("| variant | final mean val loss (per seed) | steps to uniform's final (per seed) |")
    print("|---|---|---|")
    for variant, runs in results.items():
        finals, reach = [], []
        for seed, rows in runs.items():
            target = mean_val([r for r in results["uniform"][seed] if "val_loss" in r][-1])
            vals = [r for r in rows if "val_loss" in r]
            finals.append(f"{mean_val(vals[-1]):.4f}")
            hit = next((r["step"] for r in vals if mean_val(r) <= target + 1e-9), None)
            reach.append(str(hit) if hit else f">{args.steps}")
        print(f"| {variant} | {' / '.join(finals)} | {' / '.join(reach)} |")

    # The mixer's cost: its update against a training step of these runs (median step time).
    mixer = data.OnlineMixer([1] * len(DOMAINS), variant="exp3")
    n = 20_000
    start = time.perf_counter()
    for step in range(1, n + 1):
        mixer.update({i: 5.0 + (step * (i + 1)) % 7 / 7 for i in range(len(DOMAINS))}, step)
    update_s = (time.perf_counter() - start) / n
    step_s = statistics.median(8 * 128 / r["tokens_per_s"] for runs in results.values()
                               for rows in runs.values() for r in rows if "tokens_per_s" in r)
    print(f"\nOnlineMixer.update: {update_s * 1e6:.1f} us; a training step: {step_s * 1e3:.0f} ms;"
          f" update / step = {update_s / step_s:.4%}")

    fig, axes = plt.subplots(1, 2, sharey=True, figsize=(11, 4))
    for ax, variant in zip(axes, ["exp3", "smoothed-mean"]):
        rows = results[variant][args.seeds[0]]
        for d in DOMAINS:
            ax.plot([r["step"] for r in rows], [r[f"mix/p_{d}"] for r in rows], label=d)
        ax.set_title(f"{variant}, seed {args.seeds[0]}")
        ax.set_xlabel("optimizer step")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("sampling probability")
    axes[0].legend()
    fig.tight_layout()
    out = args.out / "odm_probabilities.png"
    fig.savefig(out, dpi=110)
    print(f"\n{out}")


if __name__ == "__main__":
    main()
