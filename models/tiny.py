"""Small random models with a random head (fixed seed) for tests and demos.

They use a real byte-level tokenizer (256 byte tokens + ChatML specials) built with `tokenizers`,
so the whole pipeline, prompt text to text, runs on them in seconds.
"""
from __future__ import annotations

import dataclasses

import torch

from .config import ModelConfig
from .llama import CausalLM, EagleHead
from .weights import Checkpoint

SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHATML = ("{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] "
          "+ '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}"
          "{% endif %}")


def byte_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {ch: i for i, ch in enumerate(alphabet)}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIALS)
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<|im_start|>", eos_token="<|im_end|>",
                                   unk_token="<|endoftext|>", pad_token="<|endoftext|>", chat_template=CHATML)


VOCAB = 256 + len(SPECIALS)


def tiny_config(model_type: str) -> ModelConfig:
    qwen = model_type == "qwen2"
    return ModelConfig(
        model_type=model_type, vocab_size=VOCAB, hidden_size=128, intermediate_size=256,
        num_layers=2, num_heads=4, num_kv_heads=2, head_dim=32, rms_norm_eps=1e-6,
        rope_theta=1e6 if qwen else 1e4, max_position_embeddings=2048,
        tie_word_embeddings=qwen, qkv_bias=qwen, bos_token_id=257, eos_token_ids=(258,))


def randomize(module: torch.nn.Module, generator: torch.Generator) -> None:
    """Weights large enough that logits are well separated (no near-ties between backends)."""
    for name, p in module.named_parameters():
        with torch.no_grad():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn(p.shape, generator=generator))
            else:
                p.copy_(0.15 * torch.randn(p.shape, generator=generator))


def tiny_checkpoint(model_type: str, seed: int = 0) -> Checkpoint:
    cfg = tiny_config(model_type)
    g = torch.Generator().manual_seed(seed)
    base = CausalLM(cfg)
    randomize(base, g)
    head_cfg = dataclasses.replace(cfg, num_layers=1)
    head = EagleHead(head_cfg)
    randomize(head, g)
    state = {k: v.detach().clone() for k, v in base.state_dict().items()}
    return Checkpoint(cfg=cfg, state=state, tokenizer=byte_tokenizer(), source=f"tiny-{model_type} (seed {seed})",
                      head_cfg=head_cfg, head_state={k: v.detach().clone() for k, v in head.state_dict().items()},
                      head_source=f"random (seed {seed})")
