// The step benchmark behind `ddptrain bench`.
#include "ddp/cmd/bench.h"

#include <chrono>
#include <cmath>
#include <cstdio>
#include <functional>
#include <limits>


#include <nlohmann/json.hpp>

#include "ddp/compat.h"
#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/gemm_gelu.h"
#endif
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

// One timed run: the batch size, warm-up steps (at least the graph's own
// warm-up and capture), timed steps, and whether --profile-trace follows.
struct Plan {
  int64_t batch = 0;
  int warmup = 10;
  int steps = 0;
  bool profile = false;
};

// The plain run at `batch`: 10 warm-up steps, --bench-steps timed, then
// --profile-trace's.
Plan timed(const Config& c, int64_t batch) { return {batch, 10, c.bench_steps, !c.profile_trace.empty()}; }

// A plan's steps on a built step: warm-up (at least the graph's own warm-up
// and capture), the timed steps, and the profiled ones if asked for.
Timing run_plan(const std::function<torch::Tensor()>& run_step, const Plan& plan, int graph_warmup, const Config& c,
                World& world) {
  const auto timing = time_steps(run_step, std::max(plan.warmup, graph_warmup + 3), plan.steps, world);
  if (plan.profile) profile_steps(run_step, plan.steps, c, world);
  return timing;
}

// A bench kind's run at one batch size, built afresh (step, optimizer state,
// batch) on the model it was set up with: the fields of its JSON line.
using Measure = std::function<nlohmann::json(const Plan&)>;

// Within a bench run at one batch size: its end sets the model's
// gradients to none. The TrainStep points them at its flat gradient
// buffer, and a step that ran out of memory did not reach the zero_grad
// that lets it go, so the buffer would outlive its TrainStep into the
// next try. Declared before the TrainStep, so that it ends after it.
struct GradientsReleased {
  torch::nn::Module& model;
  ~GradientsReleased() {
    for (auto& p : model.parameters()) p.mutable_grad() = torch::Tensor();
  }
};

// Whether `e` is the GPU running out of memory: the caching allocator's
// error, or cuBLAS failing to allocate its workspace.
bool out_of_memory(const std::exception& e) {
  if (dynamic_cast<const c10::OutOfMemoryError*>(&e)) return true;
  const std::string what = e.what();
  return what.find("out of memory") != std::string::npos || what.find("CUBLAS_STATUS_ALLOC_FAILED") != std::string::npos;
}

std::string first_line(const std::exception& e) {
  const auto* c10_error = dynamic_cast<const c10::Error*>(&e);
  const std::string what = c10_error ? c10_error->what_without_backtrace() : e.what();
  return what.substr(0, what.find('\n'));
}

double peak_mib(const torch::Device& dev) {
  return dev.is_cuda() ? static_cast<double>(compat::peak_cuda_bytes(dev.index())) / (1024.0 * 1024.0) : 0.0;
}

void print_line(const nlohmann::json& j, World& world) {
  if (!world.is_main()) return;
  std::printf("%s\n", j.dump().c_str());
  std::fflush(stdout);
}

// For the tries of --largest-batch: the matmuls take cuBLASLt's first
// choice instead of timing its candidates for every new shape. Each batch
// is a new shape, and the timing grows with it: GPT-2 124M's tries took
// 18, 37 and 65 s at batches 16, 32 and 64 on an H100 (2026-12-08), where a
// try needs seconds. Memory is the same either way (the workspace is one
// size for every algorithm). The timed run after the search tunes as any
// bench does.
class UntunedMatmuls {
 public:
#ifdef DDP_WITH_CUDA_KERNELS
  UntunedMatmuls() : was_(cuda::gemm_tuning()) { cuda::set_gemm_tuning(false); }
  ~UntunedMatmuls() { cuda::set_gemm_tuning(was_); }

 private:
  bool was_;
#endif
};

// --largest-batch: each try's line (with "fits"), then the largest batch
// that fits, timed over --bench-steps (with "largest": true). A try runs a
// few steps, enough for the optimizer state to exist and the step's peak
// to be reached, its matmuls untuned (UntunedMatmuls); a try that runs out
// of memory leaves nothing behind (its step and batch go out of scope, the
// allocator's cache is emptied), as a fresh process would start, though
// the pool may be left more fragmented than a fresh one.
int search_largest_batch(const Config& c, World& world, const Measure& measure) {
  const auto dev = world.device();
  auto fits = [&](int64_t batch) {
    [[maybe_unused]] UntunedMatmuls untuned;
    compat::reset_peak_cuda_bytes(dev.index());
    nlohmann::json j;
    try {
      j = measure({batch, /*warmup=*/2, /*steps=*/2, /*profile=*/false});
      j["fits"] = true;
    } catch (const std::exception& e) {
      if (!out_of_memory(e)) throw;
      j = {{"batch", batch}, {"fits", false}, {"reason", first_line(e)}};
    }
    compat::empty_cuda_cache();
    // What the try left allocated (the model, and its gradients where the
    // parameters hold them): the same after every try, or a try leaked.
    j["held_after_mib"] = static_cast<double>(compat::allocated_cuda_bytes(dev.index())) / (1024.0 * 1024.0);
    print_line(j, world);
    return j["fits"].get<bool>();
  };
  const int64_t largest = largest_fitting_batch(c.batch, fits);
  check_user(largest > 0, "--largest-batch: even a batch of 1 does not fit in " + dev.str() + "'s memory.",
             "make the model smaller, or use --recompute, --amp bf16 or --shard-optimizer over several GPUs.");
  compat::reset_peak_cuda_bytes(dev.index());
  nlohmann::json j;
  try {
    j = measure(timed(c, largest));
  } catch (const std::exception& e) {
    if (!out_of_memory(e)) throw;
    throw UserError("--largest-batch: batch " + std::to_string(largest) +
                        " fit in its try but not when timed after the search (" + first_line(e) + ").",
                    "time it in a process of its own: --batch " + std::to_string(largest) + " without --largest-batch.");
  }
  j["largest"] = true;
  print_line(j, world);
  return 0;
}

// A bench kind's one line, or with --largest-batch its search.
int bench(const Config& c, World& world, const Measure& measure) {
  if (c.largest_batch) return search_largest_batch(c, world, measure);
  print_line(measure(timed(c, c.batch)), world);
  return 0;
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
  // nanoGPT's estimate_mfu: 6N + 12 L H Q T FLOPs per token (N without the
  // position embedding, Q the head width, T the context).
  const double n = static_cast<double>(task.gpt()->num_params(/*non_embedding=*/true));
  const double flops_per_token = 6 * n + 12.0 * static_cast<double>(o.n_layer() * o.n_head() *
                                                                     (o.n_embd() / o.n_head()) * o.block_size());
  return bench(c, world, [&](const Plan& plan) {
    GradientsReleased released{*model};
    OptimizerSetup setup{train_step_options(c, dev).optimizer(), LrScheduleOptions()};
    task.configure_optimizer(c, setup);
    auto options = train_step_options(c, dev).optimizer(setup.optimizer);
    TrainStep step(task, *model, world, options);
    torch::manual_seed(c.seed + world.rank());
    const auto ids = torch::TensorOptions().dtype(torch::kLong).device(dev);
    data::Batch batch{{"input", torch::randint(0, o.vocab_size(), {plan.batch, o.block_size()}, ids)},
                      {"target", torch::randint(0, o.vocab_size(), {plan.batch, o.block_size()}, ids)}};
    const double lr = setup.optimizer.lr();
    auto run_step = [&] { return step.run(batch, true, lr).loss; };
    const auto [ms, last_loss] = run_plan(run_step, plan, options.graph_warmup(), c, world);
    const double tokens_per_rank_s = static_cast<double>(plan.batch * o.block_size()) * 1000.0 / ms;
    std::string contender = c.cuda_graph ? "ddptrain cuda-graph" : "ddptrain eager";
    if (c.ce_kernel == "native") contender += ", LibTorch CE";
    if (c.ce_kernel == "two-pass") contender += ", two-pass CE";
    if (c.ln_kernel == "auto") contender += ", fused LN";
    if (c.linear_kernel == "auto") contender += ", fused bias grads";
    if (step.side_stream()) contender += ", side stream";
    const bool tanh = o.gelu() == models::GptGelu::kTanh;
    if (tanh) contender += ", tanh GELU";
    if (c.recompute != "none") contender += ", recompute " + c.recompute;
    return nlohmann::json{{"contender", contender},
                          {"gelu", tanh ? "tanh" : "exact"},
                          {"recompute", c.recompute},
                          {"model", c.model},
                          {"params", task.gpt()->num_params()},
                          {"context", o.block_size()},
                          {"batch", plan.batch},
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
                          {"peak_mem_mib", peak_mib(dev)},
                          {"final_loss", last_loss}};
  });
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
  return bench(c, world, [&](const Plan& plan) {
    GradientsReleased released{*model};
    OptimizerSetup setup{train_step_options(c, dev).optimizer(), LrScheduleOptions()};
    task.configure_optimizer(c, setup);
    const auto options = train_step_options(c, dev).optimizer(setup.optimizer);
    TrainStep step(task, *model, world, options);
    std::vector<int64_t> indices(static_cast<size_t>(plan.batch));
    for (size_t i = 0; i < indices.size(); ++i) indices[i] = static_cast<int64_t>(i) % data.train->size();
    data::Batch batch = data.train->get_batch(indices);
    for (auto& [name, t] : batch) {
      t = t.to(dev);
      if (name == "input" && t.dim() == 4 && t.is_floating_point()) t = step.prepare(t);
    }
    const double lr = setup.optimizer.lr();
    auto run_step = [&] { return step.run(batch, true, lr).loss; };
    const auto [ms, last_loss] = run_plan(run_step, plan, options.graph_warmup(), c, world);
    return nlohmann::json{{"contender", std::string(c.cuda_graph ? "cuda-graph" : "eager")},
                          {"program", c.program.name},
                          {"model", task.arch()},
                          {"converted_layers", conversion.converted()},
                          {"kept_layers", conversion.kept.size()},
                          {"batch", plan.batch},
                          {"ranks", world.size()},
                          {"amp", c.amp},
                          {"graphed", step.graphed()},
                          {"device", dev.str()},
                          {"ms_per_step", ms},
                          {"samples_per_s", static_cast<double>(plan.batch * world.size()) * 1000.0 / ms},
                          {"peak_mem_mib", peak_mib(dev)},
                          {"final_loss", last_loss}};
  });
}

}  // namespace

int64_t largest_fitting_batch(int64_t start, const std::function<bool(int64_t)>& fits) {
  check_user(start > 0, "--batch must be positive to start the search from, got " + std::to_string(start) + ".",
             "e.g. --batch 16.");
  int64_t lo = 0, hi = start;  // lo fits (0: none known), hi does not, once one failed
  while (fits(hi)) {
    lo = hi;
    check_user(hi <= std::numeric_limits<int64_t>::max() / 2, "--largest-batch: every batch up to " +
                                                                  std::to_string(hi) + " fits.",
               "the step's memory does not grow with its batch; time it with --batch N.");
    hi *= 2;
  }
  while (hi - lo > 1) {
    const int64_t mid = lo + (hi - lo) / 2;
    (fits(mid) ? lo : hi) = mid;
  }
  return lo;
}

int run_bench(const Config& c, World& world, Task* own_task) {
  check_profile_trace_flag(c);
  if (c.largest_batch) {  // before the model is built: a large one takes a while
    check_user(!c.cuda_graph, "--largest-batch searches eagerly: a CUDA graph's capture that runs out of memory "
                              "cannot give that memory back in this process.",
               "search without --cuda-graph, then time the batch it finds with --cuda-graph --batch N.");
    check_user(world.device().is_cuda(), "--largest-batch searches a GPU's memory; this run is on " +
                                             world.device().str() + ".",
               "run it on a CUDA GPU, or time one batch size with --batch N.");
    check_user(world.size() == 1, "--largest-batch searches one GPU's memory; this run has " +
                                      std::to_string(world.size()) + " ranks.",
               "run it with --size 1: the batch per GPU that fits is about the same with more ranks.");
  }
  if (own_task) return run_task_bench(c, world, *own_task);
  if (models::is_gpt(c.model)) return run_gpt_bench(c, world);
  const auto dev = world.device();
  const int64_t size = c.image_size > 0 ? c.image_size : 64;
  models::ModelSpec spec;
  spec.name = c.model;
  spec.stem = c.stem == "auto" && c.model != "cnn" ? "imagenet" : c.stem;  // the ResNets: ImageNet-shaped inputs
  spec.in_channels = 3;
  spec.num_classes = 1000;
  spec.input_hw = {size, size};
  spec.recompute = c.recompute;
  auto model = models::make_model(spec);
  model->to(dev);
  model->train();
  return bench(c, world, [&](const Plan& plan) {
    GradientsReleased released{*model};
    const auto options = train_step_options(c, dev);
    TrainStep step(*model, world, options);
    torch::manual_seed(c.seed + world.rank());
    auto x = step.prepare(torch::randn({plan.batch, 3, size, size}, torch::TensorOptions().device(dev)));
    auto y = torch::randint(0, spec.num_classes, {plan.batch}, torch::TensorOptions().dtype(torch::kLong).device(dev));
    auto run_step = [&] { return step.run(x, y, true, c.lr); };
    const auto [ms, last_loss] = run_plan(run_step, plan, options.graph_warmup(), c, world);
    std::string contender = c.cuda_graph ? "ddptrain cuda-graph" : "ddptrain eager";
    if (c.bn_kernel == "native") contender += ", LibTorch BN and max pool";
    if (c.bn_kernel == "unfused") contender += ", BN unfused";
    if (c.recompute != "none") contender += ", recompute " + c.recompute;
    return nlohmann::json{{"contender", contender},
                          {"model", c.model},
                          {"image_size", size},
                          {"recompute", c.recompute},
                          {"batch", plan.batch},
                          {"ranks", world.size()},
                          {"optimizer", c.optimizer},
                          {"amp", c.amp},
                          {"channels_last", options.channels_last()},
                          {"graphed", step.graphed()},
                          {"bn_kernel", c.bn_kernel},
                          {"device", dev.str()},
                          {"ms_per_step", ms},
                          {"images_per_s", static_cast<double>(plan.batch * world.size()) * 1000.0 / ms},
                          {"peak_mem_mib", peak_mib(dev)},
                          {"final_loss", last_loss}};
  });
}

}  // namespace ddp
