"""Checkpoint -> torch artifact directory: the base and draft step graphs (export/torch_graph.py)
traced to TorchScript, frozen, with their weights inside; tokenizer and manifest as for ONNX.

--target ipex optimizes them with intel-extension-for-pytorch first (bf16 weights for AMX /
AVX512-BF16, or its weight-only int8 kernels) and needs IPEX to load; --target torch keeps plain
PyTorch kernels and loads on CPU or CUDA. TorchScript because a frozen trace loads without this
project's source and lets IPEX fuse its kernels; it runs each step as one graph call.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

from artifact.directory import atomic_directory
from models.attention import KEY_BLOCK
from models.cpu import bf16_matmuls, cpu_flags
from models.draft_vocab import DraftVocab
from models.llama import CausalLM, Eagle3Head, EagleHead
from models.weights import Checkpoint

from .common import (DEFAULT_TREE, ExportError, TREE_POSITION_MARGIN, default_max_length, draft_vocab_entry,
                     finish_manifest, head_entry, save_tokenizer, stop_token_ids, versions)
from .quality import MIN_AGREEMENT, check_quality
from .torch_graph import MAX_K, BaseStep, DraftStep, Eagle3DraftStep

PRECISIONS = {"ipex": ("fp32", "bf16", "int8"), "torch": ("fp32", "bf16", "fp16")}
# Draft precisions besides the base's own.
CHEAPER_DRAFTS = {"ipex": ("int8",), "torch": ()}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}
# IPEX bf16's default tree: its linear layers cost the same for 1 to 16 rows on AMX, so wider trees pay
# (docs/code-notes.md).
IPEX_BF16_TREE = {"total_tokens": 6, "depth": 1, "top_k": 3}
# The graphs are traced at this many tokens and cache positions; both stay dynamic.
TRACE_TOKENS, TRACE_CACHE = 4, 16


def import_ipex():
    try:
        import intel_extension_for_pytorch as ipex
    except ImportError as e:
        raise ExportError(f"--target ipex needs intel-extension-for-pytorch ({e}); it lives in its own "
                          "environment: bash ci/install_ipex.sh, then use .venv-ipex/bin/python") from None
    return ipex


# IPEX's bf16 weight prepacking asserts one of these instruction sets (AVX-512 BW+VL+DQ, or AVX-NE-CONVERT).
IPEX_BF16_ISAS = ({"avx512bw", "avx512vl", "avx512dq"}, {"avx_ne_convert"})
IPEX_BF16_NEEDS = ("IPEX's bf16 kernels need AVX-512 (BW, VL, DQ) or AVX-NE-CONVERT, and AVX512-BF16 or AMX to "
                   "multiply in hardware (elsewhere bf16 is emulated, slower than fp32 and not claimed exact), "
                   "which this CPU lacks")


def ipex_bf16_supported(flags: set[str]) -> bool:
    return any(isa <= flags for isa in IPEX_BF16_ISAS)


def ipex_bf16_runs() -> bool:
    """Whether IPEX's bf16 linears run here (prepacking) and multiply in hardware (models.cpu.bf16_matmuls)."""
    return ipex_bf16_supported(cpu_flags()) and bf16_matmuls()


def woq_int8(module: torch.nn.Module, ipex) -> None:
    """Every Linear as IPEX's weight-only int8 linear: 8-bit weights in blocks of 32, activations
    quantized per token and block (the default mode; it computes each row independently of the
    others, measured; the per-tensor mode does not)."""
    from intel_extension_for_pytorch.nn.modules import WeightOnlyQuantizedLinear
    from intel_extension_for_pytorch.quantization import WoqLowpMode, WoqWeightDtype
    qconfig = ipex.quantization.get_weight_only_quant_qconfig_mapping(
        weight_dtype=WoqWeightDtype.INT8, lowp_mode=WoqLowpMode.INT8, group_size=32).global_qconfig
    for name, child in module.named_children():
        if isinstance(child, torch.nn.Linear):
            child.qconfig = qconfig
            setattr(module, name, WeightOnlyQuantizedLinear.from_float(child))
        else:
            woq_int8(child, ipex)


def optimize(step: torch.nn.Module, target: str, precision: str) -> torch.nn.Module:
    step = step.eval().to(DTYPES[precision])
    if target == "ipex":
        ipex = import_ipex()
        if precision == "int8":
            woq_int8(step, ipex)
        else:
            step = ipex.optimize(step, dtype=DTYPES[precision], inplace=True)
    return step


def trace(step: torch.nn.Module, example: tuple, path: Path) -> None:
    with torch.inference_mode():
        traced = torch.jit.freeze(torch.jit.trace(step, example, check_trace=False))
    torch.jit.save(traced, str(path))


def caches(cfg, n_layers: int, length: int) -> list[torch.Tensor]:
    shapes = [(1, cfg.num_kv_heads, length, cfg.head_dim), (1, cfg.num_kv_heads, length, cfg.head_dim + 1)]
    return [torch.zeros(shapes[i % 2]) for i in range(2 * n_layers)]


def spec(file: str, cfg, n_layers: int, draft: bool) -> dict:
    """The graph's inputs and outputs as the manifest records them (the same names as the ONNX graphs
    with exact attention; the draft's top-k is the graph's MAX_K, of which the runtime keeps k)."""
    f, i64 = "float32", "int64"
    inputs = [{"name": "input_ids", "dtype": i64, "shape": [1, "T"]},
              {"name": "position_ids", "dtype": i64, "shape": [1, "T"]},
              {"name": "attention_bias", "dtype": f, "shape": [1, 1, "T", "total"]},
              {"name": "logit_rows", "dtype": i64, "shape": ["R"]},
              {"name": "cache_position", "dtype": i64, "shape": [1]}]
    if draft:
        inputs.append({"name": "features", "dtype": f, "shape": [1, "T", cfg.hidden_size]})
    for i in range(n_layers):
        inputs.append({"name": f"past_key_{i}", "dtype": f, "shape": [1, cfg.num_kv_heads, "max_length", cfg.head_dim]})
        inputs.append({"name": f"past_value_{i}", "dtype": f,
                       "shape": [1, cfg.num_kv_heads, "max_length", cfg.head_dim + 1]})
    outputs = ([{"name": "hidden_states", "dtype": f, "shape": [1, "T", cfg.hidden_size]},
                {"name": "topk_ids", "dtype": i64, "shape": [1, "R", "k"]},
                {"name": "topk_logprobs", "dtype": f, "shape": [1, "R", "k"]}] if draft else
               [{"name": "logits", "dtype": f, "shape": [1, "R", cfg.vocab_size]},
                {"name": "hidden_states", "dtype": f, "shape": [1, "T", cfg.hidden_size]}])
    return {"file": file, "inputs": inputs, "outputs": outputs}


def build_models(ckpt: Checkpoint, n_positions: int, draft_vocab: DraftVocab | None):
    """The models/ definitions holding the checkpoint's weights, wrapped as step graphs."""
    cfg = ckpt.cfg
    base = CausalLM(cfg, n_positions).eval()
    missing = base.load_state_dict({k: v.float() for k, v in ckpt.state.items()}, strict=False).missing_keys
    if cfg.tie_word_embeddings:
        base.lm_head.weight = base.model.embed_tokens.weight
    elif missing:
        raise ExportError(f"checkpoint lacks {', '.join(missing)}")
    if ckpt.head_cfg is not None and ckpt.head_cfg.eagle3:
        head = Eagle3Head(ckpt.head_cfg, n_positions).eval()
        head.load_state_dict({k: v if k == "d2t" else v.float() for k, v in ckpt.head_state.items()})
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        with torch.no_grad():
            embed.weight.copy_(base.model.embed_tokens.weight)
        return {"base": BaseStep(base, head.fc), "draft": Eagle3DraftStep(head, embed)}
    steps = {"base": BaseStep(base)}
    if ckpt.head_cfg is not None:
        head = EagleHead(ckpt.head_cfg, n_positions).eval()
        head.load_state_dict({k: v.float() for k, v in ckpt.head_state.items()})
        rows = None if draft_vocab is None else torch.from_numpy(draft_vocab.ids)
        lm = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size if rows is None else len(rows), bias=False)
        with torch.no_grad():
            lm.weight.copy_(base.lm_head.weight if rows is None else base.lm_head.weight[rows])
        embed = torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        with torch.no_grad():
            embed.weight.copy_(base.model.embed_tokens.weight)
        steps["draft"] = DraftStep(head, embed, lm, rows)
    return steps


def export_torch(ckpt: Checkpoint, out: Path, target: str = "ipex", precision: str = "bf16",
                 max_length: int | None = None, verify: bool = True, overwrite: bool = False, log=print,
                 draft_vocab: DraftVocab | None = None, draft_precision: str | None = None,
                 min_agreement: float = MIN_AGREEMENT) -> dict:
    """draft_precision: the draft graph's. It only proposes tokens, so a cheaper one cannot change the
    output: IPEX's default is its weight-only int8, a faster draft (docs/code-notes.md); plain PyTorch's, the base's.
    min_agreement: the quality gate's threshold (export.quality)."""
    if target not in PRECISIONS:
        raise ExportError(f"unsupported target {target!r} for the torch exporter")
    if precision not in PRECISIONS[target]:
        raise ExportError(f"unsupported precision {precision!r} for --target {target}; choose one of "
                          f"{', '.join(PRECISIONS[target])}")
    draft_precision = draft_precision or ("int8" if target == "ipex" else precision)
    drafts = tuple(dict.fromkeys((precision, *CHEAPER_DRAFTS[target])))
    if draft_precision not in drafts:
        raise ExportError(f"unsupported draft precision {draft_precision!r} for --target {target} with a {precision} "
                          f"base; choose one of {', '.join(drafts)}")
    cfg = ckpt.cfg
    max_length = default_max_length(cfg, log) if max_length is None else max_length
    if max_length < 16:
        raise ExportError(f"--max-length {max_length} is too small (at least 16)")
    n_positions = max_length + TREE_POSITION_MARGIN
    start = time.time()
    ipex_version = {"intel_extension_for_pytorch": import_ipex().__version__} if target == "ipex" else {}
    if target == "ipex" and "bf16" in (precision, draft_precision) and not ipex_bf16_runs():
        raise ExportError(f"{IPEX_BF16_NEEDS}: export --target ipex --precision fp32 or int8, or an ONNX artifact")
    with atomic_directory(out, overwrite) as tmp:
        graphs = {}
        t = TRACE_TOKENS
        common = (torch.randint(0, cfg.vocab_size, (1, t)), torch.arange(t)[None], torch.zeros(1, 1, t, TRACE_CACHE),
                  torch.arange(t), torch.zeros(1, dtype=torch.int64))
        for name, step in build_models(ckpt, n_positions, draft_vocab).items():
            draft = name == "draft"
            step_precision = draft_precision if draft else precision
            print(f"tracing the {name} graph ({target}, {step_precision}) ...", file=sys.stderr)
            layers = 1 if draft else cfg.num_layers
            extra = (torch.zeros(1, t, cfg.hidden_size),) if draft else ()
            trace(optimize(step, target, step_precision), common + extra + tuple(caches(cfg, layers, TRACE_CACHE)),
                  tmp / f"{name}.pt")
            graphs[name] = spec(f"{name}.pt", cfg, layers, draft)
        save_tokenizer(ckpt, tmp / "tokenizer")
        manifest = {
            "model": {"source": ckpt.source, "config": cfg.to_dict()},
            "head": head_entry(ckpt),
            "target": target,
            "precision": precision,
            "attention": "exact",
            "exact_key_block": KEY_BLOCK,
            # bf16 and weight-only int8 kernels compute each row independently of the step size (tested);
            # PyTorch's and IPEX's fp32 GEMMs round 1, 2-12 and 16+ row products differently (measured).
            "verify_exact": precision in ("bf16", "int8"),
            "draft_precision": None if ckpt.head_cfg is None else draft_precision,
            "draft_vocab": draft_vocab_entry(ckpt, draft_vocab),
            "draft_top_k": MAX_K,
            "io_dtype": "float32",
            "max_length": max_length,
            "rotary_positions": n_positions,
            "graphs": graphs,
            "tree_defaults": IPEX_BF16_TREE if (target, precision) == ("ipex", "bf16") else
            DEFAULT_TREE.get(precision, DEFAULT_TREE["fp32"]),
            "stop_token_ids": stop_token_ids(ckpt),
            "tokenizer": "tokenizer",
            "versions": versions(**ipex_version),
        }
        finish_manifest(tmp, manifest, ckpt, draft_vocab, verify, start, log,
                        gate=lambda: check_quality(tmp, manifest, ckpt, min_agreement, log))
    return json.loads((out / "manifest.json").read_text())
