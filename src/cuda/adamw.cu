// Adam / AdamW over a flat fp32 buffer (adamw.h).
//
// The arithmetic is torch.optim's (and LibTorch's fused kernel's) in fp32:
// AdamW first decays p by lr * wd * p (Adam adds wd * p to the gradient),
// then m = b1 m + (1 - b1) g, v = b2 v + (1 - b2) g^2, and
// p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps).
// Each thread takes four adjacent elements (16-byte loads where the
// tensors are aligned) in a grid-stride loop; the tail is scalar.
#include "ddp/cuda/adamw.h"
#include "bf16_vec.cuh"
#include "tensor_access.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>

namespace ddp::cuda {
namespace {

constexpr int kThreads = 256;

struct Scalars {
  float beta1, beta2, weight_decay, eps;
  double beta1_d, beta2_d;  // for the bias corrections, in fp64 as torch.optim's
  bool decoupled;
  bool store_clipped;  // write the clipped gradient back
};

// One element: p, g, m, v in registers, updated in place.
__device__ __forceinline__ void update(float& p, float& g, float& m, float& v, float lr, float step_size,
                                       float bc2_sqrt, const Scalars& s) {
  if (s.weight_decay != 0.f) {
    if (s.decoupled) p -= lr * s.weight_decay * p;
    else g += s.weight_decay * p;
  }
  m = s.beta1 * m + (1.f - s.beta1) * g;
  v = s.beta2 * v + (1.f - s.beta2) * g * g;
  p -= step_size * m / (sqrtf(v) / bc2_sqrt + s.eps);
}

template <bool kVec4>
__global__ void adam_kernel(float* __restrict__ p, float* __restrict__ g, float* __restrict__ m, float* __restrict__ v,
                            __nv_bfloat16* __restrict__ p16, int64_t n, const float* __restrict__ step_ptr,
                            const float* __restrict__ lr_ptr, const float* __restrict__ coef_ptr,
                            const float* __restrict__ found_inf, Scalars s) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  const int64_t first = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  if (found_inf && *found_inf != 0.f) {
    // A skipped step: the parameters stay, and so must the copy of them.
    if (p16)
      for (int64_t i = first; i < n; i += stride) p16[i] = __float2bfloat16_rn(p[i]);
    return;
  }
  const float lr = *lr_ptr, coef = coef_ptr ? *coef_ptr : 1.f;
  const double t = *step_ptr;
  const float step_size = static_cast<float>(lr / (1.0 - pow(s.beta1_d, t)));
  const float bc2_sqrt = static_cast<float>(sqrt(1.0 - pow(s.beta2_d, t)));
  if constexpr (kVec4) {
    const int64_t quads = n / 4;
    for (int64_t q = first; q < quads; q += stride) {
      const int64_t i = 4 * q;
      float4 pp = *reinterpret_cast<const float4*>(p + i), gg = *reinterpret_cast<const float4*>(g + i);
      float4 mm = *reinterpret_cast<const float4*>(m + i), vv = *reinterpret_cast<const float4*>(v + i);
      if (coef_ptr) {
        gg.x *= coef, gg.y *= coef, gg.z *= coef, gg.w *= coef;
        if (s.store_clipped) *reinterpret_cast<float4*>(g + i) = gg;
      }
      update(pp.x, gg.x, mm.x, vv.x, lr, step_size, bc2_sqrt, s);
      update(pp.y, gg.y, mm.y, vv.y, lr, step_size, bc2_sqrt, s);
      update(pp.z, gg.z, mm.z, vv.z, lr, step_size, bc2_sqrt, s);
      update(pp.w, gg.w, mm.w, vv.w, lr, step_size, bc2_sqrt, s);
      *reinterpret_cast<float4*>(p + i) = pp;
      *reinterpret_cast<float4*>(m + i) = mm;
      *reinterpret_cast<float4*>(v + i) = vv;
      if (p16) {
        const float f[4] = {pp.x, pp.y, pp.z, pp.w};
        store_bf16<4>(p16 + i, f);
      }
    }
  }
  // The elements the vector loop left (all of them without it).
  for (int64_t i = (kVec4 ? n / 4 * 4 : 0) + first; i < n; i += stride) {
    float pp = p[i], gg = g[i], mm = m[i], vv = v[i];
    if (coef_ptr) {
      gg *= coef;
      if (s.store_clipped) g[i] = gg;
    }
    update(pp, gg, mm, vv, lr, step_size, bc2_sqrt, s);
    p[i] = pp, m[i] = mm, v[i] = vv;
    if (p16) p16[i] = __float2bfloat16_rn(pp);
  }
}

bool one_float(const at::Tensor& t, const at::Tensor& like) {
  return t.is_cuda() && t.get_device() == like.get_device() && t.scalar_type() == at::kFloat && t.numel() == 1;
}

}  // namespace

void adam_step(const at::Tensor& p, const at::Tensor& g, const at::Tensor& m, const at::Tensor& v,
               const at::Tensor& step, const at::Tensor& lr, const AdamStep& o, const at::Tensor& coef,
               const at::Tensor& found_inf, const at::Tensor& p16) {
  for (const auto* t : {&p, &g, &m, &v})
    TORCH_CHECK(t->is_cuda() && t->get_device() == p.get_device() && t->scalar_type() == at::kFloat &&
                    t->is_contiguous() && t->numel() == p.numel(),
                "adam_step: p, g, m and v must be contiguous CUDA fp32 tensors of one size on one device");
  TORCH_CHECK(one_float(step, p) && one_float(lr, p), "adam_step: step and lr must be one float each on p's device");
  TORCH_CHECK(!coef.defined() || one_float(coef, p), "adam_step: coef must be one float on p's device");
  TORCH_CHECK(!found_inf.defined() || one_float(found_inf, p), "adam_step: found_inf must be one float on p's device");
  TORCH_CHECK(!p16.defined() || (p16.is_cuda() && p16.get_device() == p.get_device() &&
                                 p16.scalar_type() == at::kBFloat16 && p16.is_contiguous() && p16.numel() == p.numel()),
              "adam_step: p16 must be a contiguous CUDA bf16 tensor of p's size");
  const int64_t n = p.numel();
  if (n == 0) return;
  c10::cuda::CUDAGuard guard(p.device());
  const bool vec4 = aligned(p) && aligned(g) && aligned(m) && aligned(v) &&
                    (!p16.defined() || reinterpret_cast<std::uintptr_t>(p16.data_ptr()) % 8 == 0);
  const Scalars s{static_cast<float>(o.beta1), static_cast<float>(o.beta2), static_cast<float>(o.weight_decay),
                  static_cast<float>(o.eps), o.beta1, o.beta2, o.decoupled, o.store_clipped_grad};
  const int64_t work = vec4 ? (n + 3) / 4 : n;
  auto launch = [&](auto kernel) {
    const int per_sm = std::max(1, resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, 0));
    const int64_t resident = int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} * per_sm;
    const int64_t blocks = std::max<int64_t>(1, std::min((work + kThreads - 1) / kThreads, resident));
    kernel<<<static_cast<unsigned>(blocks), kThreads, 0, at::cuda::getCurrentCUDAStream()>>>(
        as_mut<float>(p), as_mut<float>(g), as_mut<float>(m), as_mut<float>(v),
        p16.defined() ? as_mut<__nv_bfloat16>(p16) : nullptr, n, as<float>(step), as<float>(lr),
        coef.defined() ? as<float>(coef) : nullptr, found_inf.defined() ? as<float>(found_inf) : nullptr, s);
  };
  if (vec4) launch(adam_kernel<true>);
  else launch(adam_kernel<false>);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ddp::cuda
