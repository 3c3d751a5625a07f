"""Sequences grouped into batches of similar length, and the padded tensors of one batch."""
from __future__ import annotations

import random

import numpy as np
import torch


def length_batches(lengths: list[int] | np.ndarray, budget: int) -> list[list[int]]:
    """Consecutive items (already sorted by length, longest first) grouped so that
    batch_size * longest <= budget tokens."""
    batches, cur, longest = [], [], 0
    for i, n in enumerate(lengths):
        if cur and max(longest, n) * (len(cur) + 1) > budget:
            batches.append(cur)
            cur, longest = [], 0
        cur.append(i)
        longest = max(longest, n)
    if cur:
        batches.append(cur)
    return batches


def pooled_length_order(lengths: list[int], pool: int) -> list[int]:
    """Indices in data order, sorted longest first only within consecutive pools of `pool`: batches
    pad little, and stopping at a deadline still keeps an unbiased sample."""
    order = []
    for k in range(0, len(lengths), pool):
        order += sorted(range(k, min(k + pool, len(lengths))), key=lambda i: -lengths[i])
    return order


def epoch_batches(lengths: np.ndarray, budget: int, seed: int) -> list[list[int]]:
    """Shuffled batches of similar-length sequences (sorted within random pools of ~50 batches)."""
    rng = random.Random(seed)
    idx = list(range(len(lengths)))
    rng.shuffle(idx)
    mean = max(1, int(np.mean(lengths)))
    pool = max(1, 50 * budget // mean)
    batches = []
    for k in range(0, len(idx), pool):
        chunk = sorted(idx[k:k + pool], key=lambda i: -lengths[i])
        batches += [[chunk[j] for j in b] for b in length_batches([lengths[i] for i in chunk], budget)]
    rng.shuffle(batches)
    return batches


class Batch:
    def __init__(self, data: dict, items: list[int], device):
        lens = [int(data["lengths"][i]) for i in items]
        t = max(lens)
        b = len(items)
        h = data["hidden"].shape[1]
        self.ids = torch.zeros(b, t, dtype=torch.long)
        self.mask = torch.zeros(b, t + 1, dtype=torch.bool)
        self.hidden = torch.zeros(b, t, h, dtype=torch.float16)
        for r, i in enumerate(items):
            a, n = int(data["offsets"][i]), lens[r]
            self.ids[r, :n] = data["ids"][a:a + n]
            self.mask[r, :n] = data["mask"][a:a + n].bool()
            self.mask[r, n] = self.mask[r, n - 1]  # the token after a truncated end: same side
            self.hidden[r, :n] = data["hidden"][a:a + n]
        # Position t (input: token t+1, feature t; target: feature t+1, which drafts token t+2)
        # is trained when tokens t+1 and t+2 are both assistant tokens.
        self.loss_mask = (self.mask[:, 1:t] & self.mask[:, 2:t + 1]).to(device)
        self.ids = self.ids.to(device)
        self.hidden = self.hidden.to(device).float()
        self.tokens = sum(lens)
