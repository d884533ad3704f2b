"""muon.Muon beside torch.optim.Muon: the operations a step dispatches (on a GPU, each one is a
kernel launch) for GPT-2 124M's hidden matrices, and the step's time on this machine's CPU.

    python benchmarks/bench_muon.py             # GPT-2 124M's 48 block matrices
    python benchmarks/bench_muon.py --layers 4 --width 128   # the demo's tiny GPT-2

The operations are counted on the meta device (shapes only, nothing computed); views (free)
are left out. The times are the median of --repeats steps on float32 weights, the two
optimizers alternating.
"""

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import muon  # noqa: E402


class CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.ops = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops += not func.is_view
        return func(*args, **(kwargs or {}))


def optimizers(shapes, device):
    """Each optimizer over its own parameters of ``shapes``, with gradients and state made."""
    made = {}
    for cls in (torch.optim.Muon, muon.Muon):
        params = [torch.nn.Parameter(torch.randn(s, device=device)) for s in shapes]
        for p in params:
            p.grad = torch.randn_like(p)
        made[cls.__module__] = cls(params, lr=0.02, adjust_lr_fn="match_rms_adamw")
        made[cls.__module__].step()  # (the first makes the momentum buffers)
    return made


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    d = args.width  # GPT-2's Conv1D weights are [in, out]: attention in, out; MLP in, out
    shapes = [(d, 3 * d), (d, d), (d, 4 * d), (4 * d, d)] * args.layers
    print(f"{len(shapes)} matrices, {sum(a * b for a, b in shapes) / 1e6:.1f} M weights")
    for name, optimizer in optimizers(shapes, "meta").items():
        with CountOps() as count:
            optimizer.step()
        print(f"{name:12} {count.ops:5} operations a step")
    made, times = optimizers(shapes, "cpu"), {}
    for _ in range(args.repeats):
        for name, optimizer in made.items():
            start = time.perf_counter()
            optimizer.step()
            times.setdefault(name, []).append(time.perf_counter() - start)
    for name, seconds in times.items():
        print(f"{name:12} {statistics.median(seconds) * 1e3:8.1f} ms a step on the CPU")


if __name__ == "__main__":
    main()
