#!/usr/bin/env bash
# The plain decoders the benchmark compares against (`python -m runtime.bench --peers genai,llamacpp`),
# installed into .venv after ci/install.sh: onnx-ir for onnxruntime-genai's model builder, and
# llama-cpp-python, which builds llama.cpp from source (about 13 minutes on 2 cores). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
bash ci/install.sh
. .venv/bin/activate
python -m pip install -q "onnx-ir>=0.1"
# A portable build with exactly the instruction sets this CPU has: GGML_NATIVE compiles in AMX where
# the CPU has it, and a process that may not use AMX then dies with "Illegal instruction" (seen on a
# 2-core Xeon VM); AVX-VNNI compiled in on a CPU without it (AMD Zen 3) dies the same way.
flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
for pair in avx_vnni:AVX_VNNI avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI; do
    if [[ "$cpu_flags" == *" ${pair%%:*} "* ]]; then on=ON; else on=OFF; fi
    flags="$flags -DGGML_${pair##*:}=$on"
done
flags="$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
# pip's wheel cache does not key on CMAKE_ARGS: a wheel built for another CPU would be reused, so the
# flags of the installed build are recorded and a build for other flags skips the cache.
stamp=.venv/llama_cpp_build_flags
if ! python -c "import llama_cpp" 2>/dev/null || [ "$(cat "$stamp" 2>/dev/null)" != "$flags" ]; then
    echo "building llama-cpp-python for this CPU (about 13 minutes) ..." >&2
    CMAKE_ARGS="$flags" python -m pip install -q --no-cache-dir --force-reinstall --no-deps "llama-cpp-python==0.3.36"
    python -m pip install -q "llama-cpp-python==0.3.36"   # its pure-Python dependencies
    echo "$flags" > "$stamp"
fi
