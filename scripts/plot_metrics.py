"""Plot a run's training loss, validation loss and throughput from its metrics.jsonl, and,
for a run that mixes domains (--mix, --odm), each domain's probability and validation loss.

    python scripts/plot_metrics.py outputs/demo      # writes outputs/demo/metrics.png
"""

import argparse
import json
import sys
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # draw to a file; no display needed
import matplotlib.pyplot as plt  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("exp_dir", type=Path, help="an experiment directory of train_llm.py")
    args = parser.parse_args()

    path = args.exp_dir / "metrics.jsonl"
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

    def series(key):
        points = [(row["step"], row[key]) for row in rows if row.get(key) is not None]
        return [step for step, _ in points], [value for _, value in points]

    domains = sorted(key[len("mix/p_"):] for key in rows[-1] if key.startswith("mix/p_"))
    fig, axes = plt.subplots(4 if domains else 2, 1, sharex=True,
                             figsize=(8, 11 if domains else 6))
    loss_ax, speed_ax = axes[0], axes[-1]
    loss_ax.plot(*series("loss"), linewidth=0.8, label="train loss")
    loss_ax.plot(*series("val_loss"), "o-", label="validation loss")
    loss_ax.set_ylabel("loss (nats/token)")
    if domains:
        for name in domains:
            axes[1].plot(*series(f"mix/p_{name}"), label=name)
            axes[2].plot(*series(f"val_loss/{name}"), "o-", label=name)
        axes[1].set_ylabel("sampling probability")
        axes[2].set_ylabel("validation loss")
    for ax in axes[:-1]:
        ax.legend()
        ax.grid(alpha=0.3)
    speed_ax.plot(*series("tokens_per_s"), color="tab:green")
    speed_ax.set_ylabel("tokens / s")
    speed_ax.set_xlabel("optimizer step")
    speed_ax.grid(alpha=0.3)
    fig.suptitle(args.exp_dir.name)
    fig.tight_layout()
    out = args.exp_dir / "metrics.png"
    fig.savefig(out, dpi=120)
    print(out)


if __name__ == "__main__":
    main()
