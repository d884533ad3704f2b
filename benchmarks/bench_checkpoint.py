"""What a checkpoint costs the training loop: runs without saves, with synchronous saves
(--checkpoint-writer sync) and with background saves (--checkpoint-writer background), side by
side, and prints each save's cost in seconds and in step times.

    python benchmarks/bench_checkpoint.py   # GPT-2 124M, seq 64, batch 1, 13 steps, a save every 3

Each run is train_llm.py in a fresh process, logging every step. The loop time is the time
from step 1's log line to step 13's; it holds the saves of steps 3, 6, 9 and 12. A step's line
is written when its numbers are read, a step late (at the end of step 2 for step 1), so the
loop holds steps 3 to 13; an earlier kit (--before) that wrote it at once holds 2 to 13, and its
loop is scaled to 11 steps. The cost of a save is (loop time with saves - loop time without) /
4; a step time is the loop time without saves / 11. The runs alternate (none, sync,
background) --repeats times, and the medians are printed, so that a machine that drifts does
not favour one kind.

Per save, first against later ones (the first allocates the CPU copies that the later reuse):
what the training thread waited for in the save call (the log's "training waited"), and what
the save cost the loop, seen in the step times: a save at step N logs steps N - 1 and N at its
own end, and step N + 1 at the end of step N + 2, so it cost (time from the line of N - 1 to
that of N + 1) - 2 step times. That holds what the GPU waited too (on a GPU the update after a
save waits there for the save's copies; the training thread does not).
"""

import argparse
import datetime
import re
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
STAMP = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3})\] .*?step (\d+) \| loss", re.M)


def line_times(log):
    """{step: seconds} of each step's log line."""
    return {int(step): datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            for stamp, step in STAMP.findall(log)}


def run(args, kind, save_dir):
    """One run of ``kind``: none (no saves), sync, background, or before (the kit at --before,
    an earlier checkout, saving the way it does)."""
    flags = ["-e", kind, "--save-dir", str(save_dir), "--model-name", args.model_name,
             "--seq-length", str(args.seq_length), "--batch-size", str(args.batch_size),
             "--max-steps", str(args.steps), "--log-freq", "1", "--val-freq", "1000000",
             "--sample-tokens", "0", "--wandb", "disabled", "--keep-checkpoints", "1",
             "--ckpt-freq", str(1_000_000 if kind == "none" else args.every)]
    if kind in ("sync", "background"):
        flags += ["--checkpoint-writer", kind]
    if args.device:
        flags += ["--device", args.device]
    kit = Path(args.before) if kind == "before" else ROOT
    result = subprocess.run([sys.executable, str(kit / "train_llm.py"), *flags],
                            capture_output=True, text=True)
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    log = result.stderr
    waited = [tuple(map(float, x)) for x in  # (waited, of it staging)
              re.findall(r"training waited ([\d.]+) s, ([\d.]+) s of it to stage", log)]
    waited += [(float(x), 0.0) for x in re.findall(r"in ([\d.]+) s \(synchronously", log)]
    written = [float(x) for x in re.findall(r"written in the background in ([\d.]+) s", log)]
    timed = args.steps - 2  # (steps 3 to 13: step 1's line comes at the end of step 2)
    scale = timed / (args.steps - 1) if kind == "before" else 1.0  # (it holds steps 2 to 13)
    times = line_times(log)
    return (times[args.steps] - times[1]) * scale, waited, written, times


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-name", default=str(ROOT / "assets/gpt2-124m"))
    parser.add_argument("--seq-length", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=1)
    parser.add_argument("--steps", type=int, default=13)
    parser.add_argument("--every", type=int, default=3, help="--ckpt-freq of the saving runs")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default=None)
    parser.add_argument("--before", default=None, metavar="DIR",
                        help="also time the kit checked out in DIR (e.g. a git worktree of an "
                             "earlier commit), saving every --every steps its own way")
    args = parser.parse_args()
    saves = len(range(args.every, args.steps, args.every))  # inside the loop
    loops = {"none": [], "sync": [], "background": []} | ({"before": []} if args.before else {})
    waited, written = {"sync": [], "background": []}, []
    first, later = ({kind: [] for kind in waited} for _ in range(2))  # (waited, staged, cost)
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            for kind in loops:
                seconds, held, wrote, times = run(args, kind, Path(tmp) / str(repeat))
                if kind == "none":  # this repeat's step time, for the costs of its saves
                    step_time = statistics.median(times[k] - times[k - 1]
                                                  for k in range(3, args.steps + 1))
                for i, n in enumerate(range(args.every, args.steps, args.every)):
                    if kind in first:
                        cost = times[n + 1] - times[n - 1] - 2 * step_time
                        (later if i else first)[kind].append((*held[i], cost))
                loops[kind].append(seconds)
                waited.get(kind, []).extend(held)
                written.extend(wrote)
                print(f"run {repeat + 1}/{args.repeats} {kind:>10}: loop {seconds:.2f} s",
                      flush=True)
    base = statistics.median(loops["none"])
    step = base / (args.steps - 2)
    print(f"\n{args.model_name}, seq {args.seq_length}, batch {args.batch_size}: "
          f"{args.steps - 2} timed steps, {saves} saves; step time {step:.3f} s")
    print("| saves | loop (s) | cost per save (s) | in step times | training waited per save (s) |")
    print("|---|---|---|---|---|")
    for kind in [k for k in loops if k != "none"]:
        loop = statistics.median(loops[kind])
        cost = (loop - base) / saves
        held = f"{statistics.median(w[0] for w in waited[kind]):.2f}" if waited.get(kind) else ""
        print(f"| {kind} | {loop:.2f} | {cost:.2f} | {cost / step:.2f} | {held} |")
    print(f"| none | {base:.2f} | | | |")
    print("\n| saves, first / later | training waited (s) | of it staging (s) | cost (s) |"
          "\n|---|---|---|---|")
    for kind, saves_of in [(k, s) for k in first for s in (first, later)]:
        numbers = [statistics.median(save[j] for save in saves_of[kind]) for j in range(3)]
        kind = f"{kind}, {'first' if saves_of is first else 'later'}"
        print(f"| {kind} | " + " | ".join(f"{x:.3f}" for x in numbers) + " |")
    if written:
        print(f"\nbackground write: {statistics.median(written):.2f} s per checkpoint (median)")


if __name__ == "__main__":
    main()
