"""Parity of the exported graphs against the PyTorch definitions in models/.

A random prefill followed by a random tree step (non-sequential positions, a tree mask), on the
base and on the draft head, through the real ONNX Runtime sessions and in-place caches.
"""
from __future__ import annotations

import numpy as np
import torch

from eagle2 import tree_from_parents, write_attention_bias
from models.config import ModelConfig
from models.llama import CausalLM, Eagle3Head, EagleHead, KVCache, base_features, causal_bias
from runtime.engine import open_session

from .onnx_graph import INT8_BLOCK, dequantize_8bit, dequantize_channels_8bit, quantize_8bit, quantize_channels_8bit

# Largest allowed max|graph - reference| / max|reference| per tensor, by precision. The reference
# holds the graph's own weights (fp16-rounded or 8-bit dequantized), so what remains is the graph's
# arithmetic: fp32 reordering, fp16 activations, or int8 activation rounding (MatMulNBits level 4,
# w8a8's rows).
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2, "int8": 0.2, "w8a8": 0.2, "gguf": 0.2}

LINEAR_SUFFIXES = ("_proj.weight", "fc.weight", "lm_head.weight")


class ParityError(AssertionError):
    pass


def stored_weights(state: dict[str, torch.Tensor], precision: str, int8_block: int = INT8_BLOCK) -> dict[str, torch.Tensor]:
    """The weights as the graph holds them (rounded to fp16, or 8-bit dequantized), in fp32. A gguf
    graph holds the checkpoint's own values (the GGUF's blocks, which it was dequantized from)."""
    out = {}
    for name, t in state.items():
        if not t.is_floating_point():  # an EAGLE-3 head's d2t map
            out[name] = t
            continue
        t = t.float()
        if precision == "fp16":
            t = t.half().float()
        elif precision == "bf16":
            t = t.bfloat16().float()
        elif precision == "int8" and name.endswith(LINEAR_SUFFIXES):
            q, s = quantize_8bit(t.numpy(), int8_block)
            t = torch.from_numpy(dequantize_8bit(q, s, t.shape[1]))
        elif precision == "w8a8" and name.endswith(LINEAR_SUFFIXES):
            t = torch.from_numpy(dequantize_channels_8bit(*quantize_channels_8bit(t.numpy())))
        out[name] = t
    return out


def reference_models(cfg, state, head_cfg, head_state, precision, draft_precision, n_positions,
                     int8_block: int = INT8_BLOCK):
    """PyTorch twins of the exported graphs: the base, the head and the lm_head the draft graph
    uses. Always untied here: in an int8 graph the lm_head is quantized but the embedding is not,
    and the draft graph may hold its lm_head in another precision than the base."""
    base = CausalLM(cfg, n_positions).eval()
    base.load_state_dict({k: v for k, v in stored_weights(state, precision, int8_block).items() if k != "lm_head.weight"},
                         strict=False)
    lm = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    base.lm_head.weight = torch.nn.Parameter(stored_weights({"lm_head.weight": lm}, precision, int8_block)["lm_head.weight"])
    if head_cfg is None:
        return base, None, None
    head = (Eagle3Head if head_cfg.eagle3 else EagleHead)(head_cfg, n_positions).eval()
    head.load_state_dict(stored_weights(head_state, draft_precision, int8_block))
    return base, head, stored_weights({"lm_head.weight": lm}, draft_precision, int8_block)["lm_head.weight"]


def random_tree(t: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """(parents, depths) of a random tree of t nodes in topological order."""
    parents = np.array([-1] + [int(rng.integers(0, i)) for i in range(1, t)])
    return parents, tree_from_parents(np.zeros(t, np.int64), parents).depths


def tree_bias(parents: np.ndarray, start: int) -> np.ndarray:
    """Additive mask [1, 1, t, start + t]: the context plus each node's ancestors and itself."""
    t = len(parents)
    bias = np.empty((t, start + t), np.float32)
    write_attention_bias(bias, tree_from_parents(np.zeros(t, np.int64), parents), start, np.finfo(np.float32).min)
    return bias[None, None]


def _cast(x: np.ndarray, spec_dtype: str) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16 if spec_dtype == "float16" else x.dtype))


def check_parity(artifact, manifest: dict, cfg: ModelConfig, state, head_cfg, head_state,
                 prefill: int = 12, tree: int = 8, seed: int = 0, draft_vocab: np.ndarray | None = None) -> dict[str, float]:
    """Returns the relative max differences; raises ParityError above the precision's tolerance.
    `draft_vocab`: the token ids the draft graph ranks (None = all)."""
    precision, draft_precision = manifest["precision"], manifest.get("draft_precision")
    n_pos = manifest["rotary_positions"]
    io_dtype = manifest["io_dtype"]
    rng = np.random.default_rng(seed)
    cache_len = prefill + tree + 4
    int8_block = manifest.get("int8_block") or INT8_BLOCK
    base_ref, head_ref, draft_lm = reference_models(cfg, state, head_cfg, head_state, precision, draft_precision,
                                                    n_pos, int8_block)
    parents, depth = random_tree(tree, rng)
    steps = [  # (ids, positions, bias, start)
        (rng.integers(0, cfg.vocab_size, (1, prefill)), np.arange(prefill)[None], causal_bias(prefill).numpy(), 0),
        (rng.integers(0, cfg.vocab_size, (1, tree)), (prefill + depth)[None], tree_bias(parents, prefill), prefill),
    ]
    diffs: dict[str, float] = {}

    def record(name, got, want):
        got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
        rel = float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))
        diffs[name] = max(diffs.get(name, 0.0), rel)

    provider = "cpu" if manifest["target"] == "onnx" else manifest["target"]
    base = open_session(artifact, manifest["graphs"]["base"], provider, "cpu", cache_len, max(prefill, tree), 64, None)
    cache = KVCache(cfg, cache_len)
    features = []
    with torch.no_grad():
        for ids, pos, bias, start in steps:
            rows = np.arange(ids.shape[1])
            out = base.run({"input_ids": ids, "position_ids": pos, "attention_bias": _cast(bias, io_dtype),
                            "logit_rows": rows})
            if head_cfg is not None and head_cfg.eagle3:
                # The base graph outputs the head's fc of the fused layer inputs, in the base's precision.
                logits, aux = base_features(base_ref, torch.from_numpy(ids), torch.from_numpy(pos),
                                            torch.from_numpy(bias), cache, start)
                hidden = aux @ stored_weights({"fc.weight": head_state["fc.weight"]}, precision, int8_block)["fc.weight"].T
            else:
                logits, hidden = base_ref(torch.from_numpy(ids), torch.from_numpy(pos), torch.from_numpy(bias), cache,
                                          start)
            record("base.logits", out["logits"], logits)
            record("base.hidden_states", out["hidden_states"], hidden)
            features.append(hidden)
        graph_k = base.cache_arrays()[0][:, :, :prefill + tree]
        record("base.kv_cache", graph_k, cache.k[0][:, :, :prefill + tree])
        if head_ref is not None:
            draft = open_session(artifact, manifest["graphs"]["draft"], provider, "cpu", cache_len, max(prefill, tree),
                                 64, None)
            dcache = KVCache(head_cfg, cache_len)
            k = min(8, head_cfg.draft_vocab_size if head_cfg.eagle3 else cfg.vocab_size)
            top_k = np.array([k], np.int64)
            for (ids, pos, bias, start), feats in zip(steps, features):
                out = draft.run({"input_ids": ids, "position_ids": pos, "attention_bias": _cast(bias, io_dtype),
                                 "features": _cast(feats.numpy(), io_dtype), "top_k": top_k,
                                 "logit_rows": np.arange(ids.shape[1])}, k=k)
                h = head_ref(base_ref.model.embed_tokens(torch.from_numpy(ids)), feats, torch.from_numpy(pos),
                             torch.from_numpy(bias), dcache, start)
                if head_cfg.eagle3:
                    vocab = head_ref.vocab
                    logp = torch.log_softmax(head_ref.logits(h).float(), -1)
                else:
                    vocab = torch.arange(draft_lm.shape[0]) if draft_vocab is None else torch.from_numpy(draft_vocab)
                    logp = torch.log_softmax(h.float() @ draft_lm[vocab].T, -1)
                record("draft.hidden_states", out["hidden_states"], h)
                record("draft.topk_logprobs", out["topk_logprobs"], logp.topk(k, -1).values)
                if not np.isin(out["topk_ids"], vocab.numpy()).all():
                    raise ParityError("the draft graph proposed a token outside its draft vocabulary")
    tolerance = {n: TOLERANCE[draft_precision if n.startswith("draft.") else precision] for n in diffs}
    bad = [f"{n} {d:.3g} > {tolerance[n]}" for n, d in diffs.items() if d > tolerance[n]]
    if bad:
        raise ParityError("graphs differ from the PyTorch definition: " + ", ".join(bad))
    return diffs
