#!/usr/bin/env bash
# The IPEX tests, in their own environment (.venv-ipex, made by ci/install_ipex.sh): the backend
# contract, bitwise verification, lossless greedy and sampling for IPEX artifacts, and the SmolLM2
# IPEX check.
# Skipped, saying why, where the disk cannot hold that environment.
set -euo pipefail
cd "$(dirname "$0")/.."
status=0
bash ci/install_ipex.sh || status=$?
if [ "$status" -eq 75 ]; then
    echo "SKIPPED: the IPEX tests (tests/test_backend_contract.py, tests/test_runtime_bitwise.py, tests/test_runtime_torch.py -k ipex):" \
         "not enough disk for .venv-ipex" >&2
    exit 0
fi
[ "$status" -eq 0 ] || exit "$status"
PYTHONPATH="$PWD" .venv-ipex/bin/python -m pytest -q -p no:cacheprovider -p no:warnings \
    tests/test_backend_contract.py tests/test_runtime_bitwise.py tests/test_runtime_torch.py -k "ipex" "$@"
