"""A checkpoint's tensors read one at a time, so that no step of an export holds a whole model.

`TensorFiles` maps a tensor's name to its file and reads it on each access (safetensors through
`safe_open`, `.bin` through a memory-mapped `torch.load(weights_only=True)`), keeping nothing:
the caller decides what stays alive. `LazyTensors` applies a function to each tensor on access,
which is how the exporter sees fp32 arrays, smoothed weights or stored precisions without
materialising a second model.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from math import prod
from pathlib import Path

import torch


class TensorFiles(Mapping):
    """name -> torch.Tensor, read from its file on every access. `entries`: name -> (file, shape,
    bytes per element), from the files' headers."""

    def __init__(self, entries: dict[str, tuple[Path, tuple, int]], read_error: type[Exception]):
        self._entries, self._error = entries, read_error

    def __getitem__(self, name: str) -> torch.Tensor:
        path = self._entries[name][0]
        try:
            if path.suffix == ".safetensors":
                from safetensors import safe_open
                with safe_open(str(path), framework="pt") as f:
                    return f.get_tensor(name)
            # mmap: only this tensor's pages are read, and they go with the mapping
            return torch.load(path, map_location="cpu", weights_only=True, mmap=True)[name].clone()
        except Exception as e:  # truncated or garbled files raise many types
            raise self._error(f"cannot read tensor {name} from {path}: {type(e).__name__}: {e}") from None

    def __iter__(self):
        return iter(self._entries)

    def __contains__(self, name) -> bool:
        return name in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def shape(self, name: str) -> tuple:
        return self._entries[name][1]

    @property
    def nbytes(self) -> int:
        return sum(prod(shape) * size for _, shape, size in self._entries.values())


class LazyTensors(Mapping):
    """`keys` -> load(key), computed on every access and never kept."""

    def __init__(self, keys: Iterable[str], load: Callable[[str], object]):
        self._keys, self._load = list(keys), load
        self._set = set(self._keys)

    def __getitem__(self, name: str):
        if name not in self._set:
            raise KeyError(name)
        return self._load(name)

    def __iter__(self):
        return iter(self._keys)

    def __contains__(self, name) -> bool:
        return name in self._set

    def __len__(self) -> int:
        return len(self._keys)


def tensor_shape(state: Mapping, name: str) -> tuple:
    """A tensor's shape without reading it where the mapping knows it."""
    return tuple(state.shape(name)) if hasattr(state, "shape") else tuple(state[name].shape)


def fp32_arrays(state: Mapping) -> LazyTensors:
    """The tensors of `state` as float32 numpy arrays, converted on access (integer tensors, such as
    an EAGLE-3 head's d2t map, as int64)."""
    def load(name):
        t = state[name]
        return t.float().numpy() if t.is_floating_point() else t.long().numpy()
    return LazyTensors(state.keys(), load)


def layer_tensors(state: Mapping, prefix: str) -> dict[str, torch.Tensor]:
    """The tensors under `prefix` (one decoder layer), named as inside it, as torch tensors."""
    return {k[len(prefix):]: torch.as_tensor(state[k]) for k in state if k.startswith(prefix)}
