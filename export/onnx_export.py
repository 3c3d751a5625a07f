"""Checkpoint -> ONNX artifact directory (graphs, shared weights, tokenizer, manifest), atomically."""
from __future__ import annotations

import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import onnx
import torch
from tqdm import tqdm

from artifact.directory import atomic_directory
from models.cpu import cpu_kind
from models.draft_vocab import DraftVocab
from models.gguf_blocks import read_blocks
from models.tensors import LazyTensors, fp32_arrays
from models.weights import Checkpoint
from runtime import kernels

from .common import (DEFAULT_TREE, ExportError, TREE_POSITION_MARGIN, default_draft_precision, default_max_length,
                     draft_vocab_entry, finish_manifest, head_entry, save_tokenizer, stop_token_ids, versions)
from .quality import MIN_AGREEMENT, check_quality
from .memory import check_memory, resident_calibration
from .onnx_graph import (ATTENTIONS, BLOCK_PRECISIONS, EXACT_KEY_BLOCK, INT8_BLOCK, INT8_BLOCKS, PRECISIONS, SLOTTED_ATTENTIONS,
                         Precision, build_base, build_draft, build_draft_eagle3, cache_bytes, lm_head_name)
from .onnx_writer import WEIGHTS_FILE, WeightStore
from .smoothing import ALPHA, SMOOTHED, SMOOTHED_PRECISIONS, activation_maxima, smooth

# The draft's own weights are never a GGUF's: it takes the float or 8-bit precisions.
DRAFT_PRECISIONS = ("fp32", "fp16", "int8", "w8a16")


def _dtype_name(elem: int) -> str:
    return np.dtype(onnx.helper.tensor_dtype_to_np_dtype(elem)).name


def graph_spec(model: onnx.ModelProto, file: str) -> dict:
    def values(vis):
        return [{"name": v.name, "dtype": _dtype_name(v.type.tensor_type.elem_type),
                 "shape": [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]} for v in vis]
    return {"file": file, "inputs": values(model.graph.input), "outputs": values(model.graph.output)}


def export_onnx(ckpt: Checkpoint, out: Path, precision: str = "fp32", max_length: int | None = None,
                verify: bool = True, overwrite: bool = False, log=print, draft_precision: str | None = None,
                attention: str | None = None, draft_vocab: DraftVocab | None = None,
                int8_block: int = INT8_BLOCK, min_agreement: float = MIN_AGREEMENT, cpu: dict | None = None) -> dict:
    """`draft_vocab`: the head drafts from these tokens only (models/draft_vocab.py); None = all.
    `int8_block`: the block size of int8 weights (base and draft), one of INT8_BLOCKS.
    `min_agreement`: the quality gate's threshold (export.quality).
    `cpu`: the CPU kind it is exported for (export.common.cpu_entry), recorded for the runtime's load check.

    Streams: tensors are read, converted and appended to weights.bin one at a time, so memory
    stays near one layer's fp32 weights beside the embedding, whatever the model's size
    (export/memory.py estimates the peak and refuses an export that cannot fit, before starting)."""
    attention, draft_precision = _check_options(precision, attention, draft_precision, int8_block)
    blocks = _gguf_blocks(ckpt) if precision == "gguf" else None
    cfg = ckpt.cfg
    if max_length is None:
        max_length = default_max_length(cfg, log, cache_bytes(Precision(precision), attention))
    if max_length < 16:
        raise ExportError(f"--max-length {max_length} is too small (at least 16)")
    check_memory(ckpt, "onnx", precision, verify, log)
    n_positions = max_length + TREE_POSITION_MARGIN
    start = time.time()
    state, smoothing = fp32_arrays(ckpt.state), None
    if precision in SMOOTHED_PRECISIONS:
        state, smoothing = _smoothed(cfg, state, ckpt.tokenizer, resident_calibration(ckpt, "onnx", precision, verify))
        # the parity check compares the graphs with the weights they hold: the smoothed ones
        ckpt = dataclasses.replace(ckpt, state=LazyTensors(state.keys(), lambda k: torch.from_numpy(state[k])))
    with atomic_directory(out, overwrite) as tmp:
        with WeightStore(tmp / WEIGHTS_FILE) as store:
            graphs = _write_graphs(tmp, store, ckpt, state, precision, draft_precision, n_positions, attention,
                                   blocks, draft_vocab, int8_block, log)
        save_tokenizer(ckpt, tmp / "tokenizer")
        manifest = {
            "model": {"source": ckpt.source, "config": cfg.to_dict()},
            "head": head_entry(ckpt),
            "target": "onnx",
            "precision": precision,
            "attention": attention,
            # Largest run of cache positions a verify step may cover without straddling a block of
            # the exact attention's key sums; null when the attention gives no such guarantee.
            "exact_key_block": EXACT_KEY_BLOCK if attention == "exact" else None,
            # Whether verification computes every tree node bitwise as plain decoding does (on ONNX
            # Runtime's CPU kernels, tested), so that greedy speculative output equals plain output.
            # fp16 is for CUDA, whose kernels make no such promise.
            "verify_exact": attention in SLOTTED_ATTENTIONS and precision != "fp16",
            # MLAS's 4-bit MatMulNBits (accuracy level 4) computes a one-row product by another path
            # than a multi-row one on AVX2 CPUs, so the runtime runs one-token steps of such
            # artifacts as two rows.
            "verify_min_rows": 2 if blocks and any(b.bits == 4 for b in blocks.values()) else 1,
            "draft_precision": None if ckpt.head_cfg is None else draft_precision,
            "int8_block": int8_block if {precision, draft_precision} & set(BLOCK_PRECISIONS) else None,
            # Columns of a panel of w8a16's weights (Int8MatMul's layout); the runtime refuses
            # w8a16 artifacts from before panels, whose 2-D weights the operator no longer takes.
            "int8_panel": kernels.PANEL if "w8a16" in (precision, draft_precision) else None,
            "smoothing": smoothing,
            "draft_vocab": draft_vocab_entry(ckpt, draft_vocab),
            "io_dtype": "float16" if precision == "fp16" else "float32",
            "max_length": max_length,
            "rotary_positions": n_positions,
            "graphs": graphs,
            "tree_defaults": DEFAULT_TREE[precision],
            "stop_token_ids": stop_token_ids(ckpt),
            "tokenizer": "tokenizer",
            "versions": versions(),
            "cpu": cpu,
        }
        finish_manifest(tmp, manifest, ckpt, draft_vocab, verify, start, log,
                        gate=lambda: check_quality(tmp, manifest, ckpt, min_agreement, log))
    return json.loads((out / "manifest.json").read_text())


def default_attention(precision: str) -> str:
    """kernel on x86-64 CPUs with AVX2 (every CPU kind; the operator needs AVX2, FMA and F16C) for the
    CPU's precisions, else exact: fp16 is for CUDA, which runs the exact attention's graphs."""
    return "kernel" if precision != "fp16" and cpu_kind() is not None else "exact"


def _check_options(precision: str, attention: str | None, draft_precision: str | None,
                   int8_block: int) -> tuple[str, str]:
    """(attention, draft precision), the defaults filled in; ExportError for what cannot be built."""
    if precision not in PRECISIONS:
        raise ExportError(f"unsupported precision {precision!r}; choose one of {', '.join(PRECISIONS)}")
    attention = attention or default_attention(precision)
    if attention not in ATTENTIONS:
        raise ExportError(f"unsupported attention {attention!r}; choose one of {', '.join(ATTENTIONS)}")
    if attention == "kernel":
        if precision == "fp16":
            raise ExportError("--attention kernel runs on the CPU, in fp32 beside its 16-bit caches: "
                              "fp16 (for CUDA) pairs with exact or fused attention")
        if why := kernels.missing():
            raise ExportError(f"--attention kernel: {why}")
    draft_precision = draft_precision or default_draft_precision(precision)
    if int8_block not in INT8_BLOCKS:
        raise ExportError(f"unsupported int8 block size {int8_block}; choose one of {', '.join(map(str, INT8_BLOCKS))}")
    if draft_precision not in DRAFT_PRECISIONS:
        raise ExportError(f"unsupported draft precision {draft_precision!r}; choose one of {', '.join(DRAFT_PRECISIONS)}")
    if (draft_precision == "fp16") != (precision == "fp16"):
        raise ExportError("the draft graph takes the base's hidden states: fp16 pairs only with fp16 "
                          f"(got base {precision}, draft {draft_precision})")
    return attention, draft_precision


def _gguf_blocks(ckpt: Checkpoint) -> dict:
    if ckpt.gguf_path is None:
        raise ExportError("--precision gguf keeps a GGUF's own quantized weights: the model must be a .gguf "
                          "file or an alias of one (use int8 or fp32 for other sources)")
    return read_blocks(ckpt.gguf_path, ckpt.cfg)


def _smoothed(cfg, state: Mapping, tokenizer, resident: bool) -> tuple[Mapping, dict]:
    """The weights with SmoothQuant folded in, and the manifest's record of how."""
    maxima, calibration = activation_maxima(cfg, state, tokenizer, resident)
    record = {"method": "SmoothQuant", "alpha": ALPHA, "layers": list(SMOOTHED), "calibration": calibration}
    return smooth(cfg, state, maxima), record


def _write_graphs(tmp: Path, store: WeightStore, ckpt: Checkpoint, state: Mapping, precision: str,
                  draft_precision: str, n_positions: int, attention: str, blocks: dict | None,
                  draft_vocab: DraftVocab | None, int8_block: int, log) -> dict:
    """base.onnx and draft.onnx, their weights appended to `store`; returns the manifest's graphs."""
    cfg = ckpt.cfg
    eagle3 = ckpt.head_cfg is not None and ckpt.head_cfg.eagle3
    fc = ckpt.head_state["fc.weight"].float().numpy() if eagle3 else None
    with tqdm(total=cfg.num_layers, desc="base graph", unit="layer", file=sys.stderr) as bar:
        base = build_base(cfg, state, precision, n_positions, store, bar, attention, blocks, fc, int8_block)
    (tmp / "base.onnx").write_bytes(base.SerializeToString())
    graphs = {"base": graph_spec(base, "base.onnx")}
    if ckpt.head_cfg is None:
        return graphs
    # the head also reads the base's embedding, and an EAGLE-1/2 head the base's lm_head: the very
    # tensors the base graph stored
    head = fp32_arrays(ckpt.head_state)
    sources = {k: (head, k) for k in head}
    if eagle3:
        sources["eagle3_lm_head.weight"] = sources.pop("lm_head.weight")
    else:
        sources[lm_head_name(cfg)] = (state, lm_head_name(cfg))
    sources["model.embed_tokens.weight"] = (state, "model.embed_tokens.weight")
    head_state = LazyTensors(sources, lambda k: sources[k][0][sources[k][1]])
    log("draft graph ...")
    if eagle3:
        draft = build_draft_eagle3(cfg, ckpt.head_cfg, head_state, draft_precision, n_positions, store, int8_block,
                                   attention)
    else:
        draft = build_draft(cfg, ckpt.head_cfg, head_state, draft_precision, n_positions, store,
                            None if draft_vocab is None else draft_vocab.ids, int8_block, attention)
    (tmp / "draft.onnx").write_bytes(draft.SerializeToString())
    graphs["draft"] = graph_spec(draft, "draft.onnx")
    return graphs
