"""Host KV caches for graphs that attend over their whole cache (the exact attention of ONNX
artifacts, every torch artifact), shared by the ONNX Runtime and torch sessions.

Such a graph reads every position it is given, masked where not in use, so its caches are handed
over at a capacity just above the positions in use, growing in steps the session chooses (copying
out the used part every step instead cost more; docs/code-notes.md). Each
cache lives in one store allocated once for the longest length; the cache of a given capacity is
the store's first heads * capacity * width elements, re-laid out in place when the capacity changes.
"""
from __future__ import annotations

import numpy as np


class HostCaches:
    def __init__(self, dims: list[tuple[int, int]], dtype, cache_length: int, max_tokens: int, bias_dtype,
                 step: int):
        """dims: (heads, width) of each cache, laid out [1, heads, capacity, width]; the capacity is a
        multiple of `step`. Every masked position past those in use is still read, so a smaller step
        reads less, at the price of a re-layout every `step` positions."""
        self.dims, self.cache_length, self.step = dims, cache_length, step
        # Zeroed: positions past those in use are read (masked) and must hold finite numbers.
        self._stores = [np.zeros(h * cache_length * w, dtype) for h, w in dims]
        self._scratch = np.empty(cache_length * max(w for _, w in dims), dtype)
        self._wide_bias = np.empty(max_tokens * cache_length, bias_dtype)
        self._cache_position = np.zeros(1, np.int64)
        self.capacity = 0
        self.arrays: list[np.ndarray] = []
        self._lay_out(min(step, cache_length))

    def _lay_out(self, capacity: int) -> None:
        old = self.capacity
        self.arrays = []
        for store, (heads, width) in zip(self._stores, self.dims):
            keep = min(old, capacity) * width
            # Heads move back when growing and forward when shrinking: order the moves so that no
            # head is overwritten before it has moved, through a scratch copy of one head.
            for h in (reversed(range(1, heads)) if capacity > old else range(1, heads)):
                self._scratch[:keep] = store[h * old * width:h * old * width + keep]
                store[h * capacity * width:h * capacity * width + keep] = self._scratch[:keep]
            self.arrays.append(store[:heads * capacity * width].reshape(1, heads, capacity, width))
        self.capacity = capacity

    def reserve(self, length: int, shrink: bool = False) -> bool:
        """Hold at least `length` positions (with shrink, also at most a step more). Returns whether
        the caches were laid out anew (their arrays must then be handed over again)."""
        if length > self.cache_length:
            raise ValueError(f"{length} positions exceed this session's cache of {self.cache_length}")
        wanted = min(-(-length // self.step) * self.step, self.cache_length)
        if wanted > self.capacity or (shrink and wanted < self.capacity):
            self._lay_out(wanted)
            return True
        return False

    def step_inputs(self, inputs: dict, t: int) -> dict:
        """The attention bias [1, 1, t, total] widened to the capacity (positions past total masked)
        and the position where the t new rows go. Call reserve(total) first."""
        bias = inputs["attention_bias"]
        total, width = bias.shape[-1], self.capacity
        wide = self._wide_bias[: t * width].reshape(1, 1, t, width)
        wide[..., :total] = bias
        wide[..., total:] = np.finfo(bias.dtype).min
        self._cache_position[0] = total - t
        return {**inputs, "attention_bias": wide, "cache_position": self._cache_position}

    def move(self, source: np.ndarray, destination: int) -> None:
        """Positions `source` to [destination, destination + len(source)) in every cache."""
        for a in self.arrays:
            a[:, :, destination:destination + len(source)] = a[:, :, source]
