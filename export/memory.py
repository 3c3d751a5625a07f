"""How much memory an export will need, said before it starts rather than found out by the kernel's
OOM killer. The estimate comes from the checkpoint's tensor shapes alone (no tensor is read); its
factors were measured on random checkpoints of several sizes (docs/large-models.md)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from math import prod

from models.tensors import tensor_shape
from models.weights import Checkpoint

from .common import ExportError
from .smoothing import SMOOTHED_PRECISIONS

GIB = 1 << 30
# Python, torch, onnx and ONNX Runtime loaded, with the tokenizer and the draft vocabulary's counts.
BASE_BYTES = int(0.5 * GIB)
# Quantizing the largest fp32 tensor (the fused gate/up projection or the vocabulary matrix) makes
# a few same-sized temporaries (padding, scaled, rounded, clipped).
QUANTIZE_TEMPORARIES = 5
# An ONNX Runtime session holds its weights, read from the external data file, and little more.
SESSION_FACTOR = 1.1
# The torch/IPEX targets build a whole fp32 model, trace and freeze it, and check it against a
# second fp32 model: peaks near 2.3x the fp32 model (docs/large-models.md).
TORCH_FACTOR = 2.5
# Bytes per weight of a linear layer in the artifact, by precision (scales included).
LINEAR_BYTES = {"fp32": 4.0, "fp16": 2.0, "int8": 1.07, "w8a8": 1.0, "w8a16": 1.07, "gguf": 1.07}


@dataclass
class Estimate:
    peak: int
    phase: str


def _shapes(ckpt: Checkpoint) -> dict[str, tuple]:
    return {k: tensor_shape(ckpt.state, k) for k in ckpt.state}


def estimate(ckpt: Checkpoint, target: str, precision: str, verify: bool) -> Estimate:
    """The export's estimated peak resident memory, and the phase that sets it."""
    cfg = ckpt.cfg
    shapes = _shapes(ckpt)
    params = sum(prod(s) for s in shapes.values())
    head_params = sum(prod(t.shape) for t in ckpt.head_state.values())
    if target != "onnx":
        return Estimate(BASE_BYTES + int(TORCH_FACTOR * 4 * (params + head_params)), "the whole fp32 model")
    vocab_fp32 = 4 * cfg.vocab_size * cfg.hidden_size
    fused_ffn = 4 * 2 * cfg.intermediate_size * cfg.hidden_size
    layer = 4 * max(sum(prod(s) for k, s in shapes.items() if k.startswith(f"model.layers.{i}."))
                    for i in range(cfg.num_layers))
    phases = {"building the graphs": QUANTIZE_TEMPORARIES * max(vocab_fp32, fused_ffn)}
    if precision in SMOOTHED_PRECISIONS:
        phases["SmoothQuant calibration"] = layer + vocab_fp32
    if verify:
        embedding = vocab_fp32 // (2 if precision == "fp16" else 1)
        linears = params - prod(shapes["model.embed_tokens.weight"]) + head_params
        weights = embedding + LINEAR_BYTES[precision] * linears
        phases["the parity check's ONNX Runtime session"] = int(SESSION_FACTOR * weights)
        phases["the parity check's reference"] = layer + 3 * vocab_fp32
    phase = max(phases, key=phases.get)
    return Estimate(BASE_BYTES + phases[phase], phase)


def fp32_model_bytes(ckpt: Checkpoint) -> int:
    return 4 * sum(prod(s) for s in _shapes(ckpt).values())


def resident_calibration(ckpt: Checkpoint, target: str, precision: str, verify: bool) -> bool:
    """Whether SmoothQuant's calibration may hold the whole fp32 model: only where that stays within the
    export's estimated peak anyway (small models), so that no export exceeds its estimate."""
    return BASE_BYTES + fp32_model_bytes(ckpt) <= estimate(ckpt, target, precision, verify).peak


def available_memory() -> int:
    """What this process may still take: MemAvailable, or the cgroup's limit if lower."""
    with open("/proc/meminfo") as f:
        avail = next(int(line.split()[1]) * 1024 for line in f if line.startswith("MemAvailable:"))
    try:
        with open("/sys/fs/cgroup/memory.max") as f:
            limit = f.read().strip()
        with open("/sys/fs/cgroup/memory.current") as f:
            used = int(f.read())
        if limit != "max":
            avail = min(avail, int(limit) - used)
    except (OSError, ValueError):
        pass
    return avail


def check_memory(ckpt: Checkpoint, target: str, precision: str, verify: bool, log) -> None:
    """Raise ExportError, naming what would fit, when the estimated peak exceeds what is available."""
    if not os.path.exists("/proc/meminfo"):
        return
    need, have = estimate(ckpt, target, precision, verify), available_memory()
    log(f"estimated peak memory {need.peak / GIB:.1f} GiB ({need.phase}); {have / GIB:.1f} GiB available")
    if need.peak <= have:
        return
    fits = []
    if verify and estimate(ckpt, target, precision, False).peak <= have:
        fits.append(f"--no-verify (about {estimate(ckpt, target, precision, False).peak / GIB:.1f} GiB)")
    if target == "onnx":
        for other in ("int8", "w8a8"):
            if other != precision and estimate(ckpt, target, other, verify).peak <= have:
                fits.append(f"--precision {other} (about {estimate(ckpt, target, other, verify).peak / GIB:.1f} GiB)")
    elif estimate(ckpt, "onnx", "int8", verify).peak <= have:
        fits.append("--target onnx")
    advice = "; would fit: " + ", ".join(fits) if fits else "; nothing smaller fits on this machine"
    raise ExportError(f"this export needs about {need.peak / GIB:.1f} GiB of memory at its peak ({need.phase}), "
                      f"and {have / GIB:.1f} GiB are available{advice}")
