"""Training speed on this machine's GPU: tokens/s, MFU, data wait and peak memory of
train_llm.py, eager and compiled, each with the kit's data pipeline and with random tokens
(no pipeline at all: the baseline the data wait is measured against). One run, one table.
Tokens/s and MFU count the time inside the trainer's timed blocks (data, forward, backward,
update), as its log lines do; peak memory is the CUDA allocator's active peak (reserved memory,
what nvidia-smi shows, is higher), or the process's peak RSS on a CPU.

    python scripts/bench_gpu.py                          # GPT-2 124M, seq 1024, 16 x 2 per step
    python scripts/bench_gpu.py --no-compile --steps 40  # eager only

Each case is a fresh train_llm.py process (its own peak memory) on the shipped sample corpus
and tokenizer, so it runs offline. The first --log-freq steps (compilation, warm-up) are
left out of the averages. On a CPU it runs too (slowly): `--device cpu --model-name
assets/tiny-gpt2 --seq-length 128 --batch-size 8 --no-compile` checks the script itself.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def random_batches_main(argv):
    """train_llm.main() with the training pipeline replaced by random token ids (pinned and
    prefetched in a thread like the real one), so that only the data differs."""
    sys.path.insert(0, str(ROOT))
    import torch

    import data
    import train_llm

    class RandomBatches:
        def __init__(self, batch_size, seq_length, vocab, pin_memory):
            self.shape, self.vocab, self.pin_memory = (batch_size, seq_length), vocab, pin_memory
            self.generator = torch.Generator().manual_seed(0)

        def __next__(self):
            ids = torch.randint(self.vocab, self.shape, generator=self.generator)
            return {"input_ids": ids.pin_memory() if self.pin_memory else ids}

        def state_dict(self):
            return {"epoch": 0}  # what the trainer reads of a source's state

        def load_state_dict(self, state):
            pass

        def close(self):
            pass

    real = train_llm.build_pipeline

    def build_pipeline(urls, tokenizer, args, rank, world_size, *, train, **kwargs):
        if not train:
            return real(urls, tokenizer, args, rank, world_size, train=train, **kwargs)
        source = RandomBatches(args.batch_size, args.seq_length, len(tokenizer),
                               kwargs.get("pin_memory", False))
        return data.Prefetch(source, depth=args.grad_accum + 1)

    train_llm.build_pipeline = build_pipeline
    sys.argv = ["train_llm.py", *argv]
    train_llm.main()


def run_case(name, flags, random_data, save_dir, log_freq):
    """One training run; the means of its logged speed metrics after the first interval."""
    argv = ["-e", name, "--save-dir", str(save_dir), *flags]
    command = ([sys.executable, __file__, "--random-data-worker", "--", *argv] if random_data
               else [sys.executable, str(ROOT / "train_llm.py"), *argv])
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"{name} failed:\n{result.stderr[-3000:]}")
    rows = [json.loads(line) for line in (save_dir / name / "metrics.jsonl").open()]
    timed = [r for r in rows if "tokens_per_s" in r and r["step"] > log_freq] or \
        [r for r in rows if "tokens_per_s" in r]

    def mean(key):
        values = [r[key] for r in timed if r.get(key) is not None]
        return sum(values) / len(values) if values else None

    memory = max((v for r in timed for k, v in r.items()
                  if k in ("mem/active_peak_gib", "mem/peak_rss_gib")), default=None)
    return {"tokens_per_s": mean("tokens_per_s"), "mfu": mean("mfu"),
            "data_wait": mean("data_wait"), "peak_gib": memory}


def main():
    if "--random-data-worker" in sys.argv:
        return random_batches_main(sys.argv[sys.argv.index("--") + 1:])
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model-name", default="assets/gpt2-124m")
    parser.add_argument("--seq-length", type=int, default=1024)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--grad-accum", type=int, default=2)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--log-freq", type=int, default=10)
    parser.add_argument("--device", default=None)
    parser.add_argument("--no-compile", action="store_true", help="eager runs only")
    parser.add_argument("--extra", default="", help="more train_llm.py flags, e.g. "
                        "'--activation-checkpointing'")
    args = parser.parse_args()

    common = ["--model-name", args.model_name, "--seq-length", str(args.seq_length),
              "--batch-size", str(args.batch_size), "--grad-accum", str(args.grad_accum),
              "--max-steps", str(args.steps), "--log-freq", str(args.log_freq),
              "--val-freq", str(10**9), "--ckpt-freq", str(10**9), "--val-batches", "1",
              "--sample-tokens", "0", "--wandb", "disabled", "--warmup-steps", "10",
              *(["--device", args.device] if args.device else []), *args.extra.split()]
    modes = [("eager", [])] + ([] if args.no_compile else [("compiled", ["--compile"])])
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for mode, flags in modes:
            for data_name, random_data in (("kit pipeline", False), ("random tokens", True)):
                name = f"{mode}-{'random' if random_data else 'kit'}"
                print(f"running {name} ...", file=sys.stderr, flush=True)
                rows.append((mode, data_name, run_case(name, common + flags, random_data,
                                                       Path(tmp), args.log_freq)))
    print(f"{args.model_name}, seq {args.seq_length}, {args.batch_size} x {args.grad_accum} per "
          f"step, {args.steps} steps (the first {args.log_freq} not averaged)")
    print("| mode | data | tokens/s | MFU | data wait | peak memory, active (GiB) |")
    print("|---|---|---|---|---|---|")
    for mode, data_name, r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "n/a"
        peak = f"{r['peak_gib']:.2f}" if r["peak_gib"] is not None else "n/a"
        print(f"| {mode} | {data_name} | {r['tokens_per_s']:,.0f} | {mfu} | "
              f"{r['data_wait']:.2%} | {peak} |")
    for mode in dict(modes):
        kit, rand = (r for m, _, r in rows if m == mode)
        print(f"{mode}: kit pipeline / random tokens = "
              f"{kit['tokens_per_s'] / rand['tokens_per_s']:.3f} (tokens/s)")


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
