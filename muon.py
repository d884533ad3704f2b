"""Muon (MomentUm Orthogonalized by Newton-schulz), as torch.optim.Muon computes it, in batches.

torch.optim.Muon orthogonalizes one matrix at a time (about 28 kernel launches each: 1,376 a
step for GPT-2 124M on a GPU), and on FSDP2's sharded parameters (DTensors) its update is not
the whole matrix's (it differs by as much as the update). This Muon keeps torch's options, state
(``momentum_buffer``, so its checkpoints load either way) and arithmetic per matrix, and:
- stacks the matrices of one shape and runs the Newton-Schulz iteration on the stack: a few
  launches per shape, not per matrix;
- orthogonalizes each sharded (DTensor) matrix whole: gathered from its shards, every rank
  computes the same update and keeps its own rows of it. (Each rank repeats the work of all:
  at scale, spread the matrices over the ranks and gather the updates instead.)
"""

import collections

import torch
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.optim._muon import _adjust_lr  # (the same learning rate per shape as torch's)


class Muon(torch.optim.Muon):
    """torch.optim.Muon's update, batched by shape, whole under FSDP2 (the module docstring)."""

    @torch.no_grad()
    def step(self, closure=None):
        loss = None if closure is None else torch.enable_grad()(closure)()
        for group in self.param_groups:
            params = [p for p in group["params"] if p.grad is not None]
            if not params:
                continue
            grads = [p.grad for p in params]
            for p in params:
                if "momentum_buffer" not in self.state[p]:
                    self.state[p]["momentum_buffer"] = torch.zeros_like(p.grad)
            bufs = [self.state[p]["momentum_buffer"] for p in params]
            torch._foreach_lerp_(bufs, grads, 1 - group["momentum"])
            updates = (torch._foreach_lerp(grads, bufs, group["momentum"]) if group["nesterov"]
                       else bufs)
            torch._foreach_mul_(params, 1 - group["lr"] * group["weight_decay"])
            shapes = collections.defaultdict(list)  # shape: [(param, whole update)]
            for p, update in zip(params, updates):
                if isinstance(update, DTensor):  # the whole matrix on every rank
                    update = update.full_tensor()
                shapes[update.shape].append((p, update))
            for shape, pairs in shapes.items():
                tall = shape[0] > shape[1]  # orthogonalized as its transpose (fewer flops)
                stack = torch.stack([u.mT if tall else u for _, u in pairs])
                ortho = orthogonalize(stack, group["ns_coefficients"], group["ns_steps"],
                                      group["eps"]).to(stack.dtype)
                torch._foreach_add_([p for p, _ in pairs],
                                    [own_part(o.mT if tall else o, p)
                                     for (p, _), o in zip(pairs, ortho.unbind())],
                                    alpha=-_adjust_lr(group["lr"], group["adjust_lr_fn"], shape))
        return loss


def orthogonalize(wide, coefficients, steps, eps):
    """torch.optim.Muon's quintic Newton-Schulz iteration, in bfloat16, on a stack of matrices
    with no more rows than columns: each comes out near the closest orthogonal matrix."""
    a, b, c = coefficients
    x = wide.bfloat16()
    x = x / x.norm(dim=(1, 2), keepdim=True).clamp(min=eps)  # every singular value <= 1
    for _ in range(steps):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x


def own_part(update, param):
    """The rows (the shard) of a whole ``update`` that this rank's ``param`` holds."""
    if not isinstance(param, DTensor):
        return update
    return distribute_tensor(update, param.device_mesh, param.placements, src_data_rank=None)
