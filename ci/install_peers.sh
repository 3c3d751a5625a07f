#!/usr/bin/env bash
# The decoders the benchmarks compare against (`python -m runtime.bench --peers genai,llamacpp,openvino-genai`,
# `python -m runtime.load_bench --servers ...,openvino-genai`): into .venv after ci/install.sh, onnx-ir for
# onnxruntime-genai's model builder and llama-cpp-python, which builds llama.cpp from source (about 13
# minutes on 2 cores); OpenVINO GenAI and optimum-intel, which pin their own openvino and transformers,
# into .venv-ovgenai. Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
. .venv/bin/activate
python -m pip install -q "onnx-ir>=0.1"
flags="$(bash ci/llama_cpp_flags.sh)"
# pip's wheel cache does not key on CMAKE_ARGS: a wheel built for another CPU would be reused, so the
# flags of the installed build are recorded and a build for other flags skips the cache.
stamp=.venv/llama_cpp_build_flags
if ! python -c "import llama_cpp" 2>/dev/null || [ "$(cat "$stamp" 2>/dev/null)" != "$flags" ]; then
    echo "building llama-cpp-python for this CPU (about 13 minutes) ..." >&2
    CMAKE_ARGS="$flags" python -m pip install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
    python -m pip install -q "llama-cpp-python==0.3.36"   # its pure-Python dependencies
    echo "$flags" > "$stamp"
fi

# optimum-intel needs torchvision: torch 2.14.1 with torchvision 0.29.1 are the pair pip takes from this
# machine's disk. Its EAGLE-3 conversion loads its model patcher as remote code, which imports diffusers and
# einops; diffusers 0.38 and later need a newer transformers than optimum-intel 2.2 allows.
if [ ! -x .venv-ovgenai/bin/optimum-cli ] || ! .venv-ovgenai/bin/python -c "import openvino_genai" 2>/dev/null; then
    echo "installing OpenVINO GenAI and optimum-intel into .venv-ovgenai ..." >&2
    python3 -m venv .venv-ovgenai
    .venv-ovgenai/bin/python -m pip install -q --upgrade pip
    .venv-ovgenai/bin/python -m pip install -q torch==2.14.1 torchvision==0.29.1
    .venv-ovgenai/bin/python -m pip install -q "openvino-genai==2026.4.*" "optimum-intel[openvino]==2.2.*" \
        "huggingface-hub>=1.5,<1.22" "diffusers<0.38" einops
fi
