// The products of Int8MatMul (int8_matmul.cc) as tasks over its register tiles (int8_tiles.cc),
// compiled once for AVX2 and once for AVX-512 VNNI; the operator runs the build this CPU can.
#pragma once

#include <cstddef>
#include <cstdint>

namespace int8_matmul {

constexpr int64_t kPanel = 8;        // columns of a panel: an int32 lane each
constexpr int64_t kBlockRows = 48;   // rows of a task: their quantized inputs stay in L2 across its tiles
constexpr int64_t kGroupPanels = 6;  // panels of a task

struct Product {
  const int16_t* q;       // [rows, k] quantized rows
  const float* row_scales;
  const int8_t* weight;   // [panels, k / 2, 16]
  const float* scales;    // [panels, k / block, 8]
  const float* bias;      // [n] or null
  float* y;
  int64_t rows, n, k, block, panels, panel_groups;
};

// Task i of a product: rows i / panel_groups * kBlockRows on, by panels i % panel_groups * kGroupPanels on.
namespace avx2 { void product_task(const Product& p, size_t i); }
namespace avx512_vnni { void product_task(const Product& p, size_t i); }

}  // namespace int8_matmul
