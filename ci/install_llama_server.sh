#!/usr/bin/env bash
# llama.cpp's own server (llama-server: parallel slots, continuous batching), the serving peer of
# `python -m runtime.load_bench --peer-server`: built from the llama.cpp sources vendored in the
# llama-cpp-python sdist (PyPI), with the portable flags of ci/llama_cpp_flags.sh, into
# .peers/llama-server, with llama-quantize for the Q8_0 GGUF (about 6 minutes on 2 cores). Idempotent.
set -euo pipefail
cd "$(dirname "$0")/.."
flags="$(bash ci/llama_cpp_flags.sh)"
out=.peers/llama-server
if [ -x "$out/bin/llama-server" ] && [ "$(cat "$out/flags" 2>/dev/null)" = "$flags" ]; then
    exit 0
fi
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
python3 -m pip download -q --no-deps --no-binary :all: "llama-cpp-python==0.3.36" -d "$work"
tar xzf "$work"/llama_cpp_python-0.3.36.tar.gz -C "$work"
echo "building llama-server for this CPU (about 6 minutes) ..." >&2
# shellcheck disable=SC2086
cmake -S "$work/llama_cpp_python-0.3.36/vendor/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=ON \
    -DBUILD_SHARED_LIBS=OFF $flags > "$work/cmake.log"
cmake --build "$work/build" --target llama-server llama-quantize -j "$(nproc)" > "$work/build.log"
mkdir -p "$out/bin"
cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$out/bin/"
echo "$flags" > "$out/flags"
