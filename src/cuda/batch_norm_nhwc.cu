// Training-mode batch norm over channels-last bf16 activations.
//
// The activation is an [M, C] row-major matrix (M = N*H*W). Each thread owns
// 8 adjacent channels (one 16-byte load) and walks rows; a block is TX x TY
// threads (TX * 8 channels, TY rows at a time). Statistics: per-thread
// Welford, merged over the block's rows with Chan's formula, then over the
// blocks of a column by a second small kernel, which also folds weight and
// bias into one scale and shift per channel. The backward pass is the same
// shape: two per-channel sums, then dx = a*dy + b*x + d per channel.
//
// Fused variants, for the residual networks' "relu(bn(x))" and
// "relu(bn(x) + shortcut)": the normalising pass also adds the shortcut and
// applies the ReLU, so the forward reads x twice (and the shortcut once) and
// writes y once, where the unfused ops make eight passes. Backward, the
// first sum pass reads y for the ReLU mask and writes the masked gradient
// dz = dy * (y > 0) once; dz is the shortcut's gradient and the input of
// the dx pass (seven passes against eight, and no separate ReLU kernel).
// Without a residual nobody needs dz: the mask is then recomputed from x
// and the forward's scale/shift (so the forward's y need not be kept for
// the backward), in both passes, and dz is never written.
#include "ddp/cuda/batch_norm_nhwc.h"
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

constexpr int kVec = 8;        // channels per thread: one 16-byte load
constexpr int kThreads = 256;  // threads per block
constexpr int kUnroll = 4;     // rows per round: four loads in flight

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* f) {
  const uint4 v = *reinterpret_cast<const uint4*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* f) {
  uint4 v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<uint4*>(p) = v;
}

__device__ __forceinline__ void load8f(const float* p, float* f) {
  const float4 a = *reinterpret_cast<const float4*>(p);
  const float4 b = *reinterpret_cast<const float4*>(p + 4);
  f[0] = a.x, f[1] = a.y, f[2] = a.z, f[3] = a.w, f[4] = b.x, f[5] = b.y, f[6] = b.z, f[7] = b.w;
}

// g = g where y > 0, else 0 (the ReLU's backward); stores the result at dz.
__device__ __forceinline__ void mask8(const __nv_bfloat16* y, float* g, __nv_bfloat16* dz) {
  float m[kVec];
  load8(y, m);
#pragma unroll
  for (int k = 0; k < kVec; ++k) g[k] = m[k] > 0.f ? g[k] : 0.f;
  store8(dz, g);
}

// The normalising affine map, as one explicit fma: the forward and the
// ReLU mask recomputed in backward must round identically. (It is the fma
// that nvcc contracted `v * s + t` to before this was spelled out.)
__device__ __forceinline__ float affine(float v, float s, float t) { return __fmaf_rn(v, s, t); }

// g = g where relu(x * s + t), rounded to bf16 as the forward stores it,
// is > 0, else 0: the mask of the forward's y, without y.
__device__ __forceinline__ void mask8_from_x(const float* v, const float* s, const float* t, float* g) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    const float y = __bfloat162float(__float2bfloat16_rn(fmaxf(affine(v[k], s[k], t[k]), 0.f)));
    g[k] = y > 0.f ? g[k] : 0.f;
  }
}

// Where backward's ReLU mask comes from: none (plain batch norm), the
// forward's output y (the residual case; the masked gradient dz is written
// out), or x and the forward's scale/shift (no residual; nothing written).
enum class Mask { kNone, kFromY, kFromX };

// Chan et al.: (n, mean, m2) += (nb, meanb, m2b).
__device__ __forceinline__ void merge(float& n, float& mean, float& m2, float nb, float meanb, float m2b) {
  if (nb == 0.f) return;
  const float total = n + nb;
  const float delta = meanb - mean;
  const float wb = nb / total;
  mean += delta * wb;
  m2 += m2b + delta * delta * n * wb;
  n = total;
}

// Per block and channel: (count, mean, M2) over the block's rows.
// part: [3][gridDim.x][C].
template <typename T>
__global__ void stats_partial_kernel(const T* __restrict__ x, int64_t M, int C, float* __restrict__ part) {
  extern __shared__ float sh[];
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int c0 = (blockIdx.y * TX + tx) * kVec;
  float n = 0.f, mean[kVec], m2[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) mean[k] = m2[k] = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * TY;
  int64_t r = static_cast<int64_t>(blockIdx.x) * TY + ty;
  for (; r + (kUnroll - 1) * stride < M; r += kUnroll * stride) {
    float v[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load8(x + (r + u * stride) * C + c0, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      n += 1.f;
      const float inv = 1.f / n;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = v[u][k] - mean[k];
        mean[k] += d * inv;
        m2[k] += d * (v[u][k] - mean[k]);
      }
    }
  }
  for (; r < M; r += stride) {
    float v[kVec];
    load8(x + r * C + c0, v);
    n += 1.f;
    const float inv = 1.f / n;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float d = v[k] - mean[k];
      mean[k] += d * inv;
      m2[k] += d * (v[k] - mean[k]);
    }
  }
  // Merge the TY rows of the block (TY is a power of two).
  const int W = TX * kVec;
  float* sn = sh;
  float* smean = sh + TY * W;
  float* sm2 = sh + 2 * TY * W;
  const int own = ty * W + tx * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    sn[own + k] = n;
    smean[own + k] = mean[k];
    sm2[own + k] = m2[k];
  }
  for (int s = TY / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (ty < s) {
      const int other = own + s * W;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float na = sn[own + k], ma = smean[own + k], qa = sm2[own + k];
        merge(na, ma, qa, sn[other + k], smean[other + k], sm2[other + k]);
        sn[own + k] = na;
        smean[own + k] = ma;
        sm2[own + k] = qa;
      }
    }
  }
  if (ty == 0) {
    const int64_t plane = static_cast<int64_t>(gridDim.x) * C;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t o = static_cast<int64_t>(blockIdx.x) * C + c0 + k;
      part[o] = sn[own + k];
      part[plane + o] = smean[own + k];
      part[2 * plane + o] = sm2[own + k];
    }
  }
}

// Per channel: merge the blocks' summaries; out = [mean, invstd, scale,
// shift] x C; update the running statistics (unbiased variance, as PyTorch).
// Block (32, kLanes): 32 channels, kLanes lanes over the partials, merged
// in a tree. (With 8 lanes, a 64-channel layer's 1,000 partials made this
// latency-bound kernel 7% of a ResNet-50 step.)
constexpr int kLanes = 32;

__global__ void stats_finalize_kernel(const float* __restrict__ part, int parts, int C, const float* __restrict__ weight,
                                      const float* __restrict__ bias, float* __restrict__ running_mean,
                                      float* __restrict__ running_var, float momentum, float eps, float* __restrict__ out) {
  __shared__ float sn[kLanes][33], smean[kLanes][33], sm2[kLanes][33];
  const int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.x * 32 + tx;
  const int64_t plane = static_cast<int64_t>(parts) * C;
  float n = 0.f, mean = 0.f, m2 = 0.f;
  if (c < C)
    for (int i = ty; i < parts; i += kLanes) {
      const int64_t o = static_cast<int64_t>(i) * C + c;
      merge(n, mean, m2, part[o], part[plane + o], part[2 * plane + o]);
    }
  sn[ty][tx] = n;
  smean[ty][tx] = mean;
  sm2[ty][tx] = m2;
  for (int s = kLanes / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (ty < s) {
      merge(n, mean, m2, sn[ty + s][tx], smean[ty + s][tx], sm2[ty + s][tx]);
      sn[ty][tx] = n;
      smean[ty][tx] = mean;
      sm2[ty][tx] = m2;
    }
  }
  if (ty != 0 || c >= C) return;
  const float var = m2 / n;
  const float invstd = rsqrtf(var + eps);
  const float scale = weight[c] * invstd;
  out[c] = mean;
  out[C + c] = invstd;
  out[2 * C + c] = scale;
  out[3 * C + c] = bias[c] - mean * scale;
  running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * mean;
  running_var[c] = (1.f - momentum) * running_var[c] + momentum * (n > 1.f ? m2 / (n - 1.f) : var);
}

// y = x * scale[c] + shift[c] (+ residual) (then max(., 0)), 8 channels per thread.
template <typename T, bool kResidual, bool kRelu>
__global__ void normalize_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                 const float* __restrict__ scale, const float* __restrict__ shift, T* __restrict__ y,
                                 int64_t vecs, int cv) {
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c0 = static_cast<int>(i % cv) * kVec;
    float v[kVec], s[kVec], t[kVec], r[kVec];
    load8(x + i * kVec, v);
    if constexpr (kResidual) load8(residual + i * kVec, r);
    load8f(scale + c0, s);
    load8f(shift + c0, t);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      // Rounded to bf16 before the add, as the unfused ops round bn's output.
      v[k] = affine(v[k], s[k], t[k]);
      if constexpr (kResidual) v[k] = __bfloat162float(__float2bfloat16_rn(v[k])) + r[k];
      if constexpr (kRelu) v[k] = fmaxf(v[k], 0.f);
    }
    store8(y + i * kVec, v);
  }
}

// Per block and channel: sum(dy) and sum(dy * (x - mean)). part: [2][gridDim.x][C].
// kFromY: dy is first masked by the ReLU output y (dy where y > 0, else 0),
// and the masked gradient is written to dz. kFromX: the same mask from x
// and scale_shift ([2][C]: the forward's scale and shift), nothing written.
template <typename T, Mask kMask>
__global__ void grad_partial_kernel(const T* __restrict__ dy, const T* __restrict__ x, const float* __restrict__ mean,
                                    const T* __restrict__ y, T* __restrict__ dz,
                                    const float* __restrict__ scale_shift, int64_t M, int C,
                                    float* __restrict__ part) {
  extern __shared__ float sh[];
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int c0 = (blockIdx.y * TX + tx) * kVec;
  float m[kVec], sdy[kVec], sdx[kVec], sc[kVec], sf[kVec];
  load8f(mean + c0, m);
  if constexpr (kMask == Mask::kFromX) {
    load8f(scale_shift + c0, sc);
    load8f(scale_shift + C + c0, sf);
  }
#pragma unroll
  for (int k = 0; k < kVec; ++k) sdy[k] = sdx[k] = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * TY;
  int64_t r = static_cast<int64_t>(blockIdx.x) * TY + ty;
  for (; r + (kUnroll - 1) * stride < M; r += kUnroll * stride) {
    float g[kUnroll][kVec], v[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load8(dy + (r + u * stride) * C + c0, g[u]);
      load8(x + (r + u * stride) * C + c0, v[u]);
    }
    if constexpr (kMask == Mask::kFromY) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) mask8(y + (r + u * stride) * C + c0, g[u], dz + (r + u * stride) * C + c0);
    }
    if constexpr (kMask == Mask::kFromX) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) mask8_from_x(v[u], sc, sf, g[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        sdy[k] += g[u][k];
        sdx[k] += g[u][k] * (v[u][k] - m[k]);
      }
  }
  for (; r < M; r += stride) {
    float g[kVec], v[kVec];
    load8(dy + r * C + c0, g);
    load8(x + r * C + c0, v);
    if constexpr (kMask == Mask::kFromY) mask8(y + r * C + c0, g, dz + r * C + c0);
    if constexpr (kMask == Mask::kFromX) mask8_from_x(v, sc, sf, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      sdy[k] += g[k];
      sdx[k] += g[k] * (v[k] - m[k]);
    }
  }
  const int W = TX * kVec;
  float* s1 = sh;
  float* s2 = sh + TY * W;
  const int own = ty * W + tx * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    s1[own + k] = sdy[k];
    s2[own + k] = sdx[k];
  }
  for (int s = TY / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (ty < s) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        s1[own + k] += s1[own + s * W + k];
        s2[own + k] += s2[own + s * W + k];
      }
    }
  }
  if (ty == 0) {
    const int64_t plane = static_cast<int64_t>(gridDim.x) * C;
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const int64_t o = static_cast<int64_t>(blockIdx.x) * C + c0 + k;
      part[o] = s1[own + k];
      part[plane + o] = s2[own + k];
    }
  }
}

// Per channel: dbias = sum(dy), dweight = sum(dy * xhat), and the
// coefficients of dx = a*dy + b*x + d, in coef = [a, b, d] x C.
__global__ void grad_finalize_kernel(const float* __restrict__ part, int parts, int C, float rows,
                                     const float* __restrict__ weight, const float* __restrict__ mean,
                                     const float* __restrict__ invstd, float* __restrict__ dweight,
                                     float* __restrict__ dbias, float* __restrict__ coef) {
  __shared__ float s1[kLanes][33], s2[kLanes][33];
  const int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.x * 32 + tx;
  const int64_t plane = static_cast<int64_t>(parts) * C;
  float sdy = 0.f, sdx = 0.f;
  if (c < C)
    for (int i = ty; i < parts; i += kLanes) {
      const int64_t o = static_cast<int64_t>(i) * C + c;
      sdy += part[o];
      sdx += part[plane + o];
    }
  s1[ty][tx] = sdy;
  s2[ty][tx] = sdx;
  for (int s = kLanes / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (ty < s) {
      sdy += s1[ty + s][tx];
      sdx += s2[ty + s][tx];
      s1[ty][tx] = sdy;
      s2[ty][tx] = sdx;
    }
  }
  if (ty != 0 || c >= C) return;
  const float is = invstd[c];
  dbias[c] = sdy;
  dweight[c] = sdx * is;
  const float a = weight[c] * is;
  const float b = -a * is * is * sdx / rows;
  coef[c] = a;
  coef[C + c] = b;
  coef[2 * C + c] = -a * sdy / rows - b * mean[c];
}

// dx = a*g + b*x + d per channel, g = dy, or dy masked (kFromX; the kFromY
// callers pass dz as dy). dy and dx may be the same buffer (dx written over
// dz when the caller does not need dz), hence no __restrict__ on them: each
// thread reads its own 8 elements of dy before it writes the same 8 of dx,
// and no other thread touches them, so the in-place update is race-free.
template <typename T, Mask kMask>
__global__ void grad_input_kernel(const T* dy, const T* __restrict__ x, const float* __restrict__ coef,
                                  const float* __restrict__ scale_shift, T* dx, int64_t vecs, int cv) {
  const int C = cv * kVec;
  for (int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; i < vecs;
       i += static_cast<int64_t>(gridDim.x) * blockDim.x) {
    const int c0 = static_cast<int>(i % cv) * kVec;
    float g[kVec], v[kVec], a[kVec], b[kVec], d[kVec];
    load8(dy + i * kVec, g);
    load8(x + i * kVec, v);
    load8f(coef + c0, a);
    load8f(coef + C + c0, b);
    load8f(coef + 2 * C + c0, d);
    if constexpr (kMask == Mask::kFromX) {
      float sc[kVec], sf[kVec];
      load8f(scale_shift + c0, sc);
      load8f(scale_shift + C + c0, sf);
      mask8_from_x(v, sc, sf, g);
    }
#pragma unroll
    for (int k = 0; k < kVec; ++k) g[k] = a[k] * g[k] + b[k] * v[k] + d[k];
    store8(dx + i * kVec, g);
  }
}

// Block shape and grid for the column reductions: TX threads across
// channels (a power of two dividing C/8, at most 32), TY = 256/TX rows, and
// enough row-blocks to fill the GPU, each thread seeing >= kUnroll rows.
struct Plan {
  int tx, ty, gx, gy;
};

Plan plan(int64_t M, int C) {
  const int cv = C / kVec;
  Plan p{};
  p.tx = 32;
  while (cv % p.tx != 0) p.tx /= 2;
  p.ty = kThreads / p.tx;
  p.gy = cv / p.tx;
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = std::max<int64_t>(1, sms * 8 / p.gy);
  const int64_t rows_per_block = static_cast<int64_t>(p.ty) * kUnroll;
  p.gx = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, (M + rows_per_block - 1) / rows_per_block)));
  return p;
}

int elementwise_blocks(int64_t vecs) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((vecs + kThreads - 1) / kThreads, sms * 16)));
}

void check_param(const at::Tensor& t, int64_t C, const char* what) {
  TORCH_CHECK(t.defined() && t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == C,
              "bn_nhwc: ", what, " must be a contiguous fp32 CUDA tensor of ", C, " elements");
}

template <typename T, bool kResidual, bool kRelu>
void launch_normalize(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& stats, const at::Tensor& y,
                      cudaStream_t stream) {
  const int C = static_cast<int>(x.size(1));
  const int64_t vecs = x.numel() / kVec;
  normalize_kernel<T, kResidual, kRelu><<<elementwise_blocks(vecs), kThreads, 0, stream>>>(
      as<T>(x), kResidual ? as<T>(residual) : nullptr, as<float>(stats) + 2 * C, as<float>(stats) + 3 * C,
      as_mut<T>(y), vecs, C / kVec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void forward_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  const at::Tensor& running_mean, const at::Tensor& running_var, double momentum, double eps,
                  const at::Tensor& residual, bool relu, const at::Tensor& y, const at::Tensor& stats) {
  const int C = static_cast<int>(x.size(1));
  const int64_t M = x.numel() / C;
  const auto p = plan(M, C);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto part = at::empty({3 * static_cast<int64_t>(p.gx) * C}, stats.options());
  const size_t shared = sizeof(float) * 3 * p.ty * p.tx * kVec;
  stats_partial_kernel<T><<<dim3(p.gx, p.gy), dim3(p.tx, p.ty), shared, stream>>>(as<T>(x), M, C, as_mut<float>(part));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  stats_finalize_kernel<<<(C + 31) / 32, dim3(32, kLanes), 0, stream>>>(
      as<float>(part), p.gx, C, as<float>(weight), as<float>(bias), as_mut<float>(running_mean),
      as_mut<float>(running_var), static_cast<float>(momentum), static_cast<float>(eps), as_mut<float>(stats));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const bool add = residual.defined();
  if (add && relu) launch_normalize<T, true, true>(x, residual, stats, y, stream);
  else if (add) launch_normalize<T, true, false>(x, residual, stats, y, stream);
  else if (relu) launch_normalize<T, false, true>(x, residual, stats, y, stream);
  else launch_normalize<T, false, false>(x, residual, stats, y, stream);
}

// The mask comes from relu_output (then the masked gradient goes to dz,
// which may be dx itself), from scale_shift, or there is none.
template <typename T>
void backward_impl(const at::Tensor& dy, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& mean,
                   const at::Tensor& invstd, const at::Tensor& relu_output, const at::Tensor& scale_shift,
                   const at::Tensor& dz, const at::Tensor& dx, const at::Tensor& dweight, const at::Tensor& dbias) {
  const int C = static_cast<int>(x.size(1));
  const int64_t M = x.numel() / C;
  const auto p = plan(M, C);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto part = at::empty({2 * static_cast<int64_t>(p.gx) * C}, dweight.options());
  auto coef = at::empty({3 * static_cast<int64_t>(C)}, dweight.options());
  const size_t shared = sizeof(float) * 2 * p.ty * p.tx * kVec;
  const dim3 grid(p.gx, p.gy), block(p.tx, p.ty);
  const Mask mask = relu_output.defined() ? Mask::kFromY : scale_shift.defined() ? Mask::kFromX : Mask::kNone;
  const float* ss = scale_shift.defined() ? as<float>(scale_shift) : nullptr;
  if (mask == Mask::kFromY)
    grad_partial_kernel<T, Mask::kFromY><<<grid, block, shared, stream>>>(
        as<T>(dy), as<T>(x), as<float>(mean), as<T>(relu_output), as_mut<T>(dz), nullptr, M, C, as_mut<float>(part));
  else if (mask == Mask::kFromX)
    grad_partial_kernel<T, Mask::kFromX><<<grid, block, shared, stream>>>(
        as<T>(dy), as<T>(x), as<float>(mean), nullptr, nullptr, ss, M, C, as_mut<float>(part));
  else
    grad_partial_kernel<T, Mask::kNone><<<grid, block, shared, stream>>>(
        as<T>(dy), as<T>(x), as<float>(mean), nullptr, nullptr, nullptr, M, C, as_mut<float>(part));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  grad_finalize_kernel<<<(C + 31) / 32, dim3(32, kLanes), 0, stream>>>(
      as<float>(part), p.gx, C, static_cast<float>(M), as<float>(weight), as<float>(mean), as<float>(invstd),
      as_mut<float>(dweight), as_mut<float>(dbias), as_mut<float>(coef));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t vecs = x.numel() / kVec;
  const int blocks = elementwise_blocks(vecs);
  if (mask == Mask::kFromX)
    grad_input_kernel<T, Mask::kFromX><<<blocks, kThreads, 0, stream>>>(as<T>(dy), as<T>(x), as<float>(coef), ss,
                                                                        as_mut<T>(dx), vecs, C / kVec);
  else  // kFromY reads the masked gradient back from dz
    grad_input_kernel<T, Mask::kNone><<<blocks, kThreads, 0, stream>>>(
        as<T>(mask == Mask::kFromY ? dz : dy), as<T>(x), as<float>(coef), nullptr, as_mut<T>(dx), vecs, C / kVec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// dy as the kernels read it: bf16, channels-last, 16-byte aligned.
at::Tensor as_kernel_input(const at::Tensor& t, const at::Tensor& like) {
  auto r = t.to(like.scalar_type()).contiguous(at::MemoryFormat::ChannelsLast);
  if (!aligned(r)) r = r.clone(at::MemoryFormat::ChannelsLast);
  TORCH_CHECK(r.sizes() == like.sizes(), "bn_nhwc: tensor of shape ", r.sizes(), " != input ", like.sizes());
  return r;
}

}  // namespace

bool bn_nhwc_supported(const at::Tensor& x) {
  return x.defined() && x.is_cuda() && x.dim() == 4 && x.scalar_type() == at::kBFloat16 && x.size(1) % kVec == 0 &&
         x.numel() > x.size(1) && x.is_contiguous(at::MemoryFormat::ChannelsLast) && aligned(x);
}

std::vector<at::Tensor> bn_nhwc_forward(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                                        const at::Tensor& running_mean, const at::Tensor& running_var,
                                        double momentum, double eps, const at::Tensor& residual, bool relu) {
  TORCH_CHECK(bn_nhwc_supported(x), "bn_nhwc_forward: unsupported input ", x.sizes(), " ", x.scalar_type());
  TORCH_CHECK(!residual.defined() || (bn_nhwc_supported(residual) && residual.sizes() == x.sizes()),
              "bn_nhwc_forward: the residual ", residual.sizes(), " must be a tensor like the input ", x.sizes());
  const int64_t C = x.size(1);
  for (const auto& [t, what] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"},
                                std::pair{&running_mean, "running_mean"}, std::pair{&running_var, "running_var"}})
    check_param(*t, C, what);
  c10::cuda::CUDAGuard guard(x.device());
  auto y = at::empty_like(x);  // keeps channels-last
  auto stats = at::empty({4, C}, weight.options());
  forward_impl<__nv_bfloat16>(x, weight, bias, running_mean, running_var, momentum, eps, residual, relu, y, stats);
  return {y, stats[0], stats[1], stats.narrow(0, 2, 2)};
}

namespace {

void check_backward_input(const at::Tensor& x, const char* what) {
  TORCH_CHECK(bn_nhwc_supported(x), what, ": unsupported input ", x.sizes(), " ", x.scalar_type());
}

}  // namespace

std::vector<at::Tensor> bn_nhwc_backward(const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& weight,
                                         const at::Tensor& mean, const at::Tensor& invstd,
                                         const at::Tensor& relu_output, bool need_dz) {
  check_backward_input(x, "bn_nhwc_backward");
  auto dy = as_kernel_input(dy_in, x);
  c10::cuda::CUDAGuard guard(x.device());
  at::Tensor y, dz = dy, dx;
  if (relu_output.defined()) {
    y = as_kernel_input(relu_output, x);
    dz = at::empty_like(x);
    // Without a caller for dz, dx goes over it (grad_input_kernel allows
    // that): one activation-sized buffer less at backward's peak.
    dx = need_dz ? at::empty_like(x) : dz;
  } else {
    dx = at::empty_like(x);
  }
  auto dweight = at::empty_like(weight);
  auto dbias = at::empty_like(weight);
  backward_impl<__nv_bfloat16>(dy, x, weight, mean.contiguous(), invstd.contiguous(), y, at::Tensor(), dz, dx,
                               dweight, dbias);
  return {dx, dweight, dbias, need_dz ? dz : at::Tensor()};
}

std::vector<at::Tensor> bn_nhwc_relu_backward(const at::Tensor& dy_in, const at::Tensor& x, const at::Tensor& weight,
                                              const at::Tensor& mean, const at::Tensor& invstd,
                                              const at::Tensor& scale_shift) {
  check_backward_input(x, "bn_nhwc_relu_backward");
  const int64_t C = x.size(1);
  TORCH_CHECK(scale_shift.defined() && scale_shift.is_cuda() && scale_shift.scalar_type() == at::kFloat &&
                  scale_shift.is_contiguous() && scale_shift.numel() == 2 * C,
              "bn_nhwc_relu_backward: scale_shift must be the forward's contiguous fp32 [2, ", C, "]");
  auto dy = as_kernel_input(dy_in, x);
  c10::cuda::CUDAGuard guard(x.device());
  auto dx = at::empty_like(x);
  auto dweight = at::empty_like(weight);
  auto dbias = at::empty_like(weight);
  backward_impl<__nv_bfloat16>(dy, x, weight, mean.contiguous(), invstd.contiguous(), at::Tensor(), scale_shift,
                               at::Tensor(), dx, dweight, dbias);
  return {dx, dweight, dbias};
}

}  // namespace ddp::cuda
