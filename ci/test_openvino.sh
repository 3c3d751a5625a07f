#!/usr/bin/env bash
# Runs the runtime on the OpenVINO EP in its own virtualenv (onnxruntime-openvino replaces the
# onnxruntime module), against a tiny artifact exported by the main .venv.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-openvino/bin/pytest ]; then
    python3 -m venv .venv-openvino
    .venv-openvino/bin/python -m pip install -q --upgrade pip
    .venv-openvino/bin/python -m pip install -q onnxruntime-openvino numpy onnx tokenizers jinja2 pytest
fi
art="$(mktemp -d)/tiny-llama"
.venv/bin/python -m export tiny-llama --out "$art" --max-length 256 > /dev/null 2>&1
PYTHONPATH="$PWD" EAGLE2_OPENVINO_ARTIFACT="$art" .venv-openvino/bin/python -m pytest -q -p no:cacheprovider \
    tests/test_runtime_openvino.py
rm -rf "$(dirname "$art")"
