#!/usr/bin/env bash
# The IPEX tests, in their own environment (.venv-ipex, made by ci/install_ipex.sh): bitwise
# verification, lossless greedy and sampling for IPEX artifacts, and the SmolLM2 IPEX check.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install_ipex.sh
PYTHONPATH="$PWD" .venv-ipex/bin/python -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_runtime_bitwise.py tests/test_runtime_torch.py -k "ipex" "$@"
