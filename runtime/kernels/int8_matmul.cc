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
// equal one-row steps bitwise, on any CPU with AVX2; the AVX-512 VNNI build of the tiles adds the
// same integers (int8_tiles.cc), so an artifact's outputs are the same bits on every such CPU.
// EAGLE2_INT8_MATMUL=avx2 in the environment runs the AVX2 build where VNNI is there too.
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
#include <cstdlib>
#include <cstring>
#include <vector>

#include "int8_matmul.h"
#include "ops.h"

namespace {

using int8_matmul::kBlockRows;
using int8_matmul::kGroupPanels;
using int8_matmul::kPanel;
using int8_matmul::Product;

// Activations are rounded to +-kLevels: a block's sum of products stays far inside int32.
constexpr float kLevels = 32767.0f;

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

using ProductTask = void (*)(const Product&, size_t);

struct Multiplication {
  Product p;
  ProductTask task;
};

// The tiles' build for this CPU: AVX-512 VNNI's where it has VNNI on 256-bit registers.
ProductTask tiles_for_this_cpu() {
  const char* asked = std::getenv("EAGLE2_INT8_MATMUL");
  const bool avx2_asked = asked != nullptr && std::strcmp(asked, "avx2") == 0;
  if (!avx2_asked && __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("avx512vl"))
    return int8_matmul::avx512_vnni::product_task;
  return int8_matmul::avx2::product_task;
}

struct Int8MatMulKernel {
  Int8MatMulKernel(const OrtApi& api, const OrtKernelInfo* info) : api_(api), task_(tiles_for_this_cpu()) {
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

    Multiplication m{{q.data(), row_scales.data(), weight.GetTensorData<int8_t>(), scales.GetTensorData<float>(), bias,
                      y.GetTensorMutableData<float>(), rows, n_, k, block_, panels,
                      (panels + kGroupPanels - 1) / kGroupPanels},
                     task_};
    const int64_t row_blocks = (rows + kBlockRows - 1) / kBlockRows;
    auto multiply = [](void* data, size_t i) {
      const auto& m = *static_cast<const Multiplication*>(data);
      m.task(m.p, i);
    };
    Ort::ThrowOnError(api_.KernelContext_ParallelFor(raw, multiply, row_blocks * m.p.panel_groups, 0, &m));
  }

 private:
  const OrtApi& api_;
  const ProductTask task_;
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
