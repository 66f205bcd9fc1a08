// Column sums of bf16 [rows, C] matrices (linear_bias.h).
//
// Each thread owns 8 adjacent columns (one 16-byte load) and walks rows; a
// block is TX x TY threads (TX * 8 columns, TY rows at a time), and there is
// one wave of blocks (as many as the kernel's occupancy lets the GPU hold),
// each writing its partial sums to part[blockIdx.x][C]. A second kernel adds
// the partials per column in a fixed order, so the result is deterministic.
// The GELU variant computes dh = dy * gelu'(h) per element on the way,
// writes it, and sums the bf16-rounded dh (the tensor autograd would sum).
// The heads variant reads its rows from attention's [B, H, T, D] gradients
// (at their strides) and writes them side by side, as the cat would.
#include "ddp/cuda/linear_bias.h"
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

constexpr int kVec = 8;        // columns per thread: one 16-byte load
constexpr int kThreads = 256;  // threads per block
constexpr int kUnroll = 4;     // rows per round: four loads in flight
constexpr int kLanes = 32;     // lanes per column in the finalising kernel

// Rounds f to bf16 in place and stores it.
__device__ __forceinline__ void round_store8(__nv_bfloat16* p, float* f) {
  uint4 v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
  *reinterpret_cast<uint4*>(p) = v;
}

// gelu'(h) * dy in fp32. The exact GELU is 0.5 h (1 + erf(h / sqrt 2)); the
// tanh form is 0.5 h (1 + tanh(u)) with u = sqrt(2 / pi) (h + 0.044715 h^3),
// whose derivative is 0.5 (1 + t) + 0.5 h (1 - t^2) du/dh for t = tanh(u).
template <Gelu kGelu>
__device__ __forceinline__ float gelu_grad(float dy, float h) {
  if constexpr (kGelu == Gelu::kErf) {
    constexpr float kInvSqrt2 = 0.70710678118654752440f;
    constexpr float kInvSqrt2Pi = 0.39894228040143267794f;  // the normal density's 1 / sqrt(2 pi)
    const float cdf = 0.5f * (1.f + erff(h * kInvSqrt2));
    const float pdf = expf(-0.5f * h * h) * kInvSqrt2Pi;
    return dy * (cdf + h * pdf);
  } else {
    constexpr float kSqrt2OverPi = 0.79788456080286535588f;
    constexpr float kCubic = 0.044715f;
    const float h2 = h * h;
    const float t = tanhf(kSqrt2OverPi * (h + kCubic * h2 * h));
    const float du = kSqrt2OverPi * (1.f + 3.f * kCubic * h2);
    return dy * (0.5f * (1.f + t) + 0.5f * h * (1.f - t * t) * du);
  }
}

// Where a thread's 8 columns come from. kPlain: dy's [M, C] rows. kGelu:
// the same, through the GELU's backward against h, with dh written. kHeads:
// the heads of up to three [B, H, T, D] tensors (any strides, D's 1), side by
// side: output column c is part c / (H D), head (c % (H D)) / D; row r is
// (b, t) = (r / T, r % T); the values are copied into the [M, C] output.
enum class Src { kPlain, kGelu, kHeads };

struct HeadParts {
  const __nv_bfloat16* p[3];
  int64_t sb[3], st[3], sh[3];  // strides of B, T and H, in elements
  int T, D, width;              // width = H D, one part's columns
};

// g = the source's values at 8 columns of a row (kGelu: the GELU's backward,
// also written to dh); the column sums add g.
template <Src kSrc, Gelu kForm>
__global__ void partial_kernel(const __nv_bfloat16* __restrict__ dy, const __nv_bfloat16* __restrict__ h,
                               __nv_bfloat16* __restrict__ dh, HeadParts heads, int64_t M, int C,
                               float* __restrict__ part) {
  extern __shared__ float sh[];
  const int TX = blockDim.x, TY = blockDim.y, tx = threadIdx.x, ty = threadIdx.y;
  const int c0 = (blockIdx.y * TX + tx) * kVec;
  // The thread's first element of row r is src + row_offset(r).
  const __nv_bfloat16* src = dy + c0;
  int64_t sb = 0, st = C;
  if constexpr (kSrc == Src::kHeads) {
    const int i = c0 / heads.width, col = c0 - i * heads.width;
    // Constant indices: a runtime one would copy the parameters to the stack.
    auto pick = [i](const auto& a) { return i == 0 ? a[0] : i == 1 ? a[1] : a[2]; };
    src = pick(heads.p) + (col / heads.D) * pick(heads.sh) + col % heads.D;
    sb = pick(heads.sb);
    st = pick(heads.st);
  }
  auto row_offset = [&](int64_t r) -> int64_t {
    if constexpr (kSrc == Src::kHeads) {
      const int64_t b = r / heads.T;
      return b * sb + (r - b * heads.T) * st;
    } else {
      return r * st;
    }
  };
  // kGelu (x: h's values) writes dh = gelu'(h) dy rounded to bf16 and sums
  // the rounded values; kHeads copies its values (bf16 already) out.
  auto emit = [&](int64_t r, float* g, const float* x) {
    if constexpr (kSrc == Src::kGelu) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) g[k] = gelu_grad<kForm>(g[k], x[k]);
      round_store8(dh + r * C + c0, g);
    } else if constexpr (kSrc == Src::kHeads) {
      store8(dh + r * C + c0, g);
    }
  };
  constexpr int kH = kSrc == Src::kGelu ? kVec : 1;
  float acc[kVec];
#pragma unroll
  for (int k = 0; k < kVec; ++k) acc[k] = 0.f;
  const int64_t stride = static_cast<int64_t>(gridDim.x) * TY;
  int64_t r = static_cast<int64_t>(blockIdx.x) * TY + ty;
  for (; r + (kUnroll - 1) * stride < M; r += kUnroll * stride) {
    float g[kUnroll][kVec], x[kUnroll][kH];
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      load8(src + row_offset(r + u * stride), g[u]);
      if constexpr (kSrc == Src::kGelu) load8(h + (r + u * stride) * C + c0, x[u]);
    }
#pragma unroll
    for (int u = 0; u < kUnroll; ++u) {
      emit(r + u * stride, g[u], x[u]);
#pragma unroll
      for (int k = 0; k < kVec; ++k) acc[k] += g[u][k];
    }
  }
  for (; r < M; r += stride) {
    float g[kVec], x[kH];
    load8(src + row_offset(r), g);
    if constexpr (kSrc == Src::kGelu) load8(h + r * C + c0, x);
    emit(r, g, x);
#pragma unroll
    for (int k = 0; k < kVec; ++k) acc[k] += g[k];
  }
  // Add the block's TY rows (a power of two), then write its partials.
  const int W = TX * kVec;
  const int own = ty * W + tx * kVec;
#pragma unroll
  for (int k = 0; k < kVec; ++k) sh[own + k] = acc[k];
  for (int s = TY / 2; s > 0; s >>= 1) {
    __syncthreads();
    if (ty < s) {
#pragma unroll
      for (int k = 0; k < kVec; ++k) sh[own + k] += sh[own + s * W + k];
    }
  }
  if (ty == 0) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) part[static_cast<int64_t>(blockIdx.x) * C + c0 + k] = sh[own + k];
  }
}

// out[c] = the sum of part[0..parts)[c]: 32 columns x kLanes lanes a block.
__global__ void finalize_kernel(const float* __restrict__ part, int parts, int C, float* __restrict__ out) {
  __shared__ float s[kLanes][33];
  const int tx = threadIdx.x, ty = threadIdx.y, c = blockIdx.x * 32 + tx;
  float a = 0.f;
  if (c < C) {
    int i = ty;
    for (; i + 3 * kLanes < parts; i += 4 * kLanes) {
      float v[4];
#pragma unroll
      for (int u = 0; u < 4; ++u) v[u] = part[static_cast<int64_t>(i + u * kLanes) * C + c];
#pragma unroll
      for (int u = 0; u < 4; ++u) a += v[u];
    }
    for (; i < parts; i += kLanes) a += part[static_cast<int64_t>(i) * C + c];
  }
  s[ty][tx] = a;
  for (int k = kLanes / 2; k > 0; k >>= 1) {
    __syncthreads();
    if (ty < k) {
      a += s[ty + k][tx];
      s[ty][tx] = a;
    }
  }
  if (ty == 0 && c < C) out[c] = a;
}

// The partial sums (and dh or the copy), then the finalising sums into out.
template <Src kSrc, Gelu kForm = Gelu::kErf>
void launch(const at::Tensor& dy, const at::Tensor& h, const at::Tensor& dh, const HeadParts& heads, int64_t M, int C,
            const at::Tensor& out) {
  const int cv = C / kVec;
  int tx = 32;
  while (cv % tx != 0) tx /= 2;
  const int ty = kThreads / tx, gy = cv / tx;
  const size_t shared = sizeof(float) * ty * tx * kVec;
  const int per_sm =
      resident_blocks_per_sm(reinterpret_cast<const void*>(partial_kernel<kSrc, kForm>), kThreads, shared);
  const int64_t sms = at::cuda::getCurrentDeviceProperties()->multiProcessorCount;
  const int64_t want = std::max<int64_t>(1, sms * std::max(per_sm, 1) / gy);
  const int64_t rows_per_block = static_cast<int64_t>(ty) * kUnroll;
  const int gx = static_cast<int>(std::max<int64_t>(1, std::min<int64_t>(want, (M + rows_per_block - 1) / rows_per_block)));
  auto stream = at::cuda::getCurrentCUDAStream();
  auto part = at::empty({static_cast<int64_t>(gx) * C}, out.options());
  auto ptr = [](const at::Tensor& t) { return t.defined() ? as<__nv_bfloat16>(t) : nullptr; };
  partial_kernel<kSrc, kForm><<<dim3(gx, gy), dim3(tx, ty), shared, stream>>>(
      ptr(dy), ptr(h), dh.defined() ? as_mut<__nv_bfloat16>(dh) : nullptr, heads, M, C, as_mut<float>(part));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
  finalize_kernel<<<(C + 31) / 32, dim3(32, kLanes), 0, stream>>>(as<float>(part), gx, C, as_mut<float>(out));
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

}  // namespace

bool column_sum_supported(const at::Tensor& g) {
  return g.defined() && g.is_cuda() && g.scalar_type() == at::kBFloat16 && g.dim() >= 1 && g.is_contiguous() &&
         g.size(-1) % kVec == 0 && g.numel() > 0 && aligned(g);
}

namespace {
// The caller's output, checked, or a fresh one.
at::Tensor sums_into(const at::Tensor& out, const at::Tensor& like) {
  if (!out.defined()) return at::empty({like.size(-1)}, like.options().dtype(at::kFloat));
  TORCH_CHECK(out.is_cuda() && out.get_device() == like.get_device() && out.scalar_type() == at::kFloat &&
                  out.dim() == 1 && out.size(0) == like.size(-1) && out.is_contiguous(),
              "column_sum: out must be a contiguous fp32 vector of ", like.size(-1), " on ", like.device(), ", got ",
              out.sizes(), " ", out.scalar_type());
  return out;
}
}  // namespace

at::Tensor column_sum(const at::Tensor& g, const at::Tensor& out_in) {
  TORCH_CHECK(column_sum_supported(g), "column_sum: unsupported input ", g.sizes(), " ", g.scalar_type());
  c10::cuda::CUDAGuard guard(g.device());
  auto out = sums_into(out_in, g);
  const int C = static_cast<int>(g.size(-1));
  launch<Src::kPlain>(g, at::Tensor(), at::Tensor(), HeadParts{}, g.numel() / C, C, out);
  return out;
}

std::vector<at::Tensor> gelu_backward_column_sum(const at::Tensor& dy, const at::Tensor& h, Gelu form,
                                                 const at::Tensor& out_in, const at::Tensor& dh_out) {
  TORCH_CHECK(column_sum_supported(dy) && column_sum_supported(h) && dy.sizes() == h.sizes(),
              "gelu_backward_column_sum: unsupported inputs ", dy.sizes(), " ", dy.scalar_type(), " and ", h.sizes(),
              " ", h.scalar_type());
  TORCH_CHECK(!dh_out.defined() || (column_sum_supported(dh_out) && dh_out.numel() == h.numel() &&
                                    dh_out.size(-1) == h.size(-1) && dh_out.device() == h.device()),
              "gelu_backward_column_sum: dh_out must be a contiguous, aligned bf16 tensor of ", h.sizes(),
              "'s size on ", h.device(), ", got ", dh_out.sizes(), " ", dh_out.scalar_type());
  c10::cuda::CUDAGuard guard(dy.device());
  auto dh = dh_out.defined() ? dh_out : at::empty_like(h);
  auto out = sums_into(out_in, h);
  const int C = static_cast<int>(h.size(-1));
  const int64_t M = h.numel() / C;
  if (form == Gelu::kTanh) {
    launch<Src::kGelu, Gelu::kTanh>(dy, h, dh, HeadParts{}, M, C, out);
  } else {
    launch<Src::kGelu, Gelu::kErf>(dy, h, dh, HeadParts{}, M, C, out);
  }
  return {dh, out};
}

namespace {
// Whether the kernel reads `t`, a [B, H, T, D] part, as it is: 16-byte
// vectors along D at every row and head (strides of size-1 dimensions
// never count).
bool heads_readable(const at::Tensor& t) {
  for (int d = 0; d < 3; ++d)
    if (t.size(d) > 1 && t.stride(d) % kVec != 0) return false;
  return t.stride(3) == 1 && aligned(t);
}
}  // namespace

std::vector<at::Tensor> heads_column_sum(at::TensorList parts, const at::Tensor& out_in) {
  TORCH_CHECK(!parts.empty() && parts.size() <= 3, "heads_column_sum: takes 1 to 3 parts, got ", parts.size());
  const auto& first = parts[0];
  TORCH_CHECK(first.defined() && first.is_cuda() && first.scalar_type() == at::kBFloat16 && first.dim() == 4 &&
                  first.numel() > 0 && first.size(3) % kVec == 0,
              "heads_column_sum: parts must be non-empty bf16 CUDA tensors [B, H, T, D] with D a multiple of ", kVec,
              ", got ", first.sizes(), " ", first.scalar_type());
  c10::cuda::CUDAGuard guard(first.device());
  const int64_t B = first.size(0), H = first.size(1), T = first.size(2), D = first.size(3);
  TORCH_CHECK(H * D * static_cast<int64_t>(parts.size()) < (int64_t{1} << 30) && T < (int64_t{1} << 30),
              "heads_column_sum: parts too wide");
  HeadParts heads{};
  std::vector<at::Tensor> kept;  // the parts as read, alive until the kernel is queued
  for (size_t i = 0; i < parts.size(); ++i) {
    const auto& t = parts[i];
    TORCH_CHECK(t.defined() && t.sizes() == first.sizes() && t.scalar_type() == at::kBFloat16 &&
                    t.device() == first.device(),
                "heads_column_sum: part ", i, " is ", t.sizes(), ", not like part 0's ", first.sizes());
    // A fresh copy where the kernel cannot read t as it is: contiguous() would
    // return an already contiguous t at its unaligned start unchanged.
    kept.push_back(heads_readable(t) ? t : t.clone(at::MemoryFormat::Contiguous));
    heads.p[i] = as<__nv_bfloat16>(kept.back());
    heads.sb[i] = kept.back().stride(0);
    heads.sh[i] = kept.back().stride(1);
    heads.st[i] = kept.back().stride(2);
  }
  heads.T = static_cast<int>(T);
  heads.D = static_cast<int>(D);
  heads.width = static_cast<int>(H * D);
  const int C = heads.width * static_cast<int>(parts.size());
  auto cat = at::empty({B * T, C}, first.options());
  auto out = sums_into(out_in, cat);
  launch<Src::kHeads>(at::Tensor(), at::Tensor(), cat, heads, B * T, C, out);
  return {cat, out};
}

}  // namespace ddp::cuda
