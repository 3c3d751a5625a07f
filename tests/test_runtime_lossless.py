"""EAGLE-2 greedy output equals plain greedy decoding of the same graph and transformers' generate."""
import numpy as np
import pytest
import torch

import runtime
from export.onnx_export import export_onnx
from models.registry import load_checkpoint

PROMPTS = ["hello world", "The quick brown fox", "a", "Once upon a time, in a land far away, there lived"]
TREES = [(8, 3, 2), (60, 5, 10), (3, 0, 2)]  # depth 0: the root's draft children only


@pytest.fixture(scope="module", params=["tiny-llama", "tiny-qwen2"])
def tiny(request, tmp_path_factory):
    ckpt = load_checkpoint(request.param)
    path = tmp_path_factory.mktemp(request.param) / "artifact"
    export_onnx(ckpt, path, "fp32", max_length=256, verify=False, log=lambda m: None)
    return ckpt, runtime.load(path)


def hf_model(ckpt):
    import transformers
    hf = ckpt.cfg.to_hf()
    config = transformers.AutoConfig.for_model(hf.pop("model_type"), **hf)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    model.load_state_dict(ckpt.state, strict=False)
    model.tie_weights()
    return model


@pytest.mark.parametrize("total_tokens,depth,top_k", TREES)
def test_eagle_equals_plain_and_transformers(tiny, total_tokens, depth, top_k):
    ckpt, gen = tiny
    model = hf_model(ckpt)
    for prompt in PROMPTS:
        ids = gen.tokenizer.encode(prompt)
        for n in (1, 7, 40):
            plain = gen.generate(ids, max_new_tokens=n, speculative=False)
            spec = gen.generate(ids, max_new_tokens=n, speculative=True, total_tokens=total_tokens, depth=depth,
                                top_k=top_k)
            assert spec.token_ids == plain.token_ids, (prompt, n)
            stop = plain.finish_reason == "stop"
            with torch.no_grad():
                ref = model.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False,
                                     eos_token_id=None if not stop else list(gen.stop_ids), pad_token_id=0)
            assert plain.token_ids == ref[0, len(ids):].tolist()[: len(plain.token_ids)], (prompt, n)
            assert len(plain.token_ids) == n or stop


@pytest.mark.parametrize("total_tokens,depth,top_k", TREES)
def test_runs_reaching_the_cache_limit(tiny, total_tokens, depth, top_k):
    """Prompts of every length near max_length: speculative == plain, no overrun, finish 'length'."""
    _, gen = tiny
    short = runtime.load(gen.path, max_length=48)
    base = short.tokenizer.encode("abcdefghijklmnopqrstuvwxyz" * 2)
    for n in (30, 40, 45, 46, 47):
        plain = short.generate(base[:n], max_new_tokens=100, speculative=False)
        spec = short.generate(base[:n], max_new_tokens=100, total_tokens=total_tokens, depth=depth, top_k=top_k)
        assert spec.token_ids == plain.token_ids
        assert n + len(plain.token_ids) <= 48
        if plain.finish_reason == "length":
            assert n + len(plain.token_ids) == 48


def test_prompt_longer_than_cache_is_refused(tiny):
    _, gen = tiny
    short = runtime.load(gen.path, max_length=32)
    with pytest.raises(ValueError, match="32"):
        short.generate(list(range(1, 33)), max_new_tokens=4)


def test_hf_generate_shape(tiny):
    _, gen = tiny
    ids = torch.tensor([gen.tokenizer.encode("hello")])
    out = gen.hf_generate(ids, max_new_tokens=5)
    assert isinstance(out, torch.Tensor) and out.shape[0] == 1
    assert out[0, : ids.shape[1]].tolist() == ids[0].tolist()
    assert out.shape[1] <= ids.shape[1] + 5
    as_np = gen.hf_generate(ids.numpy(), max_new_tokens=5)
    assert isinstance(as_np, np.ndarray) and as_np.tolist() == out.tolist()


REPETITIVE = "one two three four, one two three four, one two three four, one two"


@pytest.mark.parametrize("lookup", [0, 1, 4, 16])
def test_lookup_branches_keep_output_identical(tiny, lookup):
    _, gen = tiny
    for prompt in PROMPTS + [REPETITIVE]:
        ids = gen.tokenizer.encode(prompt)
        plain = gen.generate(ids, max_new_tokens=40, speculative=False)
        for total_tokens, depth, top_k in TREES:
            spec = gen.generate(ids, max_new_tokens=40, total_tokens=total_tokens, depth=depth, top_k=top_k,
                                lookup=lookup)
            assert spec.token_ids == plain.token_ids, (prompt, lookup)

