"""Everything the kit promises on a GPU, checked and measured in one command: one table, and the
same rows as JSON.

    python scripts/gpu_check.py                        # a GPU machine: about 7 minutes (an H200)
    python scripts/gpu_check.py --out $OUT/gpu.json --parts speed   # the speed rows alone
    python scripts/gpu_check.py --smoke                # the same code paths on the CPU, tiny

Correctness, on the shipped tiny model unless said: the demo's first steps (bf16 on a GPU);
GPT-2 124M (seq 64) with the background checkpoint writer and --deterministic, SIGKILLed while
a background save is being written, then resumed: its last weights equal an uninterrupted run's
(torch.equal); --compile and eager losses agree over 20 steps (bf16 rounding apart); --fsdp on
one rank (torchrun) trains, and a run stopped and resumed logs the losses of one that was not.
Speed, GPT-2 124M at seq 1024, 16 x 2 sequences a step (benchmarks/bench_gpu.py's runs): tokens/s,
MFU, data wait and peak memory, eager and compiled, and the kit's pipeline against random tokens;
the kit's step ÷ a bare loop at the same shape (benchmarks/bench_loop.py --apart: 3 kit and 3
bare processes alternated, 100 steps each, the median pair's ratio and the spread); what a
background save of GPT-2 124M holds the loop up, and how long it takes to write. Each row's goal
is printed beside it. The time, on an H200: about 7 minutes, of which the loop's ratio about 2.5
(an estimate from the parts' step times there: this part is not yet timed on a GPU). Where the
whole would pass a machine's 10 minutes a command (an H100 may), run it as two commands with
--parts.

--smoke runs every row but --compile's on the CPU with the tiny model, in about 1.5 minutes: the
script is known to work before a GPU runs it (tests/test_gpu_check.py). Its figures mean
nothing; only its pass/fail rows are judged. Exit status 1 when a correctness row fails.
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))
import bench_gpu  # noqa: E402  (the speed runs: the kit's pipeline and random tokens)

TINY, GPT2 = str(ROOT / "assets/tiny-gpt2"), str(ROOT / "assets/gpt2-124m")
QUIET = ["--wandb", "disabled", "--sample-tokens", "0", "--val-batches", "1"]


class Check:
    """The rows of the table: each a figure or a pass/fail, with its goal."""

    def __init__(self, smoke):
        self.smoke, self.rows = smoke, []

    def row(self, group, name, value, goal="", ok=None, judged=True):
        """``ok``: True/False for a pass/fail or a goal met; None: a figure without a goal.
        A smoke run judges only the rows marked ``judged`` (correctness)."""
        ok = ok if judged or not self.smoke else None
        self.rows.append({"group": group, "check": name, "value": value, "goal": goal,
                          "ok": ok})
        mark = {True: "✓", False: "✗", None: ""}[ok]
        print(f"| {group} | {name} | {value} | {goal} | {mark} |", flush=True)

    def failed(self):
        return [r["check"] for r in self.rows if r["ok"] is False and r["group"] == "correct"]


def train(tmp, name, flags, torchrun=False, wait=True):
    """train_llm.py as a user runs it, in a fresh process; its output goes to tmp/NAME.log."""
    launcher = ([sys.executable, "-m", "torch.distributed.run", "--standalone",
                 "--nproc-per-node=1"] if torchrun else [sys.executable])
    with open(tmp / f"{name}.log", "a") as log:
        proc = subprocess.Popen([*launcher, str(ROOT / "train_llm.py"), "-e", name,
                                 "--save-dir", str(tmp), *flags], cwd=ROOT, stdout=log,
                                stderr=subprocess.STDOUT)
    if wait and proc.wait() != 0:
        sys.exit(f"{name} failed:\n{(tmp / f'{name}.log').read_text()[-3000:]}")
    return proc


def losses(tmp, name):
    return [json.loads(line)["loss"] for line in (tmp / name / "metrics.jsonl").open()]


def weights(tmp, name, step):
    path = tmp / name / "checkpoints" / f"step-{step:06d}" / "model.pt"
    return torch.load(path, weights_only=True, map_location="cpu")


def first_steps(check, tmp, args):
    """The demo's first 20 steps (bf16 autocast on a GPU): finite losses that go down."""
    train(tmp, "first", ["--max-steps", "20", *QUIET, *args.device_flags])
    loss = losses(tmp, "first")
    good = all(map(torch.isfinite, torch.tensor(loss))) and sum(loss[-5:]) / 5 < loss[0] - 0.5
    check.row("correct", "demo, first 20 steps", f"loss {loss[0]:.3f} → {loss[-1]:.3f}",
              "finite, going down", good)


def kill_during_save(check, tmp, args):
    """SIGKILL while a background save is written; the resumed run's last weights equal an
    uninterrupted run's. Also the save's cost to the loop, from the uninterrupted run's log."""
    flags = ["--model-name", args.save_model, "--seq-length", "64", "--batch-size", "1",
             "--max-steps", "12", "--ckpt-freq", "3", "--log-freq", "1", "--deterministic",
             "--checkpoint-writer", "background", "--keep-checkpoints", "0", *QUIET,
             *args.device_flags]
    train(tmp, "straight", flags)
    log = (tmp / "straight.log").read_text()
    staged = [float(x) for x in re.findall(r"([\d.]+) s of it to stage", log)]
    wrote = [float(x) for x in re.findall(r"written in the background in ([\d.]+) s", log)]
    # The first save also allocates the pinned buffers that the later ones reuse.
    later = sorted(staged[1:])[len(staged[1:]) // 2]
    check.row("save", f"background save of {Path(args.save_model).name}: loop held up to "
              "stage (first save; later ones, median)", f"{staged[0]:.3f} s; {later:.3f} s",
              "later ≤ 0.1 s", later <= 0.1, judged=False)
    check.row("save", "… written in the background in (the longest)", f"{max(wrote):.2f} s",
              "", None)

    proc, log = train(tmp, "killed", flags, wait=False), tmp / "killed.log"
    while proc.poll() is None and "step-000006 in the background" not in log.read_text():
        time.sleep(0.005)
    proc.kill()  # step 6's checkpoint is staged and being written in the background
    proc.wait()
    landed = "step-000006 (written" not in log.read_text()
    train(tmp, "killed", flags)  # the same command resumes
    resumed = "Resuming" in log.read_text()
    straight, killed = weights(tmp, "straight", 12), weights(tmp, "killed", 12)
    same = straight.keys() == killed.keys() and all(
        torch.equal(straight[k], killed[k]) for k in straight)
    check.row("correct", "SIGKILL during a background save", "landed during the write"
              if landed else "the write had finished", "", None)
    check.row("correct", "… resumed with --deterministic == uninterrupted",
              f"resumed: {resumed}, torch.equal: {same}", "equal", resumed and same)


def fsdp_resume(check, tmp, args):
    """--fsdp on one rank under torchrun: 8 steps straight, and 4 + 4 through a resume (all
    inside the 60 warm-up steps: the same learning rates whatever --max-steps says)."""
    flags = ["--fsdp", "--ckpt-freq", "4", "--deterministic", "--warmup-steps", "60", *QUIET,
             *args.device_flags]
    train(tmp, "fsdp", [*flags, "--max-steps", "8"], torchrun=True)
    train(tmp, "fsdp2", [*flags, "--max-steps", "4"], torchrun=True)
    train(tmp, "fsdp2", [*flags, "--max-steps", "8"], torchrun=True)
    straight, split = losses(tmp, "fsdp"), losses(tmp, "fsdp2")
    check.row("correct", "--fsdp (1 rank): trains, resumes", f"loss {straight[0]:.3f} → "
              f"{straight[-1]:.3f}; resumed steps 5-8 equal: {straight == split}",
              "equal losses", straight == split and straight[-1] < straight[0])


def speed(check, tmp, args):
    """benchmarks/bench_gpu.py's runs, eager and compiled, on the kit's data and random tokens."""
    common = ["--model-name", args.speed_model, "--seq-length", str(args.seq_length),
              "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
              "--max-steps", str(args.steps), "--log-freq", str(args.log_freq),
              "--val-freq", str(10**9), "--ckpt-freq", str(10**9), "--warmup-steps", "10",
              *QUIET, *args.device_flags]
    results = {}
    # Random tokens eager only: a second compiled run would cost its compilation again.
    runs = [("eager", "kit", []), ("eager", "random", []), ("compiled", "kit", ["--compile"])]
    for case, data, flags in runs[:2] if args.smoke else runs:
        results[case, data] = r = bench_gpu.run_case(
            f"{case}-{data}", common + flags, data == "random", tmp, args.log_freq)
        if data == "random":
            ratio = results[case, "kit"]["tokens_per_s"] / r["tokens_per_s"]
            check.row("speed", f"{case}: kit's pipeline ÷ random tokens", f"{ratio:.3f}",
                      "≥ 0.99", ratio >= 0.99, judged=False)
            check.row("speed", f"{case}: data wait on random tokens (the hand-over alone)",
                      f"{r['data_wait']:.2%}", "", None)
            continue
        goal = {"eager": 0.20, "compiled": 0.40}[case]
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        check.row("speed", f"{case}: tokens/s, MFU", f"{r['tokens_per_s']:,.0f}, {mfu}",
                  f"MFU ≥ {goal:.0%}", r["mfu"] is not None and r["mfu"] >= goal, judged=False)
        check.row("speed", f"{case}: data wait", f"{r['data_wait']:.2%}", "≤ 0.5%",
                  r["data_wait"] <= 0.005, judged=False)
        check.row("speed", f"{case}: peak memory", f"{r['peak_gib'] or 0:.2f} GiB", "", None)
    if not args.smoke:
        pairs = list(zip(results["eager", "kit"]["losses"][:20],
                         results["compiled", "kit"]["losses"][:20]))
        worst = max(abs(a - b) / abs(a) for a, b in pairs)
        check.row("correct", "--compile vs eager losses, 20 steps", f"largest relative "
                  f"difference {worst:.1e}", "≤ 2e-2 (bf16)", worst <= 2e-2)
    else:
        check.row("correct", "--compile vs eager losses", "not run (--smoke)", "", None)


def loop_overhead(check, tmp, args):
    """benchmarks/bench_loop.py --apart: the kit's step ÷ a bare loop's, the same model, batch
    and shape as the speed rows (16 x 2), the bare loop with the kit's skipping of the mask
    checks, the kit as shipped (no --wandb: its default, offline). Each loop in processes of
    its own, alternated kit, bare, kit, bare, ... (args.loop_rounds pairs, args.loop_steps
    measured steps each after args.loop_warmup: 3, 100 and 10 on a GPU); the figure is the
    median pair's ratio, printed with the spread. On an H200 about 2.5 minutes (estimated:
    about 20 s to start and end a process, and 111 steps of about 86 ms each)."""
    command = [sys.executable, str(ROOT / "benchmarks/bench_loop.py"), "--apart",
               "--rounds", str(args.loop_rounds), "--steps", str(args.loop_steps),
               "--warmup", str(args.loop_warmup), "--",
               "--model-name", args.speed_model, "--seq-length", str(args.seq_length),
               "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
               *args.device_flags]
    out = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    found = re.search(r"kit ÷ bare, shipped model: ([\d.]+) .*max of (\d+) rounds: "
                      r"([\d.]+) / [\d.]+ / ([\d.]+)", out.stdout)
    steps = dict(re.findall(r"^(kit|bare)/shipped .*\n +step ms, min / median / max of the "
                            r"processes: (.+)$", out.stdout, re.MULTILINE))
    if not found or len(steps) != 2:
        sys.exit(f"bench_loop.py failed:\n{out.stdout[-2000:]}{out.stderr[-3000:]}")
    ratio, rounds, low, high = found.groups()
    check.row("speed", "kit's step ÷ bare loop (bench_loop.py)",
              f"{ratio} (pairs: min {low}, max {high}; {rounds} kit + {rounds} bare processes "
              f"alternated, {args.loop_steps} steps each, {args.batch_size} × {args.grad_accum})",
              "≥ 0.97", float(ratio) >= 0.97, judged=False)
    check.row("speed", "… step ms, kit; bare loop (min / median / max of the processes)",
              f"{steps['kit']}; {steps['bare']}", "", None)


# The parts in the order they run: the loop's ratio before the speed runs, the longest part.
PARTS = ["first_steps", "kill_during_save", "fsdp_resume", "loop_overhead", "speed"]


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny model, about 1.5 minutes")
    parser.add_argument("--out", type=Path, default=ROOT / "outputs/gpu_check.json")
    parser.add_argument("--parts", nargs="+", choices=PARTS, default=PARTS,
                        help="run only these parts (default: all: about 7 minutes on an "
                        "H200, loop_overhead an estimated 2.5 of them)")
    args = parser.parse_args()
    big = not args.smoke
    args.device_flags = [] if big else ["--device", "cpu"]
    args.save_model = GPT2 if big else TINY
    args.speed_model = GPT2 if big else TINY
    args.seq_length, args.batch_size = (1024, 16) if big else (128, 4)
    args.grad_accum, args.steps, args.log_freq = (2, 40, 10) if big else (2, 8, 4)
    # The loop's ratio: pairs of processes, measured steps and warm-up steps of each.
    args.loop_rounds, args.loop_steps, args.loop_warmup = (3, 100, 10) if big else (2, 3, 1)
    return args


def main():
    args = parse_args()
    if not args.smoke and not torch.cuda.is_available():
        sys.exit("No GPU here: run with --smoke for the CPU check of this script.")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and not args.smoke \
        else "CPU"
    print(f"{device}, torch {torch.__version__}, CUDA {torch.version.cuda}\n")
    print("| group | check | value | goal | ok |\n|---|---|---|---|---|")
    check, start = Check(args.smoke), time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for part in (globals()[name] for name in args.parts):
            try:  # a part that fails is a failed row: the others still run, the JSON is written
                part(check, tmp, args)
            except (Exception, SystemExit) as e:
                check.row("correct", f"{part.__name__} ran", f"failed: {str(e)[-500:]!r}",
                          "runs", False)
    seconds = time.perf_counter() - start
    print(f"\n{seconds:.0f} s in all")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"device": device, "torch": torch.__version__,
                                    "cuda": torch.version.cuda, "smoke": args.smoke,
                                    "date": time.strftime("%Y-%m-%d"), "seconds": seconds,
                                    "rows": check.rows}, indent=1))
    if check.failed():
        sys.exit(f"failed: {', '.join(check.failed())}")


if __name__ == "__main__":
    main()
