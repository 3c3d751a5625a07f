"""The backend contract (runtime/backend.py), checked on every backend installed here with the same
behavioural checks: the capability questions, a step, a tree verified in one step against its
tokens decoded alone, the cache compaction after a cycle, reserving capacity, and the exactness
probe. Where the backend's probe keeps the artifact's claim, rows must match bitwise; elsewhere to
rounding. A backend that is not installed here skips saying where it runs: OpenVINO in
.venv-openvino (ci/test_openvino.sh), IPEX in .venv-ipex (ci/test_ipex.sh), CUDA on a GPU."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

import runtime
from artifact.manifest import read_manifest
from runtime.backend import ProviderError, Session
from runtime.providers import backend, check_target, open_session

CACHE, STEP_ROWS, CONTEXT = 96, 16, 9
TREE = [-1, 0, 0, 1]  # node 3's ancestors 0 and 1; node 2 a sibling of 1


def _cuda() -> bool:
    if "CUDAExecutionProvider" not in ort.get_available_providers() or importlib.util.find_spec("torch") is None:
        return False
    import torch
    return torch.cuda.is_available()


def skip_reason(provider: str) -> str | None:
    if provider == "openvino":
        if "OpenVINOExecutionProvider" not in ort.get_available_providers():
            return "the OpenVINO EP is not in this onnxruntime build (ci/test_openvino.sh runs it)"
        if not os.environ.get("EAGLE2_OPENVINO_ARTIFACT"):
            return "set EAGLE2_OPENVINO_ARTIFACT to a fused-attention artifact (ci/test_openvino.sh does)"
    if provider in ("cpu", "cuda", "torch") and importlib.util.find_spec("torch") is None:
        return "exporting its artifact needs torch, not installed here (the main suite, ci/test.sh, runs it)"
    if provider == "ipex" and importlib.util.find_spec("intel_extension_for_pytorch") is None:
        return "intel-extension-for-pytorch is not installed here (ci/test_ipex.sh runs it in .venv-ipex)"
    if provider == "cuda" and not _cuda():
        return "no CUDA device and CUDA execution provider here"
    return None


class Case:
    """One backend, one artifact of its kind, and what its exactness probe decided at load."""

    def __init__(self, provider: str, path: Path):
        self.provider, self.path = provider, Path(path)
        self.manifest = read_manifest(self.path)
        self.device = "cuda" if provider == "cuda" else "cpu"
        self.min_rows = self.manifest.get("verify_min_rows", 1)
        self.exact = runtime.load(self.path, provider=provider, device=self.device).engine.verify_exact
        self.dtype = np.float16 if self.manifest["io_dtype"] == "float16" else np.float32
        vocab = self.manifest["model"]["config"]["vocab_size"]
        self.tokens = np.random.default_rng(0).integers(0, vocab, CONTEXT + 8)

    def open(self) -> Session:
        return open_session(self.path, self.manifest["graphs"]["base"], self.provider, self.device, CACHE, STEP_ROWS,
                            8, None)

    def step(self, session: Session, ids, context: int, parents=None) -> np.ndarray:
        """Rows `ids` at cache slots context, context + 1, ..., each attending to the context and to
        its ancestors (a chain where parents is None); the logits of those rows. A step of fewer
        than min_rows rows is padded as the engine pads it (runtime/engine.Engine.run)."""
        t = len(ids)
        parents = list(range(-1, t - 1)) if parents is None else parents
        n = max(t, self.min_rows)
        masked = np.finfo(self.dtype).min
        bias = np.full((1, 1, n, context + n), masked, self.dtype)
        bias[..., :context] = 0
        depth = np.zeros(n, np.int64)
        for i in range(n):
            node = i if i < t else 0
            bias[0, 0, i, context + i] = 0
            while i < t and parents[node] >= 0:
                node = parents[node]
                bias[0, 0, i, context + node] = 0
                depth[i] += 1
        ids = np.concatenate([ids, np.repeat(ids[:1], n - t)]).astype(np.int64)
        session.reserve(context + n)
        out = session.run({"input_ids": ids[None], "position_ids": (context + depth)[None],
                           "attention_bias": bias, "logit_rows": np.arange(n, dtype=np.int64)})
        logits = np.array(out["logits"])
        return logits.reshape(-1, logits.shape[-1])[:t].astype(np.float32)

    def decode(self, session: Session, ids) -> np.ndarray:
        """`ids` after the context, one token a step; the last one's logits."""
        for i, token in enumerate(ids):
            row = self.step(session, np.array([token]), CONTEXT + i)
        return row[0]

    def prefilled(self) -> Session:
        session = self.open()
        self.step(session, self.tokens[:CONTEXT], 0)
        return session

    def assert_same(self, got, want) -> None:
        if self.exact:
            assert np.array_equal(got, want), f"{self.provider}: rows differ though its probe keeps the claim"
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=2e-2 * float(np.abs(want).max()))


@pytest.fixture(scope="module", params=["cpu", "torch", "openvino", "ipex", "cuda"])
def case(request, tmp_path_factory) -> Case:
    provider = request.param
    reason = skip_reason(provider)
    if reason:
        pytest.skip(reason)
    if provider == "openvino":
        return Case(provider, os.environ["EAGLE2_OPENVINO_ARTIFACT"])
    if provider in ("torch", "ipex"):
        from export.torch_export import export_torch
        from models.registry import load_checkpoint
        path = tmp_path_factory.mktemp(provider) / "tiny"
        export_torch(load_checkpoint("tiny-llama"), path, provider, "fp32", max_length=CACHE, log=lambda m: None)
        return Case(provider, path)
    return Case(provider, request.getfixturevalue("tiny_artifact")("tiny-llama", "fp32"))


def test_capability_questions(case):
    b = backend(case.provider)
    assert case.provider in b.providers
    b.check_provider(case.provider)
    b.check_artifact(case.manifest, case.provider)
    session = case.open()
    assert isinstance(session, Session)
    assert session.slotted == b.batches(case.manifest)
    other = "torch" if case.manifest["target"] == "onnx" else "cpu"  # the other backend's provider
    with pytest.raises(ProviderError):
        check_target(case.manifest, other)


def test_step(case):
    session = case.open()
    rows = case.step(session, case.tokens[:CONTEXT], 0)
    assert rows.shape == (CONTEXT, case.manifest["model"]["config"]["vocab_size"])
    assert np.isfinite(rows).all()
    alone = case.open()
    for i, token in enumerate(case.tokens[:CONTEXT]):
        last = case.step(alone, np.array([token]), i)
    np.testing.assert_allclose(rows[-1], last[0], rtol=0, atol=2e-2 * float(np.abs(last).max()))


def test_tree_verify_matches_decoding_alone(case):
    tree = case.tokens[CONTEXT:CONTEXT + len(TREE)]
    rows = case.step(case.prefilled(), tree, CONTEXT, TREE)
    for path in ([0, 1, 3], [0, 2]):
        case.assert_same(rows[path[-1]], case.decode(case.prefilled(), tree[path]))


def test_cache_move_compacts_an_accepted_path(case):
    tree = case.tokens[CONTEXT:CONTEXT + len(TREE)]
    session = case.prefilled()
    case.step(session, tree, CONTEXT, TREE)
    session.move(np.array([CONTEXT, CONTEXT + 2]), CONTEXT)  # path 0 -> 2 accepted
    nxt = case.tokens[CONTEXT + len(TREE)]
    got = case.step(session, np.array([nxt]), CONTEXT + 2)[0]
    case.assert_same(got, case.decode(case.prefilled(), [tree[0], tree[2], nxt]))


def test_reserve_keeps_the_cache(case):
    session = case.prefilled()
    assert session.reserve(CONTEXT + 1) >= CONTEXT + 1
    grown = session.reserve(CACHE - 8)
    assert grown >= CACHE - 8 and session.capacity == grown
    shrunk = session.reserve(CONTEXT + 1, shrink=True)
    assert CONTEXT + 1 <= shrunk <= grown
    nxt = case.tokens[CONTEXT]
    case.assert_same(case.step(session, np.array([nxt]), CONTEXT)[0], case.decode(case.prefilled(), [nxt]))


def test_exactness_probe(case):
    """The probe answers for this machine; the ONNX CPU backend keeps an exact artifact's claim as
    exported, and no backend keeps a claim the artifact does not make."""
    session = case.open()
    keeps = session.keeps_exactness(case.manifest, lambda: True)
    assert isinstance(keeps, bool)
    if not case.manifest.get("verify_exact"):
        assert not case.exact
    if case.provider == "cpu":
        assert case.manifest.get("verify_exact") and keeps and case.exact
