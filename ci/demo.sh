#!/usr/bin/env bash
# The main job on the embedded default model: set up, export SmolLM2-135M-Instruct, generate.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
. .venv/bin/activate
[ -f artifacts/smollm2-135m/manifest.json ] || python -m export smollm2-135m
python -m runtime generate artifacts/smollm2-135m --prompt "What is the capital of France?" --stats
