"""A GGUF's quantized tensors kept as they are, for the `gguf` export precision.

The SmolLM2 GGUF stores its layers as Q4_1 and its embedding (= tied lm_head) as Q8_0. Dequantizing
them to fp32 keeps their values at 4-8x their bytes, and re-quantizing them (`int8`) rounds them
again. ONNX Runtime's MatMulNBits stores the same blocks of 32:
- Q8_0, w = d * q (q int8): 8-bit MatMulNBits, q + 128 with the implicit zero point 128, scale d.
- Q4_0, w = d * (q - 8) (q in 0..15): 4-bit MatMulNBits with its implicit zero point 8.
- Q4_1, w = d * q + m: the same 4-bit blocks, w = d * (q - 8) + (8 d + m), i.e. MatMulNBits plus a
  constant per block, which the graph adds as blocksum(x) @ offsets^T.
(MatMulNBits with float zero points would hold Q4_1 directly, but ONNX Runtime runs that case
through a far slower fallback; docs/code-notes.md.)
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

BLOCK = 32
SUPPORTED = ("Q4_0", "Q4_1", "Q8_0")
_LAYER_TENSORS = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
                  "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
                  "ffn_down": "mlp.down_proj"}


class GGUFBlocksError(ValueError):
    pass


@dataclass
class Blocks:
    """One weight [N, K] in MatMulNBits layout: w[n, k] = scales[n, b] * (q - zero) + offsets[n, b] for
    k in block b, zero = 2^(bits - 1)."""
    bits: int
    data: np.ndarray            # uint8 [N, K / block, block * bits / 8]; 4-bit: element 2i low nibble, 2i+1 high
    scales: np.ndarray          # float32 [N, K / block]
    offsets: np.ndarray | None  # float32 [N, K / block], or None
    block: int = BLOCK          # 32 for every GGUF type read here; the int8 precision may use 64

    @property
    def shape(self) -> tuple[int, int]:
        return self.data.shape[0], self.data.shape[1] * self.block

    def dequantize(self) -> np.ndarray:
        if self.bits == 8:
            q = self.data.astype(np.float32) - 128
        else:
            q = np.stack([self.data & 15, self.data >> 4], axis=-1).reshape(*self.data.shape[:2], self.block)
            q = q.astype(np.float32) - 8
        w = q * self.scales[..., None]
        if self.offsets is not None:
            w = w + self.offsets[..., None]
        return w.reshape(self.shape)

    def rows(self, index: np.ndarray) -> "Blocks":
        return Blocks(self.bits, self.data[index], self.scales[index],
                      None if self.offsets is None else self.offsets[index], self.block)

    @staticmethod
    def concat(parts: list["Blocks"]) -> "Blocks":
        if len({(p.bits, p.block) for p in parts}) != 1 or len({p.offsets is None for p in parts}) != 1:
            raise GGUFBlocksError("cannot fuse tensors stored in different GGUF quantizations")
        offsets = None if parts[0].offsets is None else np.concatenate([p.offsets for p in parts])
        return Blocks(parts[0].bits, np.concatenate([p.data for p in parts]),
                      np.concatenate([p.scales for p in parts]), offsets, parts[0].block)


def from_gguf_rows(raw: np.ndarray, qtype: str) -> Blocks:
    """A tensor's raw GGUF rows (uint8 [N, bytes per row]) as Blocks."""
    n = raw.shape[0]
    if qtype == "Q8_0":
        blocks = raw.reshape(n, -1, 34)
        scales = blocks[..., :2].copy().view(np.float16)[..., 0].astype(np.float32)
        q = blocks[..., 2:].copy().view(np.int8)
        return Blocks(8, (q.astype(np.int16) + 128).astype(np.uint8), scales, None)
    if qtype in ("Q4_0", "Q4_1"):
        size = 18 if qtype == "Q4_0" else 20
        blocks = raw.reshape(n, -1, size)
        halves = blocks[..., : size - 16].copy().view(np.float16).astype(np.float32)
        d = halves[..., 0]
        qs = blocks[..., size - 16:]
        # GGUF: element j < 16 in the low nibble of byte j, element j + 16 in its high nibble.
        q = np.concatenate([qs & 15, qs >> 4], axis=-1)
        packed = (q[..., 0::2] | (q[..., 1::2] << 4)).astype(np.uint8)
        offsets = None if qtype == "Q4_0" else (8 * d + halves[..., 1]).astype(np.float32)
        return Blocks(4, packed, d, offsets)
    raise GGUFBlocksError(f"GGUF quantization {qtype} is not supported by --precision gguf "
                          f"(supported: {', '.join(SUPPORTED)}, F32, F16); export with --precision int8 or fp32")


def llamacpp_row_order(n_rows: int, heads: int) -> np.ndarray:
    """llama.cpp's converter permutes q/k rows for its RoPE layout: GGUF row i holds HF row [i]."""
    return np.arange(n_rows).reshape(heads, 2, n_rows // heads // 2).swapaxes(1, 2).reshape(n_rows)


def read_blocks(path: Path, cfg) -> dict[str, Blocks]:
    """The quantized linear weights of a Llama-family GGUF, by Hugging Face name (F32/F16 tensors
    are left to the dequantized state dict)."""
    import gguf
    reader = gguf.GGUFReader(str(path))
    out = {}
    for t in reader.tensors:
        qtype = t.tensor_type.name
        if qtype in ("F32", "F16", "BF16"):
            continue
        parts = t.name.split(".")
        if parts[0] == "token_embd":
            name = "model.embed_tokens.weight"
        elif parts[0] == "output":
            name = "lm_head.weight"
        elif parts[0] == "blk" and parts[2] in _LAYER_TENSORS:
            name = f"model.layers.{parts[1]}.{_LAYER_TENSORS[parts[2]]}.weight"
        else:
            raise GGUFBlocksError(f"unexpected quantized tensor {t.name} in {path.name}")
        blocks = from_gguf_rows(np.asarray(t.data), qtype)
        if parts[-2] in ("attn_q", "attn_k"):
            heads = cfg.num_heads if parts[-2] == "attn_q" else cfg.num_kv_heads
            gguf_row = np.empty(blocks.shape[0], np.int64)
            gguf_row[llamacpp_row_order(blocks.shape[0], heads)] = np.arange(blocks.shape[0])
            blocks = blocks.rows(gguf_row)
        out[name] = blocks
    return out
