// Residual add + LayerNorm (layer_norm.h): one warp per row.
//
// Forward: a lane walks columns lane, lane + 32, ...: it adds x and the
// branch, writes the sum and accumulates it; the warp's total gives the
// mean. A second walk over the sum the lane itself wrote (cached) gives the
// variance about that mean (two passes, as LibTorch's), and a third writes
// the normalised row in bf16.
//
// Backward, per row: with g = dout * weight and xhat = (sum - mean) * rstd,
// dx = rstd * (g - mean(g) - xhat * mean(g * xhat)) + dsum. The weight and
// bias gradients, sums over the rows of dout * xhat and dout, come from a
// second kernel: each block sums a slice of rows for a run of columns
// (threads along the columns, so reads coalesce), and the slices' partial
// sums are added by at::sum: a fixed order, so the result is deterministic.
#include "ddp/cuda/layer_norm.h"
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

constexpr int kRowsPerBlock = 8;  // warps per block, one row each
constexpr int kColumnThreads = 256;
// The weight and bias gradients' partial sums: a slice of kRowsPerSlice
// rows each, at most kMaxRowSlices. Short slices keep enough threads in
// flight: 128 slices of 128 rows (3 x 128 blocks for a GPT-2 row of 768)
// left the kernel latency-bound, 0.77 ms of config (e)'s step on the H200.
constexpr int64_t kRowsPerSlice = 32;
constexpr int64_t kMaxRowSlices = 1024;

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int offset = 16; offset > 0; offset >>= 1) v += __shfl_xor_sync(0xffffffffu, v, offset);
  return v;
}

template <bool kBranch>
__global__ void forward_kernel(const float* __restrict__ x, const __nv_bfloat16* __restrict__ branch,
                               const float* __restrict__ weight, const float* __restrict__ bias,
                               float* __restrict__ sum, __nv_bfloat16* __restrict__ out, float* __restrict__ mean_out,
                               float* __restrict__ rstd_out, int64_t rows, int cols, float eps) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t base = row * cols;
  const float* src = kBranch ? sum + base : x + base;
  float total = 0.f;
  for (int c = lane; c < cols; c += 32) {
    float v = x[base + c];
    if (kBranch) {
      v += __bfloat162float(branch[base + c]);
      sum[base + c] = v;
    }
    total += v;
  }
  const float mean = warp_sum(total) / static_cast<float>(cols);
  float squares = 0.f;
  for (int c = lane; c < cols; c += 32) {  // the elements this lane wrote
    const float d = src[c] - mean;
    squares += d * d;
  }
  const float rstd = rsqrtf(warp_sum(squares) / static_cast<float>(cols) + eps);
  for (int c = lane; c < cols; c += 32) {
    const float y = (src[c] - mean) * rstd * weight[c] + (bias ? bias[c] : 0.f);
    out[base + c] = __float2bfloat16_rn(y);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

template <bool kDsum, bool kBranch>
__global__ void backward_kernel(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ dsum,
                                const float* __restrict__ sum, const float* __restrict__ mean,
                                const float* __restrict__ rstd, const float* __restrict__ weight,
                                float* __restrict__ dx, __nv_bfloat16* __restrict__ dbranch, int64_t rows, int cols) {
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t base = row * cols;
  const float m = mean[row], r = rstd[row];
  float sum_g = 0.f, sum_gx = 0.f;
  for (int c = lane; c < cols; c += 32) {
    const float g = __bfloat162float(dout[base + c]) * weight[c];
    sum_g += g;
    sum_gx += g * (sum[base + c] - m) * r;
  }
  const float mean_g = warp_sum(sum_g) / static_cast<float>(cols);
  const float mean_gx = warp_sum(sum_gx) / static_cast<float>(cols);
  for (int c = lane; c < cols; c += 32) {
    const float g = __bfloat162float(dout[base + c]) * weight[c];
    const float xhat = (sum[base + c] - m) * r;
    float v = r * (g - mean_g - xhat * mean_gx);
    if (kDsum) v += dsum[base + c];
    dx[base + c] = v;
    if (kBranch) dbranch[base + c] = __float2bfloat16_rn(v);
  }
}

__global__ void param_grads_kernel(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ sum,
                                   const float* __restrict__ mean, const float* __restrict__ rstd,
                                   float* __restrict__ dweight_parts, float* __restrict__ dbias_parts, int64_t rows,
                                   int cols, int64_t rows_per_slice) {
  const int c = blockIdx.x * blockDim.x + threadIdx.x;
  if (c >= cols) return;
  const int64_t first = static_cast<int64_t>(blockIdx.y) * rows_per_slice;
  const int64_t last = first + rows_per_slice < rows ? first + rows_per_slice : rows;
  float dw = 0.f, db = 0.f;
#pragma unroll 4
  for (int64_t row = first; row < last; ++row) {
    const float d = __bfloat162float(dout[row * cols + c]);
    dw += d * (sum[row * cols + c] - mean[row]) * rstd[row];
    db += d;
  }
  dweight_parts[blockIdx.y * static_cast<int64_t>(cols) + c] = dw;
  dbias_parts[blockIdx.y * static_cast<int64_t>(cols) + c] = db;
}

int64_t row_blocks(int64_t rows) { return (rows + kRowsPerBlock - 1) / kRowsPerBlock; }

}  // namespace

bool add_layer_norm_supported(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& weight,
                              const at::Tensor& bias) {
  if (!x.defined() || !x.is_cuda() || x.scalar_type() != at::kFloat || !x.is_contiguous() || x.dim() < 1 ||
      x.size(-1) < 1 || x.numel() == 0 || x.size(-1) > (int64_t{1} << 30))
    return false;
  const int64_t cols = x.size(-1);
  if (branch.defined() && (branch.device() != x.device() || branch.scalar_type() != at::kBFloat16 ||
                           !branch.is_contiguous() || branch.sizes() != x.sizes()))
    return false;
  auto param_ok = [&](const at::Tensor& p) {
    return p.device() == x.device() && p.scalar_type() == at::kFloat && p.is_contiguous() && p.dim() == 1 &&
           p.size(0) == cols;
  };
  return weight.defined() && param_ok(weight) && (!bias.defined() || param_ok(bias));
}

std::vector<at::Tensor> add_layer_norm_forward(const at::Tensor& x, const at::Tensor& branch, const at::Tensor& weight,
                                               const at::Tensor& bias, double eps) {
  TORCH_CHECK(add_layer_norm_supported(x, branch, weight, bias), "add_layer_norm_forward: unsupported inputs");
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t cols = x.size(-1), rows = x.numel() / cols;
  auto sum = branch.defined() ? at::empty_like(x) : x;
  auto out = at::empty(x.sizes(), x.options().dtype(at::kBFloat16));
  auto mean = at::empty({rows}, x.options());
  auto rstd = at::empty({rows}, x.options());
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(row_blocks(rows))), block(32 * kRowsPerBlock);
  const float* b = bias.defined() ? as<float>(bias) : nullptr;
  if (branch.defined())
    forward_kernel<true><<<grid, block, 0, stream>>>(as<float>(x), as<__nv_bfloat16>(branch), as<float>(weight), b,
                                                     as_mut<float>(sum), as_mut<__nv_bfloat16>(out),
                                                     as_mut<float>(mean), as_mut<float>(rstd), rows,
                                                     static_cast<int>(cols), static_cast<float>(eps));
  else
    forward_kernel<false><<<grid, block, 0, stream>>>(as<float>(x), nullptr, as<float>(weight), b, nullptr,
                                                      as_mut<__nv_bfloat16>(out), as_mut<float>(mean),
                                                      as_mut<float>(rstd), rows, static_cast<int>(cols),
                                                      static_cast<float>(eps));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sum, out, mean, rstd};
}

std::vector<at::Tensor> add_layer_norm_backward(const at::Tensor& dout_in, const at::Tensor& dsum_in,
                                                const at::Tensor& sum, const at::Tensor& mean, const at::Tensor& rstd,
                                                const at::Tensor& weight, bool with_branch, bool with_bias) {
  const c10::cuda::CUDAGuard guard(sum.device());
  const int64_t cols = sum.size(-1), rows = sum.numel() / cols;
  const auto dout = dout_in.to(at::kBFloat16).contiguous();
  const auto dsum = dsum_in.defined() ? dsum_in.to(at::kFloat).contiguous() : dsum_in;
  TORCH_CHECK(dout.sizes() == sum.sizes() && (!dsum.defined() || dsum.sizes() == sum.sizes()),
              "add_layer_norm_backward: gradient shapes do not match the forward's");
  auto dx = at::empty_like(sum);
  at::Tensor dbranch = with_branch ? at::empty(sum.sizes(), sum.options().dtype(at::kBFloat16)) : at::Tensor();
  const auto stream = at::cuda::getCurrentCUDAStream();
  const dim3 grid(static_cast<unsigned>(row_blocks(rows))), block(32 * kRowsPerBlock);
  const float* ds = dsum.defined() ? as<float>(dsum) : nullptr;
  __nv_bfloat16* db = with_branch ? as_mut<__nv_bfloat16>(dbranch) : nullptr;
  auto launch = [&](auto kernel) {
    kernel<<<grid, block, 0, stream>>>(as<__nv_bfloat16>(dout), ds, as<float>(sum), as<float>(mean), as<float>(rstd),
                                       as<float>(weight), as_mut<float>(dx), db, rows, static_cast<int>(cols));
  };
  if (ds && with_branch) launch(backward_kernel<true, true>);
  else if (ds) launch(backward_kernel<true, false>);
  else if (with_branch) launch(backward_kernel<false, true>);
  else launch(backward_kernel<false, false>);
  C10_CUDA_KERNEL_LAUNCH_CHECK();

  const int64_t slices = std::min(kMaxRowSlices, (rows + kRowsPerSlice - 1) / kRowsPerSlice);
  const int64_t rows_per_slice = (rows + slices - 1) / slices;
  auto dweight_parts = at::empty({slices, cols}, sum.options());
  auto dbias_parts = at::empty({slices, cols}, sum.options());
  const dim3 pgrid(static_cast<unsigned>((cols + kColumnThreads - 1) / kColumnThreads), static_cast<unsigned>(slices));
  param_grads_kernel<<<pgrid, kColumnThreads, 0, stream>>>(as<__nv_bfloat16>(dout), as<float>(sum), as<float>(mean),
                                                            as<float>(rstd), as_mut<float>(dweight_parts),
                                                            as_mut<float>(dbias_parts), rows, static_cast<int>(cols),
                                                            rows_per_slice);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {dx, dbranch, dweight_parts.sum(0), with_bias ? dbias_parts.sum(0) : at::Tensor()};
}

}  // namespace ddp::cuda
