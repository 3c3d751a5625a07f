#!/usr/bin/env bash
# The plain decoders the benchmark compares against (`python -m runtime.bench --peers genai,llamacpp`),
# installed into .venv after ci/install.sh: onnx-ir for onnxruntime-genai's model builder, and
# llama-cpp-python, which builds llama.cpp from source (about 13 minutes on 2 cores; pip caches the
# wheel, so a second run takes seconds). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
. .venv/bin/activate
python -m pip install -q "onnx-ir>=0.1"
if ! python -c "import llama_cpp" 2>/dev/null; then
    # A portable AVX-512 build: GGML_NATIVE would compile in AMX where the CPU has it, and a process
    # that may not use AMX then dies with "Illegal instruction" (seen on a 2-core Xeon VM).
    flags="-DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON -DGGML_AVX_VNNI=ON"
    if grep -q avx512f /proc/cpuinfo; then
        flags="$flags -DGGML_AVX512=ON -DGGML_AVX512_VNNI=ON -DGGML_AVX512_BF16=ON -DGGML_AVX512_VBMI=ON"
    fi
    flags="$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
    echo "building llama-cpp-python (about 13 minutes) ..." >&2
    CMAKE_ARGS="$flags" python -m pip install -q "llama-cpp-python==0.3.36"
fi
