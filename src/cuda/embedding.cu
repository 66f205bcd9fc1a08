// An embedding's weight gradient, added into a given tensor (embedding.h).
//
// The indices are sorted (stably, keeping each row's position), so the rows
// that share an index sit together. One warp per sorted position: the warp
// at the first position of a run of equal indices sums that run's gradient
// rows, in order, and adds the sum to the table's row; the others return.
// Each lane owns every 32nd group of four columns (16-byte loads where C is
// a multiple of 4 and the rows are aligned, else one column at a time).
#include "ddp/cuda/embedding.h"
#include "tensor_access.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <cstdint>

namespace ddp::cuda {
namespace {

constexpr int kWarps = 8;  // warps per block

template <bool kVec4>
__global__ void add_runs_kernel(const float* __restrict__ grad, const int64_t* __restrict__ sorted,
                                const int64_t* __restrict__ order, int64_t n, int64_t c, float* __restrict__ dw) {
  const int64_t i = static_cast<int64_t>(blockIdx.x) * kWarps + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (i >= n) return;
  const int64_t row = sorted[i];
  if (i > 0 && sorted[i - 1] == row) return;  // not the first of its run
  int64_t end = i + 1;
  while (end < n && sorted[end] == row) ++end;
  float* out = dw + row * c;
  if constexpr (kVec4) {
    for (int64_t col = 4 * lane; col < c; col += 4 * 32) {
      float4 acc = make_float4(0.f, 0.f, 0.f, 0.f);
      for (int64_t j = i; j < end; ++j) {
        const float4 g = *reinterpret_cast<const float4*>(grad + order[j] * c + col);
        acc.x += g.x;
        acc.y += g.y;
        acc.z += g.z;
        acc.w += g.w;
      }
      float4 d = *reinterpret_cast<float4*>(out + col);
      d.x += acc.x;
      d.y += acc.y;
      d.z += acc.z;
      d.w += acc.w;
      *reinterpret_cast<float4*>(out + col) = d;
    }
  } else {
    for (int64_t col = lane; col < c; col += 32) {
      float acc = 0.f;
      for (int64_t j = i; j < end; ++j) acc += grad[order[j] * c + col];
      out[col] += acc;
    }
  }
}

}  // namespace

void embedding_backward_add(const at::Tensor& grad, const at::Tensor& idx, const at::Tensor& dw) {
  TORCH_CHECK(grad.is_cuda() && grad.scalar_type() == at::kFloat && grad.dim() == 2 && grad.is_contiguous(),
              "embedding_backward_add: grad must be a contiguous CUDA fp32 [N, C] tensor, got ", grad.sizes(), " ",
              grad.scalar_type());
  TORCH_CHECK(dw.is_cuda() && dw.get_device() == grad.get_device() && dw.scalar_type() == at::kFloat && dw.dim() == 2 &&
                  dw.is_contiguous() && dw.size(1) == grad.size(1),
              "embedding_backward_add: dw must be a contiguous CUDA fp32 [V, ", grad.size(1), "] tensor, got ",
              dw.sizes(), " ", dw.scalar_type());
  TORCH_CHECK(idx.is_cuda() && idx.scalar_type() == at::kLong && idx.numel() == grad.size(0),
              "embedding_backward_add: idx must be ", grad.size(0), " CUDA int64 indices, got ", idx.sizes(), " ",
              idx.scalar_type());
  const int64_t n = grad.size(0), c = grad.size(1);
  if (n == 0 || c == 0) return;
  c10::cuda::CUDAGuard guard(grad.device());
  const auto by_index = at::sort(idx.reshape({-1}), /*stable=*/true, /*dim=*/0, /*descending=*/false);
  const at::Tensor& sorted = std::get<0>(by_index);
  const at::Tensor& order = std::get<1>(by_index);
  const bool vec4 = c % 4 == 0 && aligned(grad) && aligned(dw);
  const dim3 blocks(static_cast<unsigned>((n + kWarps - 1) / kWarps));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto launch = [&](auto kernel) {
    kernel<<<blocks, kWarps * 32, 0, stream>>>(as<float>(grad), as<int64_t>(sorted), as<int64_t>(order), n, c,
                                               as_mut<float>(dw));
  };
  if (vec4) launch(add_runs_kernel<true>);
  else launch(add_runs_kernel<false>);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace ddp::cuda
