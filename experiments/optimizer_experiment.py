"""--optimizer muon against AdamW on the demo: the validation loss at equal steps, per seed.

    python experiments/optimizer_experiment.py                      # 6 demo runs, ~8 min on 2 cores
    python experiments/optimizer_experiment.py --steps 60 --seeds 0 # a smoke run

Each run is the demo (python train_llm.py -e NAME, 600 steps of 8 x 128 tokens of the sample
corpus, the tiny GPT-2) with --optimizer adamw or muon and a seed; nothing else differs: the
same --lr and schedule (Muon's updates are scaled to AdamW's size, build_optimizers). The table
shows each optimizer's validation loss as mean ± standard deviation over the seeds, so that a
difference inside the spread reads as none.
"""

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OPTIMIZERS = ["adamw", "muon"]


def run(optimizer, seed, args):
    """{step: val_loss} of one run (trained unless a finished one is there)."""
    name = f"{optimizer}-seed{seed}"
    exp_dir = args.out / name
    state = exp_dir / "state.json"
    if not state.exists() or json.loads(state.read_text())["global_step"] < args.steps:
        subprocess.run([sys.executable, "train_llm.py", f"--experiment-name={name}",
                        f"--save-dir={args.out}", f"--seed={seed}", f"--max-steps={args.steps}",
                        f"--val-freq={args.val_freq}", f"--ckpt-freq={args.steps}",
                        "--sample-tokens=0", "--wandb=disabled", f"--optimizer={optimizer}"],
                       cwd=ROOT, check=True, capture_output=True)
    rows = [json.loads(line) for line in (exp_dir / "metrics.jsonl").read_text().splitlines()]
    return {row["step"]: row["val_loss"] for row in rows if "val_loss" in row}


def spread(values):
    """mean ± standard deviation over seeds (± 0 for one seed)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):.4f} ± {sd:.4f}"


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--val-freq", type=int, default=100)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--out", type=Path, default=ROOT / "outputs/optimizer-experiment")
    args = parser.parse_args()
    losses = {opt: [run(opt, seed, args) for seed in args.seeds] for opt in OPTIMIZERS}
    print(f"validation loss, mean ± sd over seeds {args.seeds}\n")
    print("| step | " + " | ".join(OPTIMIZERS) + " |")
    print("|---:|" + "---:|" * len(OPTIMIZERS))
    for step in sorted(losses[OPTIMIZERS[0]][0]):
        print(f"| {step} | " + " | ".join(spread([r[step] for r in losses[opt]])
                                          for opt in OPTIMIZERS) + " |")


if __name__ == "__main__":
    main()
