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
#include <c10/cuda/CUDACachingAllocator.h>
#include <ATen/cuda/CUDAGraph.h>
#include <ATen/cuda/CUDAEvent.h>
#include <c10/cuda/CUDAGraphsC10Utils.h>
#endif
#include <optional>
#include <ATen/autocast_mode.h>

#include <arpa/inet.h>
#include <netdb.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <functional>
#include <string>
#include <limits>

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

/// c10::Allocator::allocate is const in LibTorch 1.x and not in 2.x (where
/// an allocator also implements copy_data): declare a subclass's as
/// `c10::DataPtr allocate(size_t n) DDP_ALLOCATOR_CONST override`.
#if DDP_TORCH_AT_LEAST(2, 3)
#define DDP_ALLOCATOR_CONST
#else
#define DDP_ALLOCATOR_CONST const
#endif


/// The CUDA runtime and NCCL this build compiled against, e.g.
/// "CUDA 12.4, NCCL 2.21.5"; "" for a CPU-only LibTorch.
inline std::string cuda_nccl_versions() {
  std::string out;
#if defined(DDP_WITH_CUDA) && defined(CUDART_VERSION)
  out += "CUDA " + std::to_string(CUDART_VERSION / 1000) + "." + std::to_string(CUDART_VERSION % 1000 / 10);
#endif
#if defined(DDP_WITH_CUDA) && defined(NCCL_MAJOR)
  out += std::string(out.empty() ? "" : ", ") + "NCCL " + std::to_string(NCCL_MAJOR) + "." + std::to_string(NCCL_MINOR) +
         "." + std::to_string(NCCL_PATCH);
#endif
  return out;
}

/// Releases a backend's communicators before the process exits. NCCL in 2.x
/// warns about leaked communicators unless they are shut down explicitly.
inline void shutdown_backend(const c10::intrusive_ptr<Backend>& pg) {
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 4)
  if (auto* nccl = dynamic_cast<::c10d::ProcessGroupNCCL*>(pg.get())) nccl->shutdown();
#else
  (void)pg;
#endif
}

/// Whether `pg`'s reduce_scatter takes parts of unequal sizes (some empty):
/// NCCL's in LibTorch 2.3 and later (it runs one reduce per part, grouped in
/// one NCCL call). NCCL's in 1.13 wants equal parts, and Gloo's in 1.13 has
/// none at all ("ProcessGroupGloo does not support reduce_scatter"; 2.x
/// wheels ship no Gloo headers, so ddptrain's Gloo is always 1.13's).
inline bool has_uneven_reduce_scatter(const c10::intrusive_ptr<Backend>& pg) {
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 3)
  return dynamic_cast<::c10d::ProcessGroupNCCL*>(pg.get()) != nullptr;
#else
  (void)pg;
  return false;
#endif
}

/// Sums parts[r] over the ranks into rank r's parts[r], for every r: a
/// reduce-scatter of parts of any sizes. Where the backend's reduce_scatter
/// takes such parts and none is empty, one call (one work); elsewhere one
/// reduce per non-empty part, to the rank that owns it (what NCCL's does
/// inside, without asking NCCL for reduces of no elements; a bucket inside
/// one rank's part is then one reduce). The other ranks' parts hold
/// unspecified values afterwards (Gloo's reduce leaves partial sums there).
/// Every rank passes parts of the same sizes, so all take the same path.
inline std::vector<c10::intrusive_ptr<Work>> reduce_scatter_parts(const c10::intrusive_ptr<Backend>& pg,
                                                                  std::vector<at::Tensor>& parts, int rank) {
  std::vector<c10::intrusive_ptr<Work>> works;
  const bool none_empty =
      std::all_of(parts.begin(), parts.end(), [](const at::Tensor& t) { return t.numel() > 0; });
  if (none_empty && has_uneven_reduce_scatter(pg)) {
    std::vector<at::Tensor> out{parts.at(static_cast<size_t>(rank))};
    std::vector<std::vector<at::Tensor>> in{parts};
    works.push_back(pg->reduce_scatter(out, in));
    return works;
  }
  for (size_t r = 0; r < parts.size(); ++r) {
    if (parts[r].numel() == 0) continue;
    std::vector<at::Tensor> one{parts[r]};
    ::c10d::ReduceOptions o;
    o.rootRank = static_cast<int64_t>(r);
    works.push_back(pg->reduce(one, o));
  }
  return works;
}

/// The dtype autocast casts to on `device` now, or nullopt while autocast is
/// off there.
inline std::optional<c10::ScalarType> autocast_dtype(c10::DeviceType device) {
#if DDP_TORCH_AT_LEAST(2, 4)
  if (!at::autocast::is_autocast_enabled(device)) return std::nullopt;
  return at::autocast::get_autocast_dtype(device);
#else
  const bool cuda = device == c10::DeviceType::CUDA;
  if (!(cuda ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled())) return std::nullopt;
  return cuda ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
#endif
}

/// Autocast's thread-local settings for one device type (on or off, and
/// the dtype), as activation recomputation saves them in forward and puts
/// them back for the re-run in backward, whatever the backward thread has.
struct AutocastState {
  bool enabled = false;
  c10::ScalarType dtype = c10::ScalarType::BFloat16;
};
inline AutocastState autocast_state(c10::DeviceType device) {
#if DDP_TORCH_AT_LEAST(2, 4)
  return {at::autocast::is_autocast_enabled(device), at::autocast::get_autocast_dtype(device)};
#else
  const bool cuda = device == c10::DeviceType::CUDA;
  return {cuda ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled(),
          cuda ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype()};
#endif
}
inline void set_autocast_state(c10::DeviceType device, const AutocastState& s) {
#if DDP_TORCH_AT_LEAST(2, 4)
  at::autocast::set_autocast_enabled(device, s.enabled);
  at::autocast::set_autocast_dtype(device, s.dtype);
#else
  if (device == c10::DeviceType::CUDA) {
    at::autocast::set_enabled(s.enabled);
    at::autocast::set_autocast_gpu_dtype(s.dtype);
  } else {
    at::autocast::set_cpu_enabled(s.enabled);
    at::autocast::set_autocast_cpu_dtype(s.dtype);
  }
#endif
}

/// Turns autocast on for one device type and dtype while it lives (the C++
/// side of `torch.autocast`). The autocast cache of cast weights is cleared
/// on exit, as Python does when the outermost autocast block ends.
class AutocastGuard {
 public:
  AutocastGuard(c10::DeviceType device, c10::ScalarType dtype, bool enabled) : device_(device), enabled_(enabled) {
    if (!enabled_) return;
#if DDP_TORCH_AT_LEAST(2, 4)
    prev_enabled_ = at::autocast::is_autocast_enabled(device_);
    prev_dtype_ = at::autocast::get_autocast_dtype(device_);
    at::autocast::set_autocast_enabled(device_, true);
    at::autocast::set_autocast_dtype(device_, dtype);
#else
    const bool cuda = device_ == c10::DeviceType::CUDA;
    prev_enabled_ = cuda ? at::autocast::is_enabled() : at::autocast::is_cpu_enabled();
    prev_dtype_ = cuda ? at::autocast::get_autocast_gpu_dtype() : at::autocast::get_autocast_cpu_dtype();
    if (cuda) {
      at::autocast::set_enabled(true);
      at::autocast::set_autocast_gpu_dtype(dtype);
    } else {
      at::autocast::set_cpu_enabled(true);
      at::autocast::set_autocast_cpu_dtype(dtype);
    }
#endif
  }
  ~AutocastGuard() {
    if (!enabled_) return;
#if DDP_TORCH_AT_LEAST(2, 4)
    at::autocast::set_autocast_enabled(device_, prev_enabled_);
    at::autocast::set_autocast_dtype(device_, prev_dtype_);
#else
    if (device_ == c10::DeviceType::CUDA) {
      at::autocast::set_enabled(prev_enabled_);
      at::autocast::set_autocast_gpu_dtype(prev_dtype_);
    } else {
      at::autocast::set_cpu_enabled(prev_enabled_);
      at::autocast::set_autocast_cpu_dtype(prev_dtype_);
    }
#endif
    if (!prev_enabled_) at::autocast::clear_cache();
  }
  AutocastGuard(const AutocastGuard&) = delete;
  AutocastGuard& operator=(const AutocastGuard&) = delete;

 private:
  c10::DeviceType device_;
  bool enabled_;
  bool prev_enabled_ = false;
  c10::ScalarType prev_dtype_ = c10::ScalarType::Float;
};

/// Whether LibTorch has the fused, graph-capturable Adam/AdamW/SGD kernels
/// that take the learning rate as a tensor (CUDA, 2.2 and later).
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 2)
constexpr bool kHasFusedOptimizers = true;
#else
constexpr bool kHasFusedOptimizers = false;
#endif

/// One fused Adam (decoupled=false) or AdamW step over a list of tensors;
/// `found_inf`, when defined, makes the kernel skip the update. A defined
/// `grad_divisor` (one float on the device) divides every gradient first,
/// in the same pass, and the kernel stores the divided gradients back (the
/// slot PyTorch's GradScaler hands its scale to).
inline void fused_adam(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                       const std::vector<torch::Tensor>& exp_avg, const std::vector<torch::Tensor>& exp_avg_sq,
                       const std::vector<torch::Tensor>& steps, const torch::Tensor& lr, double beta1, double beta2,
                       double weight_decay, double eps, bool decoupled, const torch::Tensor& found_inf,
                       const torch::Tensor& grad_divisor = {}) {
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 2)
  c10::optional<torch::Tensor> inf = found_inf.defined() ? c10::optional<torch::Tensor>(found_inf) : c10::nullopt;
  c10::optional<torch::Tensor> div =
      grad_divisor.defined() ? c10::optional<torch::Tensor>(grad_divisor) : c10::nullopt;
  if (decoupled)
    at::_fused_adamw_(params, grads, exp_avg, exp_avg_sq, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false,
                      div, inf);
  else
    at::_fused_adam_(params, grads, exp_avg, exp_avg_sq, {}, steps, lr, beta1, beta2, weight_decay, eps, false, false,
                     div, inf);
#else
  TORCH_CHECK(false, "fused Adam needs CUDA LibTorch 2.2 or later");
#endif
}

/// One fused SGD step over a list of tensors. With momentum 0 the kernel
/// takes no momentum buffers (it refuses momentum 0 with buffers, as
/// torch.optim.SGD(fused=True) never passes them).
inline void fused_sgd(const std::vector<torch::Tensor>& params, const std::vector<torch::Tensor>& grads,
                      const std::vector<torch::Tensor>& momentum_buffers, double weight_decay, double momentum,
                      const torch::Tensor& lr, const torch::Tensor& found_inf) {
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 2)
  c10::optional<torch::Tensor> inf = found_inf.defined() ? c10::optional<torch::Tensor>(found_inf) : c10::nullopt;
  const std::vector<torch::Tensor> none;
  at::_fused_sgd_(params, grads, momentum == 0 ? none : momentum_buffers, weight_decay, momentum, lr, 0.0, false, false,
                  false, c10::nullopt, inf);
#else
  TORCH_CHECK(false, "fused SGD needs CUDA LibTorch 2.2 or later");
#endif
}

/// The joint L2 norm of `grads` as torch.nn.utils.clip_grad_norm_ of this
/// version computes it: the norm of each tensor, then the norm of those
/// (1.13: torch.norm, which is at::norm over all dimensions; 2.x: one
/// _foreach_norm, then linalg.vector_norm). The same calls give the same
/// bits, which one norm over the concatenated gradients does not: 1.13's CPU
/// kernel sums the squares of a long tensor in float, in an order of its own
/// (5e-7 relative apart for a 34k-parameter CNN). per_tensor_norms() and
/// norm_of_norms() are its two halves, for norms taken bucket by bucket
/// (GradSyncOptions::gradient_norms).
inline std::vector<torch::Tensor> per_tensor_norms(const std::vector<torch::Tensor>& grads) {
  std::vector<torch::Tensor> norms;
#if DDP_TORCH_AT_LEAST(2, 0)
  for (auto& n : at::_foreach_norm(grads, 2)) norms.push_back(n.to(torch::kFloat));
#else
  norms.reserve(grads.size());
  for (const auto& g : grads) {
    std::vector<int64_t> all(static_cast<size_t>(g.dim()));
    for (int64_t d = 0; d < g.dim(); ++d) all[static_cast<size_t>(d)] = d;
    norms.push_back(at::norm(g, 2, all, /*keepdim=*/false).to(torch::kFloat));
  }
#endif
  return norms;
}

/// The L2 norm of per-tensor norms (float scalars), as clip_grad_norm_ joins them.
inline torch::Tensor norm_of_norms(const std::vector<torch::Tensor>& norms) {
#if DDP_TORCH_AT_LEAST(2, 0)
  return at::linalg_vector_norm(torch::stack(norms), 2);
#else
  return at::norm(torch::stack(norms), 2, {0}, /*keepdim=*/false);
#endif
}

/// The joint L2 norm (see above).
inline torch::Tensor clip_grad_total_norm(const std::vector<torch::Tensor>& grads) {
  return norm_of_norms(per_tensor_norms(grads));
}

/// Whether profile_chrome_trace() works: CUDA LibTorch 2.2 or later (Debian's
/// 1.13 has no Kineto GPU profiling).
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 2)
constexpr bool kHasGpuProfiler = true;
#else
constexpr bool kHasGpuProfiler = false;
#endif

/// Runs `fn` under LibTorch's Kineto profiler (CPU and CUDA activity) and
/// writes a Chrome trace (every kernel with its time) to `path`; throws
/// where kHasGpuProfiler is false. In src/compat.cpp: its header is heavy.
void profile_chrome_trace(const std::function<void()>& fn, const std::string& path);

/// Bytes allocated on a CUDA device: now (what Python's
/// torch.cuda.memory_allocated reports) or at most since the last reset
/// (torch.cuda.max_memory_allocated); 0 without CUDA.
enum class CudaBytes { kNow, kPeak };
inline int64_t allocated_cuda_bytes(int device, CudaBytes which = CudaBytes::kNow) {
#ifdef DDP_WITH_CUDA
  const auto stat = c10::cuda::CUDACachingAllocator::getDeviceStats(static_cast<c10::DeviceIndex>(device)).allocated_bytes[0];
  return which == CudaBytes::kPeak ? stat.peak : stat.current;
#else
  (void)device;
  (void)which;
  return 0;
#endif
}
inline int64_t peak_cuda_bytes(int device) { return allocated_cuda_bytes(device, CudaBytes::kPeak); }

inline void reset_peak_cuda_bytes(int device) {
#ifdef DDP_WITH_CUDA
  c10::cuda::CUDACachingAllocator::resetPeakStats(static_cast<c10::DeviceIndex>(device));
#else
  (void)device;
#endif
}

/// Returns the caching allocator's unused cached blocks to the driver (what
/// Python's torch.cuda.empty_cache does).
inline void empty_cuda_cache() {
#ifdef DDP_WITH_CUDA
  c10::cuda::CUDACachingAllocator::emptyCache();
#endif
}

/// Whether the current CUDA stream is being captured into a graph (host
/// waits and event queries are illegal then).
inline bool stream_capturing() {
#ifdef DDP_WITH_CUDA
  return torch::cuda::is_available() &&
         c10::cuda::currentStreamCaptureStatusMayInitCtx() != c10::cuda::CaptureStatus::None;
#else
  return false;
#endif
}

#ifdef DDP_WITH_CUDA
/// Starts capturing `graph` on the current stream. Where LibTorch allows it,
/// the capture is thread-local: loader threads that pin memory or query
/// events meanwhile do not invalidate it (global mode forbids that).
inline void begin_capture(at::cuda::CUDAGraph& graph) {
#if DDP_TORCH_AT_LEAST(2, 1)
  graph.capture_begin({0, 0}, cudaStreamCaptureModeThreadLocal);
#else
  graph.capture_begin();
#endif
}
#endif

/// cuDNN autotuning on; TF32 for fp32 matmuls and convolutions as asked.
inline void set_cuda_math(bool tf32) {
  at::globalContext().setBenchmarkCuDNN(true);
  at::globalContext().setAllowTF32CuBLAS(tf32);
  at::globalContext().setAllowTF32CuDNN(tf32);
}


/// Causal self-attention over q, k, v of shape B x heads x T x head_dim:
/// softmax(q k^T / sqrt(head_dim), future masked) v. LibTorch 2.x has
/// scaled_dot_product_attention, which picks the flash or memory-efficient
/// kernels on a GPU and captures into a CUDA graph; 1.13 has none, so there
/// it is written out with a mask built from the sizes (no buffer, so the
/// model's state_dict is the same in both).
#if DDP_TORCH_AT_LEAST(2, 0)
constexpr bool kHasScaledDotProductAttention = true;
#else
constexpr bool kHasScaledDotProductAttention = false;
#endif
inline torch::Tensor causal_attention(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v,
                                      double dropout_p, bool training) {
#if DDP_TORCH_AT_LEAST(2, 0)
  return at::scaled_dot_product_attention(q, k, v, /*attn_mask=*/{}, training ? dropout_p : 0.0, /*is_causal=*/true);
#else
  const int64_t t = q.size(-2);
  auto scores = torch::matmul(q, k.transpose(-2, -1)) * (1.0 / std::sqrt(static_cast<double>(q.size(-1))));
  auto future = torch::ones({t, t}, torch::TensorOptions().dtype(torch::kBool).device(q.device())).triu(1);
  auto weights = torch::softmax(scores.masked_fill(future, -std::numeric_limits<double>::infinity()), -1);
  if (training && dropout_p > 0) weights = torch::dropout(weights, dropout_p, true);
  return torch::matmul(weights, v);
#endif
}

/// Whether a store server can be bound to one address (below).
#if DDP_TORCH_AT_LEAST(2, 4)
constexpr bool kStoreBindsToAddress = true;
#else
constexpr bool kStoreBindsToAddress = false;
#endif

/// Starts a TCPStore server on `host`:`port`; port 0 lets the kernel choose
/// (read it back with getPort()), with no window between finding a port and
/// taking it. From 2.4 we bind the listening socket to `host` alone and hand
/// it to c10d (masterListenFd, which only its classic backend takes); 1.13 to
/// 2.3 have no such option, so there c10d listens on every interface.
inline c10::intrusive_ptr<::c10d::TCPStore> listen_store(const std::string& host, int port,
                                                         std::chrono::milliseconds timeout) {
  ::c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = true;
  so.waitWorkers = false;
  so.timeout = timeout;
#if DDP_TORCH_AT_LEAST(2, 4)
  addrinfo hints{};
  hints.ai_family = AF_INET;
  hints.ai_socktype = SOCK_STREAM;
  addrinfo* found = nullptr;
  TORCH_CHECK(getaddrinfo(host.c_str(), nullptr, &hints, &found) == 0 && found, "cannot resolve ", host);
  sockaddr_in a = *reinterpret_cast<sockaddr_in*>(found->ai_addr);
  freeaddrinfo(found);
  a.sin_port = htons(static_cast<uint16_t>(port));
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  TORCH_CHECK(fd >= 0, "socket(): ", std::strerror(errno));
  const int one = 1;
  ::setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  socklen_t len = sizeof(a);
  if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 1024) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len) != 0) {
    const int err = errno;
    ::close(fd);
    TORCH_CHECK(false, "cannot listen on ", host, ":", port, ": ", std::strerror(err));
  }
  so.port = ntohs(a.sin_port);
  so.masterListenFd = fd;
  so.useLibUV = false;
#else
  (void)host;
#endif
  return c10::make_intrusive<::c10d::TCPStore>(host, so);
}

}  // namespace ddp::compat
