// The channels-last max pool as an autograd function (max_pool.h).
#include "gcc13_autograd_warnings.h"  // first: see there

#include "ddp/models/max_pool.h"

#include <atomic>

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/max_pool_nhwc.h"
#endif

namespace ddp::models {
namespace {

std::atomic<bool> g_nhwc_pool{true};

#ifdef DDP_WITH_CUDA_KERNELS
using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Backward keeps only the uint8 argmax and the input's height and width:
// not the input (ATen's keeps it, and an int64 index per output), so the
// ResNet stem's 112x112 activation can be freed after the forward.
struct MaxPoolNhwcFn : torch::autograd::Function<MaxPoolNhwcFn> {
  static torch::Tensor forward(AutogradContext* ctx, torch::Tensor x, int64_t kernel, int64_t stride,
                               int64_t padding) {
    auto out = cuda::max_pool_nhwc_forward(x, kernel, stride, padding);
    ctx->save_for_backward({out[1]});
    ctx->saved_data["H"] = x.size(2);
    ctx->saved_data["W"] = x.size(3);
    ctx->saved_data["k"] = kernel;
    ctx->saved_data["s"] = stride;
    ctx->saved_data["p"] = padding;
    return out[0];
  }
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    auto argmax = ctx->get_saved_variables()[0];
    auto d = [&](const char* key) { return ctx->saved_data[key].toInt(); };
    auto dx = cuda::max_pool_nhwc_backward(grads[0], argmax, d("H"), d("W"), d("k"), d("s"), d("p"));
    return {dx, torch::Tensor(), torch::Tensor(), torch::Tensor()};
  }
};
#endif

}  // namespace

void use_nhwc_max_pool_kernels(bool on) { g_nhwc_pool.store(on); }

bool nhwc_max_pool_applies(const torch::Tensor& x, int64_t kernel, int64_t stride, int64_t padding) {
#ifdef DDP_WITH_CUDA_KERNELS
  return g_nhwc_pool.load() && cuda::max_pool_nhwc_supported(x, kernel, stride, padding);
#else
  (void)x, (void)kernel, (void)stride, (void)padding;
  return false;
#endif
}

torch::Tensor max_pool2d(const torch::Tensor& x, int64_t kernel, int64_t stride, int64_t padding) {
#ifdef DDP_WITH_CUDA_KERNELS
  if (nhwc_max_pool_applies(x, kernel, stride, padding)) return MaxPoolNhwcFn::apply(x, kernel, stride, padding);
#endif
  return torch::max_pool2d(x, kernel, stride, padding);
}

}  // namespace ddp::models
