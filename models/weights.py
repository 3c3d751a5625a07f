"""Reading checkpoints safely: Hugging Face directories, GGUF files and EAGLE heads.

Weights are read with safetensors or `torch.load(weights_only=True)`; nothing unpickles code.
"""
from __future__ import annotations

import json
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .config import ModelConfig, UnsupportedModelError
from .tensors import TensorFiles, tensor_shape


class WeightsError(ValueError):
    """Missing, corrupt or mismatched weight files."""


@dataclass
class Checkpoint:
    """A base model as loaded: config, HF-named state dict, and a tokenizer directory or object."""
    cfg: ModelConfig
    state: Mapping  # name -> torch.Tensor; read lazily from disk for checkpoint directories
    tokenizer: object  # a transformers tokenizer, saved into the artifact as it is
    source: str
    head_cfg: ModelConfig | None = None
    head_state: dict[str, torch.Tensor] = field(default_factory=dict)
    head_source: str | None = None
    head_dir: Path | None = None  # the head's directory, for files shipped beside its weights
    gguf_path: Path | None = None  # the GGUF the base was dequantized from (for --precision gguf)


def _read_json(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except FileNotFoundError:
        raise WeightsError(f"missing {path.name} in {path.parent}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise WeightsError(f"{path} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise WeightsError(f"{path} must hold a JSON object, not a {type(value).__name__}")
    return value


_SAFETENSORS_SIZES = {"F64": 8, "F32": 4, "F16": 2, "BF16": 2, "I64": 8, "I32": 4, "I16": 2, "I8": 1, "U8": 1,
                      "BOOL": 1, "F8_E4M3": 1, "F8_E5M2": 1}


def _file_entries(path: Path) -> dict[str, tuple[Path, tuple, int]]:
    """name -> (path, shape, bytes per element) from a weight file's header, reading no tensor."""
    try:
        if path.suffix == ".safetensors":
            from safetensors import safe_open
            with safe_open(str(path), framework="pt") as f:
                out = {}
                for name in f.keys():
                    s = f.get_slice(name)
                    out[name] = (path, tuple(s.get_shape()), _SAFETENSORS_SIZES.get(s.get_dtype(), 4))
                return out
        state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        return {k: (path, tuple(v.shape), v.element_size()) for k, v in state.items()}
    except Exception as e:  # safetensors and torch raise many types for truncated/garbled files
        raise WeightsError(f"cannot read weights from {path}: {type(e).__name__}: {e}") from None


def read_state_dict(directory: Path) -> TensorFiles:
    """All tensors of a checkpoint directory, read lazily: safetensors first, then .bin, single or
    sharded. Only the files' headers are read here."""
    for index_name, single in (("model.safetensors.index.json", "model.safetensors"),
                               ("pytorch_model.bin.index.json", "pytorch_model.bin")):
        index = directory / index_name
        if index.exists():
            weight_map = _read_json(index).get("weight_map")
            if not isinstance(weight_map, dict):
                raise WeightsError(f"{index} has no weight_map")
            entries = {}
            for shard in sorted(set(weight_map.values())):
                if not (directory / shard).exists():
                    raise WeightsError(f"missing weight shard {shard} listed in {index}")
                entries.update(_file_entries(directory / shard))
            return TensorFiles(entries, WeightsError)
        if (directory / single).exists():
            return TensorFiles(_file_entries(directory / single), WeightsError)
    raise WeightsError(f"no weights in {directory} (expected model.safetensors or pytorch_model.bin)")


def _check_shapes(state: dict, expected: dict[str, tuple], what: str) -> None:
    for name, shape in expected.items():
        if name not in state:
            raise WeightsError(f"{what}: missing tensor {name!r}")
        if tensor_shape(state, name) != shape:
            raise WeightsError(f"{what}: tensor {name!r} has shape {tensor_shape(state, name)}, expected {shape}")


def _layer_shapes(cfg: ModelConfig, prefix: str, input_norm: bool, attn_in: int | None = None) -> dict[str, tuple]:
    h, d = cfg.hidden_size, cfg.head_dim
    i = attn_in or h
    s = {
        f"{prefix}self_attn.q_proj.weight": (cfg.num_heads * d, i),
        f"{prefix}self_attn.k_proj.weight": (cfg.kv_dim, i),
        f"{prefix}self_attn.v_proj.weight": (cfg.kv_dim, i),
        f"{prefix}self_attn.o_proj.weight": (h, cfg.num_heads * d),
        f"{prefix}mlp.gate_proj.weight": (cfg.intermediate_size, h),
        f"{prefix}mlp.up_proj.weight": (cfg.intermediate_size, h),
        f"{prefix}mlp.down_proj.weight": (h, cfg.intermediate_size),
        f"{prefix}post_attention_layernorm.weight": (h,),
    }
    if input_norm:
        s[f"{prefix}input_layernorm.weight"] = (h,)
    if cfg.qkv_bias:
        s.update({f"{prefix}self_attn.q_proj.bias": (cfg.num_heads * d,),
                  f"{prefix}self_attn.k_proj.bias": (cfg.kv_dim,),
                  f"{prefix}self_attn.v_proj.bias": (cfg.kv_dim,)})
    return s


def base_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    s = {"model.embed_tokens.weight": (cfg.vocab_size, cfg.hidden_size),
         "model.norm.weight": (cfg.hidden_size,)}
    for i in range(cfg.num_layers):
        s.update(_layer_shapes(cfg, f"model.layers.{i}.", input_norm=True))
    if not cfg.tie_word_embeddings:
        s["lm_head.weight"] = (cfg.vocab_size, cfg.hidden_size)
    return s


def eagle3_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    h = cfg.hidden_size
    s = {"fc.weight": (h, 3 * h), "norm.weight": (h,), "lm_head.weight": (cfg.draft_vocab_size, h),
         "midlayer.input_layernorm.weight": (h,), "midlayer.hidden_norm.weight": (h,),
         "d2t": (cfg.draft_vocab_size,)}
    s.update(_layer_shapes(cfg, "midlayer.", input_norm=False, attn_in=2 * h))
    return s


def head_tensor_shapes(cfg: ModelConfig) -> dict[str, tuple]:
    if cfg.eagle3:
        return eagle3_tensor_shapes(cfg)
    s = {"fc.weight": (cfg.hidden_size, 2 * cfg.hidden_size)}
    if cfg.fc_bias:
        s["fc.bias"] = (cfg.hidden_size,)
    s.update(_layer_shapes(cfg, "layers.0.", input_norm=False))
    return s


def check_base(cfg: ModelConfig, state: dict, what: str) -> None:
    _check_shapes(state, base_tensor_shapes(cfg), what)


def load_hf_directory(directory: Path) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    cfg = ModelConfig.from_hf(_read_json(directory / "config.json"))
    state = read_state_dict(directory)
    check_base(cfg, state, f"model in {directory}")
    return cfg, state


def load_gguf(path: Path):
    """A GGUF file's config and tokenizer (through transformers, from its metadata) and its tensors,
    dequantized one at a time on access (models/gguf_tensors.py); needs the `gguf` package."""
    from transformers import AutoConfig, AutoTokenizer
    from .gguf_tensors import GGUFTensors
    if not path.is_file():
        raise WeightsError(f"GGUF file not found: {path}")
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise WeightsError(f"{path} is not a GGUF file (bad magic)")
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
        hf = AutoConfig.from_pretrained(str(path.parent), gguf_file=path.name).to_dict()
        cfg = ModelConfig.from_hf(hf)
        state = GGUFTensors(path, cfg.num_heads, cfg.num_kv_heads, WeightsError)
    except ImportError as e:
        raise WeightsError(f"loading GGUF needs extra packages: {e}") from None
    except (UnsupportedModelError, WeightsError):
        raise
    except Exception as e:
        raise WeightsError(f"cannot load GGUF {path}: {type(e).__name__}: {e}") from None
    check_base(cfg, state, f"GGUF {path.name}")
    return cfg, state, tokenizer


def load_head(directory: Path, base: ModelConfig) -> tuple[ModelConfig, dict[str, torch.Tensor]]:
    """An official EAGLE-1/2 or EAGLE-3 head directory, checked against the base it will draft for.

    EAGLE-3 heads (config with draft_vocab_size, or architectures naming Eagle3) hold fc over three
    base hidden states, `midlayer.*`, their own `norm` and `lm_head` over the draft vocabulary, and
    `d2t` (base id = draft id + d2t[draft id]; absent when the draft vocabulary is the base's)."""
    if not directory.is_dir():
        raise WeightsError(f"head directory not found: {directory}")
    raw = _read_json(directory / "config.json")
    raw.setdefault("model_type", "llama")
    archs = " ".join(raw.get("architectures") or [])
    if "eagle3" in archs.lower() and not raw.get("draft_vocab_size"):
        raw["draft_vocab_size"] = raw.get("vocab_size")
    if raw.get("num_hidden_layers", 1) != 1:
        raise WeightsError(f"head in {directory} has {raw['num_hidden_layers']} layers; EAGLE heads have 1")
    cfg = ModelConfig.from_hf(raw, is_head=True)
    # An EAGLE-3 head's attention is its own; it reads the base's hidden states and vocabulary only.
    dims = ("hidden_size", "vocab_size") if cfg.eagle3 else ("hidden_size", "vocab_size", "num_heads",
                                                              "num_kv_heads", "head_dim")
    target = raw.get("target_hidden_size")
    if cfg.eagle3 and target not in (None, base.hidden_size):
        raise WeightsError(f"head {directory} does not fit the base model: target_hidden_size is {target} in the "
                           f"head but hidden_size is {base.hidden_size} in the base")
    for name in dims:
        hv, bv = getattr(cfg, name), getattr(base, name)
        if hv != bv:
            raise WeightsError(f"head {directory} does not fit the base model: {name} is {hv} in the head "
                               f"but {bv} in the base")
    state = read_state_dict(directory)
    # The reference loader accepts heads saved with a "model." prefix or with the embedding.
    state = {k.removeprefix("model."): v for k, v in state.items()}
    state.pop("embed_tokens.weight", None)
    if cfg.eagle3:
        if cfg.draft_vocab_size > cfg.vocab_size:
            raise WeightsError(f"head {directory}: draft_vocab_size {cfg.draft_vocab_size} exceeds vocab_size "
                               f"{cfg.vocab_size}")
        if "d2t" not in state and cfg.draft_vocab_size == cfg.vocab_size:
            state["d2t"] = torch.zeros(cfg.vocab_size, dtype=torch.long)
        state.pop("t2d", None)  # derived from d2t
    _check_shapes(state, head_tensor_shapes(cfg), f"head in {directory}")
    if cfg.eagle3:
        ids = torch.arange(cfg.draft_vocab_size) + state["d2t"].long()
        if bool((ids[1:] <= ids[:-1]).any()) or int(ids[0]) < 0 or int(ids[-1]) >= cfg.vocab_size:
            raise WeightsError(f"head {directory}: d2t does not map the draft vocabulary onto distinct ascending "
                               f"base ids below {cfg.vocab_size}")
        state["d2t"] = state["d2t"].long()
    return cfg, state


def is_gguf(path: str) -> bool:
    return path.endswith(".gguf") and os.path.exists(path)
