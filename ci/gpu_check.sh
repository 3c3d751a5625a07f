#!/usr/bin/env bash
# The torch backend on a CUDA GPU, checked and measured in one run (tools/gpu_check.py): exports
# tiny-llama, tiny-qwen2 and random models of SmolLM2-135M's and Llama-3.2-1B's shapes (fp16,
# --target torch), checks EAGLE-2 greedy against plain greedy and speculative sampling's distribution
# on the GPU, with CUDA graphs and without, and measures verify cost by tree size and draft cost by
# depth; where onnxruntime-gpu is installed, the same for provider="cuda" (tiny-llama fp16, exact
# attention, caches and step outputs on the GPU). Prints one table and writes it to OUT_DIR as
# gpu_check.md / gpu_check.json.
#
#   bash ci/gpu_check.sh [OUT_DIR] [tools.gpu_check options]      (OUT_DIR defaults to $GPU_CHECK_OUT, else gpu_check_out)
#
# Installs nothing (GPU machines may have no network): it needs a python3 ($PYTHON) with CUDA PyTorch
# and the packages below, and runs from the git tree as it is. About 3-5 minutes on an H100/H200;
# stopped at 8.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
missing=$("$PY" -c 'import importlib.util as u; print(" ".join(m for m in ("torch", "numpy", "scipy", "onnx",
    "onnxruntime", "tokenizers", "transformers", "jinja2", "safetensors", "tqdm") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    echo "gpu_check: $PY lacks the Python packages: $missing" >&2
    exit 1
fi
"$PY" -c 'import sys, torch; sys.exit(None if torch.cuda.is_available() else
    f"gpu_check: torch {torch.__version__} sees no CUDA device (run python -m tools.gpu_check --device cpu --quick on a CPU)")'
out=${1:-${GPU_CHECK_OUT:-gpu_check_out}}
PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1 timeout 480 "$PY" -m tools.gpu_check --device cuda \
    --out "$out" "${@:2}"
