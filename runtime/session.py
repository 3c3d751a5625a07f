"""ONNX Runtime sessions over preallocated buffers: the backend of ONNX artifacts (runtime/backend.py).

Each graph's KV cache is allocated once (for the session's cache length) and bound as both the
past_* input and the present_* output, so the graph writes new K/V in place. Step inputs and
outputs live in buffers sized for the largest step and are bound by pointer, so a steady-state
step allocates nothing but the binding calls themselves.
"""
from __future__ import annotations

import json

import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper

from models.cpu import int8_dot_products

from .backend import GraphSpec, ProviderError
from .caches import HostCaches

PROVIDERS = {
    "cpu": ["CPUExecutionProvider"],
    "cuda": ["CUDAExecutionProvider", "CPUExecutionProvider"],
    "openvino": ["OpenVINOExecutionProvider", "CPUExecutionProvider"],
}
DEVICE = {"cpu": "cpu", "cuda": "cuda", "openvino": "cpu"}
# Capacity step of the exact attention's host caches. Its matmuls read every position of the capacity,
# masked or not, so a small step reads less (docs/code-notes.md). MLAS's sums of a row do not depend
# on the capacity (zeros past the positions in use add exact zeros), so neither does exactness;
# tests/test_runtime_bitwise.py crosses steps.
CACHE_STEP = 64


def _address(arr: np.ndarray) -> int:
    """Data pointer of a C-contiguous array (cheaper than arr.ctypes.data on the hot path)."""
    if not arr.flags.c_contiguous:
        raise ValueError("step buffers must be C-contiguous")
    return arr.__array_interface__["data"][0]


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
    return so


def openvino_options(device: str = "CPU", precision_hint: str | None = None) -> dict:
    """OpenVINO EP options: the device (CPU, GPU, NPU, GPU.0, ...) and an inference precision hint
    (bf16 runs matmuls on AMX / AVX512-BF16 on Intel CPUs that have them; f16 on GPUs)."""
    options = {"device_type": device}
    if precision_hint:
        options["load_config"] = json.dumps({device.split(".")[0]: {"INFERENCE_PRECISION_HINT": precision_hint}})
    return options


def create_session(path: str, provider: str, threads: int | None, options: dict | None) -> ort.InferenceSession:
    providers = list(PROVIDERS[provider])
    if options:
        providers[0] = (providers[0], {k: str(v) for k, v in options.items()})
    session = ort.InferenceSession(path, session_options(threads), providers=providers)
    # ONNX Runtime falls back to the CPU provider, with a logged warning only, when a provider cannot
    # be created with the options given.
    if PROVIDERS[provider][0] not in session.get_providers():
        raise ProviderError(f"{PROVIDERS[provider][0]} could not be created with options {options}")
    return session


class GraphSession:
    """One graph (base or draft) with its in-place KV cache and preallocated step buffers."""

    resident = False  # outputs are host arrays

    @staticmethod
    def check_artifact(manifest: dict, provider: str) -> None:
        """ONNX Runtime runs ONNX artifacts, w8a8 ones only where its int8 products are right."""
        target = manifest.get("target", "onnx")
        if target != "onnx":
            raise ProviderError(f"this is a {target} artifact: load it with provider={target!r}")
        if manifest.get("precision") == "w8a8" and provider != "cuda" and not int8_dot_products():
            # Without VNNI, MLAS multiplies uint8 by int8 with vpmaddubsw, whose 16-bit pair sums saturate
            # on w8a8's full-range operands: the products would be wrong, not merely rounded. The openvino
            # provider is held to the same rule: its kernels were not checked on such CPUs.
            raise ProviderError("w8a8 artifacts need a CPU with 8-bit dot products (AVX512-VNNI, AVX-VNNI or AMX); "
                                "this one has none: export --precision int8 instead")

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
        self.device = DEVICE[provider]
        io = GraphSpec.parse(spec)
        # Exact attention holds the caches of several sequences and writes each row to its own
        # sequence's slot (cache_sequences, cache_slots; artifacts before it held one sequence and
        # took one cache_position for the step's rows).
        self.slotted = "cache_slots" in io.inputs
        if sequences > 1 and not self.slotted:
            raise ProviderError("this artifact's graphs hold one sequence at a time (fused attention, or an export "
                                "before sequence slots): export it again with exact attention to decode several")
        self.grows = self.slotted or "cache_position" in io.inputs
        if self.grows and provider == "openvino":
            raise ProviderError("this artifact's exact attention writes a host cache in place, which the OpenVINO EP "
                                "does not keep: export with --attention fused for OpenVINO")
        self.session = create_session(path, provider, threads, provider_options)
        self.spec = spec
        self.cache_length = cache_length
        self.max_tokens = max_tokens
        self.binding = self.session.io_binding()
        self.cache_names, self.cache_dtype, dims = io.cache_names, io.cache_dtype, io.cache_dims
        # A graph with exact attention (input cache_position) attends over its whole cache: host caches
        # that grow (runtime/caches.py). Others get caches of cache_length where the provider keeps them.
        if self.grows:
            if self.device != "cpu":
                raise ProviderError("graphs with exact attention run on host memory (provider cpu); "
                                    "export with --attention fused for this provider")
            self.store = HostCaches(dims, self.cache_dtype, cache_length, max_tokens, io.dtypes["attention_bias"],
                                    CACHE_STEP, sequences)
            self._bind([ort.OrtValue.ortvalue_from_numpy(a) for a in self.store.arrays])
        else:
            self._bind([ort.OrtValue.ortvalue_from_shape_and_type([1, h, cache_length, w], self.cache_dtype,
                                                                  self.device, 0) for h, w in dims])
        # One buffer per non-cache output, big enough for max_tokens rows; views of it are returned.
        self.outputs: dict[str, np.ndarray] = {}
        self._out_shapes = {name: io.shapes[name] for name in io.outputs}
        for name, shape in self._out_shapes.items():
            self.outputs[name] = np.empty(int(np.prod(self._dims(shape, max_tokens, max_k))), io.dtypes[name])
        self.max_k = max_k
        self.compactor: CacheCompactor | None = None  # made at the first move

    def _bind(self, caches: list) -> None:
        """Bind every cache as both its past_* input and its present_* output."""
        self.caches = caches
        self._bound_range = None  # the sequences whose caches a slotted graph has bound (_bind_sequences)
        for name, value in zip(self.cache_names, caches):
            self.binding.bind_ortvalue_input(name, value)
            self.binding.bind_ortvalue_output(name.replace("past_", "present_"), value)

    @property
    def capacity(self) -> int:
        return self.store.capacity if self.grows else self.cache_length

    def reserve(self, length: int, shrink: bool = False) -> int:
        """Make growing caches hold at least `length` positions (with shrink, also at most a step
        more); returns the capacity. Other caches hold cache_length positions from the start."""
        if self.grows and self.store.reserve(length, shrink):
            self._bind([ort.OrtValue.ortvalue_from_numpy(a) for a in self.store.arrays])
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
                bind(bound, "cpu", 0, view.dtype, view.shape, _address(view))
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
            b.bind_input(name, "cpu", 0, arr.dtype, arr.shape, _address(arr))
        views = {}
        for name, shape in self._out_shapes.items():
            dims = self._dims(shape, t, k, r)
            buf = self.outputs[name][: int(np.prod(dims))].reshape(dims)
            b.bind_output(name, "cpu", 0, buf.dtype, dims, _address(buf))
            views[name] = buf
        self.session.run_with_iobinding(b)
        return views

    def cache_arrays(self) -> list[np.ndarray]:
        """The host caches themselves (CPU only), [sequences, heads, capacity, width] each."""
        if self.device != "cpu":
            raise RuntimeError("cache_arrays() is only available for host-resident caches")
        return self.store.arrays if self.grows else [v.numpy() for v in self.caches]

    def move(self, source: np.ndarray, destination: int, sequence: int = 0) -> None:
        """Cache positions `source` of a sequence to [destination, destination + n): the compaction of
        a cycle."""
        if self.compactor is None:
            self.compactor = CacheCompactor(self, self.provider)
        self.compactor.move(source, destination, sequence)

    def device_array(self, a: np.ndarray) -> np.ndarray:
        return a

    def keeps_exactness(self, manifest: dict, matches_decoding) -> bool:
        """The claim stands as exported: the graphs are built for MLAS's fixed summation order
        (export/onnx_graph.py), with nothing left to measure at load."""
        return True


def compaction_graph(n_caches: int, dtype) -> bytes:
    """A graph that moves the accepted tree nodes' K/V rows into place, on the device.

    For every cache: Gather the rows `source` along the sequence axis and TensorScatter them at
    `destination` (the first free slot). The caches are bound in and out as the same buffers,
    which ONNX Runtime's TensorScatter kernels recognise and update in place.
    """
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inputs, outputs = [], [], []
    inputs.append(helper.make_tensor_value_info("source", TensorProto.INT64, ["n"]))
    inputs.append(helper.make_tensor_value_info("destination", TensorProto.INT64, [1]))
    for i in range(n_caches):
        shape = [1, "heads", "length", f"width_{i}"]
        inputs.append(helper.make_tensor_value_info(f"cache_{i}", elem, shape))
        outputs.append(helper.make_tensor_value_info(f"out_{i}", elem, shape))
        nodes.append(helper.make_node("Gather", [f"cache_{i}", "source"], [f"rows_{i}"], axis=2))
        nodes.append(helper.make_node("TensorScatter", [f"cache_{i}", f"rows_{i}", "destination"], [f"out_{i}"],
                                      axis=2))
    graph = helper.make_graph(nodes, "kv_compaction", inputs, outputs)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 24)], ir_version=10)
    return model.SerializeToString()


class CacheCompactor:
    """Moves K/V rows `source` to [destination, destination + n) in every cache of a GraphSession.

    Host-resident caches (CPU, and OpenVINO on CPU, whose onnxruntime build lacks TensorScatter)
    are moved through numpy views of the bound buffers; device caches through compaction_graph.
    """

    def __init__(self, target: GraphSession, provider: str, use_graph: bool | None = None):
        self.target = target
        self.on_host = target.device == "cpu" if use_graph is None else not use_graph
        if self.on_host:
            return
        graph = compaction_graph(len(target.caches), target.cache_dtype)
        self.session = ort.InferenceSession(graph, session_options(1), providers=PROVIDERS[provider])
        self.binding = self.session.io_binding()
        self._bound = None  # the target's cache list when last bound (it changes when caches grow)
        self.destination = np.zeros(1, np.int64)

    def move(self, source: np.ndarray, destination: int, sequence: int = 0) -> None:
        if self.on_host:
            for a in self.target.cache_arrays():
                a[sequence][:, destination:destination + len(source)] = a[sequence][:, source]
            return
        if sequence:
            raise ValueError("device caches hold one sequence")
        self.destination[0] = destination
        b = self.binding
        if self._bound is not self.target.caches:
            for i, value in enumerate(self.target.caches):
                b.bind_ortvalue_input(f"cache_{i}", value)
                b.bind_ortvalue_output(f"out_{i}", value)
            self._bound = self.target.caches
        b.bind_input("source", "cpu", 0, np.int64, source.shape, _address(source))
        b.bind_input("destination", "cpu", 0, np.int64, [1], _address(self.destination))
        self.session.run_with_iobinding(b)
