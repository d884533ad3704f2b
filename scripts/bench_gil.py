"""How much the training loader slows a Python-bound training thread (DESIGN.md section 6).

    python scripts/bench_gil.py [--seconds 20] [--rounds 3] [--json out.json]   # ~3 min

On a GPU an eager step is bound by the Python that launches its kernels, so whatever else
holds this process's GIL slows it. Here a main thread stands in for that: steps of 2,000 tiny
torch ops (about the launches of a GPT-2 step). Beside it, the kit's training loader at the
GPU shape (train_llm.build_pipeline: --seq-length 1024, --batch-size 16, --grad-accum 2, the
shipped corpus) is pulled at 10 batches/s, each batch's tensors touched as a trainer would.

Per round, the main thread runs alone, then beside the loader (their order alternating):
- speed: steps/s beside the loader ÷ alone (goal >= 0.97);
- blocked: the share of the main thread's step time that it was neither on a core nor in the
  run queue (/proc/self/task/TID/schedstat), i.e. waiting for the GIL (goal <= 0.5%). The run
  queue is taken out so that a busy machine is not counted as the loader's doing.
The time inside next(loader) is the loader's wait, counted apart ("data wait").
The table shows the median of the rounds.
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


def schedstat():
    """(ns on a core, ns in the run queue) of the calling thread."""
    path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
    on_cpu, queued, _ = map(int, Path(path).read_text().split())
    return on_cpu, queued


def python_step(x):
    for _ in range(OPS_PER_STEP):
        x.add_(1.0)


def run(seconds, loader=None):
    """Steps of the main thread for ``seconds``, pulling ``loader`` at BATCHES_PER_S."""
    x = torch.zeros(8)
    steps, stepping, blocked, data_wait, batches = 0, 0.0, 0.0, 0.0, 0
    start = time.perf_counter()
    while (now := time.perf_counter()) - start < seconds:
        if loader is not None and batches < (now - start) * BATCHES_PER_S:
            batch = next(loader)
            batch["input_ids"].sum()  # (the trainer reads each batch)
            batches += 1
            data_wait += time.perf_counter() - now
            continue
        cpu0, queue0 = schedstat()
        t0 = time.perf_counter()
        python_step(x)
        wall = time.perf_counter() - t0
        cpu1, queue1 = schedstat()
        steps, stepping = steps + 1, stepping + wall
        blocked += max(0.0, wall - (cpu1 - cpu0 + queue1 - queue0) / 1e9)
    total = time.perf_counter() - start
    return {"steps_per_s": steps / stepping, "blocked": blocked / stepping,
            "data_wait": data_wait / total, "batches_per_s": batches / total}


def build_loader():
    args = train_llm.parse_args(["-e", "bench_gil", "--seq-length", "1024", "--batch-size", "16",
                                 "--grad-accum", "2"])
    tokenizer = utils.pretrained(train_llm.AutoTokenizer, args.tokenizer, "--tokenizer")
    return train_llm.build_pipeline(args.dataset, tokenizer, args, 0, 1, train=True)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20)
    parser.add_argument("--rounds", type=int, default=3)
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
        result["speed"] = result["beside"]["steps_per_s"] / result["alone"]["steps_per_s"]
        rounds.append(result)
        print(f"round {r + 1}: speed {result['speed']:.3f} of alone, blocked "
              f"{100 * result['beside']['blocked']:.2f}% (alone "
              f"{100 * result['alone']['blocked']:.2f}%), data wait "
              f"{100 * result['beside']['data_wait']:.2f}%, "
              f"{result['beside']['batches_per_s']:.1f} batches/s", flush=True)
    loader.close()
    summary = {"speed": statistics.median(r["speed"] for r in rounds),
               "blocked": statistics.median(r["beside"]["blocked"] for r in rounds),
               "blocked_alone": statistics.median(r["alone"]["blocked"] for r in rounds),
               "data_wait": statistics.median(r["beside"]["data_wait"] for r in rounds)}
    print(f"median: speed {summary['speed']:.3f} of alone (goal >= 0.97), blocked "
          f"{100 * summary['blocked']:.2f}% (goal <= 0.5%; alone "
          f"{100 * summary['blocked_alone']:.2f}%), data wait "
          f"{100 * summary['data_wait']:.2f}%")
    if args.json:
        Path(args.json).write_text(json.dumps({"rounds": rounds, "median": summary}, indent=1))


if __name__ == "__main__":
    main()
