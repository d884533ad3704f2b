"""Pre-made batches of random token ids in place of the kit's data pipeline, behind the kit's
own Prefetch: the stand-in that bench_gpu.py (the baseline of its data wait) and bench_loop.py
(the same batches for the kit and a bare loop) hand to ``train_llm.main(build_loader=...)``.
"""

import torch

import data


def random_batches(args, vocab, count=64):
    """``count`` batches [--batch-size, --seq-length] of seeded random token ids."""
    generator = torch.Generator().manual_seed(0)
    return [torch.randint(vocab, (args.batch_size, args.seq_length), generator=generator)
            for _ in range(count)]


class Premade(data.Stage):
    """``items`` (token id tensors) as a source stage, one batch each, round and round."""

    def __init__(self, items):
        self.items, self.n = items, 0

    def __next__(self):
        self.n += 1
        return {"input_ids": self.items[(self.n - 1) % len(self.items)]}

    def state_dict(self):
        return {"epoch": 0, "n": self.n}  # (the epoch: what the trainer reads of a source's)

    def load_state_dict(self, state):
        self.n = state["n"]


def loader(items, args, pin_memory=False):
    """``items`` handed out as train_llm.build_pipeline hands out its batches."""
    return data.Prefetch(Premade(items), depth=2 * args.grad_accum + 1, every=args.grad_accum,
                         pin_memory=pin_memory)


def build_loader(urls, tokenizer, args, rank, world_size, *, train, pin_memory=False, **kwargs):
    """For ``train_llm.main(build_loader=...)``: random token ids instead of the training data."""
    return loader(random_batches(args, len(tokenizer)), args, pin_memory)
