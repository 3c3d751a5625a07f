"""The Int8MatMul operator (runtime/kernels/int8_matmul.cc, the products of --precision w8a16) on its
own, through a real ONNX Runtime session: its result against the same integer products in float64,
each row's bits whatever the step's other rows and the thread count, the same bits from its AVX2 and
AVX-512 VNNI builds, and the artifacts that need it
refused where it cannot run. Whole w8a16 graphs' tree rows against one-row steps are
tests/test_runtime_bitwise.py's (kinds "w8a16")."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import runtime
from export.onnx_graph import KERNEL_DOMAIN
from export.quantize import panels_8bit, quantize_8bit, signed_8bit
from models.cpu import cpu_flags
from runtime import kernels
from runtime.backend import ProviderError
from runtime.session import GraphSession, session_options

LEVELS = 32767
pytestmark = pytest.mark.skipif(kernels.missing() is not None, reason=str(kernels.missing()))


def matmul_session(k: int, n: int, block: int, bias: bool, threads: int) -> tuple[ort.InferenceSession, dict]:
    """A one-node graph over random weights in the operator's panels, and those weights as signed
    int8 [N, K], block scales [N, K / block] and a bias."""
    rng = np.random.default_rng(k + n + block)
    w = rng.standard_normal((n, k)).astype(np.float32) * 0.05
    blocks, scales = quantize_8bit(w, block)
    weights = {"weight": signed_8bit(blocks), "scales": scales}
    stored = dict(zip(("weight", "scales"), panels_8bit(blocks, scales)))
    if bias:
        weights["bias"] = stored["bias"] = rng.standard_normal(n).astype(np.float32)
    inits = [helper.make_tensor(name, TensorProto.INT8 if a.dtype == np.int8 else TensorProto.FLOAT, a.shape,
                                a.tobytes(), raw=True) for name, a in stored.items()]
    node = helper.make_node("Int8MatMul", ["x", *stored], ["y"], domain=KERNEL_DOMAIN, block=block, columns=n)
    graph = helper.make_graph([node], "int8_matmul", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "K"])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["T", n])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(threads),
                                providers=["CPUExecutionProvider"]), weights


def reference(x: np.ndarray, weights: dict, block: int) -> np.ndarray:
    """What the operator computes, in float64: each row rounded to +-LEVELS over its own largest
    magnitude, exact integer products by block, each block's sum times its weight scale."""
    top = np.abs(x).max(axis=1, keepdims=True)
    q = np.rint(x * (np.float32(LEVELS) / top)).astype(np.int64)
    w = weights["weight"].astype(np.int64)
    n, k = w.shape
    sums = np.einsum("tbk,nbk->tnb", q.reshape(len(x), -1, block), w.reshape(n, -1, block))
    y = (sums * weights["scales"][None].astype(np.float64)).sum(-1) * (top / LEVELS)
    return y + weights.get("bias", 0)


@pytest.mark.parametrize("k, n, block, bias", [(576, 960, 32, False), (1536, 577, 32, True), (576, 962, 32, False), (256, 130, 64, True)])
def test_products_equal_the_integer_products_they_define(k, n, block, bias):
    session, weights = matmul_session(k, n, block, bias, threads=2)
    x = np.random.default_rng(1).standard_normal((37, k)).astype(np.float32) * 3
    x[5, 7] = 80.0  # an outlier channel sets its row's scale alone
    y = session.run(None, {"x": x})[0]
    want = reference(x, weights, block)
    np.testing.assert_allclose(y, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())
    stored = (weights["weight"].reshape(n, -1, block) * weights["scales"][..., None]).reshape(n, k)
    exact = x.astype(np.float64) @ stored.T + weights.get("bias", 0)
    assert np.abs(y - exact).max() < 1e-3 * np.abs(exact).max()  # 16-bit rows round little


@pytest.mark.parametrize("threads", [1, 8])
def test_a_rows_bits_do_not_depend_on_the_steps_other_rows(threads):
    """Every step size the runtime makes (a one-token step, trees, register tiles of 4 rows, tasks of
    48, a prefill chunk), each row equals that row computed alone, bitwise; 995 outputs end their
    last task of 6 panels with a tile of one panel of 3 columns."""
    session, _ = matmul_session(576, 995, 32, True, threads)
    x = np.random.default_rng(2).standard_normal((130, 576)).astype(np.float32)
    alone = np.concatenate([session.run(None, {"x": x[t:t + 1]})[0] for t in range(len(x))])
    for rows in (2, 3, 4, 5, 8, 16, 47, 48, 49, 130):
        np.testing.assert_array_equal(session.run(None, {"x": x[:rows]})[0], alone[:rows], err_msg=f"{rows} rows")
    zero = np.zeros((1, 576), np.float32)  # a row of zeros gives the bias
    np.testing.assert_array_equal(session.run(None, {"x": zero})[0], session.run(None, {"x": zero})[0])


@pytest.mark.skipif("avx512_vnni" not in cpu_flags() or "avx512vl" not in cpu_flags(),
                    reason="this CPU has no AVX-512 VNNI: only the AVX2 build of the tiles runs here")
@pytest.mark.parametrize("k, n, block, bias", [(576, 995, 32, True), (1536, 577, 64, False)])
def test_the_vnni_build_gives_the_avx2_builds_bits(k, n, block, bias, monkeypatch):
    """An artifact's outputs do not depend on which build of the tiles the CPU runs (int8_tiles.cc):
    the same integers are added, then the same float operations per column."""
    vnni, _ = matmul_session(k, n, block, bias, threads=2)
    monkeypatch.setenv("EAGLE2_INT8_MATMUL", "avx2")
    avx2, _ = matmul_session(k, n, block, bias, threads=2)
    x = np.random.default_rng(3).standard_normal((53, k)).astype(np.float32) * 2
    for rows in (1, 3, 4, 5, 53):
        np.testing.assert_array_equal(vnni.run(None, {"x": x[:rows]})[0], avx2.run(None, {"x": x[:rows]})[0],
                                      err_msg=f"{rows} rows")


def test_mismatched_inputs_are_an_error():
    session, _ = matmul_session(256, 64, 64, False, threads=1)
    with pytest.raises(Exception, match="Int8MatMul"):
        session.run(None, {"x": np.zeros((2, 128), np.float32)})


def test_a_w8a16_artifact_loads_only_where_its_products_run(tiny_artifact, monkeypatch, tmp_path):
    path = tiny_artifact("tiny-llama", "w8a16", attention="kernel")
    gen = runtime.load(path)
    assert gen.manifest["precision"] == gen.manifest["draft_precision"] == "w8a16" and gen.verify_exact
    assert gen.generate([5, 6, 7], max_new_tokens=8).token_ids == gen.generate([5, 6, 7], max_new_tokens=8,
                                                                                speculative=False).token_ids
    for provider in ("openvino", "cuda"):  # checked before any session
        with pytest.raises(ProviderError, match=f"export it with --precision int8 for {provider}"):
            GraphSession.check_artifact({**gen.manifest, "attention": "exact"}, provider)
    before_panels = {key: value for key, value in gen.manifest.items() if key != "int8_panel"}
    with pytest.raises(ProviderError, match="layout from before panels.*export it again"):
        GraphSession.check_artifact(before_panels, "cpu")
    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / "missing.so")
    with pytest.raises(ProviderError, match="bash ci/build_kernels.sh"):
        runtime.load(path)
