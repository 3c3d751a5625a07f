"""Parity of the exported graphs against the PyTorch definitions in models/.

A random prefill followed by a random tree step (non-sequential positions, a tree mask), on the
base and on the draft head, through the real ONNX Runtime sessions and in-place caches.
"""
from __future__ import annotations

import sys
from collections.abc import Mapping

import numpy as np
import torch
from tqdm import tqdm

from eagle2 import tree_from_parents, write_attention_bias
from models.config import ModelConfig
from models.llama import CausalLM, Eagle3Head, EagleHead, KVCache, RMSNorm, causal_bias, eagle3_layers, forward_layers
from models.tensors import LazyTensors, layer_tensors
from runtime import open_session, target_provider

from .onnx_graph import BLOCK_PRECISIONS, INT8_BLOCK, W8A8_ZERO_POINT
from .quantize import dequantize_8bit, dequantize_channels_8bit, quantize_8bit, quantize_channels_8bit

# Largest allowed max|graph - reference| / max|reference| per tensor, by precision. The reference
# holds the graph's own weights (fp16-rounded or 8-bit dequantized), so what remains is the graph's
# arithmetic: fp32 reordering, fp16 activations, or int8 activation rounding (MatMulNBits level 4,
# w8a8's rows; for w8a8 the bound grows with the rounding's measured effect, ROUNDING_MARGIN).
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2, "bf16": 5e-2, "int8": 0.2, "w8a8": 0.2, "w8a16": 0.2, "gguf": 0.2}

# A w8a8 graph passes where its difference is within this multiple of the activations' rounding
# alone, measured on the reference (check_parity).
ROUNDING_MARGIN = 1.5

LINEAR_SUFFIXES = ("_proj.weight", "fc.weight", "lm_head.weight")


class ParityError(AssertionError):
    pass


def stored_weight(name: str, t: torch.Tensor, precision: str, int8_block: int = INT8_BLOCK) -> torch.Tensor:
    """One weight as the graph holds it (rounded to fp16, or 8-bit dequantized), in fp32. A gguf
    graph holds the checkpoint's own values (the GGUF's blocks, which it was dequantized from)."""
    t = torch.as_tensor(t)
    if not t.is_floating_point():  # an EAGLE-3 head's d2t map
        return t
    t = t.float()
    if precision == "fp16":
        return t.half().float()
    if precision == "bf16":
        return t.bfloat16().float()
    if precision in BLOCK_PRECISIONS and name.endswith(LINEAR_SUFFIXES):
        q, s = quantize_8bit(t.numpy(), int8_block)
        return torch.from_numpy(dequantize_8bit(q, s, t.shape[1]))
    if precision == "w8a8" and name.endswith(LINEAR_SUFFIXES):
        return torch.from_numpy(dequantize_channels_8bit(*quantize_channels_8bit(t.numpy())))
    return t


def w8a8_rows(x: torch.Tensor) -> torch.Tensor:
    """x as a w8a8 linear reads it: each row rounded to 255 levels spanning [min, max] around its
    middle (export.onnx_graph.Builder._w8a8_linear). The parity check measures with it what the
    rounding alone changes in a model's outputs (check_parity)."""
    hi, lo = x.amax(-1, keepdim=True), x.amin(-1, keepdim=True)
    mid = (hi + lo) / 2
    scale = ((hi - lo) * (1 / 254)).clamp_min(1e-30)
    return mid + scale * torch.round((x - mid) / scale).clamp(-W8A8_ZERO_POINT, 255 - W8A8_ZERO_POINT)


def stored_weights(state: Mapping, precision: str, int8_block: int = INT8_BLOCK) -> dict[str, torch.Tensor]:
    return {name: stored_weight(name, t, precision, int8_block) for name, t in state.items()}


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


def rel_diff(got, want) -> float:
    """max |got - want| / max |want|."""
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-6))


def _cast(x: np.ndarray, spec_dtype: str) -> np.ndarray:
    return np.ascontiguousarray(x.astype(np.float16 if spec_dtype == "float16" else x.dtype))


def check_parity(artifact, manifest: dict, cfg: ModelConfig, state: Mapping, head_cfg, head_state,
                 prefill: int = 12, tree: int = 8, seed: int = 0, draft_vocab: np.ndarray | None = None) -> dict[str, float]:
    """Returns the relative max differences; raises ParityError above the precision's tolerance.
    `draft_vocab`: the token ids the draft graph ranks (None = all).

    Bounded memory at any size: one ONNX Runtime session at a time, and the PyTorch reference runs
    a layer at a time over weights read on demand (models.llama.forward_layers)."""
    precision, draft_precision = manifest["precision"], manifest.get("draft_precision")
    n_pos, io_dtype = manifest["rotary_positions"], manifest["io_dtype"]
    int8_block = manifest.get("int8_block") or INT8_BLOCK
    rng = np.random.default_rng(seed)
    cache_len = prefill + tree + 4
    parents, depth = random_tree(tree, rng)
    steps = [  # (ids, positions, bias, start)
        (rng.integers(0, cfg.vocab_size, (1, prefill)), np.arange(prefill)[None], causal_bias(prefill).numpy(), 0),
        (rng.integers(0, cfg.vocab_size, (1, tree)), (prefill + depth)[None], tree_bias(parents, prefill), prefill),
    ]
    diffs: dict[str, float] = {}

    def record(name, got, want):
        diffs[name] = max(diffs.get(name, 0.0), rel_diff(got, want))

    provider = target_provider(manifest["target"])

    def session(graph: str):
        return open_session(artifact, manifest["graphs"][graph], provider, "cpu", cache_len, max(prefill, tree), 64,
                            None)

    base = session("base")
    graph_out = []  # copied at once: a session's outputs are views of buffers the next run rewrites
    for ids, pos, bias, _ in steps:
        out = base.run({"input_ids": ids, "position_ids": pos, "attention_bias": _cast(bias, io_dtype),
                        "logit_rows": np.arange(ids.shape[1])})
        graph_out.append({k: np.array(v) for k, v in out.items()})
    graph_k = np.array(base.cache_arrays()[0][:, :, :prefill + tree])
    del base
    stored = LazyTensors(state.keys(), lambda k: stored_weight(k, state[k], precision, int8_block))
    lm_name = "lm_head.weight" if "lm_head.weight" in state else "model.embed_tokens.weight"
    # tied models: the graph's lm_head is the embedding in the linear layers' precision
    lm = stored_weight("lm_head.weight", state[lm_name], precision, int8_block)
    ref = _reference_base(cfg, stored, lm, steps, n_pos, head_cfg, head_state, precision, int8_block)
    graph = {"base.logits": [o["logits"] for o in graph_out], "base.hidden_states": [o["hidden_states"] for o in graph_out],
             "base.kv_cache": [graph_k]}
    for name, outs in graph.items():
        for got, want in zip(outs, ref[name]):
            record(name, got, want)
    features = ref["features"]
    tolerance = {n: TOLERANCE[precision] for n in graph}
    if precision == "w8a8":
        # The activations' rounding is part of the model a w8a8 graph defines, and a deep network
        # may amplify it past the tolerance whatever the graph: measured on the reference itself
        # (its rows rounded as the graph rounds them against not), it bounds the graph's
        # difference too, with a margin for the rounding's other realisation.
        rounded = _reference_base(cfg, stored, lm, steps, n_pos, head_cfg, head_state, precision, int8_block,
                                  w8a8_rows)
        for name in graph:
            alone = max(rel_diff(r, w) for r, w in zip(rounded[name], ref[name]))
            diffs[f"rounding alone: {name}"] = alone
            tolerance[name] = max(tolerance[name], ROUNDING_MARGIN * alone)
        del rounded
    if head_cfg is not None:
        draft_lm = stored_weight("lm_head.weight", state[lm_name], draft_precision, int8_block)
        _check_draft(session("draft"), head_cfg, head_state, draft_lm, stored["model.embed_tokens.weight"],
                     steps, features, k=min(8, head_cfg.draft_vocab_size if head_cfg.eagle3 else cfg.vocab_size),
                     n_pos=n_pos, cache_len=cache_len, io_dtype=io_dtype, draft_precision=draft_precision,
                     int8_block=int8_block, draft_vocab=draft_vocab, record=record)
    tolerance.update({n: TOLERANCE[draft_precision] for n in diffs if n.startswith("draft.")})
    bad = [f"{n} {diffs[n]:.3g} > {t:.3g}" for n, t in tolerance.items() if diffs[n] > t]
    if bad:
        raise ParityError("graphs differ from the PyTorch definition: " + ", ".join(bad))
    return diffs


@torch.no_grad()
def _check_draft(draft, head_cfg, head_state, draft_lm, embed, steps, features, k: int, n_pos: int, cache_len: int,
                 io_dtype: str, draft_precision: str, int8_block: int, draft_vocab, record) -> None:
    """The draft graph's steps against the PyTorch head fed the reference base's features."""
    head = (Eagle3Head if head_cfg.eagle3 else EagleHead)(head_cfg, n_pos).eval()
    head.load_state_dict(stored_weights(head_state, draft_precision, int8_block))
    dcache = KVCache(head_cfg, cache_len)
    top_k = np.array([k], np.int64)
    for (ids, pos, bias, start), feats in zip(steps, features):
        out = draft.run({"input_ids": ids, "position_ids": pos, "attention_bias": _cast(bias, io_dtype),
                         "features": _cast(feats.numpy(), io_dtype), "top_k": top_k,
                         "logit_rows": np.arange(ids.shape[1])}, k=k)
        h = head(embed[torch.from_numpy(ids)], feats, torch.from_numpy(pos), torch.from_numpy(bias), dcache, start)
        if head_cfg.eagle3:
            vocab = head.vocab
            logp = torch.log_softmax(head.logits(h).float(), -1)
        else:
            vocab = torch.arange(draft_lm.shape[0]) if draft_vocab is None else torch.from_numpy(draft_vocab)
            logp = torch.log_softmax(h.float() @ draft_lm[vocab].T, -1)
        record("draft.hidden_states", out["hidden_states"], h)
        record("draft.topk_logprobs", out["topk_logprobs"], logp.topk(k, -1).values)
        if not np.isin(out["topk_ids"], vocab.numpy()).all():
            raise ParityError("the draft graph proposed a token outside its draft vocabulary")


@torch.no_grad()
def _reference_base(cfg, stored: Mapping, lm: torch.Tensor, steps, n_pos, head_cfg, head_state, precision, int8_block,
                    rows=None) -> dict[str, list[torch.Tensor]]:
    """The base's reference outputs for `steps`: {"base.logits", "base.hidden_states": a tensor per
    step, "base.kv_cache": [layer 0's keys], "features": what the draft head reads at each step}.
    `rows(x)`, where given, is applied to every linear's input (w8a8_rows)."""
    embed = stored["model.embed_tokens.weight"]
    xs = [[embed[torch.from_numpy(ids)] for ids, *_ in steps]]
    del embed
    eagle3 = head_cfg is not None and head_cfg.eagle3
    taps, tapped, layer0 = eagle3_layers(cfg), {}, []

    def visit(i, layer, xs, caches):
        if rows is not None:
            for linear in layer.modules():
                if isinstance(linear, torch.nn.Linear):
                    linear.register_forward_pre_hook(lambda _, args: (rows(args[0]),))
        if i == 0:
            layer0.append(caches[0][0])
        if eagle3 and i in taps:
            tapped[i] = xs[0]
        bar.update(1)
    refs = [(torch.from_numpy(pos), torch.from_numpy(bias), start) for _, pos, bias, start in steps]
    with tqdm(total=cfg.num_layers, desc="parity check: PyTorch reference", unit="layer", file=sys.stderr) as bar:
        out = forward_layers(cfg, lambda i: layer_tensors(stored, f"model.layers.{i}."), xs, [refs], n_pos,
                             visit)[0]
    norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
    norm.weight.data = stored["model.norm.weight"]
    ref = {"base.logits": [], "base.hidden_states": [], "features": []}
    for j, x in enumerate(out):
        hidden = norm(x)
        ref["base.logits"].append(((hidden if rows is None else rows(hidden)) @ lm.T).float())
        if eagle3:
            fc = stored_weight("fc.weight", head_state["fc.weight"], precision, int8_block)
            taken = torch.cat([tapped[i][j] for i in taps], dim=-1)
            hidden = (taken if rows is None else rows(taken)) @ fc.T
        ref["base.hidden_states"].append(hidden)
        ref["features"].append(hidden)
    n = steps[-1][3] + steps[-1][0].shape[1]
    ref["base.kv_cache"] = [layer0[0][:, :, :n]]
    return ref
