// CacheAttention: tree attention over an in-place KV cache, an ONNX Runtime custom operator.
//
// The exact attention built from standard operators (export/onnx_graph.py) reads every position of
// a step's capacity for every sequence, in fp32. This operator reads, for each row, only the
// positions its attention bias allows, from a cache stored in fp32 or fp16, and keeps each row's
// arithmetic independent of everything else in the step:
//   - every sum over keys (the softmax's denominator, the weighted values) runs over positions in
//     order, a masked key adding an exact zero, so the same keys placed at other slots (a tree's
//     nodes before compaction, the same tokens after it) give the same bits;
//   - a key's score and weight are computed element by element, the same instructions wherever the
//     key sits; sums over the head dimension use one fixed lane layout;
//   - the work is split into tasks of (consecutive rows of one sequence, query head), and a row's
//     instructions are the same whichever other rows share its task.
// So a tree step's rows equal one-row steps bitwise, whatever the rows, sequences and capacity.
//
// Inputs:  q [T, heads*d], k [T, kv*d], v [T, kv*d] (rotated, fp32); past_key, past_value
//          [S, kv, capacity, d] (fp32 or fp16); attention_bias [S, 1, M, capacity] (fp32);
//          row_scatter [T] (row t's place among the bias's S*M rows); cache_sequences [T];
//          cache_slots [T] (where row t's key and value are written).
// Outputs: attention [T, heads*d]; present_key, present_value (the caches with the step's rows
//          written; bound to the past buffers, the write is in place).
// Attributes: num_heads, kv_num_heads, scale.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include <immintrin.h>

#include <cfloat>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <limits>
#include <string>
#include <vector>

#include "ops.h"

namespace {

// Keys whose bias is at or below this are masked (the runtime masks with the float's lowest value).
constexpr float kMasked = -std::numeric_limits<float>::max() / 2;

inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const uint16_t* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

inline void store_row(float* dst, const float* src, int64_t n) { std::memcpy(dst, src, n * sizeof(float)); }
inline void store_row(uint16_t* dst, const float* src, int64_t n) {
  int64_t i = 0;
  for (; i + 8 <= n; i += 8)
    _mm_storeu_si128(reinterpret_cast<__m128i*>(dst + i),
                     _mm256_cvtps_ph(_mm256_loadu_ps(src + i), _MM_FROUND_TO_NEAREST_INT));
  for (; i < n; ++i) dst[i] = _cvtss_sh(src[i], _MM_FROUND_TO_NEAREST_INT);
}

// exp(x) for x <= 0 (scores minus their maximum), floored at e^-80 as the exact attention's softmax
// is (products of such weights and values stay clear of subnormal floats, which cost CPUs dearly):
// a polynomial on x - n ln2, scaled by 2^n.
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-80.0f));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.0f)));
  const __m256i pow2n = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(pow2n));
}

// The eight dot products of acc[0..7] (one per key, eight partial sums each), as one vector: every
// key's lanes are added in the same tree, ((0+1)+(2+3))+((4+5)+(6+7)).
inline __m256 dot8(const __m256* acc) {
  const __m256 u0 = _mm256_hadd_ps(_mm256_hadd_ps(acc[0], acc[1]), _mm256_hadd_ps(acc[2], acc[3]));
  const __m256 u1 = _mm256_hadd_ps(_mm256_hadd_ps(acc[4], acc[5]), _mm256_hadd_ps(acc[6], acc[7]));
  return _mm256_add_ps(_mm256_permute2f128_ps(u0, u1, 0x20), _mm256_permute2f128_ps(u0, u1, 0x31));
}

// A task: query rows that share one kv head's keys and values, up to kQueryRows of them: some
// consecutive rows of one sequence in the step (a prefill chunk's, a tree's), each with the query
// heads [head, head + heads) of one kv group. Its sums are computed side by side, so that every key
// and value read serves all of them.
constexpr int64_t kQueryRows = 8;

struct Task {
  int64_t first, rows, sequence, head, heads;
  int64_t extent;  // past the last position any of its rows sees
};

struct Step {
  const float* q;
  const float* bias;
  const int64_t* row_scatter;
  const int64_t* extents;  // per row: past the last position the row sees
  const Task* tasks;
  const void* keys;
  const void* values;
  float* out;
  int64_t heads, kv_heads, d, capacity;
  float scale;
};

// Per-thread scratch of a task: the keys of a batch in fp32, and per query row its scores and
// weights by position.
struct Scratch {
  std::vector<float> keys, scores, weights;
  void reserve(int64_t rows, int64_t positions, int64_t d) {
    const size_t need = static_cast<size_t>(rows * positions);
    if (scores.size() < need) { scores.resize(need); weights.resize(need); }
    if (keys.size() < static_cast<size_t>(8 * d)) keys.resize(8 * d);
  }
};

// The weighted values of R query rows, divided by the sum of their weights. Each row's sums over the
// positions are taken in position order (a masked key, or one past the row's extent, adds an exact
// zero, so the same keys at other slots give the same sums), eight columns of the head at a time; C
// column blocks go at once, so that about eight independent sums are in flight whatever R is. The
// order of each sum is the same for every R and C.
template <int R, typename Cache>
void weigh_values(const Cache* values, const float* weights, int64_t stride, int64_t extent, int64_t d,
                  float* const* out) {
  constexpr int C = R >= 8 ? 1 : 8 / R;
  float total[R] = {};
  for (int64_t j0 = 0; j0 < d; j0 += 8 * C) {
    const int blocks = static_cast<int>(std::min<int64_t>(C, (d - j0) / 8));
    __m256 acc[R][C];
    for (int r = 0; r < R; ++r)
      for (int c = 0; c < C; ++c) acc[r][c] = _mm256_setzero_ps();
    for (int64_t p = 0; p < extent; ++p) {
      __m256 v[C];
      for (int c = 0; c < blocks; ++c) v[c] = load8(values + p * d + j0 + 8 * c);
      for (int r = 0; r < R; ++r) {
        const float w = weights[r * stride + p];
        if (j0 == 0) total[r] += w;
        const __m256 wv = _mm256_set1_ps(w);
        for (int c = 0; c < blocks; ++c) acc[r][c] = _mm256_fmadd_ps(wv, v[c], acc[r][c]);
      }
    }
    for (int r = 0; r < R; ++r) {
      const __m256 inverse = _mm256_set1_ps(total[r] > 0.0f ? 1.0f / total[r] : 0.0f);
      for (int c = 0; c < blocks; ++c) _mm256_storeu_ps(out[r] + j0 + 8 * c, _mm256_mul_ps(acc[r][c], inverse));
    }
  }
}

template <typename Cache>
void attend(const Step& s, const Task& task) {
  thread_local Scratch scratch;
  const int64_t d = s.d, group = s.heads / s.kv_heads, n = task.rows * task.heads;
  const int64_t extent = (task.extent + 7) & ~int64_t{7};  // whole batches of eight keys
  scratch.reserve(n, extent, d);
  const int64_t base = (task.sequence * s.kv_heads + task.head / group) * s.capacity * d;
  const Cache* keys = static_cast<const Cache*>(s.keys) + base;
  const Cache* values = static_cast<const Cache*>(s.values) + base;
  float* scores = scratch.scores.data();
  float* weights = scratch.weights.data();
  float* batch = scratch.keys.data();
  // Query row i: row first + i / heads of the step, query head head + i % heads.
  const float* q[kQueryRows];
  float* out[kQueryRows];
  int64_t row_of[kQueryRows];
  for (int64_t i = 0; i < n; ++i) {
    row_of[i] = task.first + i / task.heads;
    const int64_t at = (row_of[i] * s.heads + task.head + i % task.heads) * d;
    q[i] = s.q + at;
    out[i] = s.out + at;
  }

  // Scores against every key up to the task's extent, eight keys at a time. A key's score is the
  // same instructions whichever row, batch or task it is computed in.
  for (int64_t p = 0; p < extent; p += 8) {
    for (int64_t k = 0; k < 8; ++k) {  // keys past the capacity read as zeros (and are masked)
      if (p + k < s.capacity) {
        for (int64_t j = 0; j < d; j += 8) _mm256_storeu_ps(batch + k * d + j, load8(keys + (p + k) * d + j));
      } else {
        std::memset(batch + k * d, 0, d * sizeof(float));
      }
    }
    for (int64_t i = 0; i < n; ++i) {
      if (p >= s.extents[row_of[i]]) continue;
      __m256 acc[8];
      const __m256 q0 = _mm256_loadu_ps(q[i]);
      for (int k = 0; k < 8; ++k) acc[k] = _mm256_mul_ps(q0, _mm256_loadu_ps(batch + k * d));
      for (int64_t j = 8; j < d; j += 8) {
        const __m256 qj = _mm256_loadu_ps(q[i] + j);
        for (int k = 0; k < 8; ++k) acc[k] = _mm256_fmadd_ps(qj, _mm256_loadu_ps(batch + k * d + j), acc[k]);
      }
      _mm256_storeu_ps(scores + i * extent + p, _mm256_mul_ps(dot8(acc), _mm256_set1_ps(s.scale)));
    }
  }

  // Per query row: exp(score - the row's maximum) at each allowed position, an exact zero elsewhere
  // up to the task's extent. Element by element, so a key's weight does not depend on where it sits.
  const __m256i lanes = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
  for (int64_t i = 0; i < n; ++i) {
    const int64_t row_extent = s.extents[row_of[i]];
    const float* bias = s.bias + s.row_scatter[row_of[i]] * s.capacity;
    float* row_scores = scores + i * extent;
    float* row_weights = weights + i * extent;
    auto allowed = [&](int64_t p, __m256* b) {  // bias at p..p+7, and which of those keys the row sees
      const __m256i inside = _mm256_cmpgt_epi32(_mm256_set1_epi32(static_cast<int>(row_extent - p)), lanes);
      *b = _mm256_maskload_ps(bias + p, inside);
      return _mm256_and_ps(_mm256_castsi256_ps(inside), _mm256_cmp_ps(*b, _mm256_set1_ps(kMasked), _CMP_GT_OQ));
    };
    __m256 top = _mm256_set1_ps(-FLT_MAX);
    for (int64_t p = 0; p < row_extent; p += 8) {
      __m256 b;
      const __m256 keep = allowed(p, &b);
      const __m256 score = _mm256_add_ps(_mm256_loadu_ps(row_scores + p), b);
      _mm256_storeu_ps(row_scores + p, score);
      top = _mm256_max_ps(top, _mm256_blendv_ps(_mm256_set1_ps(-FLT_MAX), score, keep));
    }
    top = _mm256_max_ps(top, _mm256_permute2f128_ps(top, top, 1));
    top = _mm256_max_ps(top, _mm256_permute_ps(top, 0x4E));
    top = _mm256_max_ps(top, _mm256_permute_ps(top, 0xB1));
    for (int64_t p = 0; p < extent; p += 8) {
      if (p >= row_extent) {
        _mm256_storeu_ps(row_weights + p, _mm256_setzero_ps());
        continue;
      }
      __m256 b;
      const __m256 keep = allowed(p, &b);
      const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(row_scores + p), top));
      _mm256_storeu_ps(row_weights + p, _mm256_and_ps(e, keep));
    }
  }

  switch (n) {
    case 1: weigh_values<1>(values, weights, extent, task.extent, d, out); break;
    case 2: weigh_values<2>(values, weights, extent, task.extent, d, out); break;
    case 3: weigh_values<3>(values, weights, extent, task.extent, d, out); break;
    case 4: weigh_values<4>(values, weights, extent, task.extent, d, out); break;
    case 5: weigh_values<5>(values, weights, extent, task.extent, d, out); break;
    case 6: weigh_values<6>(values, weights, extent, task.extent, d, out); break;
    case 7: weigh_values<7>(values, weights, extent, task.extent, d, out); break;
    default: weigh_values<8>(values, weights, extent, task.extent, d, out); break;
  }
}

template <typename Cache>
struct CacheAttentionKernel {
  CacheAttentionKernel(const OrtApi& api, const OrtKernelInfo* info) : api_(api) {
    Ort::ConstKernelInfo ki(info);
    heads_ = ki.GetAttribute<int64_t>("num_heads");
    kv_heads_ = ki.GetAttribute<int64_t>("kv_num_heads");
    scale_ = ki.GetAttribute<float>("scale");
  }

  void Compute(OrtKernelContext* raw) {
    Ort::KernelContext ctx(raw);
    auto q = ctx.GetInput(0), k = ctx.GetInput(1), v = ctx.GetInput(2);
    auto past_key = ctx.GetInput(3), past_value = ctx.GetInput(4), bias = ctx.GetInput(5);
    auto row_scatter = ctx.GetInput(6), sequences = ctx.GetInput(7), slots = ctx.GetInput(8);
    const auto cache_shape = past_key.GetTensorTypeAndShapeInfo().GetShape();  // [S, kv, capacity, d]
    const int64_t rows = row_scatter.GetTensorTypeAndShapeInfo().GetElementCount();
    const int64_t d = cache_shape[3], capacity = cache_shape[2];
    if (cache_shape[1] != kv_heads_ || d % 8 != 0 || heads_ % kv_heads_ != 0 ||
        q.GetTensorTypeAndShapeInfo().GetElementCount() != rows * heads_ * d ||
        bias.GetTensorTypeAndShapeInfo().GetShape().back() != capacity)
      ORT_CXX_API_THROW("CacheAttention: inputs do not match num_heads, kv_num_heads and the caches", ORT_INVALID_ARGUMENT);

    auto out = ctx.GetOutput(0, {rows, heads_ * d});
    auto present_key = ctx.GetOutput(1, cache_shape);
    auto present_value = ctx.GetOutput(2, cache_shape);
    const size_t cache_elements = past_key.GetTensorTypeAndShapeInfo().GetElementCount();
    Cache* keys = present_key.GetTensorMutableData<Cache>();
    Cache* values = present_value.GetTensorMutableData<Cache>();
    // Bound to the past buffers the caches are written in place; otherwise copied first.
    if (keys != past_key.GetTensorData<Cache>()) std::memcpy(keys, past_key.GetTensorData<Cache>(), cache_elements * sizeof(Cache));
    if (values != past_value.GetTensorData<Cache>()) std::memcpy(values, past_value.GetTensorData<Cache>(), cache_elements * sizeof(Cache));

    const int64_t* seq = sequences.GetTensorData<int64_t>();
    const int64_t* slot = slots.GetTensorData<int64_t>();
    const float* k_rows = k.GetTensorData<float>();
    const float* v_rows = v.GetTensorData<float>();
    for (int64_t t = 0; t < rows; ++t)
      for (int64_t h = 0; h < kv_heads_; ++h) {
        const int64_t at = ((seq[t] * kv_heads_ + h) * capacity + slot[t]) * d;
        store_row(keys + at, k_rows + (t * kv_heads_ + h) * d, d);
        store_row(values + at, v_rows + (t * kv_heads_ + h) * d, d);
      }

    // Each row's extent, and the tasks: runs of consecutive rows of one sequence, by query heads of
    // one kv group, at most kQueryRows query rows each.
    const float* bias_rows = bias.GetTensorData<float>();
    const int64_t* scatter = row_scatter.GetTensorData<int64_t>();
    const int64_t group = heads_ / kv_heads_;
    const int64_t heads_per_task = std::min(group, kQueryRows), rows_per_task = kQueryRows / heads_per_task;
    std::vector<int64_t> extents(rows);  // local: a session may run steps from several threads
    std::vector<Task> runs;
    for (int64_t t = 0; t < rows; ++t) {
      const float* b = bias_rows + scatter[t] * capacity;
      int64_t extent = capacity;
      while (extent > 0 && b[extent - 1] <= kMasked) --extent;
      extents[t] = extent;
      if (runs.empty() || runs.back().sequence != seq[t] || runs.back().rows == rows_per_task) {
        runs.push_back({t, 1, seq[t], 0, 0, extent});
      } else {
        ++runs.back().rows;
        runs.back().extent = std::max(runs.back().extent, extent);
      }
    }
    std::vector<Task> tasks;
    for (const Task& run : runs)
      for (int64_t head = 0; head < heads_; head += heads_per_task) {
        Task task = run;
        task.head = head;
        task.heads = std::min(heads_per_task, (head / group + 1) * group - head);
        tasks.push_back(task);
      }
    Step step{q.GetTensorData<float>(), bias_rows, scatter, extents.data(), tasks.data(), keys, values,
              out.GetTensorMutableData<float>(), heads_, kv_heads_, d, capacity, scale_};
    auto run = [](void* data, size_t i) {
      const Step& s = *static_cast<const Step*>(data);
      attend<Cache>(s, s.tasks[i]);
    };
    Ort::ThrowOnError(api_.KernelContext_ParallelFor(raw, run, tasks.size(), 0, &step));
  }

 private:
  const OrtApi& api_;
  int64_t heads_, kv_heads_;
  float scale_;
};

template <typename Cache, ONNXTensorElementDataType kCacheType>
struct CacheAttentionOp : Ort::CustomOpBase<CacheAttentionOp<Cache, kCacheType>, CacheAttentionKernel<Cache>> {
  explicit CacheAttentionOp(const char* name) : name_(name) {}
  void* CreateKernel(const OrtApi& api, const OrtKernelInfo* info) const { return new CacheAttentionKernel<Cache>(api, info); }
  const char* GetName() const { return name_; }
  const char* GetExecutionProviderType() const { return "CPUExecutionProvider"; }
  size_t GetInputTypeCount() const { return 9; }
  ONNXTensorElementDataType GetInputType(size_t i) const {
    if (i == 3 || i == 4) return kCacheType;
    return i >= 6 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64 : ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
  }
  size_t GetOutputTypeCount() const { return 3; }
  ONNXTensorElementDataType GetOutputType(size_t i) const { return i == 0 ? ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT : kCacheType; }

 private:
  const char* name_;
};

CacheAttentionOp<float, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT> fp32_cache_op("CacheAttention");
CacheAttentionOp<uint16_t, ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16> fp16_cache_op("CacheAttentionF16");

}  // namespace

OrtStatus* AddCacheAttentionOps(const OrtApi* api, OrtCustomOpDomain* domain) {
  if (OrtStatus* status = api->CustomOpDomain_Add(domain, &fp32_cache_op)) return status;
  return api->CustomOpDomain_Add(domain, &fp16_cache_op);
}
