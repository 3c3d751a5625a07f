"""Torch sessions: the backend (runtime/backend.py) of torch artifacts (export/torch_export.py), a
TorchScript graph run with IPEX or plain PyTorch on CPU, CUDA or XPU.

Inputs and outputs are numpy arrays at the boundary, so the decoding loop is the one of the ONNX
path. On CPU the caches are host stores grown in place (runtime/caches.py) that the graph writes
through zero-copy torch views; on an accelerator (runtime/torch_device.py) they live on the device at
their full length, hidden states and logits stay there too (the session is `resident`), and only
the step's ids, positions, bias and the draft's top-k cross.
"""
from __future__ import annotations

import warnings

import numpy as np

from artifact.graphs import GraphSpec
from models.config import ModelConfig

from .backend import ProviderError
from .caches import HostCaches
from .torch_device import DeviceSteps

TORCH_PROVIDERS = ("ipex", "torch")
# Devices whose caches are host stores grown in place; on others every step's tensors stay on the device.
HOST_DEVICES = ("cpu",)
# Capacity step of host caches: a multiple of the graphs' key block (models/attention.KEY_BLOCK), so
# that every block of the attention's value sums is a whole one.
CACHE_STEP = 256


def import_torch(provider: str):
    try:
        import torch
        if provider == "ipex":
            import intel_extension_for_pytorch  # noqa: F401  (registers the kernels the graphs call)
    except ImportError as e:
        extra = "bash ci/install_ipex.sh, then .venv-ipex/bin/python" if provider == "ipex" else "pip install torch"
        raise ProviderError(f"provider {provider!r} needs {e.name}: {extra}") from None
    return torch


def attention_sums_in_order(torch, kv_heads: int, rows: int, width: int, block: int) -> bool:
    """Whether this CPU's GEMMs give a query row of the torch graphs' attention (models/attention.py:
    cache_product for q @ keys^T, value_product for probs @ values, in fp32) the same bits alone as
    inside a step of more tokens at a capacity one key block larger, with its last key moved to a
    later position of its block and masked zeros between: a tree node's ancestors sit at tree slots
    where plain decoding put them side by side, and a verify step may hold more capacity than a
    plain step did at the same position. True on Intel AVX-512 CPUs, false on AVX2-only ones
    (docs/code-notes.md)."""
    with warnings.catch_warnings():
        # IPEX's JIT fusion pass announces its deprecation on the first scripted call; nothing to act on.
        warnings.filterwarnings("ignore", message="JIT pass will be deprecated")
        return _attention_sums_in_order(torch, kv_heads, rows, width, block)


def _attention_sums_in_order(torch, kv_heads: int, rows: int, width: int, block: int) -> bool:
    from models.attention import cache_product, value_product  # torch: only once a torch artifact loads
    g = torch.Generator().manual_seed(0)
    d, capacity = width - 1, 2 * block
    keys = torch.randn(1, kv_heads, capacity + block, d, generator=g)
    values = torch.randn(1, kv_heads, capacity + block, width, generator=g)
    for t in (2, 3, 5, 8, 16):
        queries = torch.randn(t, kv_heads, rows, d, generator=g)
        if not torch.equal(cache_product(queries[:1], keys[:, :, :capacity].transpose(2, 3))[0],
                           cache_product(queries, keys.transpose(2, 3))[0, ..., :capacity]):
            return False
        for context in range(13, capacity - 16, 29):
            probs = torch.zeros(t, kv_heads, rows, capacity + block)
            probs[..., :context] = torch.rand(t, kv_heads, rows, context, generator=g)
            alone = probs[-1:, ..., :capacity].contiguous()
            alone[..., context] = 0.5
            for gap in (1, 5, 11):
                if (context + gap) // block != context // block:
                    continue  # trees never straddle a key block
                tree, moved = probs.clone(), values.clone()
                tree[-1, ..., context + gap] = 0.5
                moved[:, :, context + gap] = values[:, :, context]
                if not torch.equal(value_product(alone, values[:, :, :capacity], block)[0],
                                   value_product(tree, moved, block)[-1]):
                    return False
    return True


class TorchSession:
    providers = TORCH_PROVIDERS
    slotted = False  # the graphs write a step's rows side by side (cache_position)

    @staticmethod
    def check_provider(provider: str) -> None:
        """torch itself is checked when a session imports it: the ONNX path never does."""
        if provider not in TORCH_PROVIDERS:
            raise ProviderError(f"provider {provider!r} does not run torch artifacts; use one of "
                                f"{', '.join(TORCH_PROVIDERS)}")

    @staticmethod
    def batches(manifest: dict) -> bool:
        return False

    @staticmethod
    def check_artifact(manifest: dict, provider: str) -> None:
        """Torch artifacts run on the provider they were exported for."""
        target = manifest.get("target", "onnx")
        if target == "onnx":
            raise ProviderError(f"provider {provider!r} runs torch artifacts (python -m export MODEL --target "
                                f"{provider}); this artifact is ONNX: use cpu, cuda or openvino")
        if target != provider:
            raise ProviderError(f"this is a {target} artifact: load it with provider={target!r}")

    @classmethod
    def open(cls, path: str, spec: dict, provider: str, device: str, cache_length: int, max_tokens: int, max_k: int,
             threads: int | None, options: dict | None, sequences: int = 1) -> TorchSession:
        """The backends' common constructor (runtime/providers.py); torch graphs hold one sequence."""
        if sequences != 1:
            raise ProviderError("torch graphs hold one sequence at a time")
        return cls(path, spec, provider, device, cache_length, max_tokens, max_k, threads, options)

    def __init__(self, path: str, spec: dict, provider: str, device: str, cache_length: int, max_tokens: int,
                 max_k: int = 64, threads: int | None = None, options: dict | None = None):
        """options: {"cuda_graphs": bool}, on by default for CUDA devices (runtime/torch_device.py)."""
        torch = self.torch = import_torch(provider)
        options = dict(options or {})
        cuda_graphs = options.pop("cuda_graphs", None)
        if options:
            raise ProviderError(f"unknown option(s) {', '.join(sorted(options))} for provider {provider!r}; "
                                "it takes cuda_graphs")
        on_cuda = torch.device(device).type == "cuda"
        if cuda_graphs and not on_cuda:
            raise ProviderError(f"cuda_graphs needs a CUDA device, not {device!r}")
        if threads:
            torch.set_num_threads(threads)
        self.device = device
        try:
            self.module = torch.jit.load(path, map_location=device)
        except RuntimeError as e:
            raise ProviderError(f"cannot load {path} on {device}: {str(e).splitlines()[0]}") from None
        self.spec, self.cache_length, self.max_tokens, self.max_k = spec, cache_length, max_tokens, max_k
        self.io = io = GraphSpec.parse(spec)
        self.cache_names, self.cache_dtype = io.cache_names, io.cache_dtype
        self.grows = device in HOST_DEVICES
        self.resident = not self.grows
        if self.grows:
            self.store = HostCaches(io.cache_dims, self.cache_dtype, cache_length, max_tokens, np.float32, CACHE_STEP)
            self.caches = [torch.from_numpy(a) for a in self.store.arrays]
        else:
            self.steps = DeviceSteps(torch, self.module, io, device, cache_length, max_tokens,
                                     on_cuda if cuda_graphs is None else cuda_graphs)
            self.caches = self.steps.caches

    @property
    def capacity(self) -> int:
        return self.store.capacity if self.grows else self.cache_length

    def reserve(self, length: int, shrink: bool = False) -> int:
        if self.grows and self.store.reserve(length, shrink):
            self.caches = [self.torch.from_numpy(a) for a in self.store.arrays]
        return self.capacity

    def run(self, inputs: dict[str, np.ndarray], k: int = 1, sequences: tuple[int, int] = (0, 1)) -> dict:
        torch = self.torch
        t = inputs["input_ids"].shape[1]
        if t > self.max_tokens or k > self.max_k:
            raise ValueError(f"step of {t} tokens / top-{k} exceeds this session's limits "
                             f"({self.max_tokens} tokens, top-{self.max_k})")
        if not self.grows:
            return self.steps.run(inputs, t, k)
        self.reserve(inputs["attention_bias"].shape[-1])
        args = {n: torch.from_numpy(a) for n, a in self.store.step_inputs(inputs, t, slotted=False).items()}
        # optimized_execution(False): TorchScript's profiling executor would run the first calls of each
        # new step size unfused and later ones fused, which round differently (measured); the graph
        # was optimized once, when frozen at export.
        with torch.inference_mode(), torch.jit.optimized_execution(False):
            outs = self.module(*(args[n] for n in self.io.inputs), *self.caches)
        views = {}
        for name, value in zip(self.io.outputs, outs):
            if name.startswith("topk_"):
                value = value[..., :k]  # the graph returns its MAX_K best
            views[name] = value.cpu().numpy()
        return views

    def cache_arrays(self) -> list[np.ndarray]:
        if not self.grows:
            raise RuntimeError("cache_arrays() is only available for host-resident caches")
        return self.store.arrays

    def device_array(self, a: np.ndarray):
        return self.torch.from_numpy(a).to(self.device) if self.resident else a

    def keeps_exactness(self, manifest: dict, matches_decoding) -> bool:
        """On the CPU the graphs' exactness rests on the GEMM kernels, measured here: the attention's
        (attention_in_order) and, through a branching tree, the linear layers' (IPEX's int8 ones take
        another path for one row than for several). On an accelerator the claim stands as exported."""
        return self.resident or (self.attention_in_order(manifest) and matches_decoding())

    def attention_in_order(self, manifest: dict) -> bool:
        """Whether this CPU sums the artifact's attention keys in a fixed order (attention_sums_in_order;
        PyTorch's fp32 GEMMs do not on AVX2 CPUs). Artifacts without key blocks (exported before them)
        sum by capacity: never."""
        block = manifest.get("exact_key_block")
        if block is None:
            return False
        from models.attention import query_rows
        cfg = ModelConfig.from_dict(manifest["model"]["config"])
        return attention_sums_in_order(self.torch, cfg.num_kv_heads, query_rows(cfg), cfg.head_dim + 1, block)

    def move(self, source: np.ndarray, destination: int, sequence: int = 0) -> None:
        """Cache positions `source` to [destination, destination + n): the compaction of a cycle
        (torch graphs hold one sequence)."""
        if self.grows:
            self.store.move(source, destination)
        else:
            self.steps.move(source, destination)
