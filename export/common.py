"""What every export target shares: tree defaults, stop tokens, the tokenizer, versions, the draft
vocabulary choice, the error type, and the parity check and manifest that end every export."""
from __future__ import annotations

import platform
import time
from collections.abc import Callable
from pathlib import Path

from artifact.manifest import write_manifest
from models.cpu import cpu_kind, cpu_name, kv_bytes_per_position, onnx_cpu_path, physical_memory
from models.draft_vocab import DraftVocab, draft_vocab
from models.weights import Checkpoint


# Tree sizes by precision, used until `python -m runtime tune` records one for the machine: on a
# 2-core CPU every draft call and every extra verified token costs a sizeable share of a decode
# step, so CPU precisions default to a small tree, tune's choice on the CPUs measured; not 2/0/2, which
# rests on a two-row step costing what a one-row one does, as a compute-bound CPU does not give
# (docs/code-notes.md). fp16 targets CUDA, where EAGLE-2's own default is right.
CPU_TREE = {"total_tokens": 3, "depth": 1, "top_k": 2}
# w8a8's integer GEMMs make verified rows cheap on AMX, so its tree is a little wider (docs/code-notes.md).
W8A8_TREE = {"total_tokens": 4, "depth": 1, "top_k": 2}
DEFAULT_TREE = {"fp32": CPU_TREE, "int8": CPU_TREE, "w8a8": W8A8_TREE, "w8a16": CPU_TREE, "gguf": CPU_TREE,
                "fp16": {"total_tokens": 60, "depth": 5, "top_k": 10}}
# Extra rotary positions beyond max_length: draft-tree nodes sit up to `depth` past the context.
TREE_POSITION_MARGIN = 64
# The default max_length is the model's own context, capped where one sequence's fp32 K/V at that
# length would take more than this share of the machine's memory.
KV_MEMORY_SHARE = 4
GIB = 2**30
END_OF_TURN = ("<|im_end|>", "<|eot_id|>", "<|end_of_turn|>", "<end_of_turn>", "<|end|>", "<|endoftext|>", "</s>")


class ExportError(ValueError):
    pass


def default_max_length(cfg, log, value_bytes: int = 4) -> int:
    """The model's context (max_position_embeddings), capped by this machine's memory (said), for
    caches of `value_bytes` a value."""
    per_position, memory = kv_bytes_per_position(cfg, value_bytes), physical_memory()
    cap = max(64, memory // KV_MEMORY_SHARE // per_position // 64 * 64)
    context = cfg.max_position_embeddings
    if context <= cap:
        return context
    log(f"max_length {cap}: the model's context is {context} positions, and one sequence's K/V at that length "
        f"takes {context * per_position / GIB:.1f} GiB in fp{8 * value_bytes}, more than 1/{KV_MEMORY_SHARE} of this machine's "
        f"{memory / GIB:.0f} GiB (--max-length N chooses another)")
    return cap


def stop_token_ids(ckpt: Checkpoint) -> list[int]:
    tok = ckpt.tokenizer
    ids = set(ckpt.cfg.eos_token_ids)
    if tok.eos_token_id is not None:
        ids.add(tok.eos_token_id)
    vocab = tok.get_vocab()
    ids.update(vocab[t] for t in END_OF_TURN if t in vocab)
    return sorted(i for i in ids if i < ckpt.cfg.vocab_size)


def save_tokenizer(ckpt: Checkpoint, directory: Path) -> None:
    ckpt.tokenizer.save_pretrained(str(directory))
    template = getattr(ckpt.tokenizer, "chat_template", None)
    if template and not (directory / "chat_template.jinja").exists():
        (directory / "chat_template.jinja").write_text(template)


def versions(**extra: str) -> dict:
    import onnx
    import onnxruntime
    import torch
    import transformers
    from importlib.metadata import version
    return {"exporter": version("eagle2-deploy") if _installed() else "source", "onnx": onnx.__version__,
            "onnxruntime": onnxruntime.__version__, "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(), **extra}


def _installed() -> bool:
    from importlib.metadata import PackageNotFoundError, version
    try:
        version("eagle2-deploy")
        return True
    except PackageNotFoundError:
        return False


def default_draft_precision(precision: str) -> str:
    """The draft only proposes tokens (verification keeps the output exact), so it can be cheaper
    than the base: every draft call reads the whole vocabulary projection, and on a CPU 8-bit
    weights make that several times faster (docs/code-notes.md). fp16 artifacts (for CUDA) keep fp16;
    w8a16 ones keep w8a16, whose rows are cheap where it is chosen (the draft's steps have many)."""
    return precision if precision in ("fp16", "w8a16") else "int8"


# Draft vocabulary size by default: measured on SmolLM2 (docs/design.md, "Reduced draft vocabulary").
DEFAULT_DRAFT_VOCAB = 8192


def default_precision(kind: str | None = None) -> str:
    """The CLI's default: the fastest lossless path for a CPU kind (models.cpu.CPU_KINDS; this CPU's
    by default; models.cpu.ONNX_CPU_PATHS): w8a8 where it has AMX int8 tiles, w8a16 on the other
    x86-64 kinds, int8 elsewhere.

    On AMX, w8a8's integer GEMMs make verified rows cheap and its EAGLE-2 decoding measured fastest
    (docs/code-notes.md). Without VNNI, w8a8 cannot run exactly at all and int8's 8-bit kernel pays
    for each verified row almost a step; with VNNI but no AMX, int8's verified rows still cost more
    than w8a16's and its 8-bit activations answer worse: w8a16's 16-bit integer products are the
    path (docs/design.md, "Precisions")."""
    return onnx_cpu_path(kind or cpu_kind())


def cpu_entry(kind: str | None, precision_from: str) -> dict:
    """The manifest's record of the CPU kind the artifact was exported for (runtime/cpu_fit.py checks it
    at load): the kind, its path, the CPU exporting, and what chose the precision (the kind's path,
    --precision, or the quality gate's fallback)."""
    return {"kind": kind, "path": onnx_cpu_path(kind), "exported_on": cpu_name(), "precision_from": precision_from}


def choose_draft_vocab(ckpt: Checkpoint, size: int | None) -> DraftVocab | None:
    """The reduced draft vocabulary of `size` tokens, or None (the whole vocabulary) when there is
    no head, size is 0, or the vocabulary is not larger than `size`. An EAGLE-3 head brings its own
    draft vocabulary (its d2t map)."""
    if ckpt.head_cfg is None or ckpt.head_cfg.eagle3 or not size or size >= ckpt.cfg.vocab_size:
        return None
    return draft_vocab(ckpt.tokenizer, ckpt.cfg.vocab_size, ckpt.head_dir, size, stop_token_ids(ckpt))


def head_entry(ckpt: Checkpoint) -> dict | None:
    if ckpt.head_cfg is None:
        return None
    return {"source": ckpt.head_source, "kind": "eagle3" if ckpt.head_cfg.eagle3 else "eagle",
            "config": ckpt.head_cfg.to_dict()}


def draft_vocab_entry(ckpt: Checkpoint, vocab: DraftVocab | None) -> dict | None:
    if ckpt.head_cfg is not None and ckpt.head_cfg.eagle3:
        return {"size": ckpt.head_cfg.draft_vocab_size, "counted_on": "the EAGLE-3 head's own d2t map"}
    return None if ckpt.head_cfg is None or vocab is None else vocab.describe()


def finish_manifest(tmp: Path, manifest: dict, ckpt: Checkpoint, draft_vocab: DraftVocab | None, verify: bool,
                    start: float, log, gate: Callable[[], dict]) -> None:
    """The end every exporter shares: the parity check against the PyTorch definitions, then the
    quality gate (export.quality: `gate` measures it), both recorded in the manifest, the export
    time, then the manifest with its checksums."""
    if verify:
        from .verify import TOLERANCE, check_parity
        diffs = check_parity(tmp, manifest, ckpt.cfg, ckpt.state, ckpt.head_cfg, ckpt.head_state,
                             draft_vocab=None if draft_vocab is None else draft_vocab.ids)
        manifest["parity"] = diffs
        log("parity vs PyTorch definition (max abs diff / max abs value): " +
            ", ".join(f"{k} {v:.2e}" for k, v in diffs.items()))
        rounding = diffs.get("rounding alone: base.logits", 0.0)
        if rounding > TOLERANCE[manifest["precision"]]:
            log(f"note: rounding the activations to 8 bits alone changes this model's logits by {rounding:.3f} of "
                "their largest (w8a8's parity bound follows it); compare its replies with --precision int8's")
        manifest["quality"] = gate()
    manifest["export_seconds"] = round(time.time() - start, 1)
    write_manifest(tmp, manifest)
