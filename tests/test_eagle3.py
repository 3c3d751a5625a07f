"""EAGLE-3 heads in the official format: loaded and checked against their base, exported (the base
graph then outputs the head's fused feature, the draft graph maps draft ids to base ids), and run
by the shared runtime: lossless greedy and sampling, like EAGLE-1/2 heads."""

import numpy as np
import pytest
import torch

import runtime
from export.onnx_export import export_onnx
from models.registry import load_checkpoint
from models.weights import WeightsError, load_head


@pytest.fixture(scope="module", params=["int8", "fp32"])
def eagle3(request, tiny_eagle3_head_dir, tmp_path_factory):
    ckpt = load_checkpoint("tiny-llama", head=str(tiny_eagle3_head_dir()))
    path = tmp_path_factory.mktemp("eagle3") / request.param
    export_onnx(ckpt, path, request.param, max_length=512, log=lambda m: None)
    return ckpt, runtime.load(path)


def test_official_layout_round_trips(tiny_eagle3_head_dir):
    directory = tiny_eagle3_head_dir()
    base = load_checkpoint("tiny-llama").cfg
    cfg, state = load_head(directory, base)
    assert cfg.eagle3 and cfg.draft_vocab_size == 64
    assert {"fc.weight", "midlayer.hidden_norm.weight", "norm.weight", "lm_head.weight", "d2t"} <= set(state)
    assert state["fc.weight"].shape == (base.hidden_size, 3 * base.hidden_size)
    ids = torch.arange(64) + state["d2t"]
    assert bool((ids[1:] > ids[:-1]).all()) and set(base.eos_token_ids) <= set(ids.tolist())


def test_mismatched_eagle3_head_is_refused_naming_the_dimension(tiny_eagle3_head_dir):
    with pytest.raises(WeightsError, match="hidden_size is 64 in the head but 128 in the base"):
        load_head(tiny_eagle3_head_dir(hidden_size=64, intermediate_size=128, head_dim=16),
                  load_checkpoint("tiny-llama").cfg)


def test_manifest_and_parity(eagle3):
    _, gen = eagle3
    m = gen.manifest
    assert m["head"]["kind"] == "eagle3" and m["draft_vocab"]["size"] == 64
    assert set(m["parity"]) >= {"base.hidden_states", "draft.topk_logprobs"}


def test_draft_proposes_base_ids_of_its_vocabulary(eagle3):
    ckpt, gen = eagle3
    vocab = (torch.arange(64) + ckpt.head_state["d2t"]).tolist()
    e = gen.engine
    ids = np.asarray(gen.tokenizer.encode("hello world, hello"), np.int64)
    e.start(len(ids))
    e.prefill(ids, 0)
    _, top, logp = e.draft_context(np.append(ids[1:], 100), 0, 8)
    assert set(top.tolist()) <= set(vocab) and np.all(np.diff(logp) <= 0)


@pytest.mark.parametrize("tree", [(4, 2, 2), (12, 4, 4), (60, 5, 10)])
def test_greedy_speculation_equals_plain_decoding(eagle3, tree):
    _, gen = eagle3
    rng = np.random.default_rng(2)
    for length in (3, 40, 200):
        prompt = rng.integers(0, 256, length).tolist()
        plain = gen.generate(prompt, max_new_tokens=50, speculative=False)
        spec = gen.generate(prompt, max_new_tokens=50, total_tokens=tree[0], depth=tree[1], top_k=tree[2])
        assert spec.token_ids == plain.token_ids


def test_sampling_keeps_the_base_distribution(tiny_eagle3_head_dir, tmp_path):
    """The sampling test of tests/test_runtime_sampling.py with an EAGLE-3 head on its small vocabulary."""
    import dataclasses

    from models.tiny import tiny_checkpoint
    from test_runtime_sampling import ALPHA, DRAWS, VOCAB, draw, exact_distribution, pvalue
    ckpt = tiny_checkpoint("llama", seed=3)
    cfg = dataclasses.replace(ckpt.cfg, vocab_size=VOCAB, eos_token_ids=())
    for name in [n for n in ckpt.state if n.endswith(("embed_tokens.weight", "lm_head.weight"))]:
        ckpt.state[name] = ckpt.state[name][:VOCAB].clone() * 2.5
    head_cfg, head_state = load_head(tiny_eagle3_head_dir(), load_checkpoint("tiny-llama").cfg)
    head_cfg = dataclasses.replace(head_cfg, vocab_size=VOCAB, draft_vocab_size=16, eos_token_ids=())
    head_state = dict(head_state, **{"lm_head.weight": head_state["lm_head.weight"][:16] * 2.5,
                                     "d2t": torch.tensor([0] * 8 + [4] * 8)})  # base ids 0-7, 12-19
    ckpt = dataclasses.replace(ckpt, cfg=cfg, head_cfg=head_cfg, head_state=head_state)
    export_onnx(ckpt, tmp_path / "a", "fp32", max_length=64, verify=False, log=lambda m: None)
    gen = runtime.load(tmp_path / "a", threads=1)
    gen.stop_ids.clear()
    assert pvalue(draw(gen, DRAWS, 1.0, 1.0, 0), exact_distribution(ckpt, 1.0, 1.0, 0)) > ALPHA


def test_torch_export_of_an_eagle3_head_is_lossless(tiny_eagle3_head_dir, tmp_path):
    from export.torch_export import export_torch
    ckpt = load_checkpoint("tiny-llama", head=str(tiny_eagle3_head_dir()))
    export_torch(ckpt, tmp_path / "t", "torch", "bf16", max_length=256, log=lambda m: None)
    gen = runtime.load(tmp_path / "t", provider="torch")
    assert gen.manifest["head"]["kind"] == "eagle3"
    prompt = np.random.default_rng(4).integers(0, 256, 30).tolist()
    plain = gen.generate(prompt, max_new_tokens=40, speculative=False)
    assert gen.generate(prompt, max_new_tokens=40, total_tokens=12, depth=4, top_k=4).token_ids == plain.token_ids
