// Weight gradients on the side stream (cuda/side_stream.h) are the one
// stream's, to the bit: the same kernels on the same operands, only run
// beside the backward's chain. (Sequences of 32 tokens: one attention tile,
// whose backward sums in a fixed order.) Both paths run in one process, so each kind
// of matmul keeps the algorithm timed for it on its first call (gemm_gelu.h)
// whichever stream runs it. A gradient read before the side stream was
// joined would be part-written: these models' matmuls are large enough
// that such a read would not be the finished sums.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "ddp/compat.h"
#include "ddp/dist/grad_sync.h"
#include "ddp/models/fused_linear.h"
#include "ddp/models/gpt.h"
#include "ddp/train/lm_task.h"
#include "ddp/train/trainer.h"
#include "ddp/train/train_step.h"
#include "support/small_gpt.h"
#include "support/testing.h"

#ifdef DDP_WITH_CUDA_KERNELS
#include "ddp/cuda/side_stream.h"
#endif

namespace {

#ifdef DDP_WITH_CUDA_KERNELS
using ddp::models::Gpt;
using ddp::models::GptGelu;
using ddp::models::GptOptions;
using ddp::testing::FusedLayerNormOn;
using ddp::testing::FusedLinearOn;

using ddp::cuda::SideStreamMode;

// Sets the side stream's mode for a scope (on: for every model; off:
// never), then back as it was.
struct SideStream {
  explicit SideStream(bool on) : SideStream(on ? SideStreamMode::kOn : SideStreamMode::kOff) {}
  explicit SideStream(SideStreamMode mode) : was(ddp::cuda::side_stream_mode()) { ddp::cuda::set_side_stream(mode); }
  ~SideStream() { ddp::cuda::set_side_stream(was); }
  SideStreamMode was;
};

// The flat gradient buffers filled with NaN before a backward: a slot that
// the backward does not write, or that is read before its write, shows.
void poison(ddp::GradSync& sync) {
  torch::NoGradGuard no_grad;
  for (const auto& g : sync.flat_grads()) g.fill_(std::numeric_limits<float>::quiet_NaN());
}

// A training step's backward as TrainStep runs it, by hand: the gradients
// set to none, the flat buffers poisoned, the bf16 copies open, the loss
// (loss_of, under bf16 autocast) and its backward with the side work open
// (`side`) or not, then GradSync's finish.
void step_backward(ddp::GradSync& sync, bool side, const std::function<torch::Tensor()>& loss_of) {
  sync.zero_grad(/*set_to_none=*/true);
  poison(sync);
  sync.bf16_copies(true);
  torch::Tensor loss;
  {
    ddp::compat::AutocastGuard autocast(c10::DeviceType::CUDA, torch::kBFloat16, true);
    loss = loss_of();
  }
  ddp::cuda::SideWork work(side);
  loss.backward();
  work.close();
  sync.bf16_copies(false);
  sync.finish();
}

// One backward of a GPT-2-shaped model with its gradients in the flat
// buffer, with the side stream open (as a training step opens it) or not:
// every gradient equal to the bit, and the side stream used only when open.
TEST(SideStream, GptGradientsAreTheOneStreamsToTheBit_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  FusedLinearOn on;
  FusedLayerNormOn ln_on;
  const torch::Device gpu(torch::kCUDA, 0);
  for (auto gelu : {GptGelu::kTanh, GptGelu::kExact}) {
    SCOPED_TRACE(ddp::testing::mlp_case_name(gelu));
    const auto options = GptOptions().n_layer(2).n_head(8).n_embd(512).block_size(32).vocab_size(1024).gelu(gelu);
    torch::manual_seed(27);
    Gpt aside(options), inline_(options);
    ddp::testing::copy_parameters(*aside, *inline_);
    aside->to(gpu);
    inline_->to(gpu);
    auto world = ddp::testing::one_rank_world(true);
    ddp::GradSync sync_aside(*aside, *world), sync_inline(*inline_, *world);
    for (int step = 0; step < 3; ++step) {  // the first step asks for the bf16 copies, the others have them
      SCOPED_TRACE("step " + std::to_string(step));
      auto idx = torch::randint(0, 1024, {32, 32}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
      auto target = torch::randint(0, 1024, {32 * 32}, idx.options());
      auto backward = [&](Gpt& m, ddp::GradSync& sync, bool side) {
        step_backward(sync, side, [&] {
          return torch::nn::functional::cross_entropy(m->forward(idx).view({-1, 1024}).to(torch::kFloat), target);
        });
      };
      const size_t before = ddp::cuda::side_pieces();
      backward(inline_, sync_inline, false);  // first: its matmuls choose their algorithms on one stream
      EXPECT_EQ(ddp::cuda::side_pieces(), before);
      backward(aside, sync_aside, true);
      // Per block: c_attn's, the attention projection's and the MLP's two
      // weights, the MLP's first bias with the tanh GELU (the others are the
      // LayerNorms', here); the head. The process's first SideWork stays on one stream.
      if (step > 0) {
        EXPECT_GE(ddp::cuda::side_pieces() - before, 2u * 3 + 1);
      }
      auto got = aside->named_parameters();
      for (const auto& p : inline_->named_parameters()) {
        if (p.key() == "lm_head.weight") continue;  // the same tensor as wte
        ASSERT_TRUE(got[p.key()].grad().defined()) << p.key();
        EXPECT_FALSE(got[p.key()].grad().isnan().any().item<bool>()) << p.key();
        EXPECT_TRUE(torch::equal(got[p.key()].grad(), p.value().grad()))
            << p.key() << ": " << (got[p.key()].grad() - p.value().grad()).abs().max().item<double>();
      }
    }
  }
}

// A weight used twice in one backward: the gradient of the use whose
// backward runs first goes into its slot on the side stream; the other gets
// no slot, waits for the side stream, and autograd adds the two: the one
// stream's sum.
TEST(SideStream, AWeightUsedTwiceGetsBothGradients_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  SideStream side_on(true);
  FusedLinearOn on;
  const torch::Device gpu(torch::kCUDA, 0);
  torch::manual_seed(28);
  auto make = [&] {
    torch::manual_seed(29);
    torch::nn::Linear layer(torch::nn::LinearOptions(512, 512));
    layer->to(gpu);
    return layer;
  };
  auto aside = make(), inline_ = make();
  auto world = ddp::testing::one_rank_world(true);
  ddp::GradSync sync_aside(*aside, *world), sync_inline(*inline_, *world);
  for (int step = 0; step < 3; ++step) {
    SCOPED_TRACE("step " + std::to_string(step));
    auto x = torch::randn({4096, 512}, torch::TensorOptions().device(gpu));
    auto backward = [&](torch::nn::Linear& m, ddp::GradSync& sync, bool side) {
      step_backward(sync, side, [&] {
        auto h = ddp::models::linear_bias(x, m->weight, m->bias);
        return ddp::models::linear_bias(h, m->weight, m->bias).to(torch::kFloat).pow(2).mean();
      });
    };
    const size_t before = ddp::cuda::side_pieces();
    backward(inline_, sync_inline, false);
    backward(aside, sync_aside, true);
    if (step > 0) {  // the first SideWork stays on one stream
      EXPECT_GT(ddp::cuda::side_pieces(), before);
    }
    EXPECT_FALSE(aside->weight.grad().isnan().any().item<bool>());
    EXPECT_TRUE(torch::equal(aside->weight.grad(), inline_->weight.grad()))
        << (aside->weight.grad() - inline_->weight.grad()).abs().max().item<double>();
    EXPECT_TRUE(torch::equal(aside->bias.grad(), inline_->bias.grad()));
  }
}

// Through the training step, eager and captured in a CUDA graph (the side
// stream then forks from and joins back into the capture): the same losses
// to the bit with the side stream as without.
TEST(SideStream, TrainingStepsAreTheOneStreamsToTheBit_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  FusedLinearOn on;
  FusedLayerNormOn ln_on;
  const auto options =
      GptOptions().n_layer(2).n_head(4).n_embd(128).block_size(32).vocab_size(1001).gelu(GptGelu::kTanh);
  for (bool graph : {false, true}) {
    SCOPED_TRACE(graph ? "graphed" : "eager");
    std::vector<double> one, two;
    {
      SideStream off(false);
      one = ddp::testing::small_gpt_bf16_losses(options, graph, 8);
    }
    const size_t before = ddp::cuda::side_pieces();
    {
      SideStream on_(true);
      two = ddp::testing::small_gpt_bf16_losses(options, graph, 8);
    }
    EXPECT_GT(ddp::cuda::side_pieces(), before);  // recorded once into the graph, else every step
    EXPECT_EQ(two, one);
    EXPECT_LT(two.back(), two.front()) << ::testing::PrintToString(two);
  }
}

// --side-stream auto (the default) runs the side stream for ddptrain's GPT
// trained by ddptrain's LmTask in one process, which meet its contract, and
// not for a module that holds the same GPT, nor for a task derived from
// LmTask (either might put a weight through a LibTorch op too); on runs it
// for those as well, off for none. The flag sets the mode.
class DerivedLmTask : public ddp::LmTask {};

TEST(SideStream, AutoIsOnForDdptrainsGptAlone_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  FusedLinearOn on;
  FusedLayerNormOn ln_on;
  const torch::Device gpu(torch::kCUDA, 0);
  // A vocabulary that is a multiple of 8: the tied head's matmuls are
  // ddptrain's too, and its weight gradient goes aside.
  const auto options =
      GptOptions().n_layer(2).n_head(4).n_embd(128).block_size(32).vocab_size(1024).gelu(GptGelu::kTanh);
  auto world = ddp::testing::one_rank_world(true);
  enum class Trained { kGpt, kHeld, kDerivedTask };
  // Three eager steps of `options`' GPT, trained as the module itself, as
  // the one module a holder has, or by a task derived from LmTask: whether
  // the step runs the side stream, and how many pieces went to it.
  auto run = [&](SideStreamMode mode, Trained what) {
    SideStream set(mode);
    ddp::LmTask lm;
    DerivedLmTask derived;
    ddp::LmTask& task = what == Trained::kDerivedTask ? derived : lm;
    auto gpt = task.make_gpt(options, "tokens");
    auto holder = std::make_shared<torch::nn::Module>();
    holder->register_module("gpt", gpt);
    torch::nn::Module& model = what == Trained::kHeld ? *holder : *gpt;
    model.to(gpu);
    model.train();
    ddp::TrainStep step(task, model, *world,
                        ddp::TrainStepOptions().amp("bf16").optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(1e-3)));
    auto x = torch::randint(0, 1024, {8, 32}, torch::TensorOptions().dtype(torch::kLong).device(gpu));
    const ddp::data::Batch batch{{"input", x}, {"target", (x * 7 + 3).remainder(1024)}};
    const size_t before = ddp::cuda::side_pieces();
    torch::Tensor loss;
    for (int i = 0; i < 3; ++i) loss = step.run(batch, true, 1e-3).loss;  // the process's first backward: one stream
    EXPECT_TRUE(std::isfinite(loss.item<double>()));
    return std::make_pair(step.side_stream(), ddp::cuda::side_pieces() - before);
  };
  EXPECT_EQ(ddp::cuda::side_stream_mode(), SideStreamMode::kAuto);  // the default
  const auto gpt_auto = run(SideStreamMode::kAuto, Trained::kGpt);
  EXPECT_TRUE(gpt_auto.first);
  // A TrainStep's first step adds into the zeros GradSync starts with (no
  // slots, nothing aside): the last two steps, each with at least 3 pieces
  // a block and the head's (5 a block, as GptGradientsAreTheOneStreamsToTheBit
  // counts them).
  constexpr size_t kPieces = 2 * (2 * 3 + 1);
  EXPECT_GE(gpt_auto.second, kPieces);
  for (auto what : {Trained::kHeld, Trained::kDerivedTask}) {
    SCOPED_TRACE(what == Trained::kHeld ? "held" : "derived task");
    const auto other_auto = run(SideStreamMode::kAuto, what);
    EXPECT_FALSE(other_auto.first);
    EXPECT_EQ(other_auto.second, 0u);
    const auto other_on = run(SideStreamMode::kOn, what);
    EXPECT_TRUE(other_on.first);
    EXPECT_GE(other_on.second, kPieces);
  }
  const auto gpt_off = run(SideStreamMode::kOff, Trained::kGpt);
  EXPECT_FALSE(gpt_off.first);
  EXPECT_EQ(gpt_off.second, 0u);
  // The flag sets the mode, for the steps made after it.
  const auto was = ddp::cuda::side_stream_mode();
  for (const auto& [flag, mode] : std::vector<std::pair<std::string, SideStreamMode>>{
           {"off", SideStreamMode::kOff}, {"on", SideStreamMode::kOn}, {"auto", SideStreamMode::kAuto}}) {
    ddp::train_step_options(ddp::testing::parse_args({"--side-stream", flag}), gpu);
    EXPECT_EQ(ddp::cuda::side_stream_mode(), mode) << flag;
  }
  ddp::cuda::set_side_stream(was);
}
#endif

}  // namespace
