#!/usr/bin/env bash
# The plain decoders the benchmark compares against (`python -m runtime.bench --peers genai,llamacpp`),
# installed into .venv after ci/install.sh: onnx-ir for onnxruntime-genai's model builder, and
# llama-cpp-python, which builds llama.cpp from source (about 13 minutes on 2 cores). Idempotent.
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
