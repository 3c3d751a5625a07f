"""The contract between the engine (runtime/engine.py) and a backend: one graph, base or draft, with
its KV cache, stepped with numpy inputs by name. ONNX Runtime's GraphSession (runtime/session.py) and
torch's TorchSession (runtime/torch_session.py) implement it, each with its own caches and its own
check of exactness; runtime/providers.py picks one for a provider. The engine depends on nothing else.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

NP_DTYPES = {"float32": np.float32, "float16": np.float16, "int64": np.int64}


class ProviderError(ValueError):
    """The requested execution provider is unknown or not installed."""


@dataclass(frozen=True)
class GraphSpec:
    """A graph's interface as its manifest entry lists it: the step's own inputs and outputs apart
    from its caches (past_* inputs [1, heads, length, width], written in place as present_*)."""
    inputs: list[str]                  # in the graph's order, as are outputs
    outputs: list[str]
    shapes: dict[str, list]            # of inputs and outputs by name; "T", "R", "k" are a step's sizes
    dtypes: dict[str, type]
    cache_names: list[str]
    cache_dims: list[tuple[int, int]]  # (heads, width) of each cache
    cache_dtype: type

    @classmethod
    def parse(cls, spec: dict) -> GraphSpec:
        past = [i for i in spec["inputs"] if i["name"].startswith("past_")]
        own = [i for i in spec["inputs"] + spec["outputs"] if not i["name"].startswith(("past_", "present_"))]
        return cls(inputs=[i["name"] for i in spec["inputs"] if i not in past],
                   outputs=[o["name"] for o in spec["outputs"] if not o["name"].startswith("present_")],
                   shapes={i["name"]: i["shape"] for i in own}, dtypes={i["name"]: NP_DTYPES[i["dtype"]] for i in own},
                   cache_names=[i["name"] for i in past], cache_dims=[(i["shape"][1], i["shape"][3]) for i in past],
                   cache_dtype=NP_DTYPES[past[0]["dtype"]])


class Session(Protocol):
    """One graph with its KV cache and its step buffers."""

    resident: bool
    """Whether hidden states stay on the device: run() returns them, and device_array() makes the
    buffers they are copied into, as device tensors (indexed like numpy arrays)."""

    slotted: bool
    """Whether the graph holds the caches of several sequences and a step may hold rows of any of
    them (inputs row_gather, row_scatter, cache_sequences, cache_slots; export/onnx_graph.py). Other
    graphs hold one sequence and write a step's rows side by side."""

    @property
    def capacity(self) -> int:
        """Cache positions the graph attends over now."""

    def reserve(self, length: int, shrink: bool = False) -> int:
        """Hold at least `length` positions (with shrink, also not many more); returns the capacity."""

    def run(self, inputs: dict[str, np.ndarray], k: int = 1, sequences: tuple[int, int] = (0, 1)) -> dict:
        """One step: `inputs` by name (views of the caller's buffers), k the draft's top-k, over the
        caches of sequences [first, end). Returns the outputs by name, views valid until the next run."""

    def move(self, source: np.ndarray, destination: int, sequence: int = 0) -> None:
        """Cache positions `source` of a sequence to [destination, destination + n): the compaction
        of a cycle."""

    def device_array(self, a: np.ndarray):
        """`a` where this session's hidden states live (the array itself on the host)."""

    def cache_arrays(self) -> list[np.ndarray]:
        """The caches as host arrays [sequences, heads, capacity, width] (host-resident caches only)."""

    def keeps_exactness(self, manifest: dict, matches_decoding: Callable[[], bool]) -> bool:
        """Whether this machine keeps the artifact's claim that verification computes every tree node
        bitwise as plain decoding does (asked only of artifacts that claim it). matches_decoding
        runs the engine's check on a branching tree, for backends whose exactness rests on kernels
        that must be measured here."""
