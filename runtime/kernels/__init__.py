"""This project's ONNX Runtime custom operators (cache_attention.cc: the attention of artifacts
exported with --attention kernel; int8_matmul.cc and its tiles, int8_tiles.cc, built for AVX2 and
for AVX-512 VNNI: the products of --precision w8a16), compiled by ci/build_kernels.sh into a library
that sessions register before loading such a graph."""
from __future__ import annotations

from pathlib import Path

LIBRARY = Path(__file__).with_name("libeagle2_kernels.so")
BUILD_COMMAND = "bash ci/build_kernels.sh"
PANEL = 8  # columns of a panel of Int8MatMul's weights (int8_matmul.h's kPanel; export/quantize.py packs them)


def missing() -> str | None:
    """Why the kernels cannot be used here, or None."""
    if not LIBRARY.is_file():
        return f"this project's CPU operators are not built ({LIBRARY} is missing): run `{BUILD_COMMAND}`"
    return None
