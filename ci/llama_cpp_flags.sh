#!/usr/bin/env bash
# The CMake flags of a portable llama.cpp build with exactly the instruction sets this CPU has:
# GGML_NATIVE compiles in AMX where the CPU has it, and a process that may not use AMX then dies with
# "Illegal instruction" (seen on a 2-core Xeon VM); AVX-VNNI compiled in on a CPU without it (AMD
# Zen 3) dies the same way. Used by ci/install_peers.sh and ci/install_llama_server.sh.
set -euo pipefail
flags="-DGGML_NATIVE=OFF -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
cpu_flags=" $(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2) "
for pair in avx_vnni:AVX_VNNI avx512f:AVX512 avx512_vnni:AVX512_VNNI avx512_bf16:AVX512_BF16 avx512vbmi:AVX512_VBMI; do
    if [[ "$cpu_flags" == *" ${pair%%:*} "* ]]; then on=ON; else on=OFF; fi
    flags="$flags -DGGML_${pair##*:}=$on"
done
echo "$flags -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF"
