"""What a log step costs the training thread beside an ordinary one, with wandb as shipped.

    python benchmarks/bench_wandb.py [--steps 300] [--log-freq 10]   # ~20 s

utils.MetricsLog with `--wandb offline` (the default) gets the metrics a training run writes:
every step a line, and every --log-freq steps the log line that flushes metrics.jsonl and hands
the interval's steps to wandb. Between writes the thread computes for about a step of the demo
(a matmul loop of ~10 ms), so wandb's own threads run beside a busy one, as in training. Printed:
the median time of MetricsLog.write on an ordinary step and on a log step, and their
difference, the extra a log step costs the loop.
"""

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import utils  # noqa: E402


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--log-freq", type=int, default=10)
    cli = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        args = argparse.Namespace(max_steps=cli.steps, wandb="offline", wandb_project="bench",
                                  experiment_name="bench")
        log = utils.MetricsLog(Path(tmp), args, {"global_step": 0, "wandb_run_id": None}, 0)
        log.progress.disable = True
        a, times = torch.randn(256, 256), {"ordinary": [], "log": []}
        for step in range(1, cli.steps + 1):
            deadline = time.perf_counter() + 0.01
            while time.perf_counter() < deadline:  # a step's compute
                a = torch.tanh(a @ a)
            metrics = {"step": step, "loss": 1.0 / step, "lr": 1e-3, "tokens_seen": step * 1024}
            if step % cli.log_freq == 0:
                metrics |= {"tokens_per_s": 1e5, "mfu": None, "data_wait": 0.01}
            start = time.perf_counter()
            log.write(metrics)
            times["log" if step % cli.log_freq == 0 else "ordinary"].append(
                time.perf_counter() - start)
        log.close()
    ordinary, logged = (statistics.median(times[k]) * 1e3 for k in ("ordinary", "log"))
    print(f"MetricsLog.write, median: ordinary step {ordinary:.3f} ms, log step {logged:.3f} ms;"
          f" a log step's extra: {logged - ordinary:.3f} ms")


if __name__ == "__main__":
    main()
