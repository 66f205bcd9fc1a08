// Python binding of ddptrain's channels-last batch-norm kernels, for
// bench/bn_kernels.py (checked and timed against LibTorch's own kernels).
#include <torch/extension.h>

#include "ddp/cuda/batch_norm_nhwc.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &ddp::cuda::bn_nhwc_supported);
  namespace py = pybind11;
  m.def("forward", &ddp::cuda::bn_nhwc_forward, py::arg("x"), py::arg("weight"), py::arg("bias"),
        py::arg("running_mean"), py::arg("running_var"), py::arg("momentum"), py::arg("eps"),
        py::arg("residual") = at::Tensor(), py::arg("relu") = false);
  m.def("backward", &ddp::cuda::bn_nhwc_backward, py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("mean"),
        py::arg("invstd"), py::arg("relu_output") = at::Tensor(), py::arg("need_dz") = true);
  m.def("relu_backward", &ddp::cuda::bn_nhwc_relu_backward, py::arg("dy"), py::arg("x"), py::arg("weight"),
        py::arg("mean"), py::arg("invstd"), py::arg("scale_shift"));
}
