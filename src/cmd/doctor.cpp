// The doctor's checks.
#include "ddp/cmd/doctor.h"

#include <chrono>
#include <cstdio>

#include "ddp/dist/grad_sync.h"
#include "ddp/program.h"

namespace ddp {
namespace {

struct Check {
  std::string name;
  bool ok;
  std::string detail;
};

// Every rank contributes rank + 1 in every element; the sum is W(W+1)/2.
Check closed_form_all_reduce(World& world) {
  auto t = torch::full({1 << 20}, static_cast<float>(world.rank() + 1), torch::TensorOptions().device(world.device()));
  world.all_reduce(t, "doctor: closed-form all-reduce");
  const double w = world.size(), expected = w * (w + 1) / 2;
  const double worst = (t - expected).abs().max().item<double>();
  return {"all-reduce result", worst == 0, "expected " + std::to_string(expected) + ", max error " + std::to_string(worst)};
}

// Bus bandwidth as nccl-tests define it: bytes * 2(W-1)/W per second.
Check bandwidth(World& world) {
  const int64_t n = 16 << 20;  // 64 MiB of floats
  auto t = torch::ones({n}, torch::TensorOptions().device(world.device()));
  world.all_reduce(t, "doctor: warm-up");
  const int iters = 5;
  world.barrier("doctor: bandwidth start");
  auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < iters; ++i) world.all_reduce(t, "doctor: bandwidth");
  if (world.device().is_cuda()) t.cpu();  // wait for the device
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
  const double w = world.size();
  const double busbw = static_cast<double>(n * 4) * 2 * (w - 1) / w / s / 1e9;
  char buf[128];
  if (world.size() == 1)
    std::snprintf(buf, sizeof(buf), "n/a with one rank (64 MiB all-reduce took %.2f ms)", s * 1e3);
  else
    std::snprintf(buf, sizeof(buf), "%.2f GB/s bus bandwidth (64 MiB, %.2f ms per all-reduce)", busbw, s * 1e3);
  return {"all-reduce bandwidth", s > 0, buf};
}

// Gradient of a linear model on this rank's shard, synchronised, against
// the gradient of the whole batch computed in this process alone.
Check ddp_equivalence(World& world) {
  torch::manual_seed(1);
  auto model = std::make_shared<torch::nn::LinearImpl>(8, 3);
  model->to(world.device());
  const int64_t per_rank = 4, total = per_rank * world.size();
  auto x = torch::randn({total, 8}).to(world.device());
  auto y = torch::randn({total, 3}).to(world.device());
  {
    GradSync sync(*model, world);
    sync.zero_grad();
    auto xs = x.narrow(0, world.rank() * per_rank, per_rank), ys = y.narrow(0, world.rank() * per_rank, per_rank);
    torch::mse_loss(model->forward(xs), ys).backward();
    sync.finish();
  }
  auto synced = model->weight.grad().clone();
  model->weight.mutable_grad() = torch::Tensor();
  model->bias.mutable_grad() = torch::Tensor();
  torch::mse_loss(model->forward(x), y).backward();
  const double diff = (synced - model->weight.grad()).abs().max().item<double>();
  return {"data-parallel gradient vs one process", diff < 1e-5, "max difference " + std::to_string(diff)};
}

}  // namespace

int run_doctor(World& world) {
  std::vector<Check> checks;
  if (world.is_main()) {
    std::printf("%s doctor\n  LibTorch %s, %s\n", program_name(), compat::torch_version().c_str(),
                compat::kHasGloo ? "with Gloo" : "without Gloo (NCCL only)");
    const int gpus = torch::cuda::is_available() ? static_cast<int>(torch::cuda::device_count()) : 0;
    std::printf("  CUDA GPUs visible: %d\n  job: %d rank(s), backend %s, rank 0 on %s\n", gpus, world.size(),
                world.backend_name().c_str(), world.device().str().c_str());
  }
  for (auto check : {closed_form_all_reduce, bandwidth, ddp_equivalence}) checks.push_back(check(world));
  // A check passes only if it passed on every rank.
  auto failures = torch::zeros({static_cast<int64_t>(checks.size())}, torch::TensorOptions().device(world.device()));
  for (size_t i = 0; i < checks.size(); ++i) failures[static_cast<int64_t>(i)] = checks[i].ok ? 0.0 : 1.0;
  world.all_reduce(failures, "doctor: summary");
  int failed = 0;
  for (size_t i = 0; i < checks.size(); ++i) {
    const bool ok = failures[static_cast<int64_t>(i)].item<double>() == 0;
    failed += ok ? 0 : 1;
    if (world.is_main()) std::printf("  [%s] %s: %s\n", ok ? "PASS" : "FAIL", checks[i].name.c_str(), checks[i].detail.c_str());
  }
  if (world.is_main()) std::printf("doctor: %d of %zu checks passed\n", static_cast<int>(checks.size()) - failed, checks.size());
  world.barrier("doctor: end");
  return failed == 0 ? 0 : 1;
}

}  // namespace ddp
