"""A GGUF file's tensors under their Hugging Face names, dequantized to fp32 one at a time.

The header is parsed once; each access reads that tensor's bytes alone and dequantizes them with
the `gguf` package, as transformers does, with llama.cpp's q/k row permutation undone for Llama
GGUFs. So a GGUF export holds one tensor in fp32 at a time, not a whole fp32 model.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from .gguf_blocks import llamacpp_row_order
from .tensors import TensorFiles

_GLOBAL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_LAYER = {"attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm", "attn_q": "self_attn.q_proj",
          "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj", "attn_output": "self_attn.o_proj",
          "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj"}


def hf_name(gguf_name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None for tensors a
    Llama-family model does not use (e.g. rope_freqs)."""
    parts = gguf_name.split(".")
    if parts[0] in _GLOBAL and len(parts) == 2:
        return f"{_GLOBAL[parts[0]]}.{parts[1]}"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER:
        return f"model.layers.{parts[1]}.{_LAYER[parts[2]]}.{parts[3]}"
    return None


class GGUFTensors(TensorFiles):
    """name -> fp32 torch.Tensor, read from the GGUF at `path` on every access."""

    def __init__(self, path: Path, num_heads: int, num_kv_heads: int, read_error: type[Exception]):
        import gguf
        reader = gguf.GGUFReader(str(path))
        arch = reader.fields["general.architecture"].contents() if "general.architecture" in reader.fields else ""
        self._path, self._permute = path, arch == "llama"  # llama.cpp permutes q/k rows for Llama only
        self._heads = {"attn_q": num_heads, "attn_k": num_kv_heads}
        self._raw: dict[str, tuple[int, int, object, tuple, str]] = {}
        entries = {}
        for t in reader.tensors:
            name = hf_name(t.name)
            if name is None:
                continue
            shape = tuple(int(d) for d in reversed(t.shape.tolist()))
            self._raw[name] = (int(t.data_offset), int(t.n_bytes), t.tensor_type, shape, t.name)
            entries[name] = (path, shape, 4)
        super().__init__(entries, read_error)

    def __getitem__(self, name: str) -> torch.Tensor:
        import gguf
        offset, nbytes, qtype, shape, gguf_name = self._raw[name]
        try:
            raw = np.fromfile(self._path, dtype=np.uint8, count=nbytes, offset=offset)
            if qtype in (gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16):
                w = raw.view(np.float32 if qtype == gguf.GGMLQuantizationType.F32 else np.float16)
            else:
                w = gguf.dequantize(raw.reshape(shape[0] if len(shape) > 1 else 1, -1), qtype)
            w = np.asarray(w, np.float32).reshape(shape)
        except Exception as e:
            raise self._error(f"cannot read tensor {gguf_name} from {self._path}: {type(e).__name__}: {e}") from None
        kind = gguf_name.split(".")[2] if gguf_name.startswith("blk.") else ""
        if self._permute and kind in self._heads:
            gguf_row = np.empty(shape[0], np.int64)  # the GGUF row holding each HF row
            gguf_row[llamacpp_row_order(shape[0], self._heads[kind])] = np.arange(shape[0])
            w = w[gguf_row]
        return torch.from_numpy(np.ascontiguousarray(w))
