"""The same loop on the OpenVINO execution provider. onnxruntime-openvino ships its own
onnxruntime module, so this file runs in a separate virtualenv (ci/test_openvino.sh) against an
artifact exported by the main one; in the main suite it skips."""
import os

import onnxruntime as ort
import pytest

import runtime

pytestmark = pytest.mark.skipif("OpenVINOExecutionProvider" not in ort.get_available_providers(),
                                reason="OpenVINO EP not in this onnxruntime build (ci/test_openvino.sh runs this)")


@pytest.fixture(scope="module")
def artifact():
    path = os.environ.get("EAGLE2_OPENVINO_ARTIFACT")
    if not path:
        pytest.skip("set EAGLE2_OPENVINO_ARTIFACT to an exported artifact")
    return path


@pytest.mark.parametrize("prompt", ["hello world", "The quick brown fox", "a"])
def test_openvino_matches_cpu_and_is_lossless(artifact, prompt):
    cpu, ov = runtime.load(artifact, provider="cpu"), runtime.load(artifact, provider="openvino")
    plain = ov.generate(prompt, max_new_tokens=40, speculative=False)
    for tree in ((8, 3, 2), (60, 5, 10)):
        spec = ov.generate(prompt, max_new_tokens=40, total_tokens=tree[0], depth=tree[1], top_k=tree[2])
        assert spec.token_ids == plain.token_ids
    assert plain.token_ids == cpu.generate(prompt, max_new_tokens=40, speculative=False).token_ids
