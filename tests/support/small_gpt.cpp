#include "support/small_gpt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "ddp/data/dataset.h"
#include "ddp/dist/world.h"
#include "ddp/train/lm_task.h"
#include "ddp/train/train_step.h"
#include "support/testing.h"

namespace ddp::testing {

std::vector<double> small_gpt_bf16_losses(const ddp::models::GptOptions& options, bool graph, int steps,
                                          bool ignore_one) {
  const torch::Device gpu(torch::kCUDA, 0);
  auto world = one_rank_world(true);
  torch::manual_seed(11);
  ddp::LmTask task;
  auto model = task.make_gpt(options, "tokens");
  model->to(gpu);
  model->train();
  auto step_options = ddp::TrainStepOptions().amp("bf16").cuda_graph(graph).optimizer(
      ddp::FlatOptimizerOptions().name("adamw").lr(3e-3));
  ddp::TrainStep step(task, *model, *world, step_options);
  auto gen = torch::make_generator<at::CPUGeneratorImpl>(13);
  const int64_t vocab = options.vocab_size(), context = options.block_size();
  std::vector<ddp::data::Batch> batches;
  for (int i = 0; i < 2; ++i) {
    auto x = torch::randint(0, vocab, {8, context}, gen, torch::kLong);
    auto y = (x * 7 + 3).remainder(vocab);
    if (ignore_one) y.index_put_({0, 0}, -100);
    batches.push_back(ddp::data::Batch{{"input", x.to(gpu)}, {"target", y.to(gpu)}});
  }
  std::vector<torch::Tensor> on_device;
  for (int i = 0; i < steps; ++i) on_device.push_back(step.run(batches[i % 2], true, 3e-3).loss);
  std::vector<double> losses;
  for (auto& l : on_device) losses.push_back(l.item<double>());
  if (graph) {
    EXPECT_TRUE(step.graphed()) << step.graph_fallback();
  }
  return losses;
}

std::string mlp_case_name(ddp::models::GptGelu gelu) {
  return gelu == ddp::models::GptGelu::kTanh ? "tanh, one function" : "exact, two layers";
}

void copy_parameters(torch::nn::Module& from, torch::nn::Module& to) {
  torch::NoGradGuard no_grad;
  auto source = from.named_parameters();
  for (auto& p : to.named_parameters()) p.value().copy_(source[p.key()]);
}

double max_rel_diff(const std::vector<double>& a, const std::vector<double>& b) {
  double worst = 0;
  for (size_t i = 0; i < std::min(a.size(), b.size()); ++i)
    worst = std::max(worst, std::abs(a[i] - b[i]) / std::max(1e-6, std::abs(b[i])));
  return worst;
}

}  // namespace ddp::testing
