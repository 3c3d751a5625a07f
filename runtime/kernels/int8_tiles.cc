// Int8MatMul's register tiles (int8_matmul.cc), compiled twice by ci/build_kernels.sh: with AVX2,
// where a pair of 16-bit products is vpmaddwd then vpaddd, and with AVX-512 VNNI, where vpdpwssd
// does both in one instruction on the same 256-bit lanes. Both add the same integers, exactly, and
// then run the same float operations per column: their outputs are the same bits.
#include <immintrin.h>

#include <algorithm>
#include <cstring>

#include "int8_matmul.h"

#if defined(__AVX512VNNI__) && defined(__AVX512VL__)
#define INT8_TILES avx512_vnni
#define INT8_TILES_VNNI 1
#else
#define INT8_TILES avx2
#define INT8_TILES_VNNI 0
#endif

namespace int8_matmul::INT8_TILES {
namespace {

constexpr int64_t kPanels = 2;       // panels of a register tile
constexpr int64_t kRows = 4;         // rows of a register tile
constexpr int64_t kPrefetch = 8192;  // bytes of a panel read ahead (docs/benchmarks.md, "w8a16 in panels")

// sums + the products of a row's input pair (broadcast) with 8 columns' weight pairs, in int32
inline __m256i add_products(__m256i sums, __m256i weights, __m256i pair) {
#if INT8_TILES_VNNI
  return _mm256_dpwssd_epi32(sums, weights, pair);
#else
  return _mm256_add_epi32(sums, _mm256_madd_epi16(weights, pair));
#endif
}

// A row's inputs k, k + 1 in every int32 lane.
inline __m256i input_pair(const int16_t* q) {
  int32_t pair;
  std::memcpy(&pair, q, sizeof pair);
  return _mm256_set1_epi32(pair);
}

// R rows by P panels from row t and panel `panel`, over blocks of B inputs: a block's sums (R * P)
// in registers with the widened weights (P) and the broadcast pair (docs/benchmarks.md, "w8a16 in panels").
template <int R, int P, int B>
void tile(const Product& p, int64_t t, int64_t panel) {
  __m256 acc[R][P];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < P; ++c) acc[r][c] = _mm256_setzero_ps();
  const int64_t blocks = p.k / B;
  const int8_t* w[P];
  const float* scales[P];
  for (int c = 0; c < P; ++c) {
    w[c] = p.weight + (panel + c) * p.k * kPanel;
    scales[c] = p.scales + (panel + c) * blocks * kPanel;
  }
  const int16_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = p.q + (t + r) * p.k;
  for (int64_t b = 0; b < blocks; ++b) {
    // this block's share of the weights kPrefetch bytes on: memory keeps streaming while rows multiply
    // (past the last panel's end too: a prefetch never faults, and those lines go unused)
    for (int c = 0; c < P; ++c)
      for (int64_t line = 0; line < B * kPanel; line += 64)
        _mm_prefetch(reinterpret_cast<const char*>(w[c] + kPrefetch + line), _MM_HINT_T0);
    __m256i sums[R][P];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < P; ++c) sums[r][c] = _mm256_setzero_si256();
#if INT8_TILES_VNNI
    // unrolled, the tile's sums stay in AVX-512's 32 registers (not copied each pair); AVX2's 16 would spill
#pragma GCC unroll 32
#endif
    for (int j = 0; j < B; j += 2) {
      __m256i wide[P];
      for (int c = 0; c < P; ++c)
        wide[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[c] + j * kPanel)));
      for (int r = 0; r < R; ++r) {
        const __m256i pair = input_pair(q[r] + j);
        for (int c = 0; c < P; ++c) sums[r][c] = add_products(sums[r][c], wide[c], pair);
      }
    }
    for (int c = 0; c < P; ++c) {
      const __m256 scale = _mm256_loadu_ps(scales[c] + b * kPanel);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r][c]), scale, acc[r][c]);
      w[c] += B * kPanel;
    }
    for (int r = 0; r < R; ++r) q[r] += B;
  }
  for (int c = 0; c < P; ++c) {
    const int64_t col = (panel + c) * kPanel;
    const int64_t width = std::min(kPanel, p.n - col);
    alignas(32) float bias_lanes[kPanel] = {};
    if (p.bias) std::memcpy(bias_lanes, p.bias + col, width * sizeof(float));
    const __m256 bias = _mm256_load_ps(bias_lanes);
    for (int r = 0; r < R; ++r) {
      alignas(32) float out[kPanel];
      _mm256_store_ps(out, _mm256_add_ps(_mm256_mul_ps(acc[r][c], _mm256_set1_ps(p.row_scales[t + r])), bias));
      std::memcpy(p.y + (t + r) * p.n + col, out, width * sizeof(float));
    }
  }
}

template <int R, int P>
void tile(const Product& p, int64_t t, int64_t panel) {
  if (p.block == 32) tile<R, P, 32>(p, t, panel);
  else tile<R, P, 64>(p, t, panel);
}

// A tile of R rows, or of fewer where fewer are left.
template <int P, int R = kRows>
void rows_tile(const Product& p, int64_t t, int64_t rows, int64_t panel) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<P, R - 1>(p, t, rows, panel);
  }
  tile<R, P>(p, t, panel);
}

template <int P>
void rows_of(const Product& p, int64_t t, int64_t rows, int64_t panel) {
  for (int64_t r = 0; r < rows; r += kRows) rows_tile<P>(p, t + r, std::min(kRows, rows - r), panel);
}

// A tile of P panels, or of fewer where fewer are left; the panels it took.
template <int P = kPanels>
int64_t panels_tile(const Product& p, int64_t t, int64_t rows, int64_t panel, int64_t left) {
  if constexpr (P > 1) {
    if (left < P) return panels_tile<P - 1>(p, t, rows, panel, left);
  }
  rows_of<P>(p, t, rows, panel);
  return P;
}

}  // namespace

void product_task(const Product& p, size_t i) {
  const int64_t t = (static_cast<int64_t>(i) / p.panel_groups) * kBlockRows;
  const int64_t rows = std::min(kBlockRows, p.rows - t);
  const int64_t first = (static_cast<int64_t>(i) % p.panel_groups) * kGroupPanels;
  const int64_t last = std::min(first + kGroupPanels, p.panels);
  for (int64_t panel = first; panel < last;) panel += panels_tile(p, t, rows, panel, last - panel);
}

}  // namespace int8_matmul::INT8_TILES
