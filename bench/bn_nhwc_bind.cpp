// Python binding of ddptrain's channels-last batch-norm kernels, for
// bench/bn_kernels.py (checked and timed against LibTorch's own kernels).
#include <torch/extension.h>

#include "ddp/cuda/batch_norm_nhwc.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &ddp::cuda::bn_nhwc_supported);
  m.def("forward", &ddp::cuda::bn_nhwc_forward);
  m.def("backward", &ddp::cuda::bn_nhwc_backward);
}
