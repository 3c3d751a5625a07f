"""The same loop on the OpenVINO execution provider. onnxruntime-openvino ships its own
onnxruntime module, so this file runs in a separate virtualenv (ci/test_openvino.sh) against
artifacts exported by the main one; in the main suite it skips."""
import os

import numpy as np
import onnxruntime as ort
import pytest

import runtime
from models.cpu import cpu_flags
from runtime.backend import ProviderError

pytestmark = pytest.mark.skipif("OpenVINOExecutionProvider" not in ort.get_available_providers(),
                                reason="OpenVINO EP not in this onnxruntime build (ci/test_openvino.sh runs this)")


def artifact_from(variable: str) -> str:
    path = os.environ.get(variable)
    if not path:
        pytest.skip(f"set {variable} to an exported artifact")
    return path


@pytest.fixture(scope="module")
def artifact():
    """fp32, exported with --attention fused: onnxruntime-openvino lacks the exact attention's TensorScatter.
    OpenVINO's kernels give no bitwise guarantee between step sizes; on this tiny model's wide
    margins speculative and plain outputs still agree."""
    return artifact_from("EAGLE2_OPENVINO_ARTIFACT")


@pytest.mark.parametrize("prompt", ["hello world", "The quick brown fox", "a"])
def test_openvino_matches_cpu_and_speculation_agrees(artifact, prompt):
    cpu, ov = runtime.load(artifact, provider="cpu"), runtime.load(artifact, provider="openvino")
    plain = ov.generate(prompt, max_new_tokens=40, speculative=False)
    for tree in ((8, 3, 2), (60, 5, 10)):
        spec = ov.generate(prompt, max_new_tokens=40, total_tokens=tree[0], depth=tree[1], top_k=tree[2])
        assert spec.token_ids == plain.token_ids
    assert plain.token_ids == cpu.generate(prompt, max_new_tokens=40, speculative=False).token_ids


def test_precision_hint_reaches_openvino(artifact):
    """The bf16 hint changes OpenVINO's arithmetic where the CPU computes in bf16 (AVX512-BF16 or
    AMX: so it was applied); elsewhere OpenVINO keeps f32 (measured on an AVX2-only AMD Zen 3), and
    decoding works either way."""
    f32 = runtime.load(artifact, provider="openvino")
    bf16 = runtime.load(artifact, provider="openvino", provider_options=runtime.openvino_options("CPU", "bf16"))
    ids = np.asarray(f32.tokenizer.encode("The quick brown fox jumps over the lazy dog"), np.int64)
    logits = [g.engine.prefill(ids, 0).copy() for g in (f32, bf16)]
    if cpu_flags() & {"avx512_bf16", "amx_bf16"}:
        assert not np.array_equal(*logits) and np.abs(logits[0] - logits[1]).max() < 0.5
    else:
        np.testing.assert_array_equal(*logits)
    out = bf16.generate("hello world", max_new_tokens=20, speculative=False)
    assert len(out.token_ids) == 20 or out.finish_reason == "stop"


def test_unknown_openvino_device_is_refused(artifact):
    with pytest.raises(ProviderError, match="could not be created"):
        runtime.load(artifact, provider="openvino", provider_options=runtime.openvino_options("NO_SUCH_DEVICE"))


def test_exact_attention_artifact_is_refused_with_the_fix():
    exact = artifact_from("EAGLE2_OPENVINO_EXACT_ARTIFACT")
    with pytest.raises(ProviderError, match="--attention fused"):
        runtime.load(exact, provider="openvino")
