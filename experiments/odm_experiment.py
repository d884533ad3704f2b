"""Online Data Mixing against the data's natural mixture and against uniform weights, on the
sample corpus's four domains.

    python experiments/odm_experiment.py                          # 12 runs of the tiny model
    python experiments/odm_experiment.py --steps 100 --seeds 0    # a smoke run

Every variant trains the tiny model from the same start on the same per-domain pipelines; only
the sampling probabilities differ: natural (--mix natural: each domain by the bytes of its
files, what reading all domains at once samples), uniform (--mix with equal weights), and ODM
(--odm exp3, --odm smoothed-mean, starting from uniform). Scored as the ODM paper scores (Albalak
et al., 2023): the steps a variant needs to reach a baseline's final mean validation loss (the
mean over domains of each domain's validation loss), per seed, against each baseline. The seeds'
spread is shown so that a difference inside it reads as none; the final validation loss of each
domain shows what a mixture that helps the mean costs the largest domain. It also times
OnlineMixer.update against a training step, and draws the probabilities over time.
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
VARIANTS = {"natural": ["--mix", "natural"],
            "uniform": ["--mix", ",".join(f"{d}=1" for d in DOMAINS)],
            "exp3": ["--odm", "exp3"], "smoothed-mean": ["--odm", "smoothed-mean"]}
BASELINES = ["natural", "uniform"]


def run(variant, seed, args):
    """The validation rows of one run (trained unless a finished one is there)."""
    name = f"{variant}-seed{seed}"
    exp_dir = args.out / name
    if not (exp_dir / "state.json").exists() or json.loads(
            (exp_dir / "state.json").read_text())["global_step"] < args.steps:
        subprocess.run([sys.executable, "train_llm.py", f"--experiment-name={name}",
                        f"--save-dir={args.out}", f"--seed={seed}", f"--max-steps={args.steps}",
                        f"--val-freq={args.val_freq}", f"--log-freq={args.val_freq}",
                        f"--val-batches={args.val_batches}", "--sample-tokens=0",
                        f"--odm-warmup-steps={args.warmup}", f"--ckpt-freq={args.steps}",
                        "--wandb=disabled", "--optimizer=adamw", *VARIANTS[variant]],
                       cwd=ROOT, check=True, capture_output=True)
    return [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]


def mean_val(row):
    return statistics.mean(row[f"val_loss/{d}"] for d in DOMAINS)


def spread(values):
    """mean ± standard deviation over seeds (± 0 for one seed)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def steps_to(rows, target, steps):
    """The first validated step whose mean validation loss is at most ``target``."""
    hit = next((r["step"] for r in rows if "val_loss" in r and mean_val(r) <= target + 1e-9),
               None)
    return str(hit) if hit else f">{steps}"


def verdict(results, variant, baseline):
    """Whether variant's final mean validation loss differs from baseline's by more than the
    seeds' spread (twice the larger standard deviation)."""
    a, b = ([mean_val([r for r in rows if "val_loss" in r][-1]) for rows in results[v].values()]
            for v in (variant, baseline))
    diff = statistics.mean(a) - statistics.mean(b)
    noise = 2 * max(statistics.stdev(a), statistics.stdev(b)) if len(a) > 1 else 0.0
    word = "lower" if diff < 0 else "higher"
    inside = abs(diff) <= noise
    return (f"{variant} vs {baseline}: final mean val loss {abs(diff):.4f} {word}; "
            + ("inside the seeds' spread (±" if inside else "beyond the seeds' spread (±")
            + f"{noise:.4f}): " + ("no difference at this scale" if inside else "a difference"))


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
    print(f"{args.steps} steps of 8 x 128 tokens, validation every {args.val_freq} "
          f"({args.val_batches} batches per domain), ODM warm-up {args.warmup}, seeds "
          f"{args.seeds}\n")
    print("| variant | final mean val loss (mean ± sd) | steps to natural's final | "
          "steps to uniform's final |")
    print("|---|---|---|---|")
    for variant, runs in results.items():
        finals = [mean_val([r for r in rows if "val_loss" in r][-1]) for rows in runs.values()]
        reach = {b: " / ".join(steps_to(rows, mean_val([r for r in results[b][seed]
                                                         if "val_loss" in r][-1]), args.steps)
                               for seed, rows in runs.items()) for b in BASELINES}
        print(f"| {variant} | {spread(finals)} | {reach['natural']} | {reach['uniform']} |")
    print("\nFinal validation loss per domain (mean ± sd over seeds):\n")
    print("| variant | " + " | ".join(DOMAINS) + " |")
    print("|---|" + "---|" * len(DOMAINS))
    for variant, runs in results.items():
        cells = [spread([[r for r in rows if "val_loss" in r][-1][f"val_loss/{d}"]
                         for rows in runs.values()]) for d in DOMAINS]
        print(f"| {variant} | " + " | ".join(cells) + " |")
    print()
    for variant in ("exp3", "smoothed-mean", "uniform"):
        for baseline in BASELINES:
            if variant != baseline:
                print(verdict(results, variant, baseline))

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
