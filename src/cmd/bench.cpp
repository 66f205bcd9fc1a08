// The step benchmark behind `ddptrain bench`.
#include "ddp/cmd/bench.h"

#include <chrono>
#include <cmath>
#include <cstdio>

#include <nlohmann/json.hpp>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/models/registry.h"
#include "ddp/train/trainer.h"

namespace ddp {

int run_bench(const Config& c, World& world) {
  const auto dev = world.device();
  const int64_t size = c.image_size > 0 ? c.image_size : 64;
  models::ModelSpec spec;
  spec.name = c.model;
  spec.stem = c.stem == "auto" ? "imagenet" : c.stem;
  spec.in_channels = 3;
  spec.num_classes = 1000;
  spec.input_hw = {size, size};
  auto model = models::make_model(spec);
  model->to(dev);
  model->train();
  auto options = train_step_options(c, dev);
  TrainStep step(*model, world, options);
  torch::manual_seed(c.seed + world.rank());
  auto x = step.prepare(torch::randn({c.batch, 3, size, size}, torch::TensorOptions().device(dev)));
  auto y = torch::randint(0, spec.num_classes, {c.batch}, torch::TensorOptions().dtype(torch::kLong).device(dev));

  auto sync = [&] {
    if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  };
  const int warmup = std::max(10, options.graph_warmup() + 3);
  torch::Tensor loss;
  for (int i = 0; i < warmup; ++i) loss = step.run(x, y, true, c.lr);
  sync();
  world.barrier("bench warm-up");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < c.bench_steps; ++i) loss = step.run(x, y, true, c.lr);
  sync();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double last_loss = loss.item<double>();
  check_user(std::isfinite(last_loss), "the benchmark's loss became " + std::to_string(last_loss) + ".",
             "lower --lr for this benchmark.");
  const double ms = 1000.0 * seconds / c.bench_steps;
  if (world.is_main()) {
    std::string contender = c.cuda_graph ? "ddptrain cuda-graph" : "ddptrain eager";
    if (c.bn_kernel == "native") contender += ", LibTorch BN";
    nlohmann::json j = {{"contender", contender},
                        {"model", c.model},
                        {"image_size", size},
                        {"batch", c.batch},
                        {"ranks", world.size()},
                        {"optimizer", c.optimizer},
                        {"amp", c.amp},
                        {"channels_last", options.channels_last()},
                        {"graphed", step.graphed()},
                        {"bn_kernel", c.bn_kernel},
                        {"device", dev.str()},
                        {"ms_per_step", ms},
                        {"images_per_s", c.batch * world.size() * 1000.0 / ms},
                        {"peak_mem_mib", dev.is_cuda() ? compat::peak_cuda_bytes(dev.index()) / (1024.0 * 1024.0) : 0.0},
                        {"final_loss", last_loss}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace ddp
