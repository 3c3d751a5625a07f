"""What the host CPU is and which instructions it has (Linux's /proc/cpuinfo), and its memory."""
from __future__ import annotations

import platform
from pathlib import Path


def cpu_info(key: str) -> str | None:
    """The first /proc/cpuinfo line starting with `key`, after its colon (None off Linux)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(key):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def cpu_name() -> str:
    return cpu_info("model name") or platform.processor() or platform.machine()


def cpu_flags() -> set[str]:
    return set((cpu_info("flags") or "").split())


# The CPU kinds whose instructions decide which 8-bit products run, exactly and fast (docs/platforms.md),
# from the fewest to the most.
CPU_KINDS = {
    "avx2": "AVX2 without VNNI",
    "avx2-vnni": "AVX2 with VNNI (AVX-VNNI)",
    "avx512": "AVX-512 without VNNI",
    "avx512-vnni": "AVX-512 with VNNI",
    "amx": "AMX",
}


def cpu_kind(flags: set[str] | None = None) -> str | None:
    """The CPU_KINDS entry of a CPU with these flags (this one's by default); None off x86-64, where
    the flags cannot be read, or on an x86-64 CPU without AVX2."""
    if flags is None:
        flags = cpu_flags()
    if not flags or platform.machine().lower() not in ("x86_64", "amd64"):
        return None
    if "amx_int8" in flags:
        return "amx"
    if {"avx512f", "avx512bw"} <= flags:
        return "avx512-vnni" if "avx512_vnni" in flags else "avx512"
    if "avx2" in flags:
        return "avx2-vnni" if "avx_vnni" in flags else "avx2"
    return None


# The manifest's record that an export's precision is its CPU kind's path (not asked for, nor the quality
# gate's fallback): what the runtime's load check advises on (runtime/cpu_fit.py).
FROM_KIND_PATH = "the CPU kind's path"


# The fastest lossless ONNX precision by CPU kind, where it is not w8a16 (measured per kind in
# docs/benchmarks.md, "By CPU kind"): w8a8 where AMX's integer tiles make verified rows cheap. Elsewhere
# w8a16, this project's 16-bit integer products (AVX2; vpdpwssd where the CPU has AVX-512 VNNI): on
# AVX2 without VNNI MatMulNBits' 8-bit kernel pays for each extra row almost a whole step, and with
# VNNI its 8-bit activations cost extra rows more and answer worse.
ONNX_CPU_PATHS = {"amx": "w8a8"}


def onnx_cpu_path(kind: str | None) -> str:
    """The fastest lossless ONNX precision for a CPU kind (ONNX_CPU_PATHS, else w8a16); int8 (8-bit
    weights, which every CPU runs) off x86-64."""
    return "int8" if kind is None else ONNX_CPU_PATHS.get(kind, "w8a16")


def int8_dot_products() -> bool:
    """Whether the CPU multiplies 8-bit integers without saturating 16-bit pair sums: x86 with VNNI
    or AMX. True off x86 (the saturating kernel is x86's) and where the flags cannot be read
    (nothing is known to be missing)."""
    flags = cpu_flags()
    return (not flags or platform.machine().lower() not in ("x86_64", "amd64")
            or bool(flags & {"avx512_vnni", "avx_vnni", "amx_int8"}))


def bf16_matmuls() -> bool:
    """Whether the CPU multiplies bf16 in hardware (AMX or AVX512-BF16); elsewhere torch emulates
    bf16, slower than fp32."""
    return bool(cpu_flags() & {"amx_bf16", "avx512_bf16"})


def physical_memory() -> int:
    """Bytes of memory this machine has."""
    import os
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def kv_bytes_per_position(cfg, value_bytes: int = 4) -> int:
    """One sequence's base K/V per position, values of `value_bytes` (a ModelConfig, or its manifest dict)."""
    get = cfg.get if isinstance(cfg, dict) else lambda k: getattr(cfg, k)
    return 2 * get("num_layers") * get("num_kv_heads") * get("head_dim") * value_bytes
