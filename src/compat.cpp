// The compat header's out-of-line part: version-dependent code whose headers
// are too heavy to include in every translation unit.
#include "ddp/compat.h"

#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 2)  // kHasGpuProfiler
#include <torch/csrc/autograd/profiler_kineto.h>
#endif

namespace ddp::compat {

void profile_chrome_trace(const std::function<void()>& fn, const std::string& path) {
#if defined(DDP_WITH_CUDA) && DDP_TORCH_AT_LEAST(2, 2)
  namespace prof = torch::autograd::profiler;
  using torch::profiler::impl::ActivityType;
  const torch::profiler::impl::ProfilerConfig config(torch::profiler::impl::ProfilerState::KINETO,
                                                      /*report_input_shapes=*/true);
  const std::set<ActivityType> activities{ActivityType::CPU, ActivityType::CUDA};
  prof::prepareProfiler(config, activities);
  prof::enableProfiler(config, activities);
  try {
    fn();
  } catch (...) {
    prof::disableProfiler();
    throw;
  }
  prof::disableProfiler()->save(path);
#else
  (void)fn;
  TORCH_CHECK(false, "profile_chrome_trace(", path, "): this LibTorch has no Kineto GPU profiler");
#endif
}

}  // namespace ddp::compat
