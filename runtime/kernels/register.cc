// The library's entry point: ONNX Runtime's register_custom_ops_library calls RegisterCustomOps.
#define ORT_API_MANUAL_INIT
#include <onnxruntime_cxx_api.h>
#undef ORT_API_MANUAL_INIT

#include "ops.h"

extern "C" __attribute__((visibility("default"))) OrtStatus* ORT_API_CALL RegisterCustomOps(OrtSessionOptions* options, const OrtApiBase* api_base) {
  const OrtApi* api = api_base->GetApi(ORT_API_VERSION);
  if (api == nullptr) return nullptr;  // an ONNX Runtime older than these headers: ops left unregistered
  Ort::InitApi(api);
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* status = api->CreateCustomOpDomain("eagle2", &domain)) return status;
  if (OrtStatus* status = AddCacheAttentionOps(api, domain)) return status;
  if (OrtStatus* status = AddInt8MatMulOps(api, domain)) return status;
  return api->AddCustomOpDomain(options, domain);
}
