"""How much the training loader slows a Python-bound training thread (DESIGN.md section 6).

    python benchmarks/bench_gil.py [--seconds 2] [--rounds 30] [--json out.json]   # ~3 min

On a GPU an eager step is bound by the Python that launches its kernels, so whatever else
holds this process's GIL slows it. Here a main thread stands in for that: steps of 2,000 tiny
torch ops (about the launches of a GPT-2 step). Beside it, the kit's training loader at the
GPU shape (train_llm.build_pipeline: --seq-length 1024, --batch-size 16, --grad-accum 2, the
shipped corpus) is pulled at 10 batches/s, each batch's tensors touched as a trainer would.

Per round, the main thread runs alone, then beside the loader (their order alternating). From
/proc/self/task/TID/schedstat and status, over its steps (not inside next(loader)):
- speed: steps/s beside the loader ÷ alone, with the time it waited in the run queue taken out
  (goal >= 0.97): on a machine with fewer free cores than busy threads the queue measures the
  machine, not the loader; the wall-clock ratio is shown beside it;
- blocked: the share of its time off a core and out of the run queue: waiting for the GIL.
  Alone it is not zero on a VM (time the kernel spends on interrupts, or the host takes, is
  no thread's), so the goal is on what the loader adds: beside - alone <= 0.5%. The
  voluntary context switches per step tell waits apart (alone: none).
The time inside next(loader) is counted apart: "data wait" (its share of the wall clock), and
the main thread's own CPU time per batch handed over. The last line is the median of the
rounds.
"""

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

import train_llm  # noqa: E402
import utils  # noqa: E402

OPS_PER_STEP = 2000
BATCHES_PER_S = 10


def thread_counters():
    """(ns on a core, ns in the run queue, voluntary context switches) of the calling thread."""
    task = Path(f"/proc/self/task/{threading.get_native_id()}")
    on_cpu, queued, _ = map(int, (task / "schedstat").read_text().split())
    switches = next(int(line.split()[1]) for line in (task / "status").read_text().splitlines()
                    if line.startswith("voluntary_ctxt_switches"))
    return on_cpu, queued, switches


def python_step(x):
    for _ in range(OPS_PER_STEP):
        x.add_(1.0)


def run(seconds, loader=None):
    """Steps of the main thread for ``seconds``, pulling ``loader`` at BATCHES_PER_S; the
    counters are read around each pull (10 a second), not at every step."""
    x, steps, batches, pull_cpu = torch.zeros(8), 0, 0, 0.0
    pulls = [0.0, 0, 0, 0]  # wall, on a core, queued, switches: inside next(loader)
    start = time.perf_counter()
    first = thread_counters()
    while (now := time.perf_counter()) - start < seconds:
        if loader is not None and batches < (now - start) * BATCHES_PER_S:
            before = thread_counters()
            cpu = time.thread_time()
            batch = next(loader)
            batch["input_ids"].sum()  # (the trainer reads each batch)
            pull_cpu += time.thread_time() - cpu
            after = thread_counters()
            batches += 1
            pulls = [pulls[0] + time.perf_counter() - now,
                     *(total + b - a for total, a, b in zip(pulls[1:], before, after))]
            continue
        python_step(x)
        steps += 1
    last = thread_counters()
    total = time.perf_counter() - start
    wall = total - pulls[0]
    on_cpu, queued, switches = ((b - a - p) for a, b, p in zip(first, last, pulls[1:]))
    return {"steps_per_s": steps / (wall - queued / 1e9), "steps_per_wall_s": steps / wall,
            "blocked": max(0.0, wall - (on_cpu + queued) / 1e9) / wall,
            "switches_per_step": switches / steps, "data_wait": pulls[0] / total,
            "batches_per_s": batches / total,
            "pull_cpu_us": pull_cpu * 1e6 / batches if batches else 0.0}


def build_loader():
    args = train_llm.parse_args(["-e", "bench_gil", "--seq-length", "1024", "--batch-size", "16",
                                 "--grad-accum", "2"])
    tokenizer = utils.pretrained(train_llm.AutoTokenizer, args.tokenizer, "--tokenizer")
    return train_llm.build_pipeline(args.dataset, tokenizer, args, 0, 1, train=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=2)
    parser.add_argument("--rounds", type=int, default=30)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    loader = build_loader()
    for _ in range(3 * 2):  # warm: the loader's first batches, the tokenizer's caches
        next(loader)
    rounds = []
    for r in range(args.rounds):
        order = ["alone", "beside"] if r % 2 == 0 else ["beside", "alone"]
        result = {name: run(args.seconds, loader if name == "beside" else None)
                  for name in order}
        alone, beside = result["alone"], result["beside"]
        result["speed"] = beside["steps_per_s"] / alone["steps_per_s"]
        result["wall_speed"] = beside["steps_per_wall_s"] / alone["steps_per_wall_s"]
        result["added_blocked"] = beside["blocked"] - alone["blocked"]
        rounds.append(result)
        print(f"round {r + 1}: speed {result['speed']:.3f} of alone (wall clock "
              f"{result['wall_speed']:.3f}), blocked {100 * beside['blocked']:.2f}% (alone "
              f"{100 * alone['blocked']:.2f}%), voluntary switches per step "
              f"{beside['switches_per_step']:.2f} (alone {alone['switches_per_step']:.2f}), "
              f"data wait {100 * beside['data_wait']:.2f}%, "
              f"{beside['batches_per_s']:.1f} batches/s", flush=True)
    loader.close()
    summary = {key: statistics.median(r[key] for r in rounds)
               for key in ("speed", "wall_speed", "added_blocked")}
    summary |= {f"{key}_{name}": statistics.median(r[name][key] for r in rounds)
                for key in ("blocked", "switches_per_step", "data_wait", "pull_cpu_us")
                for name in ("alone", "beside")}
    print(f"median: speed {summary['speed']:.3f} of alone (goal >= 0.97; wall clock "
          f"{summary['wall_speed']:.3f}), blocked {100 * summary['blocked_beside']:.2f}% "
          f"(alone {100 * summary['blocked_alone']:.2f}%; added "
          f"{100 * summary['added_blocked']:.2f}%, goal <= 0.5%), voluntary switches per "
          f"step {summary['switches_per_step_beside']:.2f}, data wait "
          f"{100 * summary['data_wait_beside']:.2f}%, the training thread's CPU per batch "
          f"handed over {summary['pull_cpu_us_beside']:.0f} us")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
