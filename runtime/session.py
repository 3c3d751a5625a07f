"""ONNX Runtime sessions over preallocated buffers: the backend of ONNX artifacts (runtime/backend.py).

Each graph's KV cache is allocated once (for the session's cache length) and bound as both the
past_* input and the present_* output, so the graph writes new K/V in place. Step inputs and
outputs live in buffers sized for the largest step and are bound by pointer, so a steady-state
step allocates nothing but the binding calls themselves.

On CUDA the caches and the step outputs are torch tensors on the GPU, bound by pointer, and ONNX
Runtime runs on torch's current stream: hidden states stay there (the engine feeds them back to
the draft as device tensors), logits stay there behind DeviceRows (the decoding loop reads their
argmax, or the rows that prefill and sampling need), and only the draft's top-k comes back.
"""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort

from artifact.graphs import GraphSpec

from . import cpu_fit, kernels
from .backend import ProviderError
from .caches import DeviceCaches, HostCaches, move_positions, torch_dtype
from .torch_device import DeviceRows

PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "openvino": ["OpenVINOExecutionProvider", "CPUExecutionProvider"],
}
# Providers whose caches and step outputs are torch tensors on their device. Only exact attention's
# graphs run there: every operator they hold has a CUDA kernel for the types they give it
# (tests/test_runtime_cuda_path.py lists them with the kernel sources), while fused attention's
# GroupQueryAttention refuses an attention_bias on CUDA (contrib_ops/cuda/bert/group_query_attention.cc).
DEVICE_BUFFERS = {"cuda": "cuda"}
# Precisions (base and draft) whose every operator has a CUDA kernel (tests/test_runtime_cuda_path.py);
# w8a8's MatMulIntegerToFloat has none and would run on the CPU EP, copying every step.
CUDA_PRECISIONS = ("fp16", "fp32", "int8")
# Capacity step of the exact attention's host caches. Its matmuls read every position of the capacity,
# masked or not, so a small step reads less (docs/code-notes.md). MLAS's sums of a row do not depend
# on the capacity (zeros past the positions in use add exact zeros), so neither does exactness;
# tests/test_runtime_bitwise.py crosses steps.
CACHE_STEP = 64


def _address(arr) -> int:
    """Data pointer of a C-contiguous array or torch tensor (cheaper than arr.ctypes.data on the hot path)."""
    if isinstance(arr, np.ndarray):
        if not arr.flags.c_contiguous:
            raise ValueError("step buffers must be C-contiguous")
        return arr.__array_interface__["data"][0]
    if not arr.is_contiguous():
        raise ValueError("step buffers must be contiguous")
    return arr.data_ptr()


def device_torch(provider: str, device: str):
    """torch, for the device buffers of `provider`: ProviderError where it is missing or sees no device."""
    try:
        import torch
    except ImportError:
        raise ProviderError(f"provider {provider!r} keeps its caches and step outputs in torch tensors on the "
                            "device: install torch (with CUDA)") from None
    if device == "cuda" and not torch.cuda.is_available():
        raise ProviderError(f"provider {provider!r}: torch {torch.__version__} sees no CUDA device")
    return torch


def check_provider(provider: str) -> None:
    if provider not in PROVIDERS:
        raise ProviderError(f"unknown provider {provider!r}; choose one of {', '.join(PROVIDERS)}, "
                            "or ipex / torch for torch artifacts")
    wanted = PROVIDERS[provider][0]
    if wanted not in ort.get_available_providers():
        extra = {"cuda": "cuda", "openvino": "openvino"}.get(provider)
        raise ProviderError(f"{wanted} is not available in this onnxruntime build "
                            f"(available: {', '.join(ort.get_available_providers())}); "
                            f"install the project's [{extra}] extra")


def session_options(threads: int | None = None) -> ort.SessionOptions:
    so = ort.SessionOptions()
    so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    if threads:
        so.intra_op_num_threads = threads
    # The base and draft sessions run strictly one after the other, each with its own thread pool.
    # A pool left spinning after its run takes the cores the next session needs (docs/code-notes.md):
    # spin within a run only.
    so.add_session_config_entry("session.force_spinning_stop", "1")
    so.log_severity_level = 3
    if kernels.missing() is None:  # for graphs with kernel attention or w8a16 products; inert for the others
        so.register_custom_ops_library(str(kernels.LIBRARY))
    return so


def openvino_options(device: str = "CPU", precision_hint: str | None = None) -> dict:
    """OpenVINO EP options: the device (CPU, GPU, NPU, GPU.0, ...) and an inference precision hint
    (bf16 runs matmuls on AMX / AVX512-BF16 on Intel CPUs that have them; f16 on GPUs)."""
    options = {"device_type": device}
    if precision_hint:
        options["load_config"] = json.dumps({device.split(".")[0]: {"INFERENCE_PRECISION_HINT": precision_hint}})
    return options


def create_session(path: str, provider: str, threads: int | None, options: dict | None,
                   torch=None) -> ort.InferenceSession:
    """`torch`, where the provider's buffers are torch tensors on a CUDA device: ONNX Runtime runs on
    torch's current stream, so that the steps and torch's own work on their tensors stay in order."""
    providers = list(PROVIDERS[provider])
    if torch is not None and provider == "cuda":
        options = {"device_id": torch.cuda.current_device(),
                   "user_compute_stream": str(torch.cuda.current_stream().cuda_stream), **(options or {})}
    if options:
        providers[0] = (providers[0], {k: str(v) for k, v in options.items()})
    session = ort.InferenceSession(path, session_options(threads), providers=providers)
    # ONNX Runtime falls back to the CPU provider, with a logged warning only, when a provider cannot
    # be created with the options given.
    if PROVIDERS[provider][0] not in session.get_providers():
        raise ProviderError(f"{PROVIDERS[provider][0]} could not be created with options {options}")
    return session


def _grows(io: GraphSpec) -> bool:
    """Whether a graph's caches are host stores that grow in place: exact attention's, whose steps say
    where their rows go (cache_slots, or cache_position before sequence slots)."""
    return io.slotted or "cache_position" in io.inputs


class GraphSession:
    """One graph (base or draft) with its in-place KV cache and preallocated step buffers."""

    providers = tuple(PROVIDERS)
    check_provider = staticmethod(check_provider)

    @staticmethod
    def check_artifact(manifest: dict, provider: str) -> None:
        """ONNX Runtime runs ONNX artifacts, w8a8 ones only where its int8 products are right; a
        device provider only graphs whose operators all have its kernels; OpenVINO only graphs that
        keep their caches themselves."""
        target = manifest.get("target", "onnx")
        if target != "onnx":
            raise ProviderError(f"this is a {target} artifact: load it with provider={target!r}")
        precisions = {manifest.get("precision"), manifest.get("draft_precision") or manifest.get("precision")}
        if manifest.get("attention") == "kernel" and provider != "cpu":
            instead = "fused" if provider == "openvino" else "exact"
            raise ProviderError(f"this artifact's attention is this project's CPU operator, which provider "
                                f"{provider!r} cannot run: export it with --attention {instead} for {provider}")
        if "w8a16" in precisions and provider != "cpu":
            raise ProviderError(f"this artifact's w8a16 products are this project's CPU operator, which provider "
                                f"{provider!r} cannot run: export it with --precision int8 for {provider}")
        if (manifest.get("attention") == "kernel" or "w8a16" in precisions) and (why := kernels.missing()):
            raise ProviderError(why)
        if "w8a16" in precisions and manifest.get("int8_panel") != kernels.PANEL:
            raise ProviderError("this artifact's w8a16 weights are in the layout from before panels, which this "
                                "project's Int8MatMul no longer takes: export it again")
        if provider == "openvino" and _grows(GraphSpec.parse(manifest["graphs"]["base"])):
            raise ProviderError("this artifact's exact attention writes a host cache in place, which the OpenVINO EP "
                                "does not keep: export with --attention fused for OpenVINO")
        if provider in DEVICE_BUFFERS:
            if manifest.get("attention") != "exact":
                raise ProviderError("this artifact's fused attention passes GroupQueryAttention an attention_bias, "
                                    f"which ONNX Runtime's {provider} kernel refuses: export it with --attention exact "
                                    "(the default) to decode on that provider")
            if provider == "cuda" and not precisions <= set(CUDA_PRECISIONS):
                raise ProviderError(f"a {'/'.join(sorted(precisions))} artifact would run part of each step on the CPU "
                                    f"under provider {provider!r}: export it with --precision fp16 (or fp32, int8)")
        # The openvino provider is held to the CPU's rule too: its kernels were not checked on such CPUs.
        if provider != "cuda" and (why := cpu_fit.refusal(manifest)):
            raise ProviderError(why)

    @staticmethod
    def batches(manifest: dict) -> bool:
        return GraphSpec.parse(manifest["graphs"]["base"]).slotted

    @classmethod
    def open(cls, path: str, spec: dict, provider: str, device: str, cache_length: int, max_tokens: int, max_k: int,
             threads: int | None, options: dict | None, sequences: int = 1) -> GraphSession:
        """The backends' common constructor (runtime/providers.py): ONNX Runtime's providers place the
        graph themselves, so `device` is not theirs (OpenVINO's device is one of its options)."""
        return cls(path, spec, provider, cache_length, max_tokens, max_k, threads, options, sequences)

    def __init__(self, path: str, spec: dict, provider: str, cache_length: int, max_tokens: int,
                 max_k: int = 64, threads: int | None = None, provider_options: dict | None = None,
                 sequences: int = 1):
        check_provider(provider)
        self.provider = provider
        io = GraphSpec.parse(spec)
        # Exact attention holds the caches of several sequences and writes each row to its own
        # sequence's slot (cache_sequences, cache_slots; artifacts before it held one sequence and
        # took one cache_position for the step's rows).
        self.slotted = io.slotted
        if sequences > 1 and not self.slotted:
            raise ProviderError("this artifact's graphs hold one sequence at a time (fused attention, or an export "
                                "before sequence slots): export it again with exact attention to decode several")
        self.grows = _grows(io)
        # Whether the caches and outputs are torch tensors on a device (DEVICE_BUFFERS), and which.
        self.resident = provider in DEVICE_BUFFERS
        self.buffer_device = DEVICE_BUFFERS.get(provider, "cpu")
        self.torch = device_torch(provider, self.buffer_device) if self.resident else None
        self.device_id = self.torch.cuda.current_device() if self.buffer_device == "cuda" else 0
        self.session = create_session(path, provider, threads, provider_options, self.torch)
        self.spec = spec
        self.cache_length = cache_length
        self.max_tokens = max_tokens
        self.binding = self.session.io_binding()
        self.cache_names, self.cache_dtype, dims = io.cache_names, io.cache_dtype, io.cache_dims
        self.dtypes = io.dtypes
        # A graph with exact attention (input cache_position) attends over its whole cache: host caches
        # that grow, or device caches at their full length (runtime/caches.py). Others (fused attention
        # on the host) get caches of cache_length.
        if self.resident:
            self.store = DeviceCaches(dims, self.cache_dtype, cache_length, max_tokens, io.dtypes["attention_bias"],
                                      sequences, self.torch, self.buffer_device)
            self._bind_store()
        elif self.grows:
            self.store = HostCaches(dims, self.cache_dtype, cache_length, max_tokens, io.dtypes["attention_bias"],
                                    CACHE_STEP, sequences)
            self._bind_store()
        else:
            self.store = None
            self._bind([ort.OrtValue.ortvalue_from_shape_and_type([1, h, cache_length, w], self.cache_dtype,
                                                                  "cpu", 0) for h, w in dims])
        # One buffer per non-cache output, big enough for max_tokens rows; views of it are returned.
        self.outputs = {}
        self._out_shapes = {name: io.shapes[name] for name in io.outputs}
        for name, shape in self._out_shapes.items():
            size = int(np.prod(self._dims(shape, max_tokens, max_k)))
            self.outputs[name] = (self.torch.empty(size, dtype=torch_dtype(self.torch, io.dtypes[name]),
                                                   device=self.buffer_device)
                                  if self.resident else np.empty(size, io.dtypes[name]))
        self.max_k = max_k

    def _bind(self, caches: list) -> None:
        """Bind every cache (fused attention's OrtValues) as both its past_* input and its present_* output."""
        self.caches = caches
        for name, value in zip(self.cache_names, caches):
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(name.replace("past_", "present_"), value)

    def _bind_store(self) -> None:
        """Bind the store's caches whole (a slotted graph's step binds the sequences it holds)."""
        self._bound_range = None
        self._bind_sequences(0, self.store.sequences)

    @property
    def capacity(self) -> int:
        return self.store.capacity if self.grows else self.cache_length

    def reserve(self, length: int, shrink: bool = False) -> int:
        """Make growing caches hold at least `length` positions (with shrink, also at most a step
        more); returns the capacity. Other caches hold cache_length positions from the start."""
        if self.grows and self.store.reserve(length, shrink):
            self._bind_store()
        return self.capacity

    @staticmethod
    def _dims(shape, t, k, r=None):
        sizes = {"T": t, "R": t if r is None else r, "k": k}
        return [sizes.get(d, d) for d in shape]

    def _bind_sequences(self, first: int, end: int) -> None:
        """Bind the caches of sequences [first, end) (a slotted graph's step sees only those)."""
        if self._bound_range == (first, end):
            return
        for name, a in zip(self.cache_names, self.store.arrays):
            view = a[first:end]
            for bound in (name, name.replace("past_", "present_")):
                bind = self.binding.bind_input if bound == name else self.binding.bind_output
                bind(bound, self.buffer_device, self.device_id, self.cache_dtype, tuple(view.shape), _address(view))
        self._bound_range = (first, end)

    def run(self, inputs: dict[str, np.ndarray], k: int = 1, sequences: tuple[int, int] = (0, 1)) -> dict:
        """Run one step. `inputs` are C-contiguous host arrays (views of the caller's buffers);
        the cache inputs are already bound (a slotted graph's, for the cache sequences
        [first, end) its rows belong to). Returns views of the preallocated output buffers."""
        t = inputs["input_ids"].shape[1]
        r = inputs["logit_rows"].shape[0]
        if t > self.max_tokens or k > self.max_k:
            raise ValueError(f"step of {t} tokens / top-{k} exceeds this session's limits "
                             f"({self.max_tokens} tokens, top-{self.max_k})")
        b = self.binding
        if self.grows:
            self.reserve(inputs["attention_bias"].shape[-1])
            if "row_gather" not in inputs:  # one sequence's rows side by side (runtime/caches.py)
                inputs = self.store.step_inputs(inputs, t, self.slotted)
            if self.slotted:
                self._bind_sequences(*sequences)
        for name, arr in inputs.items():
            if isinstance(arr, np.ndarray):
                b.bind_input(name, "cpu", 0, arr.dtype, arr.shape, _address(arr))
            else:  # a device tensor: the draft's features
                b.bind_input(name, self.buffer_device, self.device_id, self.dtypes[name], tuple(arr.shape),
                             _address(arr))
        views = {}
        for name, shape in self._out_shapes.items():
            dims = self._dims(shape, t, k, r)
            buf = self.outputs[name][: int(np.prod(dims))].reshape(dims)
            if self.resident:
                b.bind_output(name, self.buffer_device, self.device_id, self.dtypes[name], dims, _address(buf))
            else:
                b.bind_output(name, "cpu", 0, buf.dtype, dims, _address(buf))
            views[name] = buf
        self.session.run_with_iobinding(b)
        if not self.resident:
            return views
        result = {name: DeviceRows(v) if name == "logits" else v if name == "hidden_states" else v.cpu().numpy()
                  for name, v in views.items()}
        if self.buffer_device == "cuda":
            # Steps are timed by the caller; a verify step's logits stay on the device, so wait for them.
            self.torch.cuda.synchronize()
        return result

    def cache_arrays(self) -> list[np.ndarray]:
        """The host caches themselves, [sequences, heads, capacity, width] each."""
        if self.resident:
            raise RuntimeError("cache_arrays() is only available for host-resident caches")
        return self.store.arrays if self.grows else [v.numpy() for v in self.caches]

    def move(self, source: np.ndarray, destination: int, sequence: int = 0) -> None:
        """Cache positions `source` of a sequence to [destination, destination + n): the compaction of
        a cycle, where the caches are (on the device, through torch)."""
        if self.store is not None:
            self.store.move(source, destination, sequence)
        else:
            move_positions(self.cache_arrays(), source, destination, sequence)

    def device_array(self, a: np.ndarray):
        return self.torch.from_numpy(a).to(self.buffer_device) if self.resident else a

    def keeps_exactness(self, manifest: dict, matches_decoding) -> bool:
        """The claim stands as exported on the host: the graphs are built for MLAS's fixed summation
        order (export/onnx_graph.py), with nothing left to measure at load. CUDA's kernels sum in
        orders that follow the shapes: no claim there."""
        return self.buffer_device == "cpu"
