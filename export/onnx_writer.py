"""Writing ONNX graphs: a small op-by-op builder (Graph) and the one weights file (WeightStore) that
the base and draft graphs of an artifact share as ONNX external data."""
from __future__ import annotations

import hashlib

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 24  # one opset for the project's graphs (the runtime's compaction graph uses TensorScatter)
IR_VERSION = 10  # readable by the onnxruntime builds of the cuda and openvino extras
WEIGHTS_FILE = "weights.bin"
ALIGN = 4096


class WeightStore:
    """Every large tensor of an artifact, appended to weights.bin (ONNX external data) as the graph
    builders make it, so that no more than the tensor at hand is held in memory.

    Graphs refer to tensors by name, so the draft graph's embedding and lm_head are the very
    bytes of the base graph's, not a second copy (a digest checks that a name is never reused for
    other bytes).
    """

    def __init__(self, path):
        self._file = open(path, "wb")
        self._entries: dict[str, tuple[int, tuple, np.dtype, bytes]] = {}
        self._size = 0
        self.nbytes = 0

    def tensor(self, name: str, array: np.ndarray) -> TensorProto:
        array = np.ascontiguousarray(array)
        digest = hashlib.sha1(array.reshape(-1).view(np.uint8)).digest()
        if name in self._entries:
            _, shape, dtype, old = self._entries[name]
            if (shape, dtype, old) != (array.shape, array.dtype, digest):
                raise ValueError(f"two different tensors named {name!r}")
        else:
            self._file.seek(self._size)
            self._file.write(array.data)
            self._entries[name] = (self._size, array.shape, array.dtype, digest)
            self._size += -(-array.nbytes // ALIGN) * ALIGN
            self.nbytes += array.nbytes
        t = TensorProto(name=name, data_type=helper.np_dtype_to_tensor_dtype(array.dtype), dims=array.shape)
        for key, value in (("location", WEIGHTS_FILE), ("offset", self._entries[name][0]), ("length", array.nbytes)):
            t.external_data.add(key=key, value=str(value))
        t.data_location = TensorProto.EXTERNAL
        return t

    def __enter__(self) -> "WeightStore":
        return self

    def __exit__(self, exc_type, *_) -> None:
        if exc_type is None:
            self._file.truncate(self._size)  # to the last tensor's aligned end
        self._file.close()


class Graph:
    """A tiny graph-building helper: ops return the names of their outputs."""

    def __init__(self, store: WeightStore):
        self.store = store
        self.nodes, self.inputs, self.outputs, self.initializers = [], [], [], []
        self._names: set[str] = set()
        self._n = 0

    def input(self, name, elem_type, shape):
        self.inputs.append(helper.make_tensor_value_info(name, elem_type, shape))
        return name

    def output(self, name, elem_type, shape):
        self.outputs.append(helper.make_tensor_value_info(name, elem_type, shape))

    def weight(self, name: str, array: np.ndarray) -> str:
        if name not in self._names:
            self._names.add(name)
            self.initializers.append(self.store.tensor(name, array))
        return name

    def const(self, value, dtype=np.int64) -> str:
        self._n += 1
        name = f"const_{self._n}"
        self.initializers.append(numpy_helper.from_array(np.asarray(value, dtype=dtype), name))
        return name

    def op(self, op_type, inputs, outputs=1, domain="", name=None, **attrs):
        self._n += 1
        base = name or f"{op_type}_{self._n}"
        outs = [f"{base}_out{i}" for i in range(outputs)] if isinstance(outputs, int) else outputs
        self.nodes.append(helper.make_node(op_type, inputs, outs, name=base, domain=domain or None, **attrs))
        return outs[0] if len(outs) == 1 else outs

    def model(self, name: str, doc: str) -> onnx.ModelProto:
        graph = helper.make_graph(self.nodes, name, self.inputs, self.outputs, self.initializers)
        # ONNX Runtime's contrib ops, and this project's own (the kernel attention's) where used
        domains = sorted({n.domain for n in self.nodes} - {"", "com.microsoft"})
        return helper.make_model(graph, doc_string=doc, ir_version=IR_VERSION, producer_name="eagle2-export",
                                 opset_imports=[helper.make_opsetid("", OPSET), helper.make_opsetid("com.microsoft", 1)]
                                 + [helper.make_opsetid(d, 1) for d in domains])
