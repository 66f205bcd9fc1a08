// The step benchmark behind `ddptrain bench`.
#include "ddp/cmd/bench.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>

#include <nlohmann/json.hpp>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/models/gpt.h"
#include "ddp/models/registry.h"
#include "ddp/nn/convert.h"
#include "ddp/train/lm_task.h"
#include "ddp/train/trainer.h"

namespace ddp {

namespace {

// H200 (SXM) dense bf16 peak, the denominator of MFU, as nanoGPT's
// estimate_mfu uses A100's 312e12.
constexpr double kPeakBf16Flops = 989e12;

// Warm-up (cuDNN autotuning, graph capture), then `steps` timed steps;
// ms per step and the last loss, which must be finite.
struct Timing {
  double ms = 0;
  double last_loss = 0;
};

Timing time_steps(const std::function<torch::Tensor()>& run_step, int warmup, int steps, World& world) {
  const auto dev = world.device();
  auto sync = [&] {
    if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  };
  torch::Tensor loss;
  for (int i = 0; i < warmup; ++i) loss = run_step();
  sync();
  world.barrier("bench warm-up");
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) loss = run_step();
  sync();
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const double last_loss = loss.item<double>();
  check_user(std::isfinite(last_loss), "the benchmark's loss became " + std::to_string(last_loss) + ".",
             "lower --lr for this benchmark.");
  return {1000.0 * seconds / steps, last_loss};
}

// --profile-trace: `steps` more steps under the Kineto profiler, written as
// a Chrome trace (bench/kernel_breakdown.py groups its kernels by class).
void profile_steps(const std::function<torch::Tensor()>& run_step, int steps, const Config& c, World& world) {
  if (c.profile_trace.empty()) return;
  const auto dev = world.device();
  auto run = [&] {
    for (int i = 0; i < steps; ++i) run_step();
    if (dev.is_cuda()) torch::cuda::synchronize(dev.index());
  };
  if (world.is_main())
    compat::profile_chrome_trace(run, c.profile_trace);
  else
    run();  // the other ranks take part, unprofiled
}

// GPT steps on random token ids: B x context tokens per rank per step.
int run_gpt_bench(const Config& c, World& world) {
  const auto dev = world.device();
  Config lm = c;
  if (c.task != "lm") {  // `ddptrain bench --model gpt2`: the lm flags at their defaults
    Config flags;
    LmTask().add_flags(flags);
    lm.task_flags = flags.task_flags;
  }
  LmTask task;
  const auto o = LmTask::model_options(lm);
  auto model = task.make_gpt(o, "tokens");
  model->to(dev);
  model->train();
  OptimizerSetup setup{train_step_options(c, dev).optimizer(), LrScheduleOptions()};
  task.configure_optimizer(c, setup);
  auto options = train_step_options(c, dev).optimizer(setup.optimizer);
  TrainStep step(task, *model, world, options);
  torch::manual_seed(c.seed + world.rank());
  const auto ids = torch::TensorOptions().dtype(torch::kLong).device(dev);
  data::Batch batch{{"input", torch::randint(0, o.vocab_size(), {c.batch, o.block_size()}, ids)},
                    {"target", torch::randint(0, o.vocab_size(), {c.batch, o.block_size()}, ids)}};
  const double lr = setup.optimizer.lr();
  auto run_step = [&] { return step.run(batch, true, lr).loss; };
  const auto [ms, last_loss] = time_steps(run_step, std::max(10, options.graph_warmup() + 3), c.bench_steps, world);
  profile_steps(run_step, c.bench_steps, c, world);
  // nanoGPT's estimate_mfu: 6N + 12 L H Q T FLOPs per token (N without the
  // position embedding, Q the head width, T the context).
  const double n = static_cast<double>(task.gpt()->num_params(/*non_embedding=*/true));
  const double flops_per_token = 6 * n + 12.0 * static_cast<double>(o.n_layer() * o.n_head() *
                                                                     (o.n_embd() / o.n_head()) * o.block_size());
  const double tokens_per_rank_s = static_cast<double>(c.batch * o.block_size()) * 1000.0 / ms;
  if (world.is_main()) {
    std::string contender = c.cuda_graph ? "ddptrain cuda-graph" : "ddptrain eager";
    if (c.ce_kernel == "native") contender += ", LibTorch CE";
    if (c.ce_kernel == "two-pass") contender += ", two-pass CE";
    if (c.ln_kernel == "auto") contender += ", fused LN";
    if (c.linear_kernel == "auto") contender += ", fused bias grads";
    if (step.side_stream()) contender += ", side stream";
    const bool tanh = o.gelu() == models::GptGelu::kTanh;
    if (tanh) contender += ", tanh GELU";
    if (c.recompute != "none") contender += ", recompute " + c.recompute;
    nlohmann::json j = {{"contender", contender},
                        {"gelu", tanh ? "tanh" : "exact"},
                        {"recompute", c.recompute},
                        {"model", c.model},
                        {"params", task.gpt()->num_params()},
                        {"context", o.block_size()},
                        {"batch", c.batch},
                        {"ranks", world.size()},
                        {"optimizer", c.optimizer},
                        {"amp", c.amp},
                        {"graphed", step.graphed()},
                        {"ce_kernel", c.ce_kernel},
                        {"ln_kernel", c.ln_kernel},
                        {"linear_kernel", c.linear_kernel},
                        {"side_stream", step.side_stream()},
                        {"device", dev.str()},
                        {"ms_per_step", ms},
                        {"tokens_per_s", tokens_per_rank_s * world.size()},
                        {"flops_per_token", flops_per_token},
                        {"peak_tflops", kPeakBf16Flops / 1e12},
                        {"mfu", tokens_per_rank_s * flops_per_token / kPeakBf16Flops},
                        {"peak_mem_mib", dev.is_cuda() ? compat::peak_cuda_bytes(dev.index()) / (1024.0 * 1024.0) : 0.0},
                        {"final_loss", last_loss}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

// A program's own task: its model and training_step on the first --batch
// samples of its training split, resident on the device.
int run_task_bench(const Config& c, World& world, Task& task) {
  const auto dev = world.device();
  auto data = task.make_data(c, world);
  check_user(data.train && data.train->size() > 0, "make_data() returned no training samples to time.",
             "check --data_root.");
  auto model = task.make_model(c, data);
  check_user(model != nullptr, "make_model() returned no model.", "return your model's .ptr().");
  nn::LayerConversion conversion;
  if (c.convert_layers == "on") conversion = nn::convert_layers(*model);
  model->to(dev);
  model->train();
  OptimizerSetup setup{train_step_options(c, dev).optimizer(), LrScheduleOptions()};
  task.configure_optimizer(c, setup);
  TrainStep step(task, *model, world, train_step_options(c, dev).optimizer(setup.optimizer));
  std::vector<int64_t> indices(static_cast<size_t>(c.batch));
  for (size_t i = 0; i < indices.size(); ++i) indices[i] = static_cast<int64_t>(i) % data.train->size();
  data::Batch batch = data.train->get_batch(indices);
  for (auto& [name, t] : batch) {
    t = t.to(dev);
    if (name == "input" && t.dim() == 4 && t.is_floating_point()) t = step.prepare(t);
  }
  const double lr = setup.optimizer.lr();
  auto run_step = [&] { return step.run(batch, true, lr).loss; };
  const auto [ms, last_loss] =
      time_steps(run_step, std::max(10, train_step_options(c, dev).graph_warmup() + 3), c.bench_steps, world);
  profile_steps(run_step, c.bench_steps, c, world);
  if (world.is_main()) {
    nlohmann::json j = {{"contender", std::string(c.cuda_graph ? "cuda-graph" : "eager")},
                        {"program", c.program.name},
                        {"model", task.arch()},
                        {"converted_layers", conversion.converted()},
                        {"kept_layers", conversion.kept.size()},
                        {"batch", c.batch},
                        {"ranks", world.size()},
                        {"amp", c.amp},
                        {"graphed", step.graphed()},
                        {"device", dev.str()},
                        {"ms_per_step", ms},
                        {"samples_per_s", c.batch * world.size() * 1000.0 / ms},
                        {"peak_mem_mib", dev.is_cuda() ? compat::peak_cuda_bytes(dev.index()) / (1024.0 * 1024.0) : 0.0},
                        {"final_loss", last_loss}};
    std::printf("%s\n", j.dump().c_str());
    std::fflush(stdout);
  }
  return 0;
}

}  // namespace

int run_bench(const Config& c, World& world, Task* own_task) {
  check_profile_trace_flag(c);
  if (own_task) return run_task_bench(c, world, *own_task);
  if (models::is_gpt(c.model)) return run_gpt_bench(c, world);
  const auto dev = world.device();
  const int64_t size = c.image_size > 0 ? c.image_size : 64;
  models::ModelSpec spec;
  spec.name = c.model;
  spec.stem = c.stem == "auto" ? "imagenet" : c.stem;
  spec.in_channels = 3;
  spec.num_classes = 1000;
  spec.input_hw = {size, size};
  spec.recompute = c.recompute;
  auto model = models::make_model(spec);
  model->to(dev);
  model->train();
  auto options = train_step_options(c, dev);
  TrainStep step(*model, world, options);
  torch::manual_seed(c.seed + world.rank());
  auto x = step.prepare(torch::randn({c.batch, 3, size, size}, torch::TensorOptions().device(dev)));
  auto y = torch::randint(0, spec.num_classes, {c.batch}, torch::TensorOptions().dtype(torch::kLong).device(dev));
  auto run_step = [&] { return step.run(x, y, true, c.lr); };
  const auto [ms, last_loss] = time_steps(run_step, std::max(10, options.graph_warmup() + 3), c.bench_steps, world);
  profile_steps(run_step, c.bench_steps, c, world);
  if (world.is_main()) {
    std::string contender = c.cuda_graph ? "ddptrain cuda-graph" : "ddptrain eager";
    if (c.bn_kernel == "native") contender += ", LibTorch BN and max pool";
    if (c.bn_kernel == "unfused") contender += ", BN unfused";
    if (c.recompute != "none") contender += ", recompute " + c.recompute;
    nlohmann::json j = {{"contender", contender},
                        {"model", c.model},
                        {"image_size", size},
                        {"recompute", c.recompute},
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
