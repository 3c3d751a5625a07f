"""Base and draft step graphs for the torch backend (IPEX or plain PyTorch), built from the models/
definitions and traced to TorchScript by export/torch_export.py.

They take the inputs of the ONNX graphs with exact attention (export/onnx_graph.py): token ids and
explicit positions [1, T], an additive attention bias [1, 1, T, capacity] over the whole cache,
the rows whose logits are wanted, the cache position the T new rows are written at, and the
caches, written in place ([1, kv_heads, capacity, head_dim]; values carry a column of ones, the
softmax denominator). The base returns logits [1, R, V] and the post-norm hidden states; the draft
the hidden states and its top MAX_K (ids in base vocabulary, log-probs); the runtime keeps k.

Attention runs in fp32 whatever the weights' precision, as products over the cache in which each
token's query rows of a kv head are one product of a fixed number of rows, and the value sums run
in fixed blocks of KEY_BLOCK keys, so a row's arithmetic is the same whatever the step size, the
cache's capacity and wherever its keys sit inside their block (measured on PyTorch's CPU kernels;
the bitwise tests and the runtime's load-time check test it). Linear layers are whatever the target
makes of them (IPEX's bf16 and weight-only int8 kernels compute each row independently of the
others, measured; plain fp32 GEMMs do not).
"""
from __future__ import annotations

import torch
from torch import nn

from models.attention import KEY_BLOCK, cache_product, query_rows, value_product
from models.llama import CausalLM, Eagle3Head, EagleHead, eagle3_layers, rotate

from .onnx_graph import EXP_FLOOR

MAX_K = 16  # top-k the draft graph returns (the runtime's largest draft branching)


def fuse(linears: list[nn.Linear]) -> nn.Linear:
    """One Linear computing several that share an input (q/k/v, gate/up), outputs concatenated."""
    bias = linears[0].bias is not None
    fused = nn.Linear(linears[0].in_features, sum(l.out_features for l in linears), bias=bias,
                      dtype=linears[0].weight.dtype)
    with torch.no_grad():
        fused.weight.copy_(torch.cat([l.weight for l in linears]))
        if bias:
            fused.bias.copy_(torch.cat([l.bias for l in linears]))
    return fused


class Attention(nn.Module):
    """One decoder layer's attention over its whole cache, written in place at cache_position."""

    def __init__(self, layer, cfg):
        super().__init__()
        a = layer.self_attn
        self.qkv = fuse([a.q_proj, a.k_proj, a.v_proj])
        self.o_proj = a.o_proj
        self.heads, self.kv_heads, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.group = self.heads // self.kv_heads
        self.rows = query_rows(cfg)

    def forward(self, x, cos, sin, bias, keep, index, k_cache, v_cache):
        t, heads, kv, d = x.shape[1], self.heads, self.kv_heads, self.d
        q, k, v = self.qkv(x).split([heads * d, kv * d, kv * d], dim=-1)
        q = rotate(q.view(1, t, heads, d).transpose(1, 2), cos, sin)       # [1, heads, T, d]
        k = rotate(k.view(1, t, kv, d).transpose(1, 2), cos, sin)
        v = v.view(1, t, kv, d).transpose(1, 2).float()
        k_cache.index_copy_(2, index, k.float())
        v_cache.index_copy_(2, index, torch.cat([v, torch.ones_like(v[..., :1])], dim=-1))
        # [T, kv, rows, d]: each token's query rows of one kv head form one small product.
        q = q.float().view(kv, self.group, t, d).permute(2, 0, 1, 3)
        if self.rows > self.group:
            q = q.repeat(1, 1, -(-self.rows // self.group), 1)[:, :, :self.rows]
        scores = cache_product(q, k_cache.transpose(2, 3)) * (d ** -0.5) + bias  # [T, kv, rows, capacity]
        shifted = scores - scores.amax(dim=-1, keepdim=True)
        probs = torch.exp(torch.clamp(shifted, min=EXP_FLOOR)) * keep
        out = value_product(probs, v_cache, KEY_BLOCK)                           # [T, kv, rows, d + 1]
        out = (out[..., :d] / out[..., d:])[:, :, :self.group]
        return self.o_proj(out.reshape(1, t, heads * d).to(x.dtype))


class Layer(nn.Module):
    def __init__(self, layer, cfg, input_norm: bool = True):
        super().__init__()
        self.input_layernorm = layer.input_layernorm if input_norm else nn.Identity()
        self.attn = Attention(layer, cfg)
        self.post_attention_layernorm = layer.post_attention_layernorm
        mlp = layer.mlp
        self.gate_up = fuse([mlp.gate_proj, mlp.up_proj])
        self.down = mlp.down_proj
        self.inter = cfg.intermediate_size

    def forward(self, x, cos, sin, bias, keep, index, k_cache, v_cache):
        x = x + self.attn(self.input_layernorm(x), cos, sin, bias, keep, index, k_cache, v_cache)
        gate, up = self.gate_up(self.post_attention_layernorm(x)).split([self.inter, self.inter], dim=-1)
        return x + self.down(nn.functional.silu(gate) * up)


def step_masks(attention_bias, cache_position, t: int):
    """The bias as [T, 1, 1, capacity] (broadcast over kv heads and rows), where it lets a key
    through (1.0, else 0.0), and the cache positions of the T new rows."""
    bias = attention_bias.float().view(t, 1, 1, -1)
    keep = (bias > torch.finfo(torch.float32).min / 2).float()
    # Not torch.arange(t): tracing bakes the tracing device (the CPU) into arange, so the graph would
    # fail on CUDA; a cumulative sum of ones made like cache_position runs on its device.
    offsets = torch.cumsum(torch.ones_like(cache_position).expand(t), 0) - 1
    return bias, keep, cache_position + offsets


class BaseStep(nn.Module):
    """hidden_states out: the post-norm hidden states, or with an EAGLE-3 head's fc the fused feature
    fc([inputs of the layers eagle3_layers]) (as export/onnx_graph.build_base)."""

    def __init__(self, model: CausalLM, eagle3_fc: nn.Linear | None = None):
        super().__init__()
        cfg = model.cfg
        self.embed = model.model.embed_tokens
        self.rotary = model.rotary
        self.layers = nn.ModuleList(Layer(layer, cfg) for layer in model.model.layers)
        self.norm = model.model.norm
        self.lm_head = model.lm_head
        self.fc = eagle3_fc
        self.taps = eagle3_layers(cfg) if eagle3_fc is not None else ()

    def forward(self, input_ids, position_ids, attention_bias, logit_rows, cache_position, *caches):
        t = input_ids.shape[1]
        x = self.embed(input_ids)
        cos, sin = self.rotary(position_ids, x.dtype)
        bias, keep, index = step_masks(attention_bias, cache_position, t)
        taken = {}
        for i, layer in enumerate(self.layers):
            if i in self.taps:
                taken[i] = x
            x = layer(x, cos, sin, bias, keep, index, caches[2 * i], caches[2 * i + 1])
        hidden = self.norm(x)
        logits = self.lm_head(hidden[:, logit_rows]).float()
        if self.fc is not None:
            hidden = self.fc(torch.cat([taken[i] for i in self.taps], dim=-1))
        return logits, hidden.float()


class DraftStep(nn.Module):
    """EAGLE-1/2 head: fc over [embedding, feature], one decoder layer without input norm, the base
    lm_head (its rows `vocab` only, when the draft vocabulary is reduced), log-softmax and top-k."""

    def __init__(self, head: EagleHead, embed: nn.Embedding, lm_head: nn.Linear, vocab: torch.Tensor | None):
        super().__init__()
        self.embed, self.fc, self.rotary = embed, head.fc, head.rotary
        self.layer = Layer(head.layers[0], head.cfg, input_norm=False)
        self.lm_head = lm_head
        self.register_buffer("vocab", torch.arange(lm_head.out_features) if vocab is None else vocab)
        self.k = min(MAX_K, lm_head.out_features)

    def forward(self, input_ids, position_ids, attention_bias, logit_rows, cache_position, features, k_cache, v_cache):
        t = input_ids.shape[1]
        x = self.fc(torch.cat([self.embed(input_ids), features.to(self.embed.weight.dtype)], dim=-1))
        cos, sin = self.rotary(position_ids, x.dtype)
        bias, keep, index = step_masks(attention_bias, cache_position, t)
        hidden = self.layer(x, cos, sin, bias, keep, index, k_cache, v_cache)
        logp = torch.log_softmax(self.lm_head(hidden[:, logit_rows]).float(), dim=-1)
        values, local = torch.topk(logp, self.k, dim=-1)
        return hidden.float(), self.vocab[local], values


class Eagle3DraftStep(nn.Module):
    """EAGLE-3 head over H-wide features (see export/onnx_graph.build_draft_eagle3): attention over
    [norm(embedding), norm(feature)], the feature as residual, MLP, its own norm and lm_head over the
    draft vocabulary, top-k mapped to base ids."""

    def __init__(self, head: Eagle3Head, embed: nn.Embedding):
        super().__init__()
        mid = head.midlayer
        self.embed, self.rotary = embed, head.rotary
        self.input_layernorm, self.hidden_norm = mid.input_layernorm, mid.hidden_norm
        self.attn = Attention(mid, head.cfg)
        self.post_attention_layernorm = mid.post_attention_layernorm
        self.gate_up = fuse([mid.mlp.gate_proj, mid.mlp.up_proj])
        self.down = mid.mlp.down_proj
        self.inter = head.cfg.intermediate_size
        self.norm, self.lm_head = head.norm, head.lm_head
        self.register_buffer("vocab", head.vocab.clone())
        self.k = min(MAX_K, head.cfg.draft_vocab_size)

    def forward(self, input_ids, position_ids, attention_bias, logit_rows, cache_position, features, k_cache, v_cache):
        t = input_ids.shape[1]
        emb = self.embed(input_ids)
        feats = features.to(emb.dtype)
        cos, sin = self.rotary(position_ids, emb.dtype)
        bias, keep, index = step_masks(attention_bias, cache_position, t)
        x = torch.cat([self.input_layernorm(emb), self.hidden_norm(feats)], dim=-1)
        h = feats + self.attn(x, cos, sin, bias, keep, index, k_cache, v_cache)
        gate, up = self.gate_up(self.post_attention_layernorm(h)).split([self.inter, self.inter], dim=-1)
        hidden = h + self.down(nn.functional.silu(gate) * up)
        logp = torch.log_softmax(self.lm_head(self.norm(hidden[:, logit_rows])).float(), dim=-1)
        values, local = torch.topk(logp, self.k, dim=-1)
        return hidden.float(), self.vocab[local], values
