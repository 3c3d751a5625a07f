// Each source file of this library adds its operators to the "eagle2" domain (register.cc).
#pragma once

#include <onnxruntime_c_api.h>

OrtStatus* AddCacheAttentionOps(const OrtApi* api, OrtCustomOpDomain* domain);
OrtStatus* AddInt8MatMulOps(const OrtApi* api, OrtCustomOpDomain* domain);
