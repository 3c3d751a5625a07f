#!/usr/bin/env bash
# The test command (README, .ci/run): set up, then run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
bash ci/install_serve.sh --ray     # else tests/test_server*.py skip
. .venv/bin/activate
# The suite's temporary files (exported artifacts, random checkpoints: a few GB) go once it ends,
# leaving the disk to the OpenVINO and IPEX environments.
basetemp="$(mktemp -d)"
trap 'rm -rf "$basetemp"' EXIT
python -m pytest -q --basetemp "$basetemp/pytest" "$@"
rm -rf "$basetemp"
bash ci/test_openvino.sh
bash ci/test_ipex.sh
