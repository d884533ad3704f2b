"""Training speed on a CPU, on a quiet machine and on a busy one: tokens/s, user and system CPU
seconds, page faults and peak memory of train_llm.py's demo (the shipped tiny model and sample
corpus), each a fresh process. "Busy" is the same run beside --hogs other processes that each
spin one core, as a learner's laptop with something else running.

    python benchmarks/bench_cpu.py                                 # this kit: quiet and busy
    python benchmarks/bench_cpu.py --before ../kit-old             # and an older checkout
    python benchmarks/bench_cpu.py --variants kit one-thread passive

--variants runs the kit with environment variables a user might set instead: one-thread
(OMP_NUM_THREADS=1), passive (OMP_WAIT_POLICY=PASSIVE: OpenMP threads sleep at once when they
wait), all-cores (OMP_NUM_THREADS=number of cores). Tokens/s is the median over the log
intervals after the first (start-up left out); CPU seconds and faults are the whole process's.
The ratios at the end are busy ÷ quiet of one kit, and after ÷ before of one load.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
VARIANTS = {"kit": {}, "one-thread": {"OMP_NUM_THREADS": "1"},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"},
            "all-cores": {"OMP_NUM_THREADS": str(os.cpu_count())}}
HOG = "while True: pass"


def run(kit, flags, env, tmp, name):
    """One training run: its metrics and the kernel's accounting of the process."""
    cmd = [sys.executable, "train_llm.py", "--experiment-name", name, "--save-dir", str(tmp),
           *flags]
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=kit, env={**os.environ, **env},
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    err = proc.stderr.read()
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode:
        sys.exit(f"{name} failed:\n{err.decode()[-3000:]}")
    speeds = [m["tokens_per_s"] for m in map(json.loads, open(tmp / name / "metrics.jsonl"))
              if "tokens_per_s" in m]
    return {"tokens_per_s": statistics.median(speeds[1:] or speeds), "user": usage.ru_utime,
            "sys": usage.ru_stime, "faults": usage.ru_minflt, "rss_mib": usage.ru_maxrss / 1024,
            "wall": time.perf_counter() - start}


def measure(args, kit_name, kit, variant, load, tmp):
    flags = ["--max-steps", str(args.steps), "--log-freq", str(args.log_freq),
             "--val-freq", str(10**9), "--ckpt-freq", str(10**9), "--val-batches", "1",
             "--sample-tokens", "0", "--wandb", "disabled", *args.extra.split()]
    hogs = [subprocess.Popen([sys.executable, "-c", HOG]) for _ in range(args.hogs)
            if load == "busy"]
    try:
        name = f"{kit_name}-{variant}-{load}"
        print(f"running {name} ...", file=sys.stderr, flush=True)
        return run(kit, flags, VARIANTS[variant], tmp, name)
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, metavar="DIR",
                        help="also run the kit checked out in DIR (a git worktree)")
    parser.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=["kit"])
    parser.add_argument("--loads", nargs="+", choices=["quiet", "busy"],
                        default=["quiet", "busy"])
    parser.add_argument("--hogs", type=int, default=1, help="spinning processes when busy")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--log-freq", type=int, default=5)
    parser.add_argument("--extra", default="", help="more train_llm.py flags")
    args = parser.parse_args()
    if any(os.environ.get(k) for k in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY")):
        sys.exit("unset OMP_NUM_THREADS and OMP_WAIT_POLICY: the variants set them")
    kits = [("after", ROOT)] + ([("before", args.before.resolve())] if args.before else [])
    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench_cpu_") as tmp:
        for kit_name, kit in kits:
            for variant in args.variants:
                for load in args.loads:
                    rows[kit_name, variant, load] = measure(args, kit_name, kit, variant, load,
                                                            Path(tmp))
    print(f"{os.cpu_count()} cores; {args.steps} steps of the demo; busy: {args.hogs} spinning "
          f"process(es)\n")
    print("| kit | variant | load | tokens/s | user s | sys s | minor faults | peak RSS MiB |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for (kit, variant, load), r in rows.items():
        print(f"| {kit} | {variant} | {load} | {r['tokens_per_s']:,.0f} | {r['user']:.1f} | "
              f"{r['sys']:.1f} | {r['faults']:,} | {r['rss_mib']:,.0f} |")
    print()
    for (kit, variant, load), r in rows.items():
        if load == "busy" and (kit, variant, "quiet") in rows:
            ratio = r["tokens_per_s"] / rows[kit, variant, "quiet"]["tokens_per_s"]
            print(f"{kit}, {variant}: busy / quiet = {ratio:.2f} (tokens/s)")
        if kit == "before" and ("after", variant, load) in rows:
            ratio = rows["after", variant, load]["tokens_per_s"] / r["tokens_per_s"]
            print(f"{variant}, {load}: after / before = {ratio:.2f} (tokens/s)")


if __name__ == "__main__":
    main()
