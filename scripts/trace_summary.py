"""Where the steps of a --profile-steps trace spent their time, in a few lines.

    python scripts/trace_summary.py RUN/profile/rank0-steps30-31.json

Per step: the training loop's named ranges (data, forward, backward, update: utils.Timer;
cross_entropy and its backward where the loss is utils.cross_entropy), timed on the CPU. On a
GPU trace the summary adds how busy the GPU was, its idle gaps, the kernels that took the most
time, the attention kernels (flash or not), and the host's waits for the GPU (synchronizing
CUDA calls). Open the trace itself in https://ui.perfetto.dev for the rest.
"""

import argparse
import collections
import json
import re

ATTENTION = re.compile(r"flash|fmha|attention|attn|sdpa", re.I)
# CUDA calls that block the host until the GPU has caught up (a read of a GPU value is a
# cudaMemcpyAsync to pageable memory followed by a cudaStreamSynchronize).
WAITS = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy"}
GAP_US = 20  # idle stretches of the GPU longer than this are counted as gaps


def busy_intervals(events):
    """The union of [ts, ts + dur) of ``events``, as sorted, disjoint (start, end) pairs."""
    merged = []
    for start, end in sorted((e["ts"], e["ts"] + e["dur"]) for e in events):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def summarize(trace):
    """The summary's lines for a Chrome trace (the dict torch.profiler writes)."""
    events = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
    by_cat = collections.defaultdict(list)
    for e in events:
        by_cat[e.get("cat")].append(e)
    steps = [e for e in by_cat["user_annotation"] if e["name"].startswith("ProfilerStep#")]
    n = max(1, len(steps))
    kernels = by_cat["kernel"]
    on_gpu = bool(kernels)
    # The ranges on the CPU's clock: on the GPU, a range that launches nothing (data) has no
    # span, and backward's kernels are launched from autograd's own thread.
    ranges = [e for e in by_cat["user_annotation"] if not e["name"].startswith("ProfilerStep#")]
    step_ms = sum(e["dur"] for e in steps) / n / 1000
    lines = [f"{len(steps)} step(s), {step_ms:.2f} ms each; the ranges per step, on the CPU's "
             "clock (on a GPU: the time to queue their work, or to wait for it):"]
    totals = collections.Counter()
    for e in ranges:
        totals[e["name"]] += e["dur"]
    for name, us in totals.most_common(12):
        lines.append(f"  {name:36} {us / n / 1000:9.2f} ms  {us / n / 1000 / step_ms:6.1%}")
    if not on_gpu:
        return lines
    gpu_work = kernels + by_cat["gpu_memcpy"] + by_cat["gpu_memset"]
    busy = busy_intervals(gpu_work)
    window = busy[-1][1] - busy[0][0]
    gaps = [b[0] - a[1] for a, b in zip(busy, busy[1:]) if b[0] - a[1] > GAP_US]
    lines.append(f"GPU busy {sum(end - start for start, end in busy) / window:.1%} of "
                 f"{window / n / 1000:.2f} ms per step; {len(gaps) / n:.0f} gaps over {GAP_US} "
                 f"us per step, {sum(gaps) / n / 1000:.2f} ms in all")
    kernel_us = collections.Counter()
    count = collections.Counter()
    for e in kernels:
        kernel_us[e["name"]] += e["dur"]
        count[e["name"]] += 1
    all_us = sum(kernel_us.values())
    lines.append(f"{len(kernels) / n:.0f} kernels per step; the most time:")
    for name, us in kernel_us.most_common(8):
        lines.append(f"  {us / all_us:6.1%}  x{count[name] / n:<5.0f} {name[:90]}")
    attention = {name: us for name, us in kernel_us.items() if ATTENTION.search(name)}
    lines.append(f"attention kernels: {sum(attention.values()) / all_us:.1%} of kernel time"
                 + "".join(f"\n  {name[:100]}" for name in sorted(attention)))
    waits = [e for e in by_cat["cuda_runtime"] if e["name"] in WAITS]
    lines.append(f"host waits for the GPU: {len(waits) / n:.1f} per step, "
                 f"{sum(e['dur'] for e in waits) / n / 1000:.2f} ms per step "
                 f"({', '.join(sorted({e['name'] for e in waits})) or 'none'})")
    return lines


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("trace", help="a Chrome trace written by --profile-steps")
    args = parser.parse_args()
    with open(args.trace) as f:
        print("\n".join(summarize(json.load(f))))


if __name__ == "__main__":
    main()
