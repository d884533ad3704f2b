"""Peak memory of the loss at GPT-2's vocabulary: F.cross_entropy vs utils.cross_entropy (a
float32 chunk of rows at a time, the kit's loss for bf16 or huge logits), forward and backward,
on the CPU, or on a GPU with --cuda, where the time is the warm median of 5 calls and
"compiled" (torch.compile of F.cross_entropy in float32, the kit's loss under --compile) joins.

    python scripts/bench_loss.py                      # 8 x 1024 tokens, vocabulary 50,257
    python scripts/bench_loss.py --tokens 16384 --dtypes bfloat16
    python scripts/bench_loss.py --cuda --tokens 16384 --dtypes bfloat16   # GPT-2, 16 x 1024

Each case runs in a fresh process. Its peak is the growth of the process's peak resident set
size (ru_maxrss) over the resident set once the logits exist, so it counts what the loss adds:
its float32 copies and the logits' gradient. float32 logits are the CPU kit's (no autocast);
bfloat16 logits are what a GPU's autocast gives the loss. Both cases check that loss and
gradient agree with F.cross_entropy's.
"""

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MiB = 1 << 20


def rss_bytes():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


def case(kind, dtype, tokens, vocab, cuda=False):
    """One forward and backward of the loss (on a GPU: warm, the median of 5); prints a JSON
    line of what it measured."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.nn.functional as F

    import utils
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(tokens, vocab, generator=generator, dtype=getattr(torch, dtype))
    logits.requires_grad_()
    targets = torch.randint(vocab, (tokens,), generator=generator)
    targets[::7] = -100  # prompt tokens, padding
    if cuda:
        logits, targets = logits.detach().cuda().requires_grad_(), targets.cuda()
    plain = lambda x: F.cross_entropy(x.float(), targets, reduction="none")  # noqa: E731
    loss_of = {"F.cross_entropy": plain, "compiled": torch.compile(plain),
               "utils.cross_entropy": lambda x: utils.cross_entropy(x, targets, "none")}[kind]
    before, times = torch.cuda.memory_allocated() if cuda else rss_bytes(), []
    for _ in range(8 if cuda else 1):
        start = time.perf_counter()
        loss = loss_of(logits)
        loss.sum().backward()
        torch.cuda.synchronize() if cuda else None
        times.append(time.perf_counter() - start)
        logits.grad = None
    seconds = sorted(times[-5:])[len(times[-5:]) // 2]
    peak = (torch.cuda.max_memory_allocated() if cuda else
            resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024) - before
    check = F.cross_entropy(logits[:256].detach().float().requires_grad_(), targets[:256],
                            reduction="none")
    print(json.dumps({"peak_mib": peak / MiB, "seconds": seconds,
                      "loss_diff": (loss[:256] - check).abs().max().item(),
                      "logits_mib": logits.numel() * logits.element_size() / MiB}))


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8 * 1024)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--cuda", action="store_true", help="on the GPU, timed warm")
    parser.add_argument("--case", nargs=2, help=argparse.SUPPRESS)  # a worker process
    args = parser.parse_args()
    if args.case:
        return case(*args.case, args.tokens, args.vocab, args.cuda)
    print(f"{args.tokens} tokens x vocabulary {args.vocab}: what the loss adds to the peak")
    print(f"{'logits':9} {'loss':20} {'peak MiB':>9} {'seconds':>8} {'x logits':>9}")
    for dtype in args.dtypes:
        peaks = {}
        for kind in ("F.cross_entropy", "utils.cross_entropy", *["compiled"] * args.cuda):
            out = subprocess.run([sys.executable, __file__, "--case", kind, dtype,
                                  "--tokens", str(args.tokens), "--vocab", str(args.vocab),
                                  *["--cuda"] * args.cuda],
                                 capture_output=True, text=True, check=True)
            found = json.loads(out.stdout)
            peaks[kind] = found["peak_mib"]
            assert found["loss_diff"] < 1e-3, found
            print(f"{dtype:9} {kind:20} {found['peak_mib']:9.0f} {found['seconds']:8.4f} "
                  f"{found['peak_mib'] / found['logits_mib']:9.2f}")
        ratio = peaks["utils.cross_entropy"] / peaks["F.cross_entropy"]
        print(f"{dtype:9} {'ratio':20} {ratio:9.2f}")


if __name__ == "__main__":
    main()
