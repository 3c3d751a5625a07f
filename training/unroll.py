"""The head's training-time test: its forward pass unrolled over draft depths, each depth fed the
previous depth's outputs with the attention context a tree node at that depth has."""
from __future__ import annotations

import torch

from models.config import ModelConfig
from models.llama import KVCache, additive_bias, causal_bias


def new_cache(cfg: ModelConfig, max_len: int, batch: int, device, layers: int | None = None) -> KVCache:
    cache = KVCache.__new__(KVCache)
    shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
    n = cfg.num_layers if layers is None else layers
    cache.k = [torch.zeros(shape, device=device) for _ in range(n)]
    cache.v = [torch.zeros(shape, device=device) for _ in range(n)]
    return cache


def unrolled_bias(n: int, step: int, device) -> torch.Tensor:
    """Attention mask [1, 1, n, step * n] for unrolled step `step` (1-based) over keys laid out as
    step 1's n positions, then step 2's, ... The query at position p stands for a draft at depth
    `step`: like a tree node, it sees the true-feature keys up to position p - step + 1 (the last
    verified token) and then one key per earlier depth, its ancestors', at p - step + i."""
    p = torch.arange(n, device=device)
    allowed = torch.zeros(n, step * n, dtype=torch.bool, device=device)
    allowed[:, :n] = p[None, :] <= (p[:, None] - step + 1)
    for i in range(2, step + 1):
        key = p - step + i
        ok = key >= 0
        allowed[p[ok], (i - 1) * n + key[ok]] = True
    return additive_bias(allowed)[None, None]


def unrolled_forward(head, tok: torch.Tensor, feats: torch.Tensor, unroll: int):
    """Yield the head's outputs [B, T, H] for steps 1..unroll. Step 1 is EAGLE's teacher-forced pass
    (input: token t+1, true feature t); step j's input at position t is step j-1's output at t-1,
    attending as a depth-j tree node would (unrolled_bias). Position t of step j drafts from t-j+1
    verified positions, so its first j-1 positions are meaningless."""
    b, n, _ = tok.shape
    device = tok.device
    pos = torch.arange(n, device=device)[None].expand(b, n)
    cache = new_cache(head.cfg, n, b, device, layers=1)
    out = head(tok, feats, pos, causal_bias(n).to(device), cache, 0)
    yield out
    for step in range(2, unroll + 1):
        # A fresh cache per step: autograd still needs the keys the previous step read.
        grown = new_cache(head.cfg, step * n, b, device, layers=1)
        for new, old in ((grown.k[0], cache.k[0]), (grown.v[0], cache.v[0])):
            new[:, :, :(step - 1) * n] = old
        cache = grown
        prev = torch.cat((torch.zeros_like(out[:, :1]), out[:, :-1]), dim=1)
        out = head(tok, prev, pos, unrolled_bias(n, step, device), cache, (step - 1) * n)
        yield out
