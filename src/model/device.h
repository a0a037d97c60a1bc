// the device a model loads onto (src/model/device.cpp)
#pragma once

#include "ggml-backend.h"
#include "kvblend/model.h"

namespace kvblend {

// model_params::device (and use_gpu, n_gpu_layers) to a registered ggml device.
// throws device_error for a name the caller got wrong (unknown, a build
// without that backend), kvblend::error for an unreachable rpc-server or a split -ngl.
ggml_backend_dev_t device_resolve(const model_params & p, int64_t n_layer);

}  // namespace kvblend
