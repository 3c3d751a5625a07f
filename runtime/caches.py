"""KV caches for graphs that attend over their whole cache (the exact attention of ONNX artifacts,
every torch artifact), shared by the ONNX Runtime and torch sessions: on the host, growing with the
positions in use, or on an accelerator at their full length.

Such a graph reads every position it is given, masked where not in use, so host caches are handed
over at a capacity just above the positions in use, growing in steps the session chooses (copying
out the used part every step instead cost more; docs/code-notes.md). Each
cache lives in one store allocated once for the longest length; the cache of a given capacity is
the store's first heads * capacity * width elements, re-laid out in place when the capacity changes.
"""
from __future__ import annotations

import numpy as np


def move_positions(arrays: list, source, destination: int, sequence: int) -> None:
    """Positions `source` of one sequence to [destination, destination + len(source)) in every
    cache [sequences, heads, positions, width] (numpy arrays, or torch tensors and an index tensor)."""
    for a in arrays:
        a[sequence][:, destination:destination + len(source)] = a[sequence][:, source]


def torch_dtype(torch, dtype):
    """The torch dtype of a numpy dtype."""
    return torch.from_numpy(np.zeros(0, dtype)).dtype


class WholeCaches:
    """What host and device caches share: the capacity they are read at, and the inputs that place
    a step's rows in them. Subclasses set `arrays` and `capacity`."""

    def __init__(self, cache_length: int, max_tokens: int, bias_dtype, sequences: int):
        self.cache_length, self.sequences = cache_length, sequences
        self._wide_bias = np.empty(max_tokens * cache_length, bias_dtype)
        self._cache_position = np.zeros(1, np.int64)
        self._rows = np.arange(max_tokens)
        self._zeros = np.zeros(max_tokens, np.int64)
        self._slots = np.zeros(max_tokens, np.int64)
        self.capacity = 0
        self.arrays: list = []

    def _check_length(self, length: int) -> None:
        if length > self.cache_length:
            raise ValueError(f"{length} positions exceed this session's cache of {self.cache_length}")

    def step_inputs(self, inputs: dict, t: int, slotted: bool) -> dict:
        """A step of one sequence (the first), its t rows side by side at the end of the attention
        bias [1, 1, t, total]: the bias widened to the capacity (positions past total masked), and
        where the rows go, as cache_position, or for a slotted graph as its grouping of the rows (one
        sequence of t rows). Call reserve(total) first."""
        bias = inputs["attention_bias"]
        total, width = bias.shape[-1], self.capacity
        wide = self._wide_bias[: t * width].reshape(1, 1, t, width)
        wide[..., :total] = bias
        wide[..., total:] = np.finfo(bias.dtype).min
        inputs = {**inputs, "attention_bias": wide}
        if not slotted:
            self._cache_position[0] = total - t
            return {**inputs, "cache_position": self._cache_position}
        rows = self._rows[:t]
        self._slots[:t] = rows + (total - t)
        return {**inputs, "row_gather": rows, "row_scatter": rows, "cache_sequences": self._zeros[:t],
                "cache_slots": self._slots[:t]}


class HostCaches(WholeCaches):
    def __init__(self, dims: list[tuple[int, int]], dtype, cache_length: int, max_tokens: int, bias_dtype,
                 step: int, sequences: int = 1):
        """dims: (heads, width) of each cache, laid out [sequences, heads, capacity, width]; the
        capacity is a multiple of `step`. Every masked position past those in use is still read, so a
        smaller step reads less, at the price of a re-layout every `step` positions."""
        super().__init__(cache_length, max_tokens, bias_dtype, sequences)
        self.step = step
        self.dims = [(sequences * h, w) for h, w in dims]  # a sequence's heads follow the one before's
        # Zeroed: positions past those in use are read (masked) and must hold finite numbers.
        self._stores = [np.zeros(h * cache_length * w, dtype) for h, w in self.dims]
        self._scratch = np.empty(cache_length * max(w for _, w in dims), dtype)
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
            self.arrays.append(store[:heads * capacity * width].reshape(self.sequences, -1, capacity, width))
        self.capacity = capacity

    def reserve(self, length: int, shrink: bool = False) -> bool:
        """Hold at least `length` positions (with shrink, also at most a step more). Returns whether
        the caches were laid out anew (their arrays must then be handed over again)."""
        self._check_length(length)
        wanted = min(-(-length // self.step) * self.step, self.cache_length)
        if wanted > self.capacity or (shrink and wanted < self.capacity):
            self._lay_out(wanted)
            return True
        return False

    def move(self, source: np.ndarray, destination: int, sequence: int = 0) -> None:
        """Positions `source` of one sequence to [destination, destination + len(source))."""
        move_positions(self.arrays, source, destination, sequence)


class DeviceCaches(WholeCaches):
    """Caches on an accelerator, torch tensors [sequences, heads, cache_length, width] read at their
    full length: growing them would copy them on the device, where reading the masked positions
    costs far less than on a CPU. Zeroed, as the host's are: masked positions must be finite."""

    def __init__(self, dims: list[tuple[int, int]], dtype, cache_length: int, max_tokens: int, bias_dtype,
                 sequences: int, torch, device: str):
        super().__init__(cache_length, max_tokens, bias_dtype, sequences)
        self.torch, self.device = torch, device
        self.arrays = [torch.zeros(sequences, h, cache_length, w, dtype=torch_dtype(torch, dtype), device=device)
                       for h, w in dims]
        self.capacity = cache_length

    def reserve(self, length: int, shrink: bool = False) -> bool:
        self._check_length(length)
        return False

    def move(self, source: np.ndarray, destination: int, sequence: int = 0) -> None:
        index = self.torch.from_numpy(np.ascontiguousarray(source, np.int64)).to(self.device)
        move_positions(self.arrays, index, destination, sequence)
