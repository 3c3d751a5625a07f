#!/usr/bin/env bash
# Build runtime/kernels/libeagle2_kernels.so, the ONNX Runtime custom operators of --attention kernel
# and --precision w8a16 artifacts. It needs ONNX Runtime's C API headers at compile time only; no wheel or PyPI package
# ships them, Debian 13's libonnxruntime-dev does (API 21, which the newer runtimes in .venv accept).
# The package is fetched from Debian's registry, checked and unpacked under build/, not installed.
set -euo pipefail
cd "$(dirname "$0")/.."
DEB=libonnxruntime-dev_1.21.0+dfsg-1_amd64.deb
SHA256=14f7d959d5deacbcf1504830d4189f91fc67382b399ed9ae9d3aa9c4050ced08
OUT=runtime/kernels/libeagle2_kernels.so
HEADERS=build/onnxruntime-dev/usr/include/onnxruntime
if [ "$(uname -m)" != x86_64 ]; then
  echo "build_kernels: the kernels are written for x86-64 (AVX2, FMA, F16C); skipped on $(uname -m)" >&2
  exit 0
fi
if [ ! -f "$HEADERS/onnxruntime_cxx_api.h" ]; then
  mkdir -p build
  curl -fsSL --retry 3 -o "build/$DEB" "http://deb.debian.org/debian/pool/main/o/onnxruntime/$DEB"
  echo "$SHA256  build/$DEB" | sha256sum -c --quiet
  dpkg-deb -x "build/$DEB" build/onnxruntime-dev
fi
SOURCES=(runtime/kernels/register.cc runtime/kernels/cache_attention.cc runtime/kernels/int8_matmul.cc)
TILES=runtime/kernels/int8_tiles.cc
stale=0
for f in "${SOURCES[@]}" "$TILES" runtime/kernels/*.h; do [ ! -f "$OUT" ] || [ "$f" -nt "$OUT" ] && stale=1; done
if [ "$stale" = 1 ]; then
  # -ffp-contract=off: the products and sums stay the ones written, whatever the compiler sees.
  FLAGS=(-std=c++17 -O3 -mavx2 -mfma -mf16c -ffp-contract=off -fPIC -fvisibility=hidden -I"$HEADERS")
  OBJ=build/kernels
  mkdir -p "$OBJ"
  # The tiles twice: for AVX2, and for AVX-512 VNNI, which the operator runs where the CPU has it.
  g++ "${FLAGS[@]}" -c "$TILES" -o "$OBJ/int8_tiles_avx2.o"
  g++ "${FLAGS[@]}" -mavx512f -mavx512vl -mavx512vnni -c "$TILES" -o "$OBJ/int8_tiles_avx512_vnni.o"
  g++ "${FLAGS[@]}" -shared -o "$OUT.tmp" "${SOURCES[@]}" "$OBJ/int8_tiles_avx2.o" "$OBJ/int8_tiles_avx512_vnni.o"
  mv "$OUT.tmp" "$OUT"
fi
echo "built $OUT"
