"""ONNX Runtime's CUDA path, checked here without a GPU as far as it can be:

- every operator of the graphs provider="cuda" runs (exact attention, fp16, fp32 and int8, EAGLE-1/2
  and EAGLE-3 heads) has a CUDA kernel for the opset and types the graphs give it (CUDA_KERNELS, read
  from ONNX Runtime's sources);
- the device-buffer path (caches and step outputs as torch tensors bound by pointer, caches at their
  full length, logits behind DeviceRows, compaction through torch) decodes as the host path does,
  greedy, sampled and several sequences side by side: run on the CPU EP with torch CPU tensors;
- what provider="cuda" refuses, and why.

On a machine with onnxruntime-gpu and a GPU, tools/gpu_check.py (ci/gpu_check.sh) decodes on CUDA itself.
"""
from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch

import runtime
import runtime.session as session
from eagle2 import tree_from_parents
from export.onnx_export import export_onnx
from models.registry import load_checkpoint
from runtime.backend import ProviderError
from runtime.caches import DeviceCaches
from runtime.torch_device import DeviceRows

TREE = dict(total_tokens=8, depth=2, top_k=3)  # the tiny random head's own features overflow fp16 deeper

# (domain, operator) -> the ONNX Runtime source registering its CUDA kernel, read at microsoft/onnxruntime
# 87ce87adcd5ed34bcfcdd2b939319ea13e48b77b (core/providers/cuda/cuda_execution_provider.cc,
# contrib_ops/cuda/cuda_contrib_kernels.cc, docs/OperatorKernels.md): each is registered for the version
# an opset-24 graph uses (Cast, Identity, Reshape, Shape, Transpose [23, 24]; Pad, Squeeze, Unsqueeze, TopK
# 24; ReduceMax 20; ScatterND, Split 18; the others 13, contrib ops 1) and for float and MLFloat16 data,
# int64 where the graphs give it (Gather, ScatterND, Expand, Concat, Max, Greater's inputs are floats).
CUDA_KERNELS = {
    ("", "Add"): "core/providers/cuda/math/binary_elementwise_ops.cc",
    ("", "Sub"): "core/providers/cuda/math/binary_elementwise_ops.cc",
    ("", "Mul"): "core/providers/cuda/math/binary_elementwise_ops.cc",
    ("", "Div"): "core/providers/cuda/math/binary_elementwise_ops.cc",
    ("", "Greater"): "core/providers/cuda/math/binary_elementwise_ops.cc",
    ("", "Max"): "core/providers/cuda/math/variadic_elementwise_ops.cc",
    ("", "Exp"): "core/providers/cuda/math/unary_elementwise_ops.cc",
    ("", "Sigmoid"): "core/providers/cuda/activation/activations.cc",
    ("", "Cast"): "core/providers/cuda/tensor/cast_op.cc",
    ("", "Concat"): "core/providers/cuda/tensor/concat.cc",
    ("", "Expand"): "core/providers/cuda/tensor/expand.cc",
    ("", "Gather"): "core/providers/cuda/tensor/gather.cc",
    ("", "Gemm"): "core/providers/cuda/math/gemm.cc",
    ("", "MatMul"): "core/providers/cuda/math/matmul.cc",
    ("", "Identity"): "core/providers/cuda/tensor/identity_op.cc",
    ("", "LogSoftmax"): "core/providers/cuda/math/softmax.cc",
    ("", "Pad"): "core/providers/cuda/tensor/pad.cc",
    ("", "ReduceMax"): "core/providers/cuda/reduction/reduction_ops.cc",
    ("", "Reshape"): "core/providers/cuda/tensor/reshape.cc",
    ("", "ScatterND"): "core/providers/cuda/tensor/scatter_nd.cc (in place when input and output share a buffer)",
    ("", "Shape"): "core/providers/cuda/tensor/shape_op.cc",
    ("", "Split"): "core/providers/cuda/tensor/split.cc",
    ("", "Squeeze"): "core/providers/cuda/tensor/squeeze.cc",
    ("", "Unsqueeze"): "core/providers/cuda/tensor/unsqueeze.cc",
    ("", "TopK"): "core/providers/cuda/math/topk.cc",
    ("", "Transpose"): "core/providers/cuda/tensor/transpose.cc",
    ("", "SimplifiedLayerNormalization"): "core/providers/cuda/nn/layer_norm.cc",
    ("com.microsoft", "SkipSimplifiedLayerNormalization"): "contrib_ops/cuda/bert/skip_layer_norm.cc",
    ("com.microsoft", "FusedMatMul"): "contrib_ops/cuda/math/fused_matmul.cc",
    ("com.microsoft", "RotaryEmbedding"): "contrib_ops/cuda/bert/rotary_embedding.cc (position_ids checked by "
                                          "the CPU kernel's own helper)",
    ("com.microsoft", "MatMulNBits"): "contrib_ops/cuda/quantization/matmul_nbits.cc (8-bit weights, float and "
                                      "MLFloat16 activations)",
}


@pytest.fixture(scope="module")
def artifacts(tmp_path_factory, tiny_eagle3_head_dir):
    root = tmp_path_factory.mktemp("cuda-path")
    made = {}
    for name, head, precision in (("fp16", None, "fp16"), ("fp32", None, "fp32"), ("int8", None, "int8"),
                                  ("eagle3-fp16", str(tiny_eagle3_head_dir()), "fp16")):
        made[name] = root / name
        export_onnx(load_checkpoint("tiny-llama", head=head), made[name], precision, 256, verify=False,
                    log=lambda m: None, attention="exact")  # what a CUDA export asks for on an x86-64 CPU
    return made


def device_load(path, **kwargs):
    """runtime.load on provider cpu, with the buffers provider="cuda" keeps on its device as torch CPU tensors."""
    buffers = session.DEVICE_BUFFERS
    session.DEVICE_BUFFERS = {"cpu": "cpu"}
    try:
        return runtime.load(path, **kwargs)
    finally:
        session.DEVICE_BUFFERS = buffers


@pytest.mark.parametrize("name", ["fp16", "fp32", "int8", "eagle3-fp16"])
def test_every_operator_has_a_cuda_kernel(artifacts, name):
    for graph in ("base", "draft"):
        model = onnx.load(str(artifacts[name] / f"{graph}.onnx"), load_external_data=False)
        assert {o.domain or "": o.version for o in model.opset_import} == {"": 24, "com.microsoft": 1}
        ops = {(n.domain or "", n.op_type) for n in model.graph.node}
        assert ops <= set(CUDA_KERNELS), f"{graph}: no CUDA kernel listed for {sorted(ops - set(CUDA_KERNELS))}"


def test_fp16_artifacts_default_to_the_cuda_graphs(artifacts):
    manifest = runtime.load(artifacts["fp16"]).manifest
    assert manifest["attention"] == "exact" and manifest["io_dtype"] == "float16"
    assert manifest["verify_exact"] is False  # CUDA's kernels make no bitwise promise
    session.GraphSession.check_artifact(manifest, "cuda")


def test_what_the_cuda_provider_refuses(artifacts, tmp_path):
    fused = tmp_path / "fused"
    export_onnx(load_checkpoint("tiny-llama"), fused, "fp16", 256, verify=False, log=lambda m: None, attention="fused")
    with pytest.raises(ProviderError, match="GroupQueryAttention an attention_bias"):
        session.GraphSession.check_artifact(runtime.load(fused).manifest, "cuda")
    manifest = runtime.load(artifacts["int8"]).manifest
    session.GraphSession.check_artifact(manifest, "cuda")
    with pytest.raises(ProviderError, match="part of each step on the CPU.*--precision fp16"):
        session.GraphSession.check_artifact(manifest | {"precision": "w8a8"}, "cuda")


@pytest.mark.parametrize("name", ["fp16", "fp32", "eagle3-fp16"])
def test_device_buffers_decode_as_the_host_path(artifacts, name):
    host, dev = runtime.load(artifacts[name]), device_load(artifacts[name])
    for s in (dev.engine.base, dev.engine.draft):
        assert s.resident and isinstance(s.store, DeviceCaches) and s.capacity == s.cache_length
        assert all(isinstance(a, torch.Tensor) for a in s.store.arrays)
    ids = list(range(10, 50))
    plain = host.generate(ids, max_new_tokens=40, speculative=False).token_ids
    for settings in ({"speculative": False}, TREE, {**TREE, "lookup": 0}):
        spec_host, spec_dev = (g.generate(ids, max_new_tokens=40, **settings) for g in (host, dev))
        assert spec_dev.token_ids == spec_host.token_ids == plain
        assert spec_dev.accept_lengths == spec_host.accept_lengths
    sampled = [g.generate(ids, max_new_tokens=30, temperature=0.9, seed=5, **TREE).token_ids for g in (host, dev)]
    assert sampled[0] == sampled[1]


def test_step_outputs_stay_in_device_buffers(artifacts):
    dev = device_load(artifacts["fp32"])
    e = dev.engine
    e.start(8)
    logits = e.verify(tree_from_parents(np.arange(10, 14), np.array([-1, 0, 0, 1])), 0)
    assert isinstance(logits, DeviceRows) and logits.shape == (4, dev.vocab_size)
    assert isinstance(e.solo.last_hidden, torch.Tensor)
    hidden, ids, logp = e.draft_context(np.array([11, 12]), 0, 3)
    assert isinstance(hidden, torch.Tensor) and isinstance(ids, np.ndarray) and ids.shape == logp.shape == (3,)


def test_device_buffers_decode_several_sequences_side_by_side(artifacts):
    host = runtime.load(artifacts["fp32"])
    prompts = [list(range(10, 10 + n)) for n in (12, 30, 21)]
    alone = [host.generate(p, max_new_tokens=24, **TREE).token_ids for p in prompts]
    dev = device_load(artifacts["fp32"], parallel=3)
    try:
        assert [o.token_ids for o in dev.generate_many(prompts, max_new_tokens=24, **TREE)] == alone
    finally:
        dev.close()


def test_gpu_checks_onnx_runtime_rows_pass_on_the_device_path(artifacts):
    """What tools/gpu_check.py checks and measures on provider="cuda" (its ORT_TREES), here on the
    device-buffer path over the CPU EP."""
    from tools import gpu_check
    row = gpu_check.measure(device_load(artifacts["fp16"]), "fp16", True, gpu_check.ORT_TREES)
    assert row["greedy"]["ok"], row["greedy"]
    assert set(row["verify_ms"]) == set(gpu_check.SIZES) and row["draft_ms"] and row["plain_tok_s"] > 0
