"""Rotary position tables (default, linear and Llama-3 scaling), computed once per export."""
from __future__ import annotations

import math

import numpy as np

from .config import ModelConfig


def inverse_frequencies(cfg: ModelConfig) -> np.ndarray:
    dim = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    s = cfg.rope_scaling
    if s is None:
        return inv
    if s["rope_type"] == "linear":
        return inv / float(s["factor"])
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    factor, low, high = float(s["factor"]), float(s["low_freq_factor"]), float(s["high_freq_factor"])
    old_len = float(s["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > old_len / low, inv / factor, inv)
    smooth = (old_len / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= old_len / high) & (wavelen <= old_len / low)
    return np.where(medium, blended, scaled)


def cos_sin_tables(cfg: ModelConfig, n_positions: int) -> tuple[np.ndarray, np.ndarray]:
    """cos, sin of shape [n_positions, head_dim // 2] (the half-table GroupQueryAttention takes)."""
    angles = np.outer(np.arange(n_positions, dtype=np.float64), inverse_frequencies(cfg))
    return np.cos(angles).astype(np.float32), np.sin(angles).astype(np.float32)
