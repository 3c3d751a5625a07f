"""Torch sessions: the same step interface as runtime/session.GraphSession, over a TorchScript graph
of a torch artifact (export/torch_export.py), run with IPEX or plain PyTorch on CPU, CUDA or XPU.

Inputs and outputs are numpy arrays at the boundary, so the decoding loop is the one of the ONNX
path. On CPU the caches are host stores grown in place (runtime/caches.py) that the graph writes
through zero-copy torch views; on an accelerator they live on the device at their full length, and
only the step's ids, positions, bias and small outputs cross.
"""
from __future__ import annotations

import numpy as np

from .caches import HostCaches
from .session import NP_DTYPES, ProviderError

TORCH_PROVIDERS = ("ipex", "torch")


def import_torch(provider: str):
    try:
        import torch
        if provider == "ipex":
            import intel_extension_for_pytorch  # noqa: F401  (registers the kernels the graphs call)
    except ImportError as e:
        extra = "bash ci/install_ipex.sh, then .venv-ipex/bin/python" if provider == "ipex" else "pip install torch"
        raise ProviderError(f"provider {provider!r} needs {e.name}: {extra}") from None
    return torch


class TorchSession:
    def __init__(self, path: str, spec: dict, provider: str, device: str, cache_length: int, max_tokens: int,
                 max_k: int = 64, threads: int | None = None):
        torch = self.torch = import_torch(provider)
        if threads:
            torch.set_num_threads(threads)
        self.device = device
        try:
            self.module = torch.jit.load(path, map_location=device)
        except RuntimeError as e:
            raise ProviderError(f"cannot load {path} on {device}: {str(e).splitlines()[0]}") from None
        self.spec, self.cache_length, self.max_tokens, self.max_k = spec, cache_length, max_tokens, max_k
        past = [i for i in spec["inputs"] if i["name"].startswith("past_")]
        self.cache_names = [i["name"] for i in past]
        self.cache_dtype = NP_DTYPES[past[0]["dtype"]]
        self.input_names = [i["name"] for i in spec["inputs"] if not i["name"].startswith("past_")]
        self.output_names = [o["name"] for o in spec["outputs"]]
        dims = [(i["shape"][1], i["shape"][3]) for i in past]
        self.grows = device == "cpu"
        if self.grows:
            self.store = HostCaches(dims, self.cache_dtype, cache_length, max_tokens, np.float32)
            self.caches = [torch.from_numpy(a) for a in self.store.arrays]
        else:
            self.caches = [torch.zeros(1, h, cache_length, w, device=device) for h, w in dims]
            self._bias = torch.empty(max_tokens * cache_length, device=device)
            self._position = torch.zeros(1, dtype=torch.int64, device=device)

    @property
    def capacity(self) -> int:
        return self.store.capacity if self.grows else self.cache_length

    def reserve(self, length: int, shrink: bool = False) -> int:
        if self.grows and self.store.reserve(length, shrink):
            self.caches = [self.torch.from_numpy(a) for a in self.store.arrays]
        return self.capacity

    def run(self, inputs: dict[str, np.ndarray], k: int = 1) -> dict[str, np.ndarray]:
        torch = self.torch
        t = inputs["input_ids"].shape[1]
        if t > self.max_tokens or k > self.max_k:
            raise ValueError(f"step of {t} tokens / top-{k} exceeds this session's limits "
                             f"({self.max_tokens} tokens, top-{self.max_k})")
        total = inputs["attention_bias"].shape[-1]
        if self.grows:
            self.reserve(total)
            args = {n: torch.from_numpy(a) for n, a in self.store.step_inputs(inputs, t).items()}
        else:
            args = {n: torch.from_numpy(np.ascontiguousarray(a)).to(self.device, non_blocking=True)
                    for n, a in inputs.items() if n != "attention_bias"}
            bias = self._bias[: t * self.cache_length].view(1, 1, t, self.cache_length)
            bias.fill_(torch.finfo(torch.float32).min)
            bias[..., :total] = torch.from_numpy(inputs["attention_bias"]).to(self.device)
            self._position.fill_(total - t)
            args.update(attention_bias=bias, cache_position=self._position)
        # optimized_execution(False): TorchScript's profiling executor would run the first calls of each
        # new step size unfused and later ones fused, which round differently (measured); the graph
        # was optimized once, when frozen at export.
        with torch.inference_mode(), torch.jit.optimized_execution(False):
            outs = self.module(*(args[n] for n in self.input_names), *self.caches)
        views = {}
        for name, value in zip(self.output_names, outs):
            if name.startswith("topk_"):
                value = value[..., :k]  # the graph returns its MAX_K best
            views[name] = value.cpu().numpy()
        return views

    def cache_arrays(self) -> list[np.ndarray]:
        if not self.grows:
            raise RuntimeError("cache_arrays() is only available for host-resident caches")
        return self.store.arrays

    def move(self, source: np.ndarray, destination: int) -> None:
        """Cache positions `source` to [destination, destination + n): the compaction of a cycle."""
        if self.grows:
            self.store.move(source, destination)
            return
        index = self.torch.from_numpy(source).to(self.device)
        target = self.torch.arange(destination, destination + len(source), device=self.device)
        for c in self.caches:
            c.index_copy_(2, target, c.index_select(2, index))
