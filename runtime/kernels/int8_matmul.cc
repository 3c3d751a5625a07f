// Int8MatMul: y = x W^T (+ bias) over int8 weights in blocks with a scale each, as exact integer
// products of 16-bit activations; an ONNX Runtime custom operator.
//
// On CPUs without VNNI, ONNX Runtime's 8-bit MatMulNBits pays for each extra row of a step almost
// what a separate step costs. Here each row is rounded to 16-bit integers over its own range and
// multiplied by the weights with vpmaddwd, exact in int32, the weights widened to 16 bits in
// registers and used by every row of a tile. 16-bit activations round far less than MatMulNBits'
// 8-bit ones.
//
// The weights are stored in panels of 8 columns, each pair of inputs k, k + 1 as 8 column pairs, so
// that one vpmaddwd multiplies a row's pair (broadcast) by 8 columns at once and leaves each
// column's partial sum in its own lane: a block's sum is added up in int32 lanes and turned into a
// float once per block and 8 columns, with no sum across lanes (docs/benchmarks.md, "w8a16 in panels").
//
// Why a row's result cannot depend on the step: everything is computed within the row.
//   - row t is quantized with its own scale: q = round(x * (levels / max|x|)), s = max|x| / levels;
//   - a block's sum of q * w is an integer sum, exact in any order;
//   - column n accumulates fma(float(block sum), scale[n, block], acc) block after block;
//   - then times s, plus the bias.
// Tiles of fewer rows or panels run the same operations on fewer lanes, so a tree step's rows
// equal one-row steps bitwise, on any CPU with AVX2.
//
// Inputs:  x [..., K] (fp32); weight [P, K / 2, 16] (int8, symmetric: panel p, input pair j holds
//          w[8p + c, 2j + i] at 2c + i); scales [P, K / block, 8] (fp32: scale[8p + c, b] at c);
//          bias [N] (fp32, optional). Columns past N in the last panel are zeros.
// Output:  y [..., N] (fp32).
// Attributes: block (32 or 64, dividing K); columns (N, 8P - 8 < N <= 8P).
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#include "ops.h"

namespace {

constexpr int64_t kPanel = 8;        // columns of a panel: an int32 lane each
constexpr int64_t kPanels = 2;       // panels of a register tile
constexpr int64_t kRows = 4;         // rows of a register tile
constexpr int64_t kBlockRows = 48;   // rows of a task: their quantized inputs stay in L2 across its tiles
constexpr int64_t kGroupPanels = 6;  // panels of a task
constexpr int64_t kPrefetch = 8192;  // bytes of a panel read ahead (docs/benchmarks.md, "w8a16 in panels")

// Activations are rounded to +-kLevels: a block's sum of products stays far inside int32.
constexpr float kLevels = 32767.0f;

struct Product {
  const int16_t* q;       // [rows, k] quantized rows
  const float* row_scales;
  const int8_t* weight;   // [panels, k / 2, 16]
  const float* scales;    // [panels, k / block, 8]
  const float* bias;      // [n] or null
  float* y;
  int64_t rows, n, k, block, panels, panel_groups;
};

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
    for (int j = 0; j < B; j += 2) {
      __m256i wide[P];
      for (int c = 0; c < P; ++c)
        wide[c] = _mm256_cvtepi8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(w[c] + j * kPanel)));
      for (int r = 0; r < R; ++r) {
        const __m256i pair = input_pair(q[r] + j);
        for (int c = 0; c < P; ++c) {
          const __m256i products = _mm256_madd_epi16(wide[c], pair);
          sums[r][c] = j == 0 ? products : _mm256_add_epi32(sums[r][c], products);
        }
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

void product_task(const Product& p, size_t i) {
  const int64_t t = (static_cast<int64_t>(i) / p.panel_groups) * kBlockRows;
  const int64_t rows = std::min(kBlockRows, p.rows - t);
  const int64_t first = (static_cast<int64_t>(i) % p.panel_groups) * kGroupPanels;
  const int64_t last = std::min(first + kGroupPanels, p.panels);
  for (int64_t panel = first; panel < last;) panel += panels_tile(p, t, rows, panel, last - panel);
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
    Ort::ConstKernelInfo kernel_info(info);
    block_ = kernel_info.GetAttribute<int64_t>("block");
    n_ = kernel_info.GetAttribute<int64_t>("columns");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    auto x = ctx.GetInput(0), weight = ctx.GetInput(1), scales = ctx.GetInput(2);
    const auto x_shape = x.GetTensorTypeAndShapeInfo().GetShape();
    const auto w_shape = weight.GetTensorTypeAndShapeInfo().GetShape();
    const int64_t panels = w_shape.size() == 3 ? w_shape[0] : -1, k = w_shape.size() == 3 ? 2 * w_shape[1] : -1;
    if (w_shape.size() != 3 || w_shape[2] != 2 * kPanel)
      ORT_CXX_API_THROW("Int8MatMul: weight is not in panels [P, K / 2, 16] (an artifact exported before them: "
                        "export it again)", ORT_INVALID_ARGUMENT);
    if (x_shape.empty() || k <= 0 || x_shape.back() != k || (block_ != 32 && block_ != 64) || k % block_ != 0 ||
        n_ <= (panels - 1) * kPanel || n_ > panels * kPanel ||
        scales.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(panels * (k / block_) * kPanel))
      ORT_CXX_API_THROW("Int8MatMul: x [..., K], weight [P, K / 2, 16], scales [P, K / block, 8], block (32 or 64, "
                        "dividing K) and columns (in the last panel) do not match", ORT_INVALID_ARGUMENT);
    const float* bias = nullptr;
    if (ctx.GetInputCount() > 3) {
      if (auto b = ctx.GetInput(3)) {
        if (b.GetTensorTypeAndShapeInfo().GetElementCount() != static_cast<size_t>(n_))
          ORT_CXX_API_THROW("Int8MatMul: bias does not match the columns", ORT_INVALID_ARGUMENT);
        bias = b.GetTensorData<float>();
      }
    }
    std::vector<int64_t> y_shape(x_shape.begin(), x_shape.end());
    y_shape.back() = n_;
    auto y = ctx.GetOutput(0, y_shape);
    const int64_t rows = static_cast<int64_t>(x.GetTensorTypeAndShapeInfo().GetElementCount()) / k;
    if (rows == 0) return;

    std::vector<int16_t> q(rows * k);  // local: a session may run steps from several threads
    std::vector<float> row_scales(rows);
    Quantization z{x.GetTensorData<float>(), q.data(), row_scales.data(), k};
    auto quantize = [](void* data, size_t i) { quantize_row(*static_cast<const Quantization*>(data), i); };
    Ort::ThrowOnError(api_.KernelContext_ParallelFor(raw, quantize, rows, 0, &z));

    Product p{q.data(), row_scales.data(), weight.GetTensorData<int8_t>(), scales.GetTensorData<float>(), bias,
              y.GetTensorMutableData<float>(), rows, n_, k, block_, panels,
              (panels + kGroupPanels - 1) / kGroupPanels};
    const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
    auto multiply = [](void* data, size_t i) { product_task(*static_cast<const Product*>(data), i); };
    Ort::ThrowOnError(api_.KernelContext_ParallelFor(raw, multiply, row_blocks * p.panel_groups, 0, &p));
  }

 private:
  const OrtApi& api_;
  int64_t block_, n_;
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
