// The one place where LibTorch versions differ.
//
// ddptrain builds against Debian 12's LibTorch 1.13 (CPU, Gloo) and the CUDA
// LibTorch 2.x shipped inside PyTorch wheels. The c10d class hierarchy moved
// between them: in 1.13 ProcessGroupGloo/NCCL derive from c10d::ProcessGroup,
// in 2.x they derive from c10d::Backend and ProcessGroup became a dispatcher
// over backends. ddptrain talks to the backend object directly, so only the
// base-class name changes. No other file may test TORCH_VERSION_*.
#pragma once

#include <torch/torch.h>
#include <torch/version.h>
#include <torch/csrc/distributed/c10d/Store.hpp>
#include <torch/csrc/distributed/c10d/TCPStore.hpp>
#include <torch/csrc/distributed/c10d/PrefixStore.hpp>
#ifdef DDP_WITH_GLOO
#include <torch/csrc/distributed/c10d/ProcessGroupGloo.hpp>
#endif
#ifdef DDP_WITH_CUDA
#include <torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp>
#include <ATen/cuda/CUDAContext.h>
#include <c10/cuda/CUDAGuard.h>
#endif

#define DDP_TORCH_AT_LEAST(major, minor) \
  (TORCH_VERSION_MAJOR > (major) ||      \
   (TORCH_VERSION_MAJOR == (major) && TORCH_VERSION_MINOR >= (minor)))

namespace ddp::compat {

#if DDP_TORCH_AT_LEAST(2, 0)
using Backend = ::c10d::Backend;
#else
using Backend = ::c10d::ProcessGroup;
#endif
using Work = ::c10d::Work;

/// Whether this build has the Gloo backend (CPU ranks). PyTorch's CUDA
/// wheels ship no Gloo headers, so builds against them are NCCL-only.
#ifdef DDP_WITH_GLOO
constexpr bool kHasGloo = true;
#else
constexpr bool kHasGloo = false;
#endif

/// Version string, e.g. "1.13.0".
inline std::string torch_version() { return TORCH_VERSION; }

/// Releases a backend's communicators before the process exits. NCCL in 2.x
/// warns about leaked communicators unless they are shut down explicitly.
inline void shutdown_backend(const c10::intrusive_ptr<Backend>& pg) {
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 4)
  if (auto* nccl = dynamic_cast<::c10d::ProcessGroupNCCL*>(pg.get())) nccl->shutdown();
#else
  (void)pg;
#endif
}

/// Sets every parameter's gradient to zero in place. Optimizer::zero_grad()
/// defaults to set_to_none in 2.x, which would detach gradient views.
inline void zero_grads_in_place(const std::vector<torch::Tensor>& params) {
  torch::NoGradGuard no_grad;
  for (const auto& p : params) {
    if (p.grad().defined()) p.mutable_grad().zero_();
  }
}

}  // namespace ddp::compat
