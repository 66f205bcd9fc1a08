// Python binding of ddptrain's channels-last batch-norm kernels, for
// bench/bn_kernels.py (checked and timed against LibTorch's own kernels).
#include <torch/extension.h>

#include "ddp/cuda/batch_norm_nhwc.h"

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("supported", &ddp::cuda::bn_nhwc_supported);
  namespace py = pybind11;
  // Optional tensors arrive as None from Python: an undefined at::Tensor
  // is not a pybind11 default that converts back.
  using Opt = c10::optional<at::Tensor>;
  m.def(
      "forward",
      [](const at::Tensor& x, const at::Tensor& w, const at::Tensor& b, const at::Tensor& rm, const at::Tensor& rv,
         double momentum, double eps, const Opt& residual, bool relu) {
        return ddp::cuda::bn_nhwc_forward(x, w, b, rm, rv, momentum, eps, residual.value_or(at::Tensor()), relu);
      },
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("running_mean"), py::arg("running_var"),
      py::arg("momentum"), py::arg("eps"), py::arg("residual") = py::none(), py::arg("relu") = false);
  m.def(
      "backward",
      [](const at::Tensor& dy, const at::Tensor& x, const at::Tensor& w, const at::Tensor& mean,
         const at::Tensor& invstd, const Opt& relu_output, bool need_dz) {
        return ddp::cuda::bn_nhwc_backward(dy, x, w, mean, invstd, relu_output.value_or(at::Tensor()), need_dz);
      },
      py::arg("dy"), py::arg("x"), py::arg("weight"), py::arg("mean"), py::arg("invstd"),
      py::arg("relu_output") = py::none(), py::arg("need_dz") = true);
  m.def("relu_backward", &ddp::cuda::bn_nhwc_relu_backward, py::arg("dy"), py::arg("x"), py::arg("weight"),
        py::arg("mean"), py::arg("invstd"), py::arg("scale_shift"));
}
