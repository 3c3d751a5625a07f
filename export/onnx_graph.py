"""ONNX graphs for the base model and the EAGLE draft head, built op by op from a state dict.

Why hand-built rather than traced: the hot path wants ONNX Runtime's fused contrib ops
(GroupQueryAttention with fused RoPE and a KV buffer shared between past and present,
SkipSimplifiedLayerNormalization, MatMulNBits), which no tracer emits, and EAGLE needs inputs the
stock builders lack (explicit position ids, an additive tree bias) and the post-norm hidden states.

KV cache design: one buffer per layer and per K/V, bound as both past_* input and present_*
output and written in place; nothing outside the graph copies the cache on a step. With fused
attention it is [1, kv_heads, max_length, head_dim] and the T new tokens go to [total - T, total),
total being the attention bias width (cached tokens + T). With exact attention it holds several
sequences, [sequences, kv_heads, max_length, width], and each new row goes to its own sequence and
position (declare_step_inputs), so that one step may carry the rows of many sequences.

Three attention implementations:
- "fused": GroupQueryAttention (fused RoPE, in-place cache). Fastest, but its arithmetic for a row
  depends on where the row's keys sit: a one-token step takes another path than a multi-token one,
  and a tree node whose ancestors are not contiguous sums its softmax in another order than the
  same token decoded alone. Used by fp16 (CUDA) artifacts and where asked for (OpenVINO).
- "exact": attention from plain ops whose result for a row is bitwise independent of the step
  size and of masked keys between the row's own keys, so verifying a tree computes every node
  exactly as plain decoding computes it (measured on ONNX Runtime's CPU kernels; tests check it).
  The softmax denominator comes out of the same matmul as the numerator (V carries a column of
  ones), because matmuls accumulate each output over the keys in order, and a masked key adds an
  exact zero; a vectorised softmax sum would not. The one exception is the matmul's key blocking
  (EXACT_KEY_BLOCK): keys in different blocks are summed in separate partial sums, so a verify
  step must not straddle a block boundary (the runtime clips its trees there). MLAS sizes that
  block from the width of the product each thread computes, so the value rows are cut into chunks
  of at most VALUE_CHUNK columns, one matmul each: a chunk is never split between threads, and
  the block is the same for every step size, context and thread count.
- "kernel": the exact attention's contract in one custom operator per layer, CacheAttention
  (runtime/kernels/cache_attention.cc, built by ci/build_kernels.sh): a row reads only the keys its
  bias allows (from caches stored in 16 bits beside quantized weights), and its sums do not depend
  on where those keys sit, so it has no key blocks to respect and reads less the fuller a step's
  capacity is. The default for the CPU's precisions on x86-64 (export/onnx_export.py).
"""
from __future__ import annotations

import functools
import hashlib
from collections import ChainMap
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
import torch
from onnx import TensorProto, helper

from models.config import ModelConfig
from models.gguf_blocks import Blocks
from models.llama import eagle3_layers
from models.rope import cos_sin_tables

from .onnx_writer import Graph
from .quantize import panels_8bit, quantize_8bit, quantize_channels_8bit

PRECISIONS = ("fp32", "fp16", "int8", "w8a8", "w8a16", "gguf")
ATTENTIONS = ("exact", "kernel", "fused")
# The custom operators of "kernel" attention (runtime/kernels/cache_attention.cc), by cache dtype.
KERNEL_DOMAIN = "eagle2"
KERNEL_OPS = {TensorProto.FLOAT: "CacheAttention", TensorProto.FLOAT16: "CacheAttentionF16"}
# Beside quantized weights its caches are stored in fp16, as llama.cpp stores them: at long context a
# step is the reading of the caches, and 16 bits halve it. Rounded once, when written, so every step
# reads the same bits. An fp32 export keeps fp32 caches: it is the reference precision.
FP16_CACHE_PRECISIONS = ("int8", "w8a8", "w8a16", "gguf")
# Attentions whose caches hold several sequences, a step's rows placed by sequence and slot.
SLOTTED_ATTENTIONS = ("exact", "kernel")
# MLAS's fp32 GEMM accumulates the inner dimension in blocks (MlasSgemmOperation's StrideK): 128
# keys for products wider than 64 columns, up to 1,024 for those of at most 16. It splits a product
# wider than 16 columns between threads by columns when it has few rows, each thread then blocking
# by its own width: with 65 columns, one block size for a one-token step and another for a tree
# once 4+ threads work on it (measured; docs/code-notes.md). Chunks of at most VALUE_CHUNK value
# columns are never split, so a row's P @ V sums keys [0, 1024), [1024, 2048), ... separately,
# always. tests/test_runtime_bitwise.py fails if a tree straddling such a boundary stops differing
# from plain decoding or one inside a block starts to, so a change in ONNX Runtime shows up there.
VALUE_CHUNK = 16
EXACT_KEY_BLOCK = 1024
# Lowest exponent the exact attention's softmax evaluates (weights below e^-80 relative to the row's
# largest are dropped to e^-80); see _exact_attention.
EXP_FLOOR = -80.0
# Weight block sizes of int8 and w8a16. 32 rounds less than 64 and passes the quality gate (docs/design.md,
# "Precisions"); 64 stays for speed where a model keeps its answers at 64 (docs/code-notes.md).
INT8_BLOCK = 32
INT8_BLOCKS = (32, 64)
BLOCK_PRECISIONS = ("int8", "w8a16")  # the precisions whose weights are int8 in those blocks
# Level 4 = int8 activations x int8 weights (VNNI), much faster than level 0's fp32 compute
# (docs/code-notes.md). Each row's activations are quantized on their own, so int8 bases verify
# exactly (tests/test_runtime_bitwise.py; the 4-bit products of --precision gguf do not on AVX2).
INT8_ACCURACY_LEVEL = 4
# w8a8: activation rows are quantized to 8 bits around this zero point (uint8, the operand MLAS's
# integer GEMMs take; weights are int8, symmetric).
W8A8_ZERO_POINT = 128


@dataclass(frozen=True)
class Precision:
    name: str

    @property
    def io_dtype(self):
        return np.float16 if self.name == "fp16" else np.float32

    @property
    def onnx_io(self) -> int:
        return helper.np_dtype_to_tensor_dtype(np.dtype(self.io_dtype))


class Builder:
    """Emits the layers shared by the base and draft graphs for one precision.

    `blocks` (precision gguf): the source GGUF's quantized weights by name (models/gguf_blocks.py);
    linear layers found there keep their blocks, others stay fp32."""

    def __init__(self, g: Graph, precision: str, state: Mapping[str, np.ndarray], blocks: dict | None = None,
                 int8_block: int = INT8_BLOCK):
        self.g, self.p, self.state, self.blocks = g, Precision(precision), state, blocks or {}
        self.int8_block = int8_block
        self._row_zero_points: dict[str, str] = {}

    def param(self, name: str) -> str:
        return self.g.weight(name, self.state[name].astype(self.p.io_dtype))

    def linear(self, x: str, name: str, weight: np.ndarray, bias: np.ndarray | None = None,
               blocks: Blocks | None = None, rows: str = "step") -> str:
        """x [T, K] @ weight[N, K]^T (+ bias). Weights stay in torch layout: Gemm transB=1, no copy.
        `rows` names x's row count (the step's tokens, or the rows the lm_head reads): values made per
        row are made once per count."""
        g = self.g
        blocks = blocks or self.blocks.get(f"{name}.weight")
        if blocks is None and self.p.name == "w8a8":
            return self._w8a8_linear(x, name, weight, bias, rows)
        if blocks is None and self.p.name == "w8a16":
            return self._w8a16_linear(x, name, weight, bias)
        if blocks is None and self.p.name == "int8":
            blocks = Blocks(8, *quantize_8bit(weight, self.int8_block), None, self.int8_block)
        if blocks is not None:
            return self._block_linear(x, name, weight.shape[1], blocks, bias)
        ins = [x, g.weight(f"{name}.weight", weight.astype(self.p.io_dtype))]
        if bias is not None:
            ins.append(g.weight(f"{name}.bias", bias.astype(self.p.io_dtype)))
        return g.op("Gemm", ins, transB=1)

    def _w8a8_linear(self, x: str, name: str, weight: np.ndarray, bias: np.ndarray | None, rows: str) -> str:
        """Each row of x quantized to 8 bits over its own range, times int8 weights with a scale per
        output channel, as an integer GEMM (MLAS: AMX tiles or VNNI).

        Why: an integer product is exact whatever the kernel's blocking or the number of rows, and
        everything around it is elementwise within a row, so a row's result cannot depend on the
        step's other rows: verification is exact by construction. And the integer GEMM's cost barely
        grows with rows on AMX, unlike MatMulNBits' 8-bit kernel's (docs/code-notes.md), so wider
        trees are cheap to verify.

        A row x is centred on the middle of its range, m = (max + min) / 2, so that its 255 levels
        span [min, max] (as an asymmetric quantizer would; MatMulIntegerToFloat takes no zero point
        per row): x W^T = s (q W^T) + m colsum(W) with q = round((x - m) / s) in [-127, 127]. This
        agrees with fp32 more closely than a scale of max |x| / 127 does, and than levels anchored at
        the minimum (q in [0, 254], three ops fewer), whose larger integer sums lose bits as floats
        (docs/code-notes.md). SmoothQuant (export/smoothing.py) narrows the rows beforehand.

        Each op here costs a few microseconds whatever its size, over 121 linears a step, so the
        form is the one with the fewest: QuantizeLinear with one block per row (opset 21) rounds,
        offsets and casts in one op, and MatMulIntegerToFloat scales each output row by an a_scale
        of shape [T, 1] itself. 11 ops against 16 for Round/Div/Add/Cast and a separate scaling,
        measurably faster (docs/code-notes.md)."""
        g = self.g
        q, scales = quantize_channels_8bit(weight)
        f32 = np.float32
        hi = g.op("ReduceMax", [x, g.const([-1])], keepdims=1)
        lo = g.op("ReduceMin", [x, g.const([-1])], keepdims=1)
        mid = g.op("Mean", [hi, lo])
        # a constant row keeps scale 1e-30 (it quantizes to zeros around its mid) rather than dividing by zero
        row_scale = g.op("Max", [g.op("Mul", [g.op("Sub", [hi, lo]), g.const(1 / 254, f32)]), g.const(1e-30, f32)])
        xq = g.op("QuantizeLinear", [g.op("Sub", [x, mid]), row_scale, self._zero_points(row_scale, rows)],
                  axis=1, block_size=weight.shape[1])
        # MatMulInteger's B is [K, N]; torch transposes int8 several times faster than numpy
        q_kn = torch.from_numpy(q).t().contiguous().numpy()
        ins = [xq, g.weight(f"{name}.w8", q_kn), row_scale, g.weight(f"{name}.channel_scales", scales),
               g.const(W8A8_ZERO_POINT, np.uint8)]
        column_sums = (q_kn.T.astype(f32) * scales[:, None]).sum(axis=1)
        y = g.op("Add", [g.op("MatMulIntegerToFloat", ins, domain="com.microsoft"),
                         g.op("Mul", [mid, g.weight(f"{name}.column_sums", column_sums)])])
        if bias is not None:
            y = g.op("Add", [y, g.weight(f"{name}.bias", bias.astype(f32))])
        return y

    def _w8a16_linear(self, x: str, name: str, weight: np.ndarray, bias: np.ndarray | None) -> str:
        """int8's weight blocks (signed) times each row rounded to 16 bits over its own range, as exact
        integer products in this project's Int8MatMul (runtime/kernels/int8_matmul.cc): without VNNI,
        extra rows cost far less than MatMulNBits' (docs/design.md, "Precisions")."""
        panels, scales = panels_8bit(*quantize_8bit(weight, self.int8_block))
        ins = [x, self.g.weight(f"{name}.w8", panels), self.g.weight(f"{name}.scales", scales)]
        ins += [self.g.weight(f"{name}.bias", bias.astype(np.float32))] if bias is not None else []
        return self.g.op("Int8MatMul", ins, domain=KERNEL_DOMAIN, block=self.int8_block, columns=weight.shape[0])

    def _zero_points(self, row_scale: str, rows: str) -> str:
        """W8A8_ZERO_POINT for each row ([T, 1] uint8: QuantizeLinear's zero points take its scales'
        shape), made once per row count from the first linear's row scales."""
        if rows not in self._row_zero_points:
            self._row_zero_points[rows] = self.g.op("Expand", [self.g.const([[W8A8_ZERO_POINT]], np.uint8),
                                                               self.g.op("Shape", [row_scale])])
        return self._row_zero_points[rows]

    def _block_linear(self, x: str, name: str, k: int, blocks: Blocks, bias: np.ndarray | None) -> str:
        """MatMulNBits over blocks (8-bit, or 4-bit plus a per-block constant: Q4_1)."""
        g = self.g
        n = blocks.shape[0]
        ins = [x, g.weight(f"{name}.q{blocks.bits}", blocks.data), g.weight(f"{name}.scales", blocks.scales)]
        if bias is not None:
            ins += ["", "", g.weight(f"{name}.bias", bias.astype(np.float32))]
        y = g.op("MatMulNBits", ins, domain="com.microsoft", K=k, N=n, bits=blocks.bits, block_size=blocks.block,
                 accuracy_level=INT8_ACCURACY_LEVEL)
        if blocks.offsets is None:
            return y
        # sum_k x_k * offset[block(k)] = (per-block sums of x) @ offsets^T, a [T, K/32] x [K/32, N] product.
        sums = g.op("ReduceSum", [g.op("Reshape", [x, g.const([-1, k // blocks.block, blocks.block])]), g.const([-1])],
                    keepdims=0)
        offsets = g.weight(f"{name}.offsets", np.ascontiguousarray(blocks.offsets.T))
        return g.op("Add", [y, g.op("MatMul", [sums, offsets])])

    def proj(self, x: str, prefix: str, names: list[str]) -> str:
        """Several torch Linear layers sharing an input, fused into one matmul."""
        keys = [f"{prefix}{n}.weight" for n in names]
        w = np.concatenate([self.state[k] for k in keys])
        has_bias = f"{prefix}{names[0]}.bias" in self.state
        b = np.concatenate([self.state[f"{prefix}{n}.bias"] for n in names]) if has_bias else None
        blocks = Blocks.concat([self.blocks[k] for k in keys]) if all(k in self.blocks for k in keys) else None
        return self.linear(x, prefix + "_".join(names), w, b, blocks)

    def attention(self, cfg: ModelConfig, prefix: str, x: str, layer: str, io: "StepInputs") -> str:
        qkv = self.proj(x, f"{prefix}self_attn.", ["q_proj", "k_proj", "v_proj"])
        attend = {"exact": self._exact_attention, "kernel": self._kernel_attention}.get(io.attention,
                                                                                         self._fused_attention)
        attn = attend(cfg, qkv, layer, io)
        o_bias = self.state.get(f"{prefix}self_attn.o_proj.bias")
        return self.linear(attn, f"{prefix}self_attn.o_proj", self.state[f"{prefix}self_attn.o_proj.weight"], o_bias)

    def _fused_attention(self, cfg: ModelConfig, qkv: str, layer: str, io: "StepInputs") -> str:
        g = self.g
        qkv3 = g.op("Reshape", [qkv, g.const([1, -1, (cfg.num_heads + 2 * cfg.num_kv_heads) * cfg.head_dim])])
        attn, _, _ = g.op("GroupQueryAttention",
                    [qkv3, "", "", f"past_key_{layer}", f"past_value_{layer}", io.seqlens_k, io.total,
                     io.cos, io.sin, "position_ids", "attention_bias"],
                    [f"attn_{layer}", f"present_key_{layer}", f"present_value_{layer}"],
                    domain="com.microsoft", num_heads=cfg.num_heads, kv_num_heads=cfg.num_kv_heads,
                    do_rotary=1, rotary_interleaved=0)
        return g.op("Reshape", [attn, g.const([-1, cfg.num_heads * cfg.head_dim])])

    def _rotate(self, t: str, heads: int, d: str, io: "StepInputs") -> str:
        """RoPE of rows [T, heads * d] at position_ids, as [1, T, heads * d]."""
        t = self.g.op("Reshape", [t, self.g.const([1, -1, heads * d])])
        return self.g.op("RotaryEmbedding", [t, "position_ids", io.cos, io.sin], domain="com.microsoft",
                         num_heads=heads, interleaved=0)

    def _kernel_attention(self, cfg: ModelConfig, qkv: str, layer: str, io: "StepInputs") -> str:
        """The exact attention's contract (the same step inputs, each row computed independently
        of the others) in one custom operator per layer (runtime/kernels/cache_attention.cc), which
        reads each row's allowed keys only, from caches stored in io.cache_dtype."""
        g = self.g
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        q, k, v = g.op("Split", [qkv, g.const([heads * d, kv_heads * d, kv_heads * d])], 3, axis=-1)
        attn, _, _ = g.op(KERNEL_OPS[io.cache_dtype],
                          [self._rotate(q, heads, d, io), self._rotate(k, kv_heads, d, io), v,
                           f"past_key_{layer}", f"past_value_{layer}", "attention_bias", "row_scatter",
                           "cache_sequences", "cache_slots"],
                          [f"attn_{layer}", f"present_key_{layer}", f"present_value_{layer}"],
                          domain=KERNEL_DOMAIN, num_heads=heads, kv_num_heads=kv_heads, scale=float(d ** -0.5))
        return g.op("Reshape", [attn, g.const([-1, heads * d])])

    def _exact_attention(self, cfg: ModelConfig, qkv: str, layer: str, io: "StepInputs") -> str:
        """softmax(q k^T / sqrt(d) + bias) v over its sequence's whole cache, each row computed
        independently of the others (see the module docstring). Query head j reads kv head
        j // group, as in GroupQueryAttention. The caches hold S sequences [S, heads, capacity,
        width]; a step's rows are regrouped by sequence (row_gather, padded to M rows each), each
        sequence's rows attend over its own cache only, and go back to the step's order
        (row_scatter).

        With MLAS's SGEMM (ONNX Runtime's MatMul) in mind: one matmul per kv head over all its query
        rows, whose count never drops to one (a one-row product takes another kernel, so without
        grouping each row is computed twice), and value products in chunks of constant width at most
        VALUE_CHUNK (the key blocking of MLAS follows the width each thread computes, and stays at
        EXACT_KEY_BLOCK for these)."""
        g = self.g
        heads, kv_heads, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        group = heads // kv_heads
        rows = max(group, 2)
        q, k, v = g.op("Split", [qkv, g.const([heads * d, kv_heads * d, kv_heads * d])], 3, axis=-1)

        def rotate(t: str, n: int) -> str:
            return self._rotate(t, n, d, io)

        def write(cache: str, new: str, heads: int) -> str:
            """new [T, heads, width] into the cache, row t in sequence cache_sequences[t] at position
            cache_slots[t], in place; returns the whole updated cache [S, heads, capacity, width]
            (attention_bias masks what is not in use)."""
            return g.op("ScatterND", [f"past_{cache}_{layer}", io.write_index(heads), new],
                        [f"present_{cache}_{layer}"])

        chunks, width = value_chunks(d)
        keys = write("key", g.op("Reshape", [rotate(k, kv_heads), g.const([-1, kv_heads, d])]), kv_heads)
        v = g.op("Pad", [g.op("Reshape", [v, g.const([-1, kv_heads, d])]), g.const([0, 0, 0, 0, 0, 1]),
                         g.const(1.0, self.p.io_dtype)])
        if chunks * width > d + 1:
            v = g.op("Pad", [v, g.const([0, 0, 0, 0, 0, chunks * width - d - 1])])
        values = write("value", g.op("Reshape", [v, g.const([-1, kv_heads * chunks, width])]), kv_heads * chunks)
        values = g.op("Reshape", [values, io.shapes["values"]])  # [S, kv, chunks, capacity, width]
        q = g.op("Reshape", [rotate(q, heads), g.const([-1, kv_heads, group * d])])
        if rows > group:
            q = g.op("Concat", [q] * (rows // group), axis=-1)
        # Each sequence's rows side by side ([S * M] rows, padded), against its own cache only.
        q = g.op("Reshape", [g.op("Gather", [q, "row_gather"], axis=0), io.shapes["q_grouped"]])
        q = g.op("Reshape", [g.op("Transpose", [q], perm=[0, 2, 1, 3]), io.shapes["q_rows"]])  # [S, kv, M*rows, d]
        scores = g.op("FusedMatMul", [q, keys], domain="com.microsoft", transB=1, alpha=float(d ** -0.5))
        scores = g.op("Add", [g.op("Reshape", [scores, io.scores_shape]), io.row_bias])  # [S, kv, M, rows, capacity]
        # exp of the scores minus the row max, floored at EXP_FLOOR and zeroed where masked: an exact
        # zero for masked keys, and ONNX Runtime's Exp runs far slower on inputs below about -87 (docs/code-notes.md).
        shifted = g.op("Sub", [scores, g.op("ReduceMax", [scores, g.const([-1])], keepdims=1)])
        probs = g.op("Mul", [g.op("Exp", [g.op("Max", [shifted, g.const(EXP_FLOOR, self.p.io_dtype)])]), io.row_keep])
        probs = g.op("Reshape", [probs, io.flat_shape])  # [S, kv, 1, M * rows, capacity], against each chunk
        pv = g.op("Transpose", [g.op("MatMul", [probs, values])], perm=[0, 1, 3, 2, 4])  # [S, kv, M*rows, chunks, w]
        pv = g.op("Reshape", [pv, io.shapes["pv"]])
        sizes = [d, 1] + ([chunks * width - d - 1] if chunks * width > d + 1 else [])
        weighted, total = g.op("Split", [pv, g.const(sizes)], len(sizes), axis=-1)[:2]
        out = g.op("Reshape", [g.op("Div", [weighted, total]), io.shapes["out"]])  # [S, kv, M, rows * d]
        if rows > group:
            out = g.op("Slice", [out, g.const([0]), g.const([group * d]), g.const([3])])
        out = g.op("Reshape", [g.op("Transpose", [out], perm=[0, 2, 1, 3]), g.const([-1, heads * d])])
        return g.op("Gather", [out, "row_scatter"], axis=0)

    def mlp(self, x: str, prefix: str) -> str:
        g = self.g
        gate, up = g.op("Split", [self.proj(x, f"{prefix}mlp.", ["gate_proj", "up_proj"])], 2, axis=-1, num_outputs=2)
        act = g.op("Mul", [g.op("Mul", [gate, g.op("Sigmoid", [gate])]), up])
        return self.linear(act, f"{prefix}mlp.down_proj", self.state[f"{prefix}mlp.down_proj.weight"])

    def add_norm(self, delta: str, residual: str, weight: str, eps: float) -> tuple[str, str]:
        """(rmsnorm(residual + delta), residual + delta) in one fused op."""
        normed, _, _, total = self.g.op("SkipSimplifiedLayerNormalization", [delta, residual, self.param(weight)],
                                        4, domain="com.microsoft", epsilon=eps)
        return normed, total

    def lm_head(self, x: str, weight_name: str) -> str:
        """Logits [1, R, V] (fp32) of the rows `logit_rows` of x [T, H]. Tied models store one
        matrix: Gather for the embedding, Gemm transB for the head."""
        g = self.g
        rows = g.op("Gather", [x, "logit_rows"], axis=0)
        logits = self.linear(rows, weight_name.removesuffix(".weight"), self.state[weight_name], rows="logit_rows")
        if self.p.name == "fp16":
            logits = g.op("Cast", [logits], to=TensorProto.FLOAT)
        return g.op("Unsqueeze", [logits, g.const([0])])


@dataclass
class StepInputs:
    """Graph-side values every attention layer needs, derived from the graph inputs."""
    seqlens_k: str
    total: str
    cos: str
    sin: str
    attention: str = "fused"
    cache_dtype: int = TensorProto.FLOAT  # of the past_*/present_* caches
    # exact attention only
    scores_shape: str = ""      # [S, kv_heads, M, query rows, capacity]
    row_bias: str = ""          # attention_bias as [S, 1, M, 1, capacity]
    row_keep: str = ""          # 1 where attention_bias allows a key, else 0, as row_bias
    flat_shape: str = ""        # [S, kv_heads, 1, M * query rows, capacity]
    write_index: Callable[[int], str] | None = None  # heads -> ScatterND indices [T, heads, 3] of the rows' slots
    shapes: dict = None         # q_grouped, q_rows, values, pv, out: reshape targets with S, M


def value_chunks(head_dim: int) -> tuple[int, int]:
    """(chunks, width): the exact attention's value row (head_dim values and a one) cut into the
    fewest chunks of at most VALUE_CHUNK columns, zero-padded to equal widths."""
    chunks = -(-(head_dim + 1) // VALUE_CHUNK)
    return chunks, -(-(head_dim + 1) // chunks)


def cache_dtype(precision: Precision, attention: str) -> int:
    """The caches' element type: the graph's io type, but 16 bits for the kernel's beside quantized weights."""
    if attention == "kernel" and precision.name in FP16_CACHE_PRECISIONS:
        return TensorProto.FLOAT16
    return precision.onnx_io


def cache_bytes(precision: Precision, attention: str) -> int:
    """Bytes of one cached value."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(cache_dtype(precision, attention))).itemsize


def cache_shape(cfg: ModelConfig, kind: str, attention: str) -> list:
    """[1, kv_heads, max_length, head_dim]. The exact and kernel attentions' caches hold a batch of
    sequences; the exact attention's value rows carry one more column, ones (its softmax
    denominator), stored as value_chunks: [sequences, kv_heads * chunks, max_length, width] (see
    _exact_attention)."""
    if attention not in SLOTTED_ATTENTIONS:
        return [1, cfg.num_kv_heads, "max_length", cfg.head_dim]
    if kind == "value" and attention == "exact":
        chunks, width = value_chunks(cfg.head_dim)
        return ["sequences", cfg.num_kv_heads * chunks, "max_length", width]
    return ["sequences", cfg.num_kv_heads, "max_length", cfg.head_dim]


def declare_step_inputs(g: Graph, b: Builder, cfg: ModelConfig, n_layers: int, n_positions: int,
                        attention: str = "fused") -> StepInputs:
    """Inputs shared by both graphs. With fused attention the attention bias [1, 1, T, total] has
    the total length (cached tokens + T) as its width, so the runtime passes no separate lengths.

    The exact and kernel attentions hold the caches of S sequences, [S, heads, capacity, width], and attends
    over each sequence's whole cache: a step's T rows (any of the S sequences' rows, in any order)
    are regrouped into S groups of M rows (row_gather [S * M]: the row at each place, padding rows
    anything), the attention bias [S, 1, M, capacity] masks what each may not see, and row_scatter
    [T] puts them back. Row t is written to sequence cache_sequences[t] at position cache_slots[t]."""
    io = b.p.onnx_io
    slotted = attention in SLOTTED_ATTENTIONS
    g.input("input_ids", TensorProto.INT64, [1, "T"])
    g.input("position_ids", TensorProto.INT64, [1, "T"])
    g.input("attention_bias", io, ["S", 1, "M", "total"] if slotted else [1, 1, "T", "total"])
    # Rows whose logits are wanted: all tree nodes when verifying, only the last one in a prefill
    # or a draft context pass. The vocabulary projection dominates small models, so this pays.
    g.input("logit_rows", TensorProto.INT64, ["R"])
    for i in range(n_layers):
        for kind in ("key", "value"):
            g.input(f"past_{kind}_{i}", cache_dtype(b.p, attention), cache_shape(cfg, kind, attention))
    total64 = g.op("Shape", ["attention_bias"], start=3, end=4)
    total32 = g.op("Cast", [total64], to=TensorProto.INT32)
    seqlens_k = g.op("Sub", [total32, g.const([1], np.int32)])
    total = g.op("Squeeze", [total32, g.const([0])])
    cos, sin = (t.astype(b.p.io_dtype) for t in cos_sin_tables(cfg, n_positions))
    # Named by content: base and head share the table when their RoPE agrees, and only then.
    tag = hashlib.sha1(cos.tobytes()).hexdigest()[:12]
    step = StepInputs(seqlens_k, total, g.weight(f"rotary.{tag}.cos", cos), g.weight(f"rotary.{tag}.sin", sin),
                      cache_dtype=cache_dtype(b.p, attention))
    if slotted:
        for name, shape in (("row_gather", ["SM"]), ("row_scatter", ["T"]), ("cache_sequences", ["T"]),
                            ("cache_slots", ["T"])):
            g.input(name, TensorProto.INT64, shape)
        step.attention = attention
    if attention == "exact":
        step.write_index = functools.cache(lambda heads: scatter_index(g, heads))
        kv, rows, d = cfg.num_kv_heads, max(cfg.num_heads // cfg.num_kv_heads, 2), cfg.head_dim
        chunks, width = value_chunks(d)
        s64 = g.op("Shape", ["attention_bias"], start=0, end=1)
        m64 = g.op("Shape", ["attention_bias"], start=2, end=3)

        def shape(*parts) -> str:
            return g.op("Concat", [p if isinstance(p, str) else g.const(p) for p in parts], axis=0)

        step.shapes = {"q_grouped": shape(s64, m64, [kv, rows * d]), "q_rows": shape(s64, [kv, -1, d]),
                       "values": shape(s64, [kv, chunks, -1, width]), "pv": shape(s64, [kv, -1, chunks * width]),
                       "out": shape(s64, [kv, -1, rows * d])}
        step.scores_shape = shape(s64, [kv], m64, [rows], total64)
        step.row_bias = g.op("Reshape", ["attention_bias", shape(s64, [1], m64, [1], total64)])
        masked = np.finfo(b.p.io_dtype).min / 2
        step.row_keep = g.op("Cast", [g.op("Greater", [step.row_bias, g.const(masked, b.p.io_dtype)])], to=io)
        step.flat_shape = shape(s64, [kv, 1, -1], total64)
    return step


def scatter_index(g: Graph, heads: int) -> str:
    """ScatterND indices [T, heads, 3]: row t of every head to (cache_sequences[t], head, cache_slots[t])."""
    shape = g.op("Concat", [g.op("Shape", ["cache_slots"]), g.const([heads, 1])], axis=0)
    parts = [g.op("Reshape", ["cache_sequences", g.const([-1, 1, 1])]),
             g.const(np.arange(heads, dtype=np.int64).reshape(1, heads, 1)),
             g.op("Reshape", ["cache_slots", g.const([-1, 1, 1])])]
    return g.op("Concat", [g.op("Expand", [part, shape]) for part in parts], axis=-1)


def declare_cache_outputs(g: Graph, cfg: ModelConfig, step: StepInputs, n_layers: int, attention: str = "fused") -> None:
    for i in range(n_layers):
        for kind in ("key", "value"):
            g.output(f"present_{kind}_{i}", step.cache_dtype, cache_shape(cfg, kind, attention))


def embed(g: Graph, b: Builder, cfg: ModelConfig) -> str:
    x = g.op("Gather", [b.param("model.embed_tokens.weight"), "input_ids"])
    return g.op("Reshape", [x, g.const([-1, cfg.hidden_size])])


def lm_head_name(cfg: ModelConfig) -> str:
    return "model.embed_tokens.weight" if cfg.tie_word_embeddings else "lm_head.weight"


def build_base(cfg: ModelConfig, state: Mapping[str, np.ndarray], precision: str, n_positions: int,
               store: WeightStore, progress=None, attention: str = "exact", blocks: dict | None = None,
               eagle3_fc: np.ndarray | None = None, int8_block: int = INT8_BLOCK) -> onnx.ModelProto:
    """Inputs: input_ids, position_ids [1,T]; attention_bias; logit_rows [R]; past_{key,value}_i (with
    exact attention, the caches of several sequences and the inputs that group a step's rows by
    sequence: declare_step_inputs). Outputs: logits [1,R,V] (fp32),
    hidden_states [1,T,H], present_{key,value}_i. `blocks`: precision gguf.

    hidden_states is the feature the draft head reads: the post-final-norm hidden states for an
    EAGLE-1/2 head; for an EAGLE-3 head (`eagle3_fc`, its fc weight [H, 3H]) the head's fc applied to
    the inputs of the layers models.llama.eagle3_layers, concatenated, so that its draft graph reads
    H-wide features at every depth."""
    g = Graph(store)
    b = Builder(g, precision, state, blocks, int8_block)
    io = b.p.onnx_io
    step = declare_step_inputs(g, b, cfg, cfg.num_layers, n_positions, attention)
    x = embed(g, b, cfg)
    h = g.op("SimplifiedLayerNormalization", [x, b.param("model.layers.0.input_layernorm.weight")],
             axis=-1, epsilon=cfg.rms_norm_eps)
    taps, fused = eagle3_layers(cfg), {}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        if eagle3_fc is not None and i in taps:
            fused[i] = x
        h, x = b.add_norm(b.attention(cfg, p, h, str(i), step), x, f"{p}post_attention_layernorm.weight",
                          cfg.rms_norm_eps)
        nxt = f"model.layers.{i + 1}.input_layernorm.weight" if i + 1 < cfg.num_layers else "model.norm.weight"
        h, x = b.add_norm(b.mlp(h, p), x, nxt, cfg.rms_norm_eps)
        if progress is not None:
            progress.update(1)
    g.op("Identity", [b.lm_head(h, lm_head_name(cfg))], ["logits"])
    if eagle3_fc is not None:
        h = b.linear(g.op("Concat", [fused[i] for i in taps], axis=-1), "eagle3_fc", eagle3_fc)
    g.op("Reshape", [h, g.const([1, -1, cfg.hidden_size])], ["hidden_states"])
    g.output("logits", TensorProto.FLOAT, [1, "R", cfg.vocab_size])
    g.output("hidden_states", io, [1, "T", cfg.hidden_size])
    declare_cache_outputs(g, cfg, step, cfg.num_layers, attention)
    return g.model("base", "EAGLE-2 base model: tree step over an in-place KV cache")


def build_draft(base_cfg: ModelConfig, head_cfg: ModelConfig, state: Mapping[str, np.ndarray], precision: str,
                n_positions: int, store: WeightStore, draft_vocab: np.ndarray | None = None,
                int8_block: int = INT8_BLOCK, attention: str = "exact") -> onnx.ModelProto:
    """EAGLE-1/2 head. `state` holds the head tensors plus the base's embedding and lm_head.
    Inputs: input_ids, position_ids [1,T]; features [1,T,H]; attention_bias; logit_rows [R];
    past_{key,value}_0 (with exact attention, the caches of several sequences and the inputs that
    group a step's rows by sequence, as the base's: declare_step_inputs); top_k [1]. Outputs:
    hidden_states [1,T,H] (fed to the next depth), topk_ids [1,R,k] int64, topk_logprobs [1,R,k]
    fp32 (log-softmax and top-k inside, so only small tensors leave the device).

    With `draft_vocab` (sorted base token ids, models/draft_vocab.py) the head scores only those
    rows of the lm_head, a tensor of its own; top-k ids are mapped back to base ids in the graph."""
    g = Graph(store)
    b = Builder(g, precision, state, int8_block=int8_block)
    io = b.p.onnx_io
    step = declare_step_inputs(g, b, head_cfg, 1, n_positions, attention)
    g.input("features", io, [1, "T", head_cfg.hidden_size])
    g.input("top_k", TensorProto.INT64, [1])
    feats = g.op("Reshape", ["features", g.const([-1, head_cfg.hidden_size])])
    x = g.op("Concat", [embed(g, b, base_cfg), feats], axis=-1)
    x = b.linear(x, "fc", state["fc.weight"], state.get("fc.bias"))
    h, x = b.add_norm(b.attention(head_cfg, "layers.0.", x, "0", step), x, "layers.0.post_attention_layernorm.weight",
                      head_cfg.rms_norm_eps)
    out = g.op("Add", [x, b.mlp(h, "layers.0.")])
    lm = lm_head_name(base_cfg)
    if draft_vocab is not None:
        b.state = ChainMap({"draft_lm_head.weight": state[lm][draft_vocab]}, state)
        lm = "draft_lm_head.weight"
    logp = g.op("LogSoftmax", [b.lm_head(out, lm)], axis=-1)
    if draft_vocab is None:
        g.op("TopK", [logp, "top_k"], ["topk_logprobs", "topk_ids"], axis=-1)
    else:
        _, local = g.op("TopK", [logp, "top_k"], ["topk_logprobs", "draft_topk_ids"], axis=-1)
        g.op("Gather", [g.const(draft_vocab), local], ["topk_ids"])
    g.op("Reshape", [out, g.const([1, -1, head_cfg.hidden_size])], ["hidden_states"])
    g.output("hidden_states", io, [1, "T", head_cfg.hidden_size])
    g.output("topk_ids", TensorProto.INT64, [1, "R", "k"])
    g.output("topk_logprobs", TensorProto.FLOAT, [1, "R", "k"])
    declare_cache_outputs(g, head_cfg, step, 1, attention)
    return g.model("draft", "EAGLE-1/2 draft head: fc + one decoder layer + base lm_head, top-k inside")


def build_draft_eagle3(base_cfg: ModelConfig, head_cfg: ModelConfig, state: Mapping[str, np.ndarray], precision: str,
                       n_positions: int, store: WeightStore, int8_block: int = INT8_BLOCK,
                       attention: str = "exact") -> onnx.ModelProto:
    """EAGLE-3 head, the same inputs and outputs as build_draft. `state` holds the head tensors
    (its lm_head renamed eagle3_lm_head.weight, d2t int64) plus the base's embedding. Features are
    H wide: the base graph's fused feature for verified positions, the head's own output for deeper
    drafts. Top-k runs over the draft vocabulary and maps to base ids (id + d2t[id]) in the graph."""
    g = Graph(store)
    b = Builder(g, precision, state, int8_block=int8_block)
    io = b.p.onnx_io
    h = head_cfg.hidden_size
    step = declare_step_inputs(g, b, head_cfg, 1, n_positions, attention)
    g.input("features", io, [1, "T", h])
    g.input("top_k", TensorProto.INT64, [1])
    feats = g.op("Reshape", ["features", g.const([-1, h])])

    def norm(x: str, weight: str) -> str:
        return g.op("SimplifiedLayerNormalization", [x, b.param(weight)], axis=-1, epsilon=head_cfg.rms_norm_eps)

    x = g.op("Concat", [norm(embed(g, b, base_cfg), "midlayer.input_layernorm.weight"),
                        norm(feats, "midlayer.hidden_norm.weight")], axis=-1)
    h2, res = b.add_norm(b.attention(head_cfg, "midlayer.", x, "0", step), feats,
                         "midlayer.post_attention_layernorm.weight", head_cfg.rms_norm_eps)
    out = g.op("Add", [res, b.mlp(h2, "midlayer.")])
    logp = g.op("LogSoftmax", [b.lm_head(norm(out, "norm.weight"), "eagle3_lm_head.weight")], axis=-1)
    _, local = g.op("TopK", [logp, "top_k"], ["topk_logprobs", "draft_topk_ids"], axis=-1)
    g.op("Add", [local, g.op("Gather", [g.weight("eagle3_d2t", state["d2t"].astype(np.int64)), local])],
         ["topk_ids"])
    g.op("Reshape", [out, g.const([1, -1, h])], ["hidden_states"])
    g.output("hidden_states", io, [1, "T", h])
    g.output("topk_ids", TensorProto.INT64, [1, "R", "k"])
    g.output("topk_logprobs", TensorProto.FLOAT, [1, "R", "k"])
    declare_cache_outputs(g, head_cfg, step, 1, attention)
    return g.model("draft", "EAGLE-3 draft head: one layer over [embedding, feature], own norm and lm_head over "
                   "a draft vocabulary, top-k inside")
