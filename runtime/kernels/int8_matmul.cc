// Int8MatMul: y = x W^T (+ bias) over int8 weights in blocks with a scale each, as exact integer
// products of 16-bit activations; an ONNX Runtime custom operator.
//
// On CPUs without VNNI, ONNX Runtime's 8-bit MatMulNBits pays for each extra row of a step almost
// what a separate step costs. Here each row is rounded to 16-bit integers over its own range and
// multiplied by the weights with vpmaddwd (sixteen products and eight pair sums an instruction,
// exact in int32), the weights widened to 16 bits in registers and used by every row of a tile.
// 16-bit activations round far less than MatMulNBits' 8-bit ones.
//
// Why a row's result cannot depend on the step: everything is computed within the row.
//   - row t is quantized with its own scale: q = round(x * (levels / max|x|)), s = max|x| / levels;
//   - a block's sum of q * w is an integer sum, exact in any order;
//   - eight lanes accumulate fma(float(block sum), scale[n, block], lane) block after block;
//   - the lanes are summed in one fixed order, times s, plus the bias.
// Tiles of fewer rows or columns run the same operations on fewer accumulators, so a tree step's
// rows equal one-row steps bitwise, on any CPU with AVX2.
//
// Inputs:  x [..., K] (fp32); weight [N, K] (int8, symmetric); scales [N, K / block] (fp32);
//          bias [N] (fp32, optional).
// Output:  y [..., N] (fp32).
// Attribute: block (32 or 64, dividing K).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kCols = 3;        // columns of a register tile
constexpr int64_t kRows = 3;        // rows of a register tile
constexpr int64_t kBlockRows = 48;  // rows of a task: their quantized inputs stay in L2 across its tiles
constexpr int64_t kGroupCols = 48;  // columns of a task

// Activations are rounded to +-kLevels: a block's sum of products stays far inside int32.
constexpr float kLevels = 32767.0f;

struct Product {
  const int16_t* q;       // [rows, k] quantized rows
  const float* row_scales;
  const int8_t* weight;   // [n, k]
  const float* scales;    // [n, k / block]
  const float* bias;      // or null
  float* y;
  int64_t rows, n, k, block, col_groups;
};

// The eight lanes summed in one fixed order.
inline float lane_sum(__m256 v) {
  const __m128 half = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  const __m128 pairs = _mm_add_ps(half, _mm_movehl_ps(half, half));
  return _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps(pairs, pairs, 1)));
}

// R rows by C columns from row t and column col, over blocks of B inputs. A column's weights are
// widened once per 16 inputs and multiplied with each row's inputs as read from L1, one column after
// another, so that the accumulators (R * C) and one column's block sums (R) fit in AVX2's 16
// registers with the widened weights and the scale: at 3 x 3, 14 (docs/benchmarks.md, "w8a16").
template <int R, int C, int B>
void tile(const Product& p, int64_t t, int64_t col) {
  __m256 acc[R][C];
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
  const int8_t* w[C];
  for (int c = 0; c < C; ++c) w[c] = p.weight + (col + c) * p.k;
  const int16_t* q[R];
  for (int r = 0; r < R; ++r) q[r] = p.q + (t + r) * p.k;
  const int64_t blocks = p.k / B;
  const float* scales = p.scales + col * blocks;
  for (int64_t b = 0; b < blocks; ++b) {
    // the next tile's weights, from memory while this tile's are multiplied
    for (int c = 0; c < C; ++c) _mm_prefetch(reinterpret_cast<const char*>(w[c] + C * p.k), _MM_HINT_T0);
    for (int c = 0; c < C; ++c) {
      __m256i sums[R];
      for (int j = 0; j < B; j += 16) {
        const __m256i wide = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[c] + j)));
        for (int r = 0; r < R; ++r) {
          const __m256i products =
              _mm256_madd_epi16(wide, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(q[r] + j)));
          sums[r] = j == 0 ? products : _mm256_add_epi32(sums[r], products);
        }
      }
      const __m256 scale = _mm256_broadcast_ss(scales + c * blocks + b);
      for (int r = 0; r < R; ++r) acc[r][c] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(sums[r]), scale, acc[r][c]);
    }
    for (int c = 0; c < C; ++c) w[c] += B;
    for (int r = 0; r < R; ++r) q[r] += B;
  }
  for (int r = 0; r < R; ++r)
    for (int c = 0; c < C; ++c) {
      float out = lane_sum(acc[r][c]) * p.row_scales[t + r];
      if (p.bias) out += p.bias[col + c];
      p.y[(t + r) * p.n + col + c] = out;
    }
}

template <int R, int C>
void tile(const Product& p, int64_t t, int64_t col) {
  if (p.block == 32) tile<R, C, 32>(p, t, col);
  else tile<R, C, 64>(p, t, col);
}

// A tile of R rows, or of fewer where fewer are left.
template <int C, int R = kRows>
void rows_tile(const Product& p, int64_t t, int64_t rows, int64_t col) {
  if constexpr (R > 1) {
    if (rows < R) return rows_tile<C, R - 1>(p, t, rows, col);
  }
  tile<R, C>(p, t, col);
}

template <int C>
void rows_of(const Product& p, int64_t t, int64_t rows, int64_t col) {
  for (int64_t r = 0; r < rows; r += kRows) rows_tile<C>(p, t + r, std::min(kRows, rows - r), col);
}

// A tile of C columns, or of fewer where fewer are left; the columns it took.
template <int C = kCols>
int64_t columns_tile(const Product& p, int64_t t, int64_t rows, int64_t col, int64_t left) {
  if constexpr (C > 1) {
    if (left < C) return columns_tile<C - 1>(p, t, rows, col, left);
  }
  rows_of<C>(p, t, rows, col);
  return C;
}

void product_task(const Product& p, size_t i) {
  const int64_t t = (static_cast<int64_t>(i) / p.col_groups) * kBlockRows;
  const int64_t rows = std::min(kBlockRows, p.rows - t);
  const int64_t first = (static_cast<int64_t>(i) % p.col_groups) * kGroupCols;
  const int64_t last = std::min(first + kGroupCols, p.n);
  for (int64_t col = first; col < last;) col += columns_tile(p, t, rows, col, last - col);
}

struct Quantization {
  const float* x;
  int16_t* q;
  float* row_scales;
  int64_t k;
};

// Row i to 16-bit levels over its own range (round half to even, as cvtps does by default).
void quantize_row(const Quantization& z, size_t i) {
  const float* x = z.x + i * z.k;
  int16_t* q = z.q + i * z.k;
  float top = 0.0f;
  for (int64_t k = 0; k < z.k; ++k) top = std::max(top, std::fabs(x[k]));
  const float scale = top / kLevels;
  const float inverse = top > 0.0f ? kLevels / top : 0.0f;
  z.row_scales[i] = scale;
  const __m256 by = _mm256_set1_ps(inverse);
  for (int64_t k = 0; k < z.k; k += 16) {
    const __m256i lo = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k), by));
    const __m256i hi = _mm256_cvtps_epi32(_mm256_mul_ps(_mm256_loadu_ps(x + k + 8), by));
    // packs interleaves 128-bit lanes; the permute puts the 16 values back in order
    const __m256i packed = _mm256_permute4x64_epi64(_mm256_packs_epi32(lo, hi), 0xd8);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(q + k), packed);
  }
}

struct Int8MatMulKernel {
  Int8MatMulKernel(const OrtApi& api, const OrtKernelInfo* info) : api_(api) {
    block_ = Ort::ConstKernelInfo(info).GetAttribute<int64_t>("block");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    auto x = ctx.GetInput(0), weight = ctx.GetInput(1), scales = ctx.GetInput(2);
    const auto x_shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const auto w_shape = weight.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t n = w_shape.size() == 2 ? w_shape[0] : -1, k = w_shape.size() == 2 ? w_shape[1] : -1;
    if (x_shape.empty() || k <= 0 || x_shape.back() != k || (block_ != 32 && block_ != 64) || k % block_ != 0 ||
        scales.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n * (k / block_)))
      ORT_CXX_API_THROW("Int8MatMul: x [..., K], weight [N, K], scales [N, K / block] and block (32 or 64, "
                        "dividing K) do not match", ORT_INVALID_ARGUMENT);
    const float* bias = nullptr;
    if (ctx.GetInputCount() > 3) {
      if (auto b = ctx.GetInput(3)) {
        if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n))
          ORT_CXX_API_THROW("Int8MatMul: bias does not match the weight's rows", ORT_INVALID_ARGUMENT);
        bias = b.GetTensorData<float>();
      }
    }
    std::vector<int64_t> y_shape(x_shape.begin(), x_shape.end());
    y_shape.back() = n;
    auto y = ctx.GetOutput(0, y_shape);
    const int64_t rows = static_cast<int64_t>(x.GetTensorTypeAndShapeInfo().GetElementCount()) / k;
    if (rows == 0 || n == 0) return;

    std::vector<int16_t> q(rows * k);  // local: a session may run steps from several threads
    std::vector<float> row_scales(rows);
    Quantization z{x.GetTensorData<float>(), q.data(), row_scales.data(), k};
    auto quantize = [](void* data, size_t i) { quantize_row(*static_cast<const Quantization*>(data), i); };
    Ort::ThrowOnError(api_.KernelContext_ParallelFor(raw, quantize, rows, 0, &z));

    Product p{q.data(), row_scales.data(), weight.GetTensorData<int8_t>(), scales.GetTensorData<float>(), bias,
              y.GetTensorMutableData<float>(), rows, n, k, block_, (n + kGroupCols - 1) / kGroupCols};
    const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
    auto multiply = [](void* data, size_t i) { product_task(*static_cast<const Product*>(data), i); };
    Ort::ThrowOnError(api_.KernelContext_ParallelFor(raw, multiply, row_blocks * p.col_groups, 0, &p));
  }

 private:
  const OrtApi& api_;
  int64_t block_;
};

struct Int8MatMulOp : Ort::CustomOpBase<Int8MatMulOp, Int8MatMulKernel> {
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new Int8MatMulKernel(api, info); }
  const char* GetName() const { return "Int8MatMul"; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 4; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    return i == 1 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  OrtCustomOpInputOutputCharacteristic GetInputCharacteristic(size_t i) const {
    return i == 3 ? INPUT_OUTPUT_OPTIONAL : INPUT_OUTPUT_REQUIRED;
  }
  size_t GetOutputTypeCount() const { return 1; }
  ONNXTensorElementDataType GetOutputType(size_t) const { return ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT; }
};

Int8MatMulOp int8_matmul_op;

}  // namespace

OrtStatus* AddInt8MatMulOps(const OrtApi* api, OrtCustomOpDomain* domain) {
  return api->CustomOpDomain_Add(domain, &int8_matmul_op);
}
