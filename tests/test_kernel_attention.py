"""The CacheAttention operator (runtime/kernels/cache_attention.cc) on its own, through a real ONNX
Runtime session: its result against a float64 softmax over the keys each row may see, its writes in
place into bound caches, and the refusals around artifacts that need it. Whether tree rows equal
one-row steps bitwise is tests/test_runtime_bitwise.py's (kinds ":kernel")."""
from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import runtime
from export.onnx_graph import KERNEL_DOMAIN, KERNEL_OPS
from runtime import kernels
from runtime.backend import ProviderError
from runtime.session import GraphSession, session_options

HEADS, KV_HEADS, D, CAPACITY, SEQUENCES = 6, 2, 32, 96, 3
LOWEST = np.finfo(np.float32).min
INPUTS = ("q", "k", "v", "past_key", "past_value", "attention_bias", "row_scatter", "cache_sequences", "cache_slots")

pytestmark = pytest.mark.skipif(kernels.missing() is not None, reason=str(kernels.missing()))


def kernel_session(cache_type: int) -> ort.InferenceSession:
    types = dict.fromkeys(INPUTS, TensorProto.FLOAT) | {"past_key": cache_type, "past_value": cache_type} \
        | dict.fromkeys(INPUTS[6:], TensorProto.INT64)
    ins = [helper.make_tensor_value_info(n, types[n], None) for n in INPUTS]
    outs = [helper.make_tensor_value_info("attention", TensorProto.FLOAT, None),
            helper.make_tensor_value_info("present_key", cache_type, None),
            helper.make_tensor_value_info("present_value", cache_type, None)]
    node = helper.make_node(KERNEL_OPS[cache_type], INPUTS, [o.name for o in outs], domain=KERNEL_DOMAIN,
                            num_heads=HEADS, kv_num_heads=KV_HEADS, scale=D ** -0.5)
    model = helper.make_model(helper.make_graph([node], "cache_attention", ins, outs),
                              opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid(KERNEL_DOMAIN, 1)])
    return ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


def step(rng, dtype):
    """Rows of sequences 2 and 0, in that order: a chain of 3 after 40 cached positions of sequence 2
    (the last skipping the middle one) and one row after 70 positions of sequence 0."""
    rows = [(2, 40, [0]), (2, 41, [0, 1]), (2, 42, [0, 2]), (0, 70, [0])]
    t, m = len(rows), 3
    bias = np.full((SEQUENCES, 1, m, CAPACITY), LOWEST, np.float32)
    scatter, slots, sequences = [], [], []
    placed = {0: 0, 2: 0}
    for seq, slot, own in rows:
        place = placed[seq]
        placed[seq] += 1
        context = slot - own.index(0) if len(own) == 1 else 40
        bias[seq, 0, place, :context] = 0
        for i in own:
            bias[seq, 0, place, context + i] = 0
        scatter.append(seq * m + place)
        slots.append(slot)
        sequences.append(seq)
    feeds = {"q": rng.standard_normal((t, HEADS * D), np.float32), "k": rng.standard_normal((t, KV_HEADS * D), np.float32),
             "v": rng.standard_normal((t, KV_HEADS * D), np.float32),
             "past_key": rng.standard_normal((SEQUENCES, KV_HEADS, CAPACITY, D), np.float32).astype(dtype),
             "past_value": rng.standard_normal((SEQUENCES, KV_HEADS, CAPACITY, D), np.float32).astype(dtype),
             "attention_bias": bias, "row_scatter": np.array(scatter), "cache_sequences": np.array(sequences),
             "cache_slots": np.array(slots)}
    return feeds


@pytest.mark.parametrize("cache_type", list(KERNEL_OPS))
def test_each_row_is_the_softmax_over_the_keys_it_may_see(cache_type):
    dtype = np.float16 if cache_type == TensorProto.FLOAT16 else np.float32
    feeds = step(np.random.default_rng(0), dtype)
    out, keys, values = kernel_session(cache_type).run(None, feeds)
    t = len(feeds["cache_slots"])
    for row in range(t):
        seq, slot = feeds["cache_sequences"][row], feeds["cache_slots"][row]
        for h in range(KV_HEADS):  # written, rounded once to the cache's type
            np.testing.assert_array_equal(keys[seq, h, slot], feeds["k"][row, h * D:(h + 1) * D].astype(dtype))
            np.testing.assert_array_equal(values[seq, h, slot], feeds["v"][row, h * D:(h + 1) * D].astype(dtype))
        allowed = np.flatnonzero(feeds["attention_bias"].reshape(-1, CAPACITY)[feeds["row_scatter"][row]] > LOWEST / 2)
        for h in range(HEADS):
            kv = h // (HEADS // KV_HEADS)
            k, v = keys[seq, kv, allowed].astype(np.float64), values[seq, kv, allowed].astype(np.float64)
            scores = k @ feeds["q"][row, h * D:(h + 1) * D].astype(np.float64) * D ** -0.5
            weights = np.exp(scores - scores.max())
            np.testing.assert_allclose(out[row, h * D:(h + 1) * D], weights @ v / weights.sum(), rtol=2e-5, atol=2e-5)
    untouched = np.ones(CAPACITY, bool)
    untouched[[40, 41, 42]] = False
    np.testing.assert_array_equal(keys[1], feeds["past_key"][1])  # a sequence with no rows
    np.testing.assert_array_equal(keys[2][:, untouched], feeds["past_key"][2][:, untouched])


def test_caches_bound_as_their_own_output_are_written_in_place():
    feeds = step(np.random.default_rng(1), np.float16)
    session = kernel_session(TensorProto.FLOAT16)
    expected = session.run(None, {**feeds, "past_key": feeds["past_key"].copy(), "past_value": feeds["past_value"].copy()})
    binding = session.io_binding()
    for name, value in feeds.items():
        binding.bind_cpu_input(name, value)
    binding.bind_output("attention")
    for name in ("key", "value"):
        cache = feeds[f"past_{name}"]
        binding.bind_output(f"present_{name}", "cpu", 0, cache.dtype, cache.shape, cache.ctypes.data)
    session.run_with_iobinding(binding)
    np.testing.assert_array_equal(feeds["past_key"], expected[1])
    np.testing.assert_array_equal(feeds["past_value"], expected[2])
    np.testing.assert_array_equal(binding.copy_outputs_to_cpu()[0], expected[0])


def test_an_export_needing_a_missing_kernel_or_fp16_is_refused(export_cli, tmp_path, monkeypatch):
    rc, _, err = export_cli("tiny-llama", "--attention", "kernel", "--precision", "fp16", "--out", tmp_path / "a")
    assert rc == 1 and "fp16 (for CUDA) pairs with exact or fused attention" in err
    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / "missing.so")
    rc, _, err = export_cli("tiny-llama", "--attention", "kernel", "--out", tmp_path / "a")
    assert rc == 1 and "bash ci/build_kernels.sh" in err
    assert not (tmp_path / "a").exists()


def test_a_kernel_artifact_loads_only_where_the_kernel_runs(tiny_artifact, monkeypatch, tmp_path):
    path = tiny_artifact("tiny-llama", "int8", attention="kernel")
    gen = runtime.load(path)
    assert gen.manifest["attention"] == "kernel" and gen.verify_exact
    assert gen.generate([5, 6, 7], max_new_tokens=8).token_ids == gen.generate([5, 6, 7], max_new_tokens=8,
                                                                                speculative=False).token_ids
    for provider, instead in (("openvino", "fused"), ("cuda", "exact")):  # checked before any session
        with pytest.raises(ProviderError, match=f"export it with --attention {instead} for {provider}"):
            GraphSession.check_artifact(gen.manifest, provider)
    monkeypatch.setattr(kernels, "LIBRARY", tmp_path / "missing.so")
    with pytest.raises(ProviderError, match="CPU operators are not built"):
        runtime.load(path)
