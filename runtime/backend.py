"""The contract between the engine (runtime/engine.py, and through it runtime/batch.py) and a
backend. A backend is a class (Backend) that answers questions about a provider and an artifact
before anything loads, and opens Sessions: one graph, base or draft, with its KV cache, stepped with
numpy inputs by name. ONNX Runtime's GraphSession (runtime/session.py) and torch's TorchSession
(runtime/torch_session.py) implement both; runtime/providers.py picks one for a provider and is the
one place that tells them apart. tests/test_backend_contract.py runs every installed backend
through the same checks.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, runtime_checkable

import numpy as np


class ProviderError(ValueError):
    """The requested provider is unknown or not installed, or cannot run this artifact here."""


@runtime_checkable
class Session(Protocol):
    """One graph with its KV cache and its step buffers."""

    resident: bool
    """Whether hidden states stay on the device: run() returns them, and device_array() makes the
    buffers they are copied into, as device tensors (indexed like numpy arrays)."""

    slotted: bool
    """The slot layout: whether the graph holds the caches of several sequences and a step may hold
    rows of any of them (inputs row_gather, row_scatter, cache_sequences, cache_slots;
    export/onnx_graph.py). Other graphs hold one sequence and write a step's rows side by side."""

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
        """The exactness probe: whether this machine keeps the artifact's claim that verification
        computes every tree node bitwise as plain decoding does (asked only of artifacts that claim
        it). matches_decoding runs the engine's check on a branching tree, for backends whose
        exactness rests on kernels that must be measured here."""


class Backend(Protocol):
    """What a backend answers before it opens anything, and how it opens a Session. Every question
    raises ProviderError with what to do instead, or answers for this machine."""

    providers: tuple[str, ...]
    """The providers it runs (runtime/providers.py maps each to one backend)."""

    @staticmethod
    def check_provider(provider: str) -> None:
        """Refuse an unknown or uninstalled provider before anything loads."""

    @staticmethod
    def check_artifact(manifest: dict, provider: str) -> None:
        """Refuse an artifact this provider cannot run here (its target, precision, attention or
        this CPU), saying what to export instead."""

    @staticmethod
    def batches(manifest: dict) -> bool:
        """Batching capability: whether the artifact's graphs hold several sequences' caches and a
        step may hold rows of any of them (its sessions would be `slotted`). Asked after
        check_artifact."""

    @classmethod
    def open(cls, path: str, spec: dict, provider: str, device: str, cache_length: int, max_tokens: int,
             max_k: int, threads: int | None, options: dict | None, sequences: int = 1) -> Session:
        """A Session of the graph at `path` (its manifest entry `spec`) with caches of `cache_length`
        positions for `sequences` sequences, steps of at most `max_tokens` rows and top-`max_k`."""
