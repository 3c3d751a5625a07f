"""Architecture description shared by the PyTorch definitions and the graph builders.

One dataclass covers every supported base (Llama 2/3, Vicuna, SmolLM2, Mistral without sliding
window, Qwen2) and the EAGLE-1/2 head, whose config.json is itself a one-layer Llama config.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass


class UnsupportedModelError(ValueError):
    """The checkpoint is of an architecture or variant this project does not export."""


_SUPPORTED = {"llama", "mistral", "qwen2"}


@dataclass(frozen=True)
class ModelConfig:
    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict | None = None
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    fc_bias: bool = True  # EAGLE head only: bias of fc over [embedding, feature]
    draft_vocab_size: int = 0  # EAGLE-3 head only: the size of its own vocabulary (d2t maps it to the base's)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()

    @property
    def kv_dim(self) -> int:
        return self.num_kv_heads * self.head_dim

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> "ModelConfig":
        d = dict(d)
        d["eos_token_ids"] = tuple(d.get("eos_token_ids") or ())
        return cls(**d)

    @classmethod
    def from_hf(cls, hf: dict, *, is_head: bool = False) -> "ModelConfig":
        """Read a Hugging Face (transformers 4.x or 5.x) or EAGLE head config.json dict."""
        model_type = hf.get("model_type", "llama" if is_head else None)
        if model_type not in _SUPPORTED:
            archs = hf.get("architectures") or [model_type]
            raise UnsupportedModelError(
                f"unsupported architecture {archs[0]!r} (model_type={model_type!r}); "
                f"supported: Llama family (llama, mistral) and qwen2")
        if model_type == "mistral" and hf.get("sliding_window") not in (None, 0):
            raise UnsupportedModelError(
                f"Mistral with sliding_window={hf['sliding_window']} is not supported "
                "(tree attention over a sliding window cache is not implemented)")
        if model_type == "qwen2" and hf.get("use_sliding_window"):
            raise UnsupportedModelError("Qwen2 with use_sliding_window=true is not supported")
        # transformers 5 moved rope_theta/rope_scaling into rope_parameters.
        rope = dict(hf.get("rope_parameters") or {})
        theta = rope.pop("rope_theta", None) or hf.get("rope_theta", 10000.0)
        scaling = hf.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
        if scaling is not None:
            scaling = dict(scaling)
            kind = scaling.get("rope_type", scaling.get("type", "default"))
            if kind not in ("default", "linear", "llama3"):
                raise UnsupportedModelError(f"unsupported rope scaling {kind!r} (supported: linear, llama3)")
            scaling = None if kind == "default" else {**scaling, "rope_type": kind}
        missing = [k for k in ("vocab_size", "hidden_size", "intermediate_size", "num_attention_heads") if k not in hf]
        if missing:
            raise UnsupportedModelError(f"config.json lacks {', '.join(missing)}")
        heads = hf["num_attention_heads"]
        eos = hf.get("eos_token_id")
        attention_bias = bool(hf.get("attention_bias", False))
        return cls(
            model_type=model_type,
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf.get("num_hidden_layers", 1),
            num_heads=heads,
            num_kv_heads=hf.get("num_key_value_heads") or heads,
            head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope_theta=float(theta),
            rope_scaling=scaling,
            max_position_embeddings=hf.get("max_position_embeddings", 4096),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            qkv_bias=model_type == "qwen2" or attention_bias or bool(hf.get("qkv_bias", False)),
            o_bias=attention_bias,
            fc_bias=bool(hf.get("bias", True)),
            draft_vocab_size=int(hf.get("draft_vocab_size") or 0),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=tuple(eos if isinstance(eos, list) else ([] if eos is None else [eos])),
        )

    def to_hf(self) -> dict:
        """A config.json that transformers (4.x and 5.x) and the reference EAGLE code read."""
        arch = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM"}
        d = {
            "architectures": [arch[self.model_type]],
            "model_type": self.model_type,
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "rope_scaling": self.rope_scaling,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "hidden_act": "silu",
            "bos_token_id": self.bos_token_id,
            "eos_token_id": list(self.eos_token_ids) if len(self.eos_token_ids) != 1 else self.eos_token_ids[0],
        }
        if self.model_type == "llama":
            d["attention_bias"] = self.o_bias
        if self.draft_vocab_size:
            d["draft_vocab_size"] = self.draft_vocab_size
        return d

    @property
    def eagle3(self) -> bool:
        """An EAGLE-3 head's config (it has its own draft vocabulary)."""
        return self.draft_vocab_size > 0
