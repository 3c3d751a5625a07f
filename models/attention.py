"""The attention kernels of the torch step graphs (export/torch_graph.py), shared with the runtime's
load-time check that this CPU's GEMMs sum them in a fixed order (runtime/torch_session.py).

Each token's query rows of a kv head are one product of a fixed number of rows over the cache read
in place, and value sums run in fixed blocks of KEY_BLOCK keys, so a row's arithmetic is the same
whatever the step size, the cache's capacity and wherever its keys sit inside their block.
"""
from __future__ import annotations

import torch

# Keys per block of the attention's value sums (value_product); the runtime's capacity steps
# (runtime/torch_session.CACHE_STEP) are a multiple of it, and trees never straddle a block.
KEY_BLOCK = 256


def query_rows(cfg) -> int:
    """Query rows per kv head and token: at least 3, below which PyTorch's CPU GEMM switches to other
    kernels (measured: 1 and 2 rows round differently from 3 and more)."""
    return max(cfg.num_heads // cfg.num_kv_heads, 3)


@torch.jit.script
def cache_product(rows: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
    """rows [T, kv, r, n] @ cache [1, kv, n, m] -> [T, kv, r, m], as products of r rows each over
    the cache read in place: one batched product per token (batch: the kv heads) or per kv head
    (batch: the tokens, the head's cache repeated by a stride-0 batch), whichever makes fewer calls.
    Every token's r rows are one small product of the same shape whatever T is; torch.matmul's
    broadcast would instead copy the whole cache T times, a large share of a step (docs/code-notes.md).
    Scripted, so that the traced graphs keep the choice for every step size."""
    t, kv = rows.shape[0], cache.shape[1]
    parts: list[torch.Tensor] = []
    if t <= kv:
        for i in range(t):
            parts.append(torch.matmul(rows[i:i + 1], cache))
        return torch.cat(parts, dim=0)
    for h in range(kv):
        parts.append(torch.bmm(rows[:, h], cache[0, h].expand(t, -1, -1)))
    return torch.stack(parts, dim=1)


@torch.jit.script
def value_product(probs: torch.Tensor, cache: torch.Tensor, block: int) -> torch.Tensor:
    """probs [T, kv, r, capacity] @ cache [1, kv, capacity, m], the key sum taken in blocks of `block`
    keys added in order: a GEMM blocks a long key sum by its length (measured; docs/code-notes.md), so a
    row's sum would depend on the capacity it is computed at. With fixed blocks it depends only on
    where its keys sit; blocks past them add exact zeros."""
    out = cache_product(probs[..., :block], cache[:, :, :block])
    for start in range(block, cache.shape[2], block):
        out = out + cache_product(probs[..., start:start + block], cache[:, :, start:start + block])
    return out
