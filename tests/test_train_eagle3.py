"""`python -m training.train_head --arch eagle3` on the tiny random Llama: features from three base
layers, a short run that lowers the loss, the official EAGLE-3 layout, and the trained head
exported and run losslessly."""
import json

import numpy as np
import pytest
import torch

import runtime
from export.onnx_export import export_onnx
from models.llama import base_features, causal_bias, eagle3_layers
from models.registry import load_checkpoint
from models.tiny import tiny_checkpoint
from models.weights import load_head
from training.features import base_hidden, build_base
from training.train_head import main
from training.unroll import new_cache
from test_train_head import write_conversations


def test_eagle3_features_are_the_taps_then_the_final_hidden_state():
    ckpt = tiny_checkpoint("llama")
    base = build_base(ckpt, 64, "cpu")
    h, t = ckpt.cfg.hidden_size, 7
    ids = torch.arange(3, 3 + t)[None]

    def run(taps):
        return base_hidden(base, ids, torch.arange(t)[None], causal_bias(t), new_cache(base.cfg, t, 1, "cpu"), 0, taps)
    with torch.no_grad():
        plain, fused = run(()), run(eagle3_layers(ckpt.cfg))
        _, reference_taps = base_features(base, ids, torch.arange(t)[None], causal_bias(t), new_cache(base.cfg, t, 1, "cpu"), 0)
    assert fused.shape[-1] == 4 * h
    torch.testing.assert_close(fused[..., -h:], plain)
    torch.testing.assert_close(fused[..., :-h], reference_taps)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("eagle3-train")
    data = write_conversations(tmp / "convs.jsonl")
    out = tmp / "head"
    summary = main(["--base", "tiny-llama", "--out", str(out), "--data", str(data), "--arch", "eagle3",
                    "--draft-vocab", "96", "--max-tokens", "4000", "--max-len", "160", "--lr", "3e-3",
                    "--batch-tokens", "640", "--log-every", "1", "--save-every", "4", "--self-distill", "4",
                    "--distill-new-tokens", "16", "--distill-batch", "2", "--threads", "1", "--epochs", "3",
                    "--unroll", "2"])
    return out, summary


def test_training_lowers_the_loss_and_saves_the_official_layout(trained):
    out, s = trained
    logs = [h for h in s["history"] if "loss" in h]
    first, last = np.mean([h["loss"] for h in logs[:2]]), np.mean([h["loss"] for h in logs[-2:]])
    assert last < 0.9 * first, (first, last)
    assert 0 < s["final"]["dev_sharegpt"]["acc"] <= 1 and "acc_2" in s["final"]["dev_sharegpt"]

    cfg = json.loads((out / "config.json").read_text())
    assert cfg["architectures"] == ["LlamaForCausalLMEagle3"] and cfg["draft_vocab_size"] == 96
    from safetensors.torch import load_file
    state = load_file(str(out / "model.safetensors"))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight",
            "lm_head.weight", "d2t", "t2d"} <= set(state)
    assert "embed_tokens.weight" not in state
    base = tiny_checkpoint("llama").cfg
    head_cfg, head_state = load_head(out, base)
    assert head_cfg.eagle3 and head_cfg.draft_vocab_size == 96
    vocab = torch.arange(96) + head_state["d2t"]
    assert vocab.tolist() == torch.nonzero(state["t2d"])[:, 0].tolist()
    assert set(base.eos_token_ids) <= set(vocab.tolist())
    # The draft vocabulary is the replies' most frequent tokens (counts saved next to the head).
    counts = np.load(out / "token_counts.npy")
    chosen = counts[vocab.numpy()]
    others = np.delete(counts, vocab.numpy())
    assert chosen[chosen > 0].size and np.sort(chosen)[len(base.eos_token_ids)] >= others.max()


def test_trained_head_exports_and_decodes_losslessly(trained, tmp_path):
    out, _ = trained
    path = tmp_path / "artifact"
    export_onnx(load_checkpoint("tiny-llama", head=str(out)), path, "fp32", max_length=512, log=lambda m: None)
    gen = runtime.load(path)
    assert gen.manifest["head"]["kind"] == "eagle3"
    for prompt in ("the cat sat on", "a big red house where many dogs"):
        plain = gen.generate(prompt, max_new_tokens=40, speculative=False)
        spec = gen.generate(prompt, max_new_tokens=40, total_tokens=12, depth=4, top_k=4)
        assert spec.token_ids == plain.token_ids


def test_init_refuses_a_head_of_the_other_kind(trained, tmp_path):
    out, _ = trained
    data = write_conversations(tmp_path / "convs.jsonl", n=8)
    with pytest.raises(SystemExit, match="is an EAGLE-3 head; --arch is eagle2"):
        main(["--base", "tiny-llama", "--out", str(tmp_path / "h"), "--data", str(data), "--max-tokens", "800",
              "--epochs", "1", "--threads", "1", "--init", str(out)])


def test_continued_head_keeps_its_draft_vocabulary_and_its_counts(trained, tmp_path):
    """--init on other data: the head keeps its draft vocabulary, and the counts saved beside it are
    the ones that vocabulary came from, not the new data's."""
    out, _ = trained
    data = write_conversations(tmp_path / "convs.jsonl", n=8, seed=1)
    cont = tmp_path / "continued"
    main(["--base", "tiny-llama", "--out", str(cont), "--data", str(data), "--arch", "eagle3", "--draft-vocab", "96",
          "--max-tokens", "800", "--max-len", "160", "--batch-tokens", "640", "--epochs", "1", "--threads", "1",
          "--init", str(out)])
    from safetensors.torch import load_file
    assert torch.equal(load_file(str(cont / "model.safetensors"))["d2t"], load_file(str(out / "model.safetensors"))["d2t"])
    assert np.array_equal(np.load(cont / "token_counts.npy"), np.load(out / "token_counts.npy"))
