"""The reduced draft vocabulary (FR-Spec): the draft proposes only its N tokens, the manifest says
so, and verification over the whole vocabulary keeps the output identical to plain decoding."""
import json

import numpy as np
import pytest

import runtime
from export.common import choose_draft_vocab
from export.onnx_export import export_onnx
from export.verify import TOLERANCE
from models.draft_vocab import DraftVocab, select
from models.registry import load_checkpoint


def test_select_keeps_the_most_frequent_and_the_stop_tokens():
    counts = np.array([5, 0, 9, 9, 1, 7, 0, 3])
    assert select(counts, 3, []).tolist() == [2, 3, 5]         # ties: the lower id first
    assert select(counts, 3, [6]).tolist() == [2, 3, 6]        # a stop token displaces the last
    assert select(counts, 8, []).tolist() == list(range(8))
    with pytest.raises(ValueError, match="size"):
        select(counts, 0, [])
    with pytest.raises(ValueError, match="stop tokens"):
        select(counts, 1, [1, 6])


def test_small_vocabularies_draft_from_every_token():
    ckpt = load_checkpoint("tiny-llama")
    assert choose_draft_vocab(ckpt, 16384) is None          # 259 tokens: nothing to cut
    assert choose_draft_vocab(ckpt, 0) is None


@pytest.fixture(scope="module")
def reduced(tmp_path_factory):
    ckpt = load_checkpoint("tiny-llama")
    counts = np.random.default_rng(0).integers(0, 1000, ckpt.cfg.vocab_size)
    vocab = DraftVocab(select(counts, 48, ckpt.cfg.eos_token_ids), "random counts (test)")
    path = tmp_path_factory.mktemp("draft-vocab") / "artifact"
    export_onnx(ckpt, path, "fp32", max_length=256, log=lambda m: None, draft_vocab=vocab)
    return runtime.load(path), vocab


def test_manifest_records_the_draft_vocabulary(reduced):
    gen, vocab = reduced
    assert gen.manifest["draft_vocab"] == {"size": 48, "counted_on": "random counts (test)"}
    manifest = json.loads((gen.path / "manifest.json").read_text())
    # Checked against the PyTorch head scoring the same 48 rows of the lm_head.
    assert manifest["parity"]["draft.topk_logprobs"] < TOLERANCE[manifest["draft_precision"]]


def test_draft_proposes_only_its_vocabulary_and_output_is_unchanged(reduced, monkeypatch):
    gen, vocab = reduced
    drafted = []
    original = gen.engine.finish_draft

    def spy(part):
        out = original(part)
        drafted.append(out[1].copy())
        return out

    monkeypatch.setattr(gen.engine, "finish_draft", spy)
    for prompt in ("hello world", "The quick brown fox", "Once upon a time"):
        plain = gen.generate(prompt, max_new_tokens=40, speculative=False)
        spec = gen.generate(prompt, max_new_tokens=40, total_tokens=12, depth=4, top_k=4)
        assert spec.token_ids == plain.token_ids
    assert drafted and np.isin(np.concatenate([d.ravel() for d in drafted]), vocab.ids).all()
