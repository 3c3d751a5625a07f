#!/usr/bin/env bash
# The test command (README, .ci/run): set up, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
bash ci/install_serve.sh --ray     # else tests/test_server*.py skip
. .venv/bin/activate
python -m pytest -q "$@"
bash ci/test_openvino.sh
bash ci/test_ipex.sh
