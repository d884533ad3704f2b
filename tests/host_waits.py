"""train_llm.py, counting where each optimizer step would make the host wait for the GPU.

On a GPU the training thread runs ahead of the GPU, queueing kernels; it stops and waits
whenever it reads a value that lives on the GPU (.item(), .tolist(), float(), a bool test...)
or copies Python data onto it (torch.tensor(list, device=...): from pageable memory the copy
waits for all the work queued before it). On a CPU neither costs anything, nor can a "GPU
value" be told from any other, so this script tells them apart by where a tensor came from:

- host tensors: the tensors of the batches the training loader hands out, and whatever is
  computed from host tensors alone, or made without a device (torch.zeros(3));
- everything else is a device tensor: the model's weights and gradients, anything made with a
  ``device=`` (torch.full(..., device=ctx.device)) or moved with ``.to(device)``, and anything
  computed from a device tensor.

It counts, with the optimizer step it happened in, every *read* of a device tensor and every
*blocking upload* (a tensor made on a device from Python data; ``.to(device)`` of a host
tensor without non_blocking=True). A *download* (``.to("cpu", non_blocking=True)`` of a
device tensor: into pinned memory, behind the GPU's queued work) is no wait, and neither is
reading it in a later step (the GPU has long got there); reading it in the step that made it
is counted as a read. Step k is everything from the fetch of its first micro-batch to the
fetch of step k + 1's.

    HOST_WAITS_OUT=waits.json python tests/host_waits.py train_llm.py --experiment-name ...

writes {"grad_accum": G, "events": [[fetches so far, "read" or "upload", op, where,
inside a module's forward], ...]}.
Runs under torchrun too (each rank writes HOST_WAITS_OUT with its rank appended).
"""

import json
import os
import sys
import traceback
import weakref
from pathlib import Path

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import train_llm  # noqa: E402

# What hands a tensor's value to Python (waits for the GPU to have computed it).
READS = {"item", "tolist", "cpu", "numpy", "__float__", "__int__", "__bool__", "__index__",
         "__format__", "__repr__", "__str__", "__contains__", "equal", "allclose", "is_nonzero"}
MOVES = {"to", "cuda"}
FROM_DATA = {"tensor", "as_tensor"}  # torch.tensor(python data, device=...)


class HostWaits(TorchFunctionMode):
    def __init__(self):
        super().__init__()
        self.host = {}  # id -> weakref of the host tensors (a WeakSet would compare tensors)
        self.downloads = {}  # id -> (weakref, the step it was made in)
        self.fetches, self.events, self.seen, self.grad_accum = 0, [], set(), 1

    def is_host(self, t):
        ref = self.host.get(id(t))
        return ref is not None and ref() is t

    def mark_host(self, t):
        self.host[id(t)] = weakref.ref(t)

    def step(self):
        return (self.fetches - 1) // self.grad_accum

    def is_download(self, t):
        ref, _ = self.downloads.get(id(t), (None, None))
        return ref is not None and ref() is t

    def downloaded_now(self, t):
        """Whether ``t`` is a download made in this very step (not yet on the host)."""
        return self.is_download(t) and self.downloads[id(t)][1] == self.step()

    def record(self, kind, op):
        stack = traceback.extract_stack()[:-2]
        where = next((f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(stack)
                      if Path(f.filename).parent == ROOT), "?")
        in_module = any(f.name == "_call_impl" and f.filename.endswith("nn/modules/module.py")
                        for f in stack)  # inside a forward: the model's own business
        self.events.append([self.fetches, kind, op, where, in_module])
        if os.environ.get("HOST_WAITS_DEBUG") and (kind, op, where) not in self.seen:
            self.seen.add((kind, op, where))
            print(kind, op, "".join(traceback.format_stack()[-9:-2]), file=sys.stderr)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", str(func))
        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        on_device = [not self.is_host(t) for t in tensors]
        target = kwargs.get("device")
        if name in MOVES and target is None:
            target = next((a for a in args[1:] if isinstance(a, (torch.device, str))), None)
        non_blocking = kwargs.get("non_blocking") or (len(args) > 2 and args[2] is True)
        download = name in MOVES and target == "cpu" and non_blocking and any(on_device)
        to_host = name in READS or (name in MOVES and target == "cpu" and not download)
        made_on_device = target is not None and target != "cpu"  # "cpu" by name: the host
        upload = name in MOVES and made_on_device and tensors and not on_device[0]
        if to_host and (any(on_device) or any(map(self.downloaded_now, tensors))):
            self.record("read", name)
        elif name.endswith("_") and tensors and not on_device[0] and any(on_device[1:]):
            self.record("read", name)  # host_tensor.copy_(device_tensor): a download
        if (upload and not non_blocking) or (name in FROM_DATA and made_on_device
                                             and not tensors):
            self.record("upload", name)
        out = func(*args, **kwargs)
        if (upload or download) and out is tensors[0]:  # .to() of its own device: the tensor
            out = out.view_as(out)
        # A download, and what is made of one (a part of it), arrive with the download.
        made = [self.step()] if download else [self.downloads[id(t)][1] for t in tensors
                                               if self.is_download(t)]
        for t in tree_leaves(out) if made else ():
            if isinstance(t, torch.Tensor):
                self.mark_host(t)
                self.downloads[id(t)] = (weakref.ref(t), min(made))
        if not any(on_device) and not made_on_device:
            for t in tree_leaves(out):
                if isinstance(t, torch.Tensor):
                    self.mark_host(t)
        return out


class Counted:
    """The training loader, counting fetches and marking its batches' tensors as host ones."""

    def __init__(self, loader, mode):
        self.loader, self.mode = loader, mode

    def __next__(self):
        self.mode.fetches += 1
        batch = next(self.loader)
        for value in batch.values():
            if isinstance(value, torch.Tensor):
                self.mode.mark_host(value)
        return batch

    def __getattr__(self, name):
        return getattr(self.loader, name)


def main():
    mode = HostWaits()

    def counted(*args, **kwargs):  # the training loader, as main() builds it, counted
        return Counted(train_llm.build_pipeline(*args, **kwargs), mode)
    sys.argv = sys.argv[1:]
    grad_accum = int(next(a.split("=")[1] for a in sys.argv if a.startswith("--grad-accum=")))
    mode.grad_accum = grad_accum
    try:
        with mode:
            train_llm.main(build_loader=counted)
    finally:
        out = os.environ["HOST_WAITS_OUT"] + os.environ.get("RANK", "")
        Path(out).write_text(json.dumps({"grad_accum": grad_accum, "events": mode.events}))


if __name__ == "__main__":
    main()
