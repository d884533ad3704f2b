"""A model written by hand, without transformers: what a learner who swaps in their own model
writes (README, "Changing the kit": create_model). tests/test_own_model.py puts this file next
to a copy of the kit, whose create_model returns TinyGPT.
"""

import types

import torch
import torch.nn.functional as F
from torch import nn


class Block(nn.Module):
    def __init__(self, dim, heads, dropout):
        super().__init__()
        self.heads, self.dropout = heads, dropout
        self.ln1, self.ln2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.qkv, self.proj = nn.Linear(dim, 3 * dim), nn.Linear(dim, dim)
        self.mlp = nn.Sequential(nn.Linear(dim, 4 * dim), nn.GELU(), nn.Linear(4 * dim, dim),
                                 nn.Dropout(dropout))

    def forward(self, x):
        b, t, d = x.shape
        q, k, v = (z.view(b, t, self.heads, -1).transpose(1, 2)
                   for z in self.qkv(self.ln1(x)).split(d, dim=2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """nanoGPT's shape in miniature: token + position embeddings, pre-norm blocks, a tied
    output layer. Its forward takes the kit's keyword arguments and returns ``.logits``."""

    def __init__(self, vocab_size, dim=32, layers=1, heads=2, positions=64, dropout=0.1):
        super().__init__()
        self.tokens, self.positions = nn.Embedding(vocab_size, dim), nn.Embedding(positions, dim)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(dim, heads, dropout) for _ in range(layers))
        self.ln = nn.LayerNorm(dim)

    def forward(self, input_ids, position_ids=None, **unused):  # (use_cache: no cache here)
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.drop(self.tokens(input_ids) + self.positions(position_ids))
        for block in self.blocks:
            x = block(x)
        return types.SimpleNamespace(logits=self.ln(x) @ self.tokens.weight.T)
