// Device helpers the bf16 kernel files share: eight bf16 values (one
// 16-byte access), or four (one 8-byte access), to and from fp32 registers.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace ddp::cuda {

// The register type of N bf16 values' one access: 16 bytes for 8, 8 for 4.
template <int N>
struct Bf16Bits;
template <>
struct Bf16Bits<8> {
  using type = uint4;
};
template <>
struct Bf16Bits<4> {
  using type = uint2;
};

template <int N>
__device__ __forceinline__ void load_bf16(const __nv_bfloat16* p, float* f) {
  using Bits = typename Bf16Bits<N>::type;
  const Bits v = *reinterpret_cast<const Bits*>(p);
  const auto* h = reinterpret_cast<const __nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) {
    const float2 t = __bfloat1622float2(h[i]);
    f[2 * i] = t.x;
    f[2 * i + 1] = t.y;
  }
}

template <int N>
__device__ __forceinline__ void store_bf16(__nv_bfloat16* p, const float* f) {
  using Bits = typename Bf16Bits<N>::type;
  Bits v;
  auto* h = reinterpret_cast<__nv_bfloat162*>(&v);
#pragma unroll
  for (int i = 0; i < N / 2; ++i) h[i] = __floats2bfloat162_rn(f[2 * i], f[2 * i + 1]);
  *reinterpret_cast<Bits*>(p) = v;
}

__device__ __forceinline__ void load8(const __nv_bfloat16* p, float* f) { load_bf16<8>(p, f); }
__device__ __forceinline__ void store8(__nv_bfloat16* p, const float* f) { store_bf16<8>(p, f); }
__device__ __forceinline__ void load4(const __nv_bfloat16* p, float* f) { load_bf16<4>(p, f); }
__device__ __forceinline__ void store4(__nv_bfloat16* p, const float* f) { store_bf16<4>(p, f); }

}  // namespace ddp::cuda
