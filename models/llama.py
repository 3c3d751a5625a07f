"""Compact PyTorch definitions of the base (Llama family, Qwen2) and of the EAGLE-1/2 head.

They mirror the exported graphs exactly: explicit position ids, an additive attention bias over
[cached tokens + new tokens], and a KV cache preallocated for max_length that each call writes at
[cache_len, cache_len + T). Parameter names follow Hugging Face so checkpoints load as they are.
Nothing here imports transformers' modeling code, which changes between releases.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import ModelConfig
from .rope import cos_sin_tables


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x):
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate(x, cos, sin):
    """Non-interleaved RoPE (HF rotate_half); cos/sin are half tables [B, T, D/2]."""
    x1, x2 = x.chunk(2, dim=-1)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class KVCache:
    """Per-layer K/V buffers [B, kv_heads, max_len, head_dim], written in place."""

    def __init__(self, cfg: ModelConfig, max_len: int, batch: int = 1, dtype=torch.float32):
        shape = (batch, cfg.num_kv_heads, max_len, cfg.head_dim)
        self.k = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype) for _ in range(cfg.num_layers)]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, in_features: int | None = None):
        super().__init__()
        h, d = cfg.hidden_size, cfg.head_dim
        i = in_features or h
        self.cfg = cfg
        self.q_proj = nn.Linear(i, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(i, cfg.kv_dim, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(i, cfg.kv_dim, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)

    def forward(self, x, cos, sin, bias, k_cache, v_cache, start: int):
        b, t, _ = x.shape
        c = self.cfg
        q = self.q_proj(x).view(b, t, c.num_heads, c.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, t, c.num_kv_heads, c.head_dim).transpose(1, 2)
        q, k = rotate(q, cos, sin), rotate(k, cos, sin)
        k_cache[:, :, start:start + t] = k.to(k_cache.dtype)
        v_cache[:, :, start:start + t] = v.to(v_cache.dtype)
        keys = k_cache[:, :, :start + t].to(q.dtype)
        values = v_cache[:, :, :start + t].to(q.dtype)
        y = F.scaled_dot_product_attention(q, keys, values, attn_mask=bias.to(q.dtype),
                                           enable_gqa=c.num_heads != c.num_kv_heads)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, c.num_heads * c.head_dim))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, input_norm: bool = True):
        super().__init__()
        # EAGLE-1/2 heads drop the first layer's input norm: attention runs on fc's output.
        if input_norm:
            self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x, cos, sin, bias, k_cache, v_cache, start):
        h = self.input_layernorm(x) if hasattr(self, "input_layernorm") else x
        x = x + self.self_attn(h, cos, sin, bias, k_cache, v_cache, start)
        return x + self.mlp(self.post_attention_layernorm(x))


class Rotary(nn.Module):
    def __init__(self, cfg: ModelConfig, n_positions: int):
        super().__init__()
        cos, sin = cos_sin_tables(cfg, n_positions)
        self.register_buffer("cos", torch.from_numpy(cos), persistent=False)
        self.register_buffer("sin", torch.from_numpy(sin), persistent=False)

    def forward(self, position_ids, dtype):
        return self.cos[position_ids].to(dtype), self.sin[position_ids].to(dtype)


class Backbone(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg) for _ in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The base model. forward returns (logits, post-final-norm hidden states)."""

    def __init__(self, cfg: ModelConfig, n_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.model = Backbone(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.rotary = Rotary(cfg, n_positions or cfg.max_position_embeddings)

    def forward(self, input_ids, position_ids, attention_bias, cache: KVCache, start: int):
        hidden, _ = self.hidden_states(input_ids, position_ids, attention_bias, cache, start)
        return self.lm_head(hidden).float(), hidden

    def hidden_states(self, input_ids, position_ids, attention_bias, cache: KVCache, start: int,
                      taps: tuple[int, ...] = ()) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """The post-final-norm hidden states, and the inputs of the layers `taps` (EAGLE-3's
        features, eagle3_layers), without the lm_head."""
        x = self.model.embed_tokens(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        taken = {}
        for i, layer in enumerate(self.model.layers):
            if i in taps:
                taken[i] = x
            x = layer(x, cos, sin, attention_bias, cache.k[i], cache.v[i], start)
        return self.model.norm(x), [taken[i] for i in taps]


class EagleHead(nn.Module):
    """EAGLE-1/2 draft head: fc over [embedding(token t+1), feature t] and one decoder layer.

    It owns no embedding and no lm_head: both are the base model's, passed in at call time, so a
    head can never silently carry a different copy of them.
    """

    def __init__(self, cfg: ModelConfig, n_positions: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=cfg.fc_bias)
        self.layers = nn.ModuleList([DecoderLayer(cfg, input_norm=False)])
        self.rotary = Rotary(cfg, n_positions or cfg.max_position_embeddings)

    def forward(self, token_embeds, features, position_ids, attention_bias, cache: KVCache, start: int):
        x = self.fc(torch.cat((token_embeds, features.to(token_embeds.dtype)), dim=-1))
        cos, sin = self.rotary(position_ids, x.dtype)
        return self.layers[0](x, cos, sin, attention_bias, cache.k[0], cache.v[0], start)


def eagle3_layers(cfg: ModelConfig) -> tuple[int, int, int]:
    """The base layers whose inputs an EAGLE-3 head fuses (low, middle, high): 2, L // 2 and L - 3, as
    the reference implementation takes them (kept inside shallower test models)."""
    n = cfg.num_layers
    return min(2, n - 1), n // 2, max(n - 3, 0)


class Eagle3Layer(nn.Module):
    """EAGLE-3's decoder layer: attention over [norm(token embedding), norm(hidden)] (2H wide), the
    hidden as residual, then the usual MLP."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.hidden_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, 2 * cfg.hidden_size)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, embeds, hidden, cos, sin, bias, k_cache, v_cache, start):
        x = torch.cat((self.input_layernorm(embeds), self.hidden_norm(hidden)), dim=-1)
        h = hidden + self.self_attn(x, cos, sin, bias, k_cache, v_cache, start)
        return h + self.mlp(self.post_attention_layernorm(h))


class Eagle3Head(nn.Module):
    """EAGLE-3 draft head (arXiv 2503.01840): fc fuses the base's low, middle and high hidden states
    (3 x target hidden) into one feature; one Eagle3Layer; its own final norm and lm_head over a
    draft vocabulary of draft_vocab_size tokens, base id = draft id + d2t[draft id].

    forward takes either the fused base features (3H wide, at the verified positions) or its own
    previous output (H wide, for deeper drafts) and returns the layer's output before the norm."""

    def __init__(self, cfg: ModelConfig, n_positions: int | None = None, target_hidden: int | None = None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(3 * (target_hidden or cfg.hidden_size), cfg.hidden_size, bias=False)
        self.midlayer = Eagle3Layer(cfg)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.draft_vocab_size, bias=False)
        self.register_buffer("d2t", torch.zeros(cfg.draft_vocab_size, dtype=torch.long))
        self.rotary = Rotary(cfg, n_positions or cfg.max_position_embeddings)

    def forward(self, token_embeds, features, position_ids, attention_bias, cache: KVCache, start: int):
        hidden = features.to(token_embeds.dtype)
        if hidden.shape[-1] != self.cfg.hidden_size:
            hidden = self.fc(hidden)
        cos, sin = self.rotary(position_ids, token_embeds.dtype)
        return self.midlayer(token_embeds, hidden, cos, sin, attention_bias, cache.k[0], cache.v[0], start)

    def logits(self, hidden):
        """Logits over the draft vocabulary."""
        return self.lm_head(self.norm(hidden))

    @property
    def vocab(self) -> torch.Tensor:
        """The base ids of the draft vocabulary, ascending."""
        return torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t


def base_features(base: "CausalLM", input_ids, position_ids, attention_bias, cache: KVCache, start: int):
    """(logits, EAGLE-3 feature input [B, T, 3H]: the inputs of eagle3_layers, concatenated)."""
    hidden, taken = base.hidden_states(input_ids, position_ids, attention_bias, cache, start, eagle3_layers(base.cfg))
    return base.lm_head(hidden).float(), torch.cat(taken, dim=-1)


@torch.no_grad()
def forward_layers(cfg: ModelConfig, layer_weights, xs: list[list[torch.Tensor]], steps: list[list[tuple]],
                   n_positions: int, before=None) -> list[list[torch.Tensor]]:
    """The base's decoder layers one at a time, for passes that must not hold a whole model (the
    exporter's parity check and calibration): layer i is built from `layer_weights(i)` (its tensors
    named as inside the layer), every step of every sequence goes through it, then it is dropped.

    xs[s][j] is step j's input [1, T, H] of sequence s, steps[s][j] its (position_ids [1, T],
    attention bias, start); one sequence's steps share a KV cache. `before(i, layer, xs, caches)`
    runs before layer i, with that layer's (k, v) cache of each sequence, which it fills. Returns
    the last layer's outputs, in the shape of xs."""
    rotary = Rotary(cfg, n_positions)
    lengths = [max(start + p.shape[1] for p, _, start in seq) for seq in steps]
    shape = (1, cfg.num_kv_heads)
    for i in range(cfg.num_layers):
        with torch.device("meta"):  # no random initialisation of weights about to be replaced
            layer = DecoderLayer(cfg).eval()
        # not strict: old .bin checkpoints also carry rotary buffers, which the layer computes itself
        missing = layer.load_state_dict(layer_weights(i), strict=False, assign=True).missing_keys
        if missing:
            raise KeyError(f"layer {i} lacks {', '.join(missing)}")
        caches = [(torch.zeros(*shape, n, cfg.head_dim), torch.zeros(*shape, n, cfg.head_dim)) for n in lengths]
        if before is not None:
            before(i, layer, xs, caches)
        xs = [[layer(x, *rotary(p, x.dtype), bias, k, v, start) for x, (p, bias, start) in zip(seq_x, seq)]
              for seq_x, seq, (k, v) in zip(xs, steps, caches)]
    return xs


def additive_bias(allowed: torch.Tensor, dtype=torch.float32) -> torch.Tensor:
    """The attention bias for a boolean mask of allowed (query, key) pairs, same shape: 0 where
    allowed, the dtype's minimum elsewhere."""
    return torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill(~allowed, torch.finfo(dtype).min)


def causal_bias(t: int, start: int = 0, dtype=torch.float32) -> torch.Tensor:
    """Additive mask [1, 1, t, start + t] for a plain causal step after `start` cached tokens."""
    allowed = torch.ones(t, start + t, dtype=torch.bool).tril(diagonal=start)
    return additive_bias(allowed, dtype)[None, None]
