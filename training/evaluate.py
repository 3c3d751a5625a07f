"""The head's dev metrics: teacher-forced agreement with the base, at each draft depth."""
from __future__ import annotations

import torch

from models.llama import EagleHead

from .batches import Batch, length_batches
from .losses import head_losses


@torch.no_grad()
def evaluate(head: EagleHead, emb, lm, data: dict | None, budget: int, device, depth: int = 3) -> dict | None:
    """Teacher-forced dev metrics; acc_j is the top-1 agreement of a depth-j draft that is fed the
    head's own features (see head_losses), which is what tree drafting at depth j needs."""
    if data is None:
        return None
    head.eval()
    order = sorted(range(len(data["lengths"])), key=lambda i: -data["lengths"][i])
    keys = ["vloss", "ploss", "acc", "top5"]
    totals = {k: 0.0 for k in keys} | {"n": 0} | {f"acc_{j}": 0.0 for j in range(2, depth + 1)} \
        | {f"n_{j}": 0 for j in range(2, depth + 1)}
    for b in length_batches([data["lengths"][i] for i in order], budget):
        r = head_losses(head, emb, lm, Batch(data, [order[i] for i in b], device), 0.0, None, unroll=depth)
        for k in keys:
            totals[k] += float(r[k]) * r["n"]
        totals["n"] += r["n"]
        for j in range(2, depth + 1):
            totals[f"acc_{j}"] += r.get(f"acc_{j}", 0.0) * r.get(f"n_{j}", 0)
            totals[f"n_{j}"] += r.get(f"n_{j}", 0)
    head.train()
    out = {k: totals[k] / max(totals["n"], 1) for k in keys}
    out |= {f"acc_{j}": totals[f"acc_{j}"] / max(totals[f"n_{j}"], 1) for j in range(2, depth + 1)}
    return out | {"positions": totals["n"]}


def describe(ev: dict, depth: int) -> str:
    """The metrics of evaluate as one log line."""
    deep = " ".join(f"d{j} {ev[f'acc_{j}']:.3f}" for j in range(2, depth + 1))
    return f"top-1 {ev['acc']:.3f} ({deep}) top-5 {ev['top5']:.3f} vloss {ev['vloss']:.4f} ploss {ev['ploss']:.3f}"
