"""Plot runs' training loss, validation loss and throughput from their metrics.jsonl, and, for
runs that mix domains (--mix, --odm), each domain's probability and validation loss. Several
runs are drawn on the same axes, to compare them (their seeds' spread: docs/benchmarks.md,
"Muon beside AdamW", made by experiments/optimizer_experiment.py).

    python scripts/plot_metrics.py outputs/demo             # writes outputs/demo/metrics.png
    python scripts/plot_metrics.py outputs/adamw outputs/muon --out compare.png
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draw to a file; no display needed
import matplotlib.pyplot as plt  # noqa: E402


def read_rows(exp_dir):
    """The step lines of a run's metrics.jsonl (a torn last line and notes left out)."""
    path = exp_dir / "metrics.jsonl"
    if not path.is_file():
        sys.exit(f"{path}: no such file. Pass the directory of a run of train_llm.py "
                 "(outputs/NAME) that has trained a step.")
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except ValueError:  # the torn last line of a run that is being killed
            pass
    rows = [row for row in rows if isinstance(row, dict) and "step" in row]  # (not a note)
    if not rows:
        sys.exit(f"{path} holds no step yet: nothing to plot.")
    return rows


def series(rows, key):
    points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
    return [step for step, _ in points], [value for _, value in points]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exp_dirs", type=Path, nargs="+",
                        help="experiment directories of train_llm.py (several: compared)")
    parser.add_argument("--out", type=Path, default=None,
                        help="the image (default: RUN/metrics.png; with several runs required)")
    args = parser.parse_args()
    if args.out is None and len(args.exp_dirs) > 1:
        parser.error("several runs: pass --out, the image to write (say compare.png)")
    runs = {exp_dir.name: read_rows(exp_dir) for exp_dir in args.exp_dirs}
    if len(runs) < len(args.exp_dirs):
        parser.error("two runs of one name: pass directories whose names differ")

    one = len(runs) == 1  # (one run: its series by kind; several: by run)
    domains = sorted({key[len("mix/p_"):] for rows in runs.values() for key in rows[-1]
                      if key.startswith("mix/p_")})
    fig, axes = plt.subplots(4 if domains else 2, 1, sharex=True,
                             figsize=(8, 11 if domains else 6))
    loss_ax, speed_ax = axes[0], axes[-1]
    for name, rows in runs.items():
        tag = "" if one else f"{name}: "
        loss_ax.plot(*series(rows, "loss"), linewidth=0.8, label=f"{tag}train loss")
        loss_ax.plot(*series(rows, "val_loss"), "o-", label=f"{tag}validation loss")
        for domain in domains:
            axes[1].plot(*series(rows, f"mix/p_{domain}"), label=f"{tag}{domain}")
            axes[2].plot(*series(rows, f"val_loss/{domain}"), "o-", label=f"{tag}{domain}")
        speed_ax.plot(*series(rows, "tokens_per_s"), label=name)
    loss_ax.set_ylabel("loss (nats/token)")
    if domains:
        axes[1].set_ylabel("sampling probability")
        axes[2].set_ylabel("validation loss")
    for ax in axes[:-1] if one else axes:
        ax.legend()
    for ax in axes:
        ax.grid(alpha=0.3)
    speed_ax.set_ylabel("tokens / s")
    speed_ax.set_xlabel("optimizer step")
    fig.suptitle(" vs ".join(runs))
    fig.tight_layout()
    out = args.out or args.exp_dirs[0] / "metrics.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
