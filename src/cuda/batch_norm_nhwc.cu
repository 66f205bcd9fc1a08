// Training-mode batch norm over channels-last bf16 activations.
//
// The activation is an [M, C] row-major matrix (M = N*H*W). Each thread owns
// 8 adjacent channels (one 16-byte load) and walks rows; a block is TX x TY
// threads (TX * 8 channels, TY rows at a time). Statistics: per-thread
// sums about a pivot (see stats_partial_kernel), added over the block's
// rows, then over the blocks of a column by a second small kernel, which
// also folds weight and bias into one scale and shift per channel. The backward pass is the same
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

constexpr int kVec = 8;        // channels per thread: one 16-byte load
constexpr int kThreads = 256;  // threads per block
constexpr int kUnroll = 4;     // rows per round: four loads in flight

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

// g = bf16(g + h): the sum of two bf16 gradients as a bf16 add rounds it.
__device__ __forceinline__ void add8_rounded(float* g, const float* h) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) g[k] = __bfloat162float(__float2bfloat16_rn(g[k] + h[k]));
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

__device__ __forceinline__ float to_float(__nv_bfloat16 v) { return __bfloat162float(v); }

// The column reductions' block epilogue: adds the TY rows' (a, b) per
// channel (TY a power of two) and writes the block's sums to part
// ([2][gridDim.x][C]). sh holds 2 x TY x TX x kVec floats.
__device__ __forceinline__ void block_sums_to_part(float* sh, const float* a, const float* b,
                                                   float* __restrict__ part, int C, int c0) {
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int W = TX * kVec;
  float* s1 = sh;
  float* s2 = sh + TY * W;
  const int own = ty * W + tx * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    s1[own + k] = a[k];
    s2[own + k] = b[k];
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

// Per channel: the plain sums of `parts` pairs of partial sums (part:
// [2][parts][C]); a block is 32 channels x kLanes lanes, each lane with
// kLoads loads in flight. The sums land in lane threadIdx.y == 0.
constexpr int kLanes = 32;
constexpr int kLoads = 4;

__device__ __forceinline__ void column_sums(const float* __restrict__ part, int parts, int C, int c, float& sa,
                                            float& sb) {
  __shared__ float s1[kLanes][33], s2[kLanes][33];
  const int tx = threadIdx.x, ty = threadIdx.y;
  const int64_t plane = static_cast<int64_t>(parts) * C;
  float a = 0.f, b = 0.f;
  if (c < C) {
    int i = ty;
    for (; i + (kLoads - 1) * kLanes < parts; i += kLoads * kLanes) {
      float va[kLoads], vb[kLoads];
#pragma unroll
      for (int u = 0; u < kLoads; ++u) {
        const int64_t o = static_cast<int64_t>(i + u * kLanes) * C + c;
        va[u] = part[o];
        vb[u] = part[plane + o];
      }
#pragma unroll
      for (int u = 0; u < kLoads; ++u) a += va[u], b += vb[u];
    }
    for (; i < parts; i += kLanes) {
      const int64_t o = static_cast<int64_t>(i) * C + c;
      a += part[o];
      b += part[plane + o];
    }
  }
  s1[ty][tx] = a;
  s2[ty][tx] = b;
  for (int s = kLanes / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (ty < s) {
      a += s1[ty + s][tx];
      b += s2[ty + s][tx];
      s1[ty][tx] = a;
      s2[ty][tx] = b;
    }
  }
  sa = a;
  sb = b;
}

// Statistics as sums about a pivot: per channel, S = sum(x - K) and
// Q = sum((x - K)^2); then mean = K + S/M and var = Q/M - (S/M)^2. K is the
// median of the channel's values in x's first, middle and last rows: a
// sample of the data, so (mean - K)^2 stays of the order of the variance
// and the subtraction costs a few bits at most (sums about 0 would lose all
// of them for a large mean), and a median, so one outlier among the three
// is never the pivot. Sums cost three flops an element and merge by
// addition, where per-row Welford updates cost a division per row and per
// merge; with one wave of blocks (see plan) this pass reads at a copy's
// bandwidth (it ran at 18-75% of it), and the finalising kernel is a plain
// column sum.
__device__ __forceinline__ float median3(float a, float b, float c) {
  return fmaxf(fminf(a, b), fminf(fmaxf(a, b), c));
}

template <typename T>
__device__ __forceinline__ void pivot8(const T* x, int64_t M, int C, int c0, float* k) {
  float a[kVec], b[kVec], c[kVec];
  load8(x + c0, a);
  load8(x + (M / 2) * C + c0, b);
  load8(x + (M - 1) * C + c0, c);
#pragma unroll
  for (int i = 0; i < kVec; ++i) k[i] = median3(a[i], b[i], c[i]);
}

// Per block and channel: S and Q over the block's rows. part: [2][gridDim.x][C].
template <typename T>
__global__ void stats_partial_kernel(const T* __restrict__ x, int64_t M, int C, float* __restrict__ part) {
  extern __shared__ float sh[];
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int c0 = (blockIdx.y * TX + tx) * kVec;
  float pivot[kVec], s1[kVec], s2[kVec];
  pivot8(x, M, C, c0, pivot);
#pragma unroll
  for (int k = 0; k < kVec; ++k) s1[k] = s2[k] = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * TY;
  int64_t r = static_cast<int64_t>(blockIdx.x) * TY + ty;
  for (; r + (kUnroll - 1) * stride < M; r += kUnroll * stride) {
    float v[kUnroll][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) load8(x + (r + u * stride) * C + c0, v[u]);
#pragma unroll
    for (int u = 0; u < kUnroll; ++u)
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = v[u][k] - pivot[k];
        s1[k] += d;
        s2[k] = __fmaf_rn(d, d, s2[k]);
      }
  }
  for (; r < M; r += stride) {
    float v[kVec];
    load8(x + r * C + c0, v);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      const float d = v[k] - pivot[k];
      s1[k] += d;
      s2[k] = __fmaf_rn(d, d, s2[k]);
    }
  }
  block_sums_to_part(sh, s1, s2, part, C, c0);
}

// Per channel: the blocks' sums merged; out = [mean, invstd, scale, shift]
// x C; the running statistics updated (unbiased variance, as PyTorch).
template <typename T>
__global__ void stats_finalize_kernel(const float* __restrict__ part, int parts, int C, const T* __restrict__ x,
                                      int64_t M, const float* __restrict__ weight, const float* __restrict__ bias,
                                      float* __restrict__ running_mean, float* __restrict__ running_var,
                                      float momentum, float eps, float* __restrict__ out) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  float sum, sumsq;
  column_sums(part, parts, C, c, sum, sumsq);
  if (threadIdx.y != 0 || c >= C) return;
  const float rows = static_cast<float>(M);
  const float pivot = median3(to_float(x[c]), to_float(x[(M / 2) * C + c]), to_float(x[(M - 1) * C + c]));
  const float offset = sum / rows;  // mean - pivot
  const float mean = pivot + offset;
  // Rounding may take a zero variance below 0; a NaN must stay NaN (fmaxf
  // would make it 0, and the running variance would hide a NaN input).
  const float v = sumsq / rows - offset * offset;
  const float var = v < 0.f ? 0.f : v;
  const float invstd = rsqrtf(var + eps);
  const float scale = weight[c] * invstd;
  out[c] = mean;
  out[C + c] = invstd;
  out[2 * C + c] = scale;
  out[3 * C + c] = bias[c] - mean * scale;
  running_mean[c] = (1.f - momentum) * running_mean[c] + momentum * mean;
  running_var[c] = (1.f - momentum) * running_var[c] + momentum * (rows > 1.f ? var * rows / (rows - 1.f) : var);
}

// The elementwise passes visit vector i = thread + k * stride (stride =
// grid x block threads). When the stride is a multiple of the row's
// vectors (cv = C / 8; true for every power-of-two C up to 2048 with
// 256-thread blocks), a thread's channels never change (kFixed): it loads
// its per-channel factors once. Otherwise (odd test shapes) it finds its
// channels per vector. (Unrolling the loop 2 or 4 deep was slower:
// bench/RESULTS.md, session 12.)
// y = x * scale[c] + shift[c] (+ residual) (then max(., 0)), 8 channels per thread.
template <bool kResidual, bool kRelu>
__device__ __forceinline__ void normalize8(float* v, const float* r, const float* s, const float* t) {
#pragma unroll
  for (int k = 0; k < kVec; ++k) {
    // Rounded to bf16 before the add, as the unfused ops round bn's output.
    v[k] = affine(v[k], s[k], t[k]);
    if constexpr (kResidual) v[k] = __bfloat162float(__float2bfloat16_rn(v[k])) + r[k];
    if constexpr (kRelu) v[k] = fmaxf(v[k], 0.f);
  }
}

template <typename T, bool kResidual, bool kRelu, bool kFixed>
__global__ void normalize_kernel(const T* __restrict__ x, const T* __restrict__ residual,
                                 const float* __restrict__ scale, const float* __restrict__ shift, T* __restrict__ y,
                                 int64_t vecs, int cv) {
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  float s[kVec], t[kVec];
  if constexpr (kFixed) {
    const int c0 = static_cast<int>(i % cv) * kVec;
    load8f(scale + c0, s);
    load8f(shift + c0, t);
  }
  for (; i < vecs; i += stride) {
    if constexpr (!kFixed) {
      const int c0 = static_cast<int>(i % cv) * kVec;
      load8f(scale + c0, s);
      load8f(shift + c0, t);
    }
    float v[kVec], r[kVec];
    load8(x + i * kVec, v);
    if constexpr (kResidual) load8(residual + i * kVec, r);
    normalize8<kResidual, kRelu>(v, r, s, t);
    store8(y + i * kVec, v);
  }
}

// Per block and channel: sum(dy) and sum(dy * (x - mean)). part: [2][gridDim.x][C].
// kFromY: dy is first masked by the ReLU output y (dy where y > 0, else 0),
// and the masked gradient is written to dz. kFromX: the same mask from x
// and scale_shift ([2][C]: the forward's scale and shift), nothing written.
// kSum (with kFromY): dy is the sum of two gradients, dy and dy2, rounded
// to bf16 as autograd's add of the two would round it: an output with two
// consumers (a residual block's output feeds the next block's convolution
// and its shortcut) gets both gradients here, with no separate add pass.
template <typename T, Mask kMask, bool kSum = false>
__global__ void grad_partial_kernel(const T* __restrict__ dy, const T* __restrict__ dy2, const T* __restrict__ x,
                                    const float* __restrict__ mean, const T* __restrict__ y, T* __restrict__ dz,
                                    const float* __restrict__ scale_shift, int64_t M, int C,
                                    float* __restrict__ part) {
  static_assert(!kSum || kMask == Mask::kFromY, "two gradients only for the residual tail");
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
    float g[kUnroll][kVec], v[kUnroll][kVec], o[kMask == Mask::kFromY ? kUnroll : 1][kVec];
    float g2[kSum ? kUnroll : 1][kVec];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load8(dy + (r + u * stride) * C + c0, g[u]);
      if constexpr (kSum) load8(dy2 + (r + u * stride) * C + c0, g2[u]);
      load8(x + (r + u * stride) * C + c0, v[u]);
      if constexpr (kMask == Mask::kFromY) load8(y + (r + u * stride) * C + c0, o[u]);
    }
    if constexpr (kMask == Mask::kFromY) {
#pragma unroll
      for (int u = 0; u < kUnroll; ++u) {
        if constexpr (kSum) add8_rounded(g[u], g2[u]);
#pragma unroll
        for (int k = 0; k < kVec; ++k) g[u][k] = o[u][k] > 0.f ? g[u][k] : 0.f;
        store8(dz + (r + u * stride) * C + c0, g[u]);
      }
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
    if constexpr (kSum) {
      float g2[kVec];
      load8(dy2 + r * C + c0, g2);
      add8_rounded(g, g2);
    }
    if constexpr (kMask == Mask::kFromY) mask8(y + r * C + c0, g, dz + r * C + c0);
    if constexpr (kMask == Mask::kFromX) mask8_from_x(v, sc, sf, g);
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      sdy[k] += g[k];
      sdx[k] += g[k] * (v[k] - m[k]);
    }
  }
  block_sums_to_part(sh, sdy, sdx, part, C, c0);
}

// Per channel: dbias = sum(dy), dweight = sum(dy * xhat), and the
// coefficients of dx = a*dy + b*x + d, in coef = [a, b, d] x C.
__global__ void grad_finalize_kernel(const float* __restrict__ part, int parts, int C, float rows,
                                     const float* __restrict__ weight, const float* __restrict__ mean,
                                     const float* __restrict__ invstd, float* __restrict__ dweight,
                                     float* __restrict__ dbias, float* __restrict__ coef) {
  const int c = blockIdx.x * 32 + threadIdx.x;
  float sdy, sdx;
  column_sums(part, parts, C, c, sdy, sdx);
  if (threadIdx.y != 0 || c >= C) return;
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
// kFixed: as normalize_kernel.
struct InputCoef {
  float a[kVec], b[kVec], d[kVec], sc[kVec], sf[kVec];
};

template <Mask kMask>
__device__ __forceinline__ void load_input_coef(const float* coef, const float* scale_shift, int C, int c0,
                                                InputCoef& q) {
  load8f(coef + c0, q.a);
  load8f(coef + C + c0, q.b);
  load8f(coef + 2 * C + c0, q.d);
  if constexpr (kMask == Mask::kFromX) {
    load8f(scale_shift + c0, q.sc);
    load8f(scale_shift + C + c0, q.sf);
  }
}

template <Mask kMask>
__device__ __forceinline__ void grad_input8(float* g, const float* v, const InputCoef& q) {
  if constexpr (kMask == Mask::kFromX) mask8_from_x(v, q.sc, q.sf, g);
#pragma unroll
  for (int k = 0; k < kVec; ++k) g[k] = q.a[k] * g[k] + q.b[k] * v[k] + q.d[k];
}

template <typename T, Mask kMask, bool kFixed>
__global__ void grad_input_kernel(const T* dy, const T* __restrict__ x, const float* __restrict__ coef,
                                  const float* __restrict__ scale_shift, T* dx, int64_t vecs, int cv) {
  const int C = cv * kVec;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * blockDim.x;
  int64_t i = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  InputCoef q;
  if constexpr (kFixed) load_input_coef<kMask>(coef, scale_shift, C, static_cast<int>(i % cv) * kVec, q);
  for (; i < vecs; i += stride) {
    if constexpr (!kFixed) load_input_coef<kMask>(coef, scale_shift, C, static_cast<int>(i % cv) * kVec, q);
    float g[kVec], v[kVec];
    load8(dy + i * kVec, g);
    load8(x + i * kVec, v);
    grad_input8<kMask>(g, v, q);
    store8(dx + i * kVec, g);
  }
}

// Block shape and grid for the column reductions: TX threads across
// channels (a power of two dividing C/8, at most 32), TY = 256/TX rows, and
// one wave of row-blocks: as many as the kernel's occupancy lets the GPU
// hold at once, each thread seeing >= kUnroll rows. (Eight blocks an SM,
// whatever the occupancy, made up to four waves of short blocks, and the
// small layers' sum passes ran at 30-70% of a copy's bandwidth.)
#ifndef BN_REDUCE_WAVES
#define BN_REDUCE_WAVES 1
#endif

struct Plan {
  int tx, ty, gx, gy;
  size_t shared;  // bytes: two sums per channel and row of the block
};

template <typename Kernel>
Plan plan(int64_t M, int C, Kernel kernel) {
  const int cv = C / kVec;
  Plan p{};
  p.tx = 32;
  while (cv % p.tx != 0) p.tx /= 2;
  p.ty = kThreads / p.tx;
  p.gy = cv / p.tx;
  p.shared = sizeof(float) * 2 * p.ty * p.tx * kVec;
  const int per_sm = resident_blocks_per_sm(reinterpret_cast<const void*>(kernel), kThreads, p.shared);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = std::max<int64_t>(1, sms * std::max(per_sm, 1) * BN_REDUCE_WAVES / p.gy);
  const int64_t rows_per_block = static_cast<int64_t>(p.ty) * kUnroll;
  p.gx = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, (M + rows_per_block - 1) / rows_per_block)));
  return p;
}

int elementwise_blocks(int64_t vecs) {
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  return static_cast<int>(std::max<int64_t>(1, std::min<int64_t>((vecs + kThreads - 1) / kThreads, sms * 16)));
}

// Whether every thread of an elementwise pass of `blocks` blocks sees the
// same channels in each vector it visits (see normalize_kernel).
bool fixed_channels(int blocks, int C) { return (static_cast<int64_t>(blocks) * kThreads) % (C / kVec) == 0; }

void check_param(const at::Tensor& t, int64_t C, const char* what) {
  TORCH_CHECK(t.defined() && t.is_cuda() && t.scalar_type() == at::kFloat && t.is_contiguous() && t.numel() == C,
              "bn_nhwc: ", what, " must be a contiguous fp32 CUDA tensor of ", C, " elements");
}

template <typename T, bool kResidual, bool kRelu>
void launch_normalize(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& stats, const at::Tensor& y,
                      cudaStream_t stream) {
  const int C = static_cast<int>(x.size(1));
  const int64_t vecs = x.numel() / kVec;
  const int blocks = elementwise_blocks(vecs);
  const auto* r = kResidual ? as<T>(residual) : nullptr;
  const float* scale = as<float>(stats) + 2 * C;
  if (fixed_channels(blocks, C))
    normalize_kernel<T, kResidual, kRelu, true><<<blocks, kThreads, 0, stream>>>(as<T>(x), r, scale, scale + C,
                                                                                 as_mut<T>(y), vecs, C / kVec);
  else
    normalize_kernel<T, kResidual, kRelu, false><<<blocks, kThreads, 0, stream>>>(as<T>(x), r, scale, scale + C,
                                                                                  as_mut<T>(y), vecs, C / kVec);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

template <typename T>
void forward_impl(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& bias,
                  const at::Tensor& running_mean, const at::Tensor& running_var, double momentum, double eps,
                  const at::Tensor& residual, bool relu, const at::Tensor& y, const at::Tensor& stats) {
  const int C = static_cast<int>(x.size(1));
  const int64_t M = x.numel() / C;
  const auto p = plan(M, C, stats_partial_kernel<T>);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto part = at::empty({2 * static_cast<int64_t>(p.gx) * C}, stats.options());
  stats_partial_kernel<T><<<dim3(p.gx, p.gy), dim3(p.tx, p.ty), p.shared, stream>>>(as<T>(x), M, C,
                                                                                   as_mut<float>(part));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  stats_finalize_kernel<T><<<(C + 31) / 32, dim3(32, kLanes), 0, stream>>>(
      as<float>(part), p.gx, C, as<T>(x), M, as<float>(weight), as<float>(bias),
      as_mut<float>(running_mean), as_mut<float>(running_var), static_cast<float>(momentum), static_cast<float>(eps),
      as_mut<float>(stats));
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
void backward_impl(const at::Tensor& dy, const at::Tensor& dy2, const at::Tensor& x, const at::Tensor& weight,
                   const at::Tensor& mean, const at::Tensor& invstd, const at::Tensor& relu_output,
                   const at::Tensor& scale_shift, const at::Tensor& dz, const at::Tensor& dx,
                   const at::Tensor& dweight, const at::Tensor& dbias) {
  const int C = static_cast<int>(x.size(1));
  const int64_t M = x.numel() / C;
  const Mask mask = relu_output.defined() ? Mask::kFromY : scale_shift.defined() ? Mask::kFromX : Mask::kNone;
  const auto p = mask == Mask::kFromY   ? (dy2.defined() ? plan(M, C, grad_partial_kernel<T, Mask::kFromY, true>)
                                                         : plan(M, C, grad_partial_kernel<T, Mask::kFromY>))
                 : mask == Mask::kFromX ? plan(M, C, grad_partial_kernel<T, Mask::kFromX>)
                                        : plan(M, C, grad_partial_kernel<T, Mask::kNone>);
  auto stream = at::cuda::getCurrentCUDAStream();
  auto part = at::empty({2 * static_cast<int64_t>(p.gx) * C}, dweight.options());
  auto coef = at::empty({3 * static_cast<int64_t>(C)}, dweight.options());
  const size_t shared = p.shared;
  const dim3 grid(p.gx, p.gy), block(p.tx, p.ty);
  const float* ss = scale_shift.defined() ? as<float>(scale_shift) : nullptr;
  if (mask == Mask::kFromY && dy2.defined())
    grad_partial_kernel<T, Mask::kFromY, true><<<grid, block, shared, stream>>>(
        as<T>(dy), as<T>(dy2), as<T>(x), as<float>(mean), as<T>(relu_output), as_mut<T>(dz), nullptr, M, C,
        as_mut<float>(part));
  else if (mask == Mask::kFromY)
    grad_partial_kernel<T, Mask::kFromY><<<grid, block, shared, stream>>>(
        as<T>(dy), nullptr, as<T>(x), as<float>(mean), as<T>(relu_output), as_mut<T>(dz), nullptr, M, C,
        as_mut<float>(part));
  else if (mask == Mask::kFromX)
    grad_partial_kernel<T, Mask::kFromX><<<grid, block, shared, stream>>>(
        as<T>(dy), nullptr, as<T>(x), as<float>(mean), nullptr, nullptr, ss, M, C, as_mut<float>(part));
  else
    grad_partial_kernel<T, Mask::kNone><<<grid, block, shared, stream>>>(
        as<T>(dy), nullptr, as<T>(x), as<float>(mean), nullptr, nullptr, nullptr, M, C, as_mut<float>(part));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  grad_finalize_kernel<<<(C + 31) / 32, dim3(32, kLanes), 0, stream>>>(
      as<float>(part), p.gx, C, static_cast<float>(M), as<float>(weight), as<float>(mean), as<float>(invstd),
      as_mut<float>(dweight), as_mut<float>(dbias), as_mut<float>(coef));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  const int64_t vecs = x.numel() / kVec;
  const int blocks = elementwise_blocks(vecs);
  const bool fixed = fixed_channels(blocks, C);
  const T* g = as<T>(mask == Mask::kFromY ? dz : dy);  // kFromY reads the masked gradient back from dz
  if (mask == Mask::kFromX && fixed)
    grad_input_kernel<T, Mask::kFromX, true><<<blocks, kThreads, 0, stream>>>(g, as<T>(x), as<float>(coef), ss,
                                                                              as_mut<T>(dx), vecs, C / kVec);
  else if (mask == Mask::kFromX)
    grad_input_kernel<T, Mask::kFromX, false><<<blocks, kThreads, 0, stream>>>(g, as<T>(x), as<float>(coef), ss,
                                                                               as_mut<T>(dx), vecs, C / kVec);
  else if (fixed)
    grad_input_kernel<T, Mask::kNone, true><<<blocks, kThreads, 0, stream>>>(g, as<T>(x), as<float>(coef), nullptr,
                                                                             as_mut<T>(dx), vecs, C / kVec);
  else
    grad_input_kernel<T, Mask::kNone, false><<<blocks, kThreads, 0, stream>>>(g, as<T>(x), as<float>(coef), nullptr,
                                                                              as_mut<T>(dx), vecs, C / kVec);
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
                                         const at::Tensor& relu_output, bool need_dz, const at::Tensor& dy2_in) {
  check_backward_input(x, "bn_nhwc_backward");
  TORCH_CHECK(!dy2_in.defined() || relu_output.defined(), "bn_nhwc_backward: a second gradient needs relu_output");
  // One of two gradients may be missing (an output nobody used).
  const at::Tensor& first = dy_in.defined() ? dy_in : dy2_in;
  TORCH_CHECK(first.defined(), "bn_nhwc_backward: no gradient");
  auto dy = as_kernel_input(first, x);
  at::Tensor dy2;
  if (dy_in.defined() && dy2_in.defined()) dy2 = as_kernel_input(dy2_in, x);
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
  backward_impl<__nv_bfloat16>(dy, dy2, x, weight, mean.contiguous(), invstd.contiguous(), y, at::Tensor(), dz, dx,
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
  backward_impl<__nv_bfloat16>(dy, at::Tensor(), x, weight, mean.contiguous(), invstd.contiguous(), at::Tensor(),
                               scale_shift, at::Tensor(), dx, dweight, dbias);
  return {dx, dweight, dbias};
}

}  // namespace ddp::cuda
