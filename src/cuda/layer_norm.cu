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
// sums, the weight's and the bias's, are added by one more kernel
// (sum_rows_kernel): a fixed order, so the result is deterministic.
//
// Rows of C = 128 k columns, k <= 6 (GPT-2's 768), take vectorised
// kernels instead: a lane owns 4 adjacent columns of each 128-column chunk
// (16-byte fp32 and 8-byte bf16 accesses) and keeps its part of the row in
// registers between the passes. The backward's warps stay resident and walk
// rows, each summing the weight and bias gradients of its columns over its
// rows; a block's warps then add theirs in shared memory into one partial
// row a block (added by sum_rows_kernel, in a fixed order): dout and sum
// are read once, not again by a second kernel.
#include "ddp/cuda/layer_norm.h"
#include "bf16_vec.cuh"
#include "tensor_access.cuh"

#include <ATen/ATen.h>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <cuda_bf16.h>

#include <algorithm>
#include <cstdint>
#include <type_traits>

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

// The weight's and the bias's gradients from their partial rows, in one
// launch (blockIdx.y: 0 the weight, 1 the bias, 2 the branch's column sums;
// one not wanted: its out null): each block sums 32 columns, its 32 lanes
// per column taking every 32nd row, then a tree over the lanes. A fixed
// order, so the sums are deterministic.
constexpr int kSumLanes = 32;
struct PartialRows {
  const float* parts[3];
  float* out[3];
};
__global__ void sum_rows_kernel(PartialRows p, int64_t rows, int cols) {
  __shared__ float s[kSumLanes][33];
  const int y = blockIdx.y;
  const float* part = y == 0 ? p.parts[0] : y == 1 ? p.parts[1] : p.parts[2];
  float* out = y == 0 ? p.out[0] : y == 1 ? p.out[1] : p.out[2];
  if (out == nullptr) return;
  const int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.x * 32 + tx;
  float a = 0.f;
  if (c < cols)
    for (int64_t r = ty; r < rows; r += kSumLanes) a += part[r * cols + c];
  s[ty][tx] = a;
  for (int k = kSumLanes / 2; k > 0; k >>= 1) {
    __syncthreads();
    if (ty < k) s[ty][tx] += s[ty + k][tx];
  }
  if (ty == 0 && c < cols) out[c] = s[0][tx];
}

// ---- vectorised kernels: C = 128 k, k <= kMaxChunks -------------------------

constexpr int kVecCols = 4;                 // adjacent columns per lane per chunk
constexpr int kChunkCols = 32 * kVecCols;  // columns per chunk: a warp's one access each
constexpr int kMaxChunks = 6;  // 768 columns; 7 or 8 chunks spill registers in the backward

__device__ __forceinline__ void load_f4(const float* p, float* f) {
  const float4 v = *reinterpret_cast<const float4*>(p);
  f[0] = v.x, f[1] = v.y, f[2] = v.z, f[3] = v.w;
}

__device__ __forceinline__ void store_f4(float* p, const float* f) {
  *reinterpret_cast<float4*>(p) = make_float4(f[0], f[1], f[2], f[3]);
}

template <int kChunks, bool kBranch>
__global__ void __launch_bounds__(32 * kRowsPerBlock)
    forward_vec_kernel(const float* __restrict__ x, const __nv_bfloat16* __restrict__ branch,
                       const float* __restrict__ weight, const float* __restrict__ bias, float* __restrict__ sum,
                       __nv_bfloat16* __restrict__ out, float* __restrict__ mean_out, float* __restrict__ rstd_out,
                       int64_t rows, float eps) {
  constexpr int kCols = kChunks * kChunkCols;
  const int64_t row = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  if (row >= rows) return;
  const int64_t base = row * kCols;
  float v[kChunks][kVecCols];
  float total = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = i * kChunkCols + lane * kVecCols;
    load_f4(x + base + c, v[i]);
    if constexpr (kBranch) {
      float b[kVecCols];
      load4(branch + base + c, b);
#pragma unroll
      for (int k = 0; k < kVecCols; ++k) v[i][k] += b[k];
      store_f4(sum + base + c, v[i]);
    }
#pragma unroll
    for (int k = 0; k < kVecCols; ++k) total += v[i][k];
  }
  const float mean = warp_sum(total) / static_cast<float>(kCols);
  float squares = 0.f;
#pragma unroll
  for (int i = 0; i < kChunks; ++i)
#pragma unroll
    for (int k = 0; k < kVecCols; ++k) squares += (v[i][k] - mean) * (v[i][k] - mean);
  const float rstd = rsqrtf(warp_sum(squares) / static_cast<float>(kCols) + eps);
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
    const int c = i * kChunkCols + lane * kVecCols;
    float w[kVecCols], b[kVecCols] = {0.f, 0.f, 0.f, 0.f}, y[kVecCols];
    load_f4(weight + c, w);
    if (bias) load_f4(bias + c, b);
#pragma unroll
    for (int k = 0; k < kVecCols; ++k) y[k] = (v[i][k] - mean) * rstd * w[k] + b[k];
    store4(out + base + c, y);
  }
  if (lane == 0) {
    mean_out[row] = mean;
    rstd_out[row] = rstd;
  }
}

// Warp `wid` of the grid takes rows wid, wid + warps, ...; the weight and
// bias gradients over a block's rows go to row blockIdx.x of dweight_parts
// and dbias_parts. With kBranchSum, also the column sums of dbranch as
// written (bf16), to dbranch_parts: they are the bias gradient of the layer
// that made the branch. Those sums live in shared memory, a row per warp
// (the registers are full: 128 at two blocks an SM), which then serves
// each part's sum over the block's warps.
template <int kChunks, bool kDsum, bool kBranch, bool kBranchSum = false>
__global__ void __launch_bounds__(32 * kRowsPerBlock, 2)
    backward_vec_kernel(const __nv_bfloat16* __restrict__ dout, const float* __restrict__ dsum,
                        const float* __restrict__ sum, const float* __restrict__ mean, const float* __restrict__ rstd,
                        const float* __restrict__ weight, float* __restrict__ dx, __nv_bfloat16* __restrict__ dbranch,
                        float* __restrict__ dweight_parts, float* __restrict__ dbias_parts,
                        float* __restrict__ dbranch_parts, int64_t rows) {
  static_assert(kBranch || !kBranchSum, "the branch's sums need the branch");
  constexpr int kCols = kChunks * kChunkCols;
  extern __shared__ float4 branch_sums[];  // [kRowsPerBlock][kCols / 4]
  const int lane = threadIdx.x % 32;
  const int64_t wid = static_cast<int64_t>(blockIdx.x) * kRowsPerBlock + threadIdx.x / 32;
  const int64_t warps = static_cast<int64_t>(gridDim.x) * kRowsPerBlock;
  float4* own_sums = branch_sums + (threadIdx.x / 32) * (kCols / kVecCols);  // this warp's row
  float dw[kChunks][kVecCols], db[kChunks][kVecCols];
#pragma unroll
  for (int i = 0; i < kChunks; ++i) {
#pragma unroll
    for (int k = 0; k < kVecCols; ++k) dw[i][k] = db[i][k] = 0.f;
    // A lane only ever touches its own four columns of each chunk: no sync.
    if constexpr (kBranchSum) own_sums[i * 32 + lane] = make_float4(0.f, 0.f, 0.f, 0.f);
  }
  for (int64_t row = wid; row < rows; row += warps) {
    const int64_t base = row * kCols;
    const float m = mean[row], r = rstd[row];
    float sum_g = 0.f, sum_gx = 0.f;
#pragma unroll
    for (int i = 0; i < kChunks; ++i) {
      const int c = i * kChunkCols + lane * kVecCols;
      float d[kVecCols], xhat[kVecCols], w[kVecCols];
      load4(dout + base + c, d);
      load_f4(sum + base + c, xhat);
      load_f4(weight + c, w);
#pragma unroll
      for (int k = 0; k < kVecCols; ++k) {
        xhat[k] = (xhat[k] - m) * r;
        const float g = d[k] * w[k];
        sum_g += g;
        sum_gx += g * xhat[k];
        dw[i][k] += d[k] * xhat[k];
        db[i][k] += d[k];
      }
    }
    const float mean_g = warp_sum(sum_g) / static_cast<float>(kCols);
    const float mean_gx = warp_sum(sum_gx) / static_cast<float>(kCols);
#pragma unroll 2
    for (int i = 0; i < kChunks; ++i) {
      const int c = i * kChunkCols + lane * kVecCols;
      // dout and sum again, from the cache (the warp just read the row):
      // only the gradient sums stay in registers across the warp's sums, so
      // two blocks fit an SM without spilling.
      float d[kVecCols], xhat[kVecCols], w[kVecCols], v[kVecCols], ds[kVecCols] = {0.f, 0.f, 0.f, 0.f};
      load4(dout + base + c, d);
      load_f4(sum + base + c, xhat);
      load_f4(weight + c, w);
      if constexpr (kDsum) load_f4(dsum + base + c, ds);
#pragma unroll
      for (int k = 0; k < kVecCols; ++k) v[k] = r * (d[k] * w[k] - mean_g - (xhat[k] - m) * r * mean_gx) + ds[k];
      store_f4(dx + base + c, v);
      if constexpr (kBranch) store4(dbranch + base + c, v);
      if constexpr (kBranchSum) {  // the values as stored, rounded to bf16
        float4 a = own_sums[i * 32 + lane];
        a.x += __bfloat162float(__float2bfloat16_rn(v[0]));
        a.y += __bfloat162float(__float2bfloat16_rn(v[1]));
        a.z += __bfloat162float(__float2bfloat16_rn(v[2]));
        a.w += __bfloat162float(__float2bfloat16_rn(v[3]));
        own_sums[i * 32 + lane] = a;
      }
    }
  }
  // The block's warps add their rows in shared memory (warp 0 to the last:
  // a fixed order), and the block writes one row of each part: the
  // finalising kernel reads a row a block, not a row a warp (2,112 rows of
  // 768 columns, for two or three sums, on an H100).
  auto block_sum = [&](float* out_row) {  // every warp's row is in `rows4`
    const float4* rows4 = branch_sums;
    __syncthreads();
    for (int c4 = threadIdx.x; c4 < kCols / kVecCols; c4 += blockDim.x) {
      float4 a = rows4[c4];
#pragma unroll
      for (int k = 1; k < kRowsPerBlock; ++k) {
        const float4 b = rows4[k * (kCols / kVecCols) + c4];
        a.x += b.x, a.y += b.y, a.z += b.z, a.w += b.w;
      }
      reinterpret_cast<float4*>(out_row)[c4] = a;
    }
    __syncthreads();
  };
  if constexpr (kBranchSum) block_sum(dbranch_parts + blockIdx.x * kCols);
  auto own_row = [&](const float (*f)[kVecCols]) {
#pragma unroll
    for (int i = 0; i < kChunks; ++i) own_sums[i * 32 + lane] = make_float4(f[i][0], f[i][1], f[i][2], f[i][3]);
  };
  own_row(dw);
  block_sum(dweight_parts + blockIdx.x * kCols);
  own_row(db);
  block_sum(dbias_parts + blockIdx.x * kCols);
}

// The vectorised kernels' chunk count for `cols`, or 0 where they do not apply.
int vec_chunks(int64_t cols) {
  return cols % kChunkCols == 0 && cols / kChunkCols <= kMaxChunks ? static_cast<int>(cols / kChunkCols) : 0;
}

// f(std::integral_constant<int, k>{}) for k = chunks in 1..kMaxChunks.
template <typename F>
void with_chunks(int chunks, F&& f) {
  switch (chunks) {
    case 1: f(std::integral_constant<int, 1>{}); break;
    case 2: f(std::integral_constant<int, 2>{}); break;
    case 3: f(std::integral_constant<int, 3>{}); break;
    case 4: f(std::integral_constant<int, 4>{}); break;
    case 5: f(std::integral_constant<int, 5>{}); break;
    case 6: f(std::integral_constant<int, 6>{}); break;
    default: TORCH_CHECK(false, "layer_norm: no vectorised kernel for ", chunks, " chunks");
  }
}

}  // namespace

bool add_layer_norm_vectorised(int64_t cols, std::initializer_list<at::Tensor> tensors) {
  if (vec_chunks(cols) == 0) return false;
  for (const auto& t : tensors)
    if (t.defined() && !aligned(t)) return false;
  return true;
}

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
  if (add_layer_norm_vectorised(cols, {x, branch, weight, bias})) {
    const int chunks = vec_chunks(cols);
    with_chunks(chunks, [&](auto k) {
      constexpr int kChunks = decltype(k)::value;
      if (branch.defined())
        forward_vec_kernel<kChunks, true><<<grid, block, 0, stream>>>(
            as<float>(x), as<__nv_bfloat16>(branch), as<float>(weight), b, as_mut<float>(sum),
            as_mut<__nv_bfloat16>(out), as_mut<float>(mean), as_mut<float>(rstd), rows, static_cast<float>(eps));
      else
        forward_vec_kernel<kChunks, false><<<grid, block, 0, stream>>>(
            as<float>(x), nullptr, as<float>(weight), b, nullptr, as_mut<__nv_bfloat16>(out), as_mut<float>(mean),
            as_mut<float>(rstd), rows, static_cast<float>(eps));
    });
  } else if (branch.defined()) {
    forward_kernel<true><<<grid, block, 0, stream>>>(as<float>(x), as<__nv_bfloat16>(branch), as<float>(weight), b,
                                                     as_mut<float>(sum), as_mut<__nv_bfloat16>(out),
                                                     as_mut<float>(mean), as_mut<float>(rstd), rows,
                                                     static_cast<int>(cols), static_cast<float>(eps));
  } else {
    forward_kernel<false><<<grid, block, 0, stream>>>(as<float>(x), nullptr, as<float>(weight), b, nullptr,
                                                      as_mut<__nv_bfloat16>(out), as_mut<float>(mean),
                                                      as_mut<float>(rstd), rows, static_cast<int>(cols),
                                                      static_cast<float>(eps));
  }
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  return {sum, out, mean, rstd};
}

std::vector<at::Tensor> add_layer_norm_backward(const at::Tensor& dout_in, const at::Tensor& dsum_in,
                                                const at::Tensor& sum, const at::Tensor& mean, const at::Tensor& rstd,
                                                const at::Tensor& weight, bool with_branch, bool with_bias,
                                                const at::Tensor& dweight_out, const at::Tensor& dbias_out,
                                                bool branch_sums, const at::Tensor& dbranch_sum_out) {
  TORCH_CHECK(with_branch || !branch_sums, "add_layer_norm_backward: the branch's sums need with_branch");
  const c10::cuda::CUDAGuard guard(sum.device());
  const int64_t cols = sum.size(-1), rows = sum.numel() / cols;
  // A gradient vector: into the parameter's slot where given (param_slots.h), else fresh.
  auto fresh = [&](const at::Tensor& out) {
    TORCH_CHECK(!out.defined() || (out.scalar_type() == at::kFloat && out.is_contiguous() && out.numel() == cols &&
                                   out.device() == sum.device()),
                "add_layer_norm_backward: a gradient slot must be a contiguous fp32 vector of ", cols);
    return out.defined() ? out : at::empty({cols}, sum.options());
  };
  auto dw = fresh(dweight_out), dbias = with_bias ? fresh(dbias_out) : at::Tensor();
  auto dbranch_sum = branch_sums ? fresh(dbranch_sum_out) : at::Tensor();
  // The weight's, the bias's (and the branch's) gradients: the sums of
  // their partial rows, in one launch.
  auto sum_partial_rows = [&](const at::Tensor& parts_w, const at::Tensor& parts_b, const at::Tensor& parts_r) {
    PartialRows p{{as<float>(parts_w), with_bias ? as<float>(parts_b) : nullptr,
                   parts_r.defined() ? as<float>(parts_r) : nullptr},
                  {as_mut<float>(dw), with_bias ? as_mut<float>(dbias) : nullptr,
                   parts_r.defined() ? as_mut<float>(dbranch_sum) : nullptr}};
    const dim3 grid(static_cast<unsigned>((cols + 31) / 32), parts_r.defined() ? 3 : with_bias ? 2 : 1);
    sum_rows_kernel<<<grid, dim3(32, kSumLanes), 0, at::cuda::getCurrentCUDAStream()>>>(p, parts_w.numel() / cols,
                                                                                      static_cast<int>(cols));
    C10_CUDA_KERNEL_LAUNCH_CHECK();
  };
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
  if (add_layer_norm_vectorised(cols, {dout, dsum, sum, weight})) {
    const int chunks = vec_chunks(cols);
    at::Tensor parts;  // [2 or 3, blocks, cols]: the weight's partial gradients, the bias's, the branch's sums
    with_chunks(chunks, [&](auto k) {
      constexpr int kChunks = decltype(k)::value;
      auto launch = [&](auto kernel, bool sums) {
        const size_t shared = sizeof(float) * kRowsPerBlock * kChunks * kChunkCols;  // 24 KiB at 768 columns
        const int per_sm = resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), 32 * kRowsPerBlock, shared);
        const int64_t resident = int64_t{at::cuda::getCurrentDeviceProperties()->multiProcessorCount} * std::max(per_sm, 1);
        const int64_t blocks = std::max<int64_t>(1, std::min(row_blocks(rows), resident));
        parts = at::empty({sums ? 3 : 2, blocks, cols}, sum.options());
        kernel<<<static_cast<unsigned>(blocks), block, shared, stream>>>(
            as<__nv_bfloat16>(dout), ds, as<float>(sum), as<float>(mean), as<float>(rstd), as<float>(weight),
            as_mut<float>(dx), db, as_mut<float>(parts[0]), as_mut<float>(parts[1]),
            sums ? as_mut<float>(parts[2]) : nullptr, rows);
      };
      if (ds && branch_sums) launch(backward_vec_kernel<kChunks, true, true, true>, true);
      else if (branch_sums) launch(backward_vec_kernel<kChunks, false, true, true>, true);
      else if (ds && with_branch) launch(backward_vec_kernel<kChunks, true, true>, false);
      else if (ds) launch(backward_vec_kernel<kChunks, true, false>, false);
      else if (with_branch) launch(backward_vec_kernel<kChunks, false, true>, false);
      else launch(backward_vec_kernel<kChunks, false, false>, false);
    });
    C10_CUDA_KERNEL_LAUNCH_CHECK();
    sum_partial_rows(parts[0], parts[1], branch_sums ? parts[2] : at::Tensor());
    return {dx, dbranch, dw, dbias, dbranch_sum};
  }
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
  sum_partial_rows(dweight_parts, dbias_parts, at::Tensor());
  // The scalar kernels' branch sums: a plain fp32 sum over the rows of the
  // bf16 branch gradient (widths the vectorised kernels do not take).
  if (branch_sums) at::sum_out(dbranch_sum, dbranch.reshape({rows, cols}), {0}, false, at::kFloat);
  return {dx, dbranch, dw, dbias, dbranch_sum};
}

}  // namespace ddp::cuda
