"""8-bit weights as the ONNX graphs store them: blockwise for MatMulNBits (int8) and in panels of those
blocks for Int8MatMul (w8a16), per output channel for the integer GEMMs (w8a8), and back to fp32 for
the parity check's reference."""
from __future__ import annotations

import numpy as np

from runtime.kernels import PANEL


def quantize_8bit(w: np.ndarray, block: int) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric 8-bit blockwise weights in MatMulNBits layout (implicit zero point 128).

    w is [N, K] (a torch Linear weight). Returns B [N, K/block, block] uint8 and scales [N, K/block].
    """
    n, k = w.shape
    pad = -k % block
    w = np.pad(w.astype(np.float32), ((0, 0), (0, pad))).reshape(n, -1, block)
    scale = np.abs(w).max(axis=-1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[..., None]) + 128, 0, 255).astype(np.uint8)
    return q, scale.astype(np.float32)


def signed_8bit(q: np.ndarray) -> np.ndarray:
    """quantize_8bit's B [N, K/block, block] (zero point 128) as signed int8 [N, K]."""
    return (q.astype(np.int16) - 128).astype(np.int8).reshape(q.shape[0], -1)


def panels_8bit(q: np.ndarray, scales: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """quantize_8bit's B [N, K/block, block] and scales [N, K/block] in the panels of w8a16's Int8MatMul
    (runtime/kernels/int8_matmul.cc): signed weights [P, K/2, 16], each input pair's 8 columns side by
    side, and scales [P, K/block, 8], N padded with zero columns to P = ceil(N / 8) panels."""
    w = signed_8bit(q)
    n, k = w.shape
    pad = -n % PANEL
    w = np.pad(w, ((0, pad), (0, 0))).reshape(-1, PANEL, k // 2, 2).transpose(0, 2, 1, 3)
    scales = np.pad(scales, ((0, pad), (0, 0))).reshape(-1, PANEL, scales.shape[1]).transpose(0, 2, 1)
    return np.ascontiguousarray(w).reshape(-1, k // 2, 2 * PANEL), np.ascontiguousarray(scales)


def dequantize_8bit(q: np.ndarray, scale: np.ndarray, k: int) -> np.ndarray:
    w = (q.astype(np.float32) - 128) * scale[..., None]
    return w.reshape(q.shape[0], -1)[:, :k]


def quantize_channels_8bit(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric int8 weights with one scale per output channel (the w8a8 precision).

    w is [N, K] (a torch Linear weight). Returns q [N, K] int8 and scales [N]."""
    scale = np.abs(w).max(axis=1) / 127.0
    scale[scale == 0] = 1.0
    q = np.clip(np.rint(w / scale[:, None]), -127, 127).astype(np.int8)
    return q, scale.astype(np.float32)


def dequantize_channels_8bit(q: np.ndarray, scale: np.ndarray) -> np.ndarray:
    return q.astype(np.float32) * scale[:, None]
