// Activation recomputation (src/models/recompute.cpp): the same losses and
// gradients as without it, bit for bit on the CPU, with dropout on, under
// autocast, with batch norm's running statistics, with gradient
// accumulation; the forward really runs again in backward; a parameter the
// function hides is an error, not a lost gradient; the built-in GPT and
// ResNet with --recompute equal themselves without it; and the bytes a
// step holds fall, counted by an allocator that wraps the CPU's.
#include <atomic>
#include <cstring>
#include <mutex>
#include <unordered_map>

#include <c10/core/CPUAllocator.h>

#include "ddp/cli.h"
#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/models/registry.h"
#include "ddp/models/gpt.h"
#include "ddp/models/recompute.h"
#include "ddp/models/resnet.h"
#include "ddp/train/lm_task.h"
#include "ddp/train/train_step.h"
#include "support/small_gpt.h"
#include "support/counting_allocator.h"
#include "support/testing.h"

namespace ddp {
namespace {

// A residual block with dropout: Linear, GELU, Dropout, Linear.
struct DropBlockImpl : torch::nn::Module {
  explicit DropBlockImpl(double p)
      : fc1(register_module("fc1", torch::nn::Linear(16, 32))),
        fc2(register_module("fc2", torch::nn::Linear(32, 16))),
        drop(register_module("drop", torch::nn::Dropout(p))) {}
  torch::Tensor forward(const torch::Tensor& x) {
    ++calls;
    return x + fc2(drop(torch::gelu(fc1(x))));
  }
  torch::nn::Linear fc1, fc2;
  torch::nn::Dropout drop;
  int calls = 0;
};
TORCH_MODULE(DropBlock);

struct Run {
  torch::Tensor loss, x_grad, next_random;
  std::vector<torch::Tensor> grads;
  int calls = 0;
};

// Three blocks on one seeded batch; `recompute` runs blocks 0 and 2 under
// ddp::recompute. `backwards`: micro-batches accumulated into .grad.
Run three_blocks(double p, bool recompute, int backwards = 1) {
  torch::manual_seed(3);
  std::vector<DropBlock> blocks{DropBlock(p), DropBlock(p), DropBlock(p)};
  Run r;
  for (int k = 0; k < backwards; ++k) {
    auto x = torch::randn({8, 16}).requires_grad_();
    auto h = x;
    for (size_t i = 0; i < blocks.size(); ++i) h = recompute && i != 1 ? ddp::recompute(blocks[i], h) : blocks[i]->forward(h);
    auto loss = (h * h).mean();
    loss.backward();
    r.loss = loss.detach();
    r.x_grad = x.grad();
  }
  for (auto& b : blocks) {
    for (auto& q : b->parameters()) r.grads.push_back(q.grad().clone());
    r.calls += b->calls;
  }
  r.next_random = torch::rand({4});  // the generator after the step
  return r;
}

void expect_same(const Run& a, const Run& b) {
  EXPECT_TRUE(torch::equal(a.loss, b.loss));
  EXPECT_TRUE(torch::equal(a.x_grad, b.x_grad));
  ASSERT_EQ(a.grads.size(), b.grads.size());
  for (size_t i = 0; i < a.grads.size(); ++i) EXPECT_TRUE(torch::equal(a.grads[i], b.grads[i])) << "gradient " << i;
  EXPECT_TRUE(torch::equal(a.next_random, b.next_random)) << "the generator moved on differently";
}

TEST(Recompute, GradientsEqualWithoutRecomputeBitForBit_Dropout) {
  const auto plain = three_blocks(0.3, false), again = three_blocks(0.3, true);
  expect_same(plain, again);
  // The forward of the two recomputed blocks ran again in backward.
  EXPECT_EQ(plain.calls, 3);
  EXPECT_EQ(again.calls, 5);
  // Dropout is on (the control): without it the gradients differ, so a
  // re-run that drew another mask would have been seen.
  const auto no_dropout = three_blocks(0.0, false);
  EXPECT_FALSE(torch::equal(plain.grads[0], no_dropout.grads[0]));
}

TEST(Recompute, GradientAccumulationEqualsPlain) {
  expect_same(three_blocks(0.3, false, 3), three_blocks(0.3, true, 3));
}

// Forward under CPU autocast (bf16), backward after the autocast scope has
// ended: the re-run must compute in bf16 as the first run did.
TEST(Recompute, ReRunsUnderTheForwardsAutocast) {
  auto run = [](bool recompute) {
    torch::manual_seed(4);
    torch::nn::Linear a(16, 16), b(16, 16);
    auto x = torch::randn({4, 16});
    torch::Tensor y;
    {
      compat::AutocastGuard autocast(c10::DeviceType::CPU, torch::kBFloat16, true);
      auto fn = [&](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{b(torch::relu(a(in[0])))}; };
      std::vector<torch::Tensor> params = a->parameters();
      for (auto& q : b->parameters()) params.push_back(q);
      y = recompute ? ddp::recompute(fn, {x}, params)[0] : fn({x})[0];
    }
    EXPECT_EQ(y.scalar_type(), torch::kBFloat16);
    y.to(torch::kFloat).pow(2).sum().backward();
    return std::vector<torch::Tensor>{a->weight.grad().clone(), b->weight.grad().clone()};
  };
  const auto plain = run(false), again = run(true);
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], again[i])) << i;
  // The control: the same in fp32 differs, so a re-run outside autocast would be seen.
  torch::manual_seed(4);
  torch::nn::Linear a(16, 16), b(16, 16);
  b(torch::relu(a(torch::randn({4, 16})))).pow(2).sum().backward();
  EXPECT_FALSE(torch::equal(plain[0], a->weight.grad()));
}

// Batch norm's running statistics and counter are updated once per step,
// as without recompute (the re-run's update is undone).
TEST(Recompute, BufferUpdatesHappenOnce) {
  auto run = [](bool recompute) {
    torch::manual_seed(5);
    torch::nn::Sequential seq(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                              torch::nn::BatchNorm2d(4), torch::nn::ReLU());
    auto x = torch::randn({2, 3, 6, 6});
    auto y = recompute ? recompute_sequential(seq, x, 1) : seq->forward(x);
    y.sum().backward();
    std::vector<torch::Tensor> out;
    for (auto& b : seq->buffers()) out.push_back(b.clone());
    for (auto& p : seq->parameters()) out.push_back(p.grad().clone());
    return out;
  };
  const auto plain = run(false), again = run(true);
  ASSERT_EQ(plain.size(), again.size());
  for (size_t i = 0; i < plain.size(); ++i) EXPECT_TRUE(torch::equal(plain[i], again[i])) << i;
}

// A function that reads a parameter it was not given would lose that
// parameter's gradient: backward says so instead.
TEST(Recompute, AParameterNotPassedIsAnError) {
  torch::nn::Linear a(4, 4), hidden(4, 4);
  auto fn = [&](const std::vector<torch::Tensor>& in) { return std::vector<torch::Tensor>{hidden(a(in[0]))}; };
  auto y = ddp::recompute(fn, {torch::randn({2, 4})}, a->parameters())[0];
  try {
    y.sum().backward();
    FAIL() << "no error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("params"), std::string::npos) << e.what();
  }
}

TEST(Recompute, PolicySpellings) {
  EXPECT_EQ(parse_recompute("none").kind, RecomputePolicy::Kind::kNone);
  EXPECT_EQ(parse_recompute("mlp").kind, RecomputePolicy::Kind::kMlp);
  EXPECT_EQ(parse_recompute("stages").kind, RecomputePolicy::Kind::kStages);
  const auto every3 = parse_recompute("blocks:3");
  EXPECT_EQ(every3.kind, RecomputePolicy::Kind::kBlocks);
  EXPECT_TRUE(every3.block(0) && every3.block(3) && !every3.block(1) && !every3.block(2));
  EXPECT_TRUE(parse_recompute("blocks").block(1));
  for (const char* bad : {"block", "blocks:0", "blocks:x", "blocks:2x", "all", ""})
    EXPECT_THROW(parse_recompute(bad), UserError) << bad;
}

// ---- the built-in models --------------------------------------------------

models::GptOptions small_gpt() {
  return models::GptOptions().n_layer(4).n_head(2).n_embd(32).block_size(16).vocab_size(64).dropout(0.1);
}

// Loss and gradients of one step of a GPT of `o` (seeded weights and batch).
std::vector<torch::Tensor> gpt_step(const models::GptOptions& o) {
  torch::manual_seed(9);
  models::Gpt model(o);
  auto idx = torch::randint(0, o.vocab_size(), {4, o.block_size()});
  auto logits = model->forward(idx);
  auto loss = torch::nn::functional::cross_entropy(logits.view({-1, o.vocab_size()}), idx.view({-1}));
  loss.backward();
  std::vector<torch::Tensor> out{loss.detach()};
  for (auto& p : model->parameters()) out.push_back(p.grad().clone());
  return out;
}

TEST(Recompute, GptLevelsEqualNoneBitForBit) {
  const auto none = gpt_step(small_gpt());
  for (const char* level : {"mlp", "blocks", "blocks:2", "blocks:3"}) {
    const auto got = gpt_step(small_gpt().recompute(parse_recompute(level)));
    ASSERT_EQ(got.size(), none.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], none[i])) << level << ", tensor " << i;
  }
}

TEST(Recompute, ResNetLevelsEqualNoneBitForBit) {
  auto step = [](const std::string& level) {
    torch::manual_seed(2);
    models::ResNet net(models::ResNetOptions(18).num_classes(5).stem(models::ResNetStem::kSmall).recompute(
        parse_recompute(level)));
    auto x = torch::randn({4, 3, 8, 8});
    auto y = torch::randint(0, 5, {4});
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    std::vector<torch::Tensor> out{loss.detach()};
    for (auto& p : net->parameters()) out.push_back(p.grad().clone());
    for (auto& b : net->buffers()) out.push_back(b.clone());
    return out;
  };
  const auto none = step("none");
  for (const char* level : {"stages", "blocks", "blocks:3"}) {
    const auto got = step(level);
    ASSERT_EQ(got.size(), none.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], none[i])) << level << ", tensor " << i;
  }
}

// The ResNet through the real program on 2 Gloo ranks, with SyncBatchNorm
// (whose re-run forward all-reduces again, in backward) and two
// micro-batches per step: the same weights and running statistics, bit for
// bit, with each stage or every other block recomputed.
TEST(Recompute, ResNetTrajectoryThroughTheProgramEqualsPlain_BitExact) {
  DDP_SKIP_UNLESS_GLOO();
  auto train = [](const std::string& level) {
    const auto dir = testing::temp_dir("resnet_rc_" + level.substr(0, 6));
    auto r = testing::run_process({DDPTRAIN_EXE, "--model", "resnet18", "--stem", "small", "--size", "2", "--backend",
                                   "gloo", "--workers", "0", "--progress", "plain", "--epochs", "2", "--batch", "8",
                                   "--accum-steps", "2", "--train-samples", "96", "--test-samples", "32", "--timeout",
                                   "60", "--recompute", level, "--save_path", dir});
    EXPECT_EQ(r.exit_code, 0) << r.output;
    models::ModelSpec spec;
    spec.name = "resnet18";
    spec.stem = "small";
    auto model = models::make_model(spec);
    load_checkpoint(testing::find_file(dir, "epoch_2.pt"), *model, nullptr, torch::kCPU, "");
    std::vector<torch::Tensor> out;
    for (auto& p : model->parameters()) out.push_back(p.detach().clone());
    for (auto& b : model->buffers()) out.push_back(b.detach().clone());
    return out;
  };
  const auto none = train("none");
  for (const char* level : {"stages", "blocks:2"}) {
    const auto got = train(level);
    ASSERT_EQ(got.size(), none.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_TRUE(torch::equal(got[i], none[i])) << level << ", tensor " << i;
  }
}

// ---- memory ----------------------------------------------------------------

// Peak bytes above what was live before, over one forward and backward of
// a GPT of `o` (the gradients included).
int64_t gpt_step_peak_bytes(const models::GptOptions& o) {
  const auto& alloc = ddp::testing::counting_allocator();
  torch::manual_seed(9);
  models::Gpt model(o);
  for (auto& p : model->parameters()) p.mutable_grad() = torch::zeros_like(p);
  auto idx = torch::randint(0, o.vocab_size(), {8, o.block_size()});
  const int64_t before = alloc.live();
  alloc.reset_peak();
  auto logits = model->forward(idx);
  auto loss = torch::nn::functional::cross_entropy(logits.view({-1, o.vocab_size()}), idx.view({-1}));
  logits = torch::Tensor();
  loss.backward();
  return alloc.peak() - before;
}

// 8 blocks of width 64 at context 128, 8 sequences: the activations are
// most of a step's memory, and recomputing blocks keeps only their inputs.
TEST(Recompute, PeakMemoryOfAGptStepFalls) {
  const auto o = models::GptOptions().n_layer(8).n_head(4).n_embd(64).block_size(128).vocab_size(128).dropout(0.1);
  const int64_t none = gpt_step_peak_bytes(o);
  const int64_t mlp = gpt_step_peak_bytes(models::GptOptions(o).recompute(parse_recompute("mlp")));
  const int64_t every2 = gpt_step_peak_bytes(models::GptOptions(o).recompute(parse_recompute("blocks:2")));
  const int64_t blocks = gpt_step_peak_bytes(models::GptOptions(o).recompute(parse_recompute("blocks")));
  std::printf("peak bytes of a step: none %lld, mlp %lld, blocks:2 %lld, blocks %lld\n", static_cast<long long>(none),
              static_cast<long long>(mlp), static_cast<long long>(every2), static_cast<long long>(blocks));
  ASSERT_GT(none, 0) << "the counting allocator saw nothing";
  EXPECT_LT(mlp, none * 85 / 100);  // measured 0.79
  EXPECT_LT(every2, mlp);
  EXPECT_LT(blocks, every2);
  EXPECT_LT(blocks, none * 4 / 10);  // measured 0.16
}

// bf16 on one GPU, with ddptrain's fused kernels (gradient slots, the
// residual add in the LayerNorm): recompute changes nothing beyond rounding
// order, and in practice nothing at all.
TEST(Recompute, GptBf16LossesMatchWithKernels_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  testing::FusedLinearOn linear;
  testing::FusedLayerNormOn ln;
  const auto o = models::GptOptions().n_layer(4).n_head(4).n_embd(128).block_size(64).vocab_size(256);
  const auto none = testing::small_gpt_bf16_losses(o, /*graph=*/false, 8);
  for (const char* level : {"mlp", "blocks", "blocks:2"}) {
    const auto got = testing::small_gpt_bf16_losses(models::GptOptions(o).recompute(parse_recompute(level)), false, 8);
    ASSERT_EQ(got.size(), none.size());
    for (size_t i = 0; i < got.size(); ++i) EXPECT_NEAR(got[i], none[i], 1e-6) << level << ", step " << i;
  }
}

// Under --cuda-graph the recomputed backward is captured with the rest of
// the step: the same losses as the eager step, and the step really is one
// graph (small_gpt_bf16_losses fails the test otherwise).
TEST(Recompute, CapturedStepEqualsEager_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  testing::FusedLinearOn linear;
  testing::FusedLayerNormOn ln;
  const auto o = models::GptOptions().n_layer(4).n_head(4).n_embd(128).block_size(64).vocab_size(256);
  for (const char* level : {"mlp", "blocks"}) {
    const auto rc = models::GptOptions(o).recompute(parse_recompute(level));
    const auto eager = testing::small_gpt_bf16_losses(rc, /*graph=*/false, 8);
    const auto graphed = testing::small_gpt_bf16_losses(rc, /*graph=*/true, 8);
    ASSERT_EQ(graphed.size(), eager.size());
    for (size_t i = 0; i < eager.size(); ++i) EXPECT_NEAR(graphed[i], eager[i], 1e-6) << level << ", step " << i;
  }
}

// Dropout inside a recomputed part cannot be replayed in a captured
// backward: ddp::recompute says so, and the step runs eagerly with that
// reason (the losses still fall: it trains).
TEST(Recompute, DropoutInACapturedStepFallsBackWithTheReason_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const torch::Device gpu(torch::kCUDA, 0);
  auto world = testing::one_rank_world(true);
  torch::manual_seed(5);
  LmTask task;
  auto model = task.make_gpt(models::GptOptions().n_layer(2).n_head(2).n_embd(64).block_size(32).vocab_size(128).dropout(
                                 0.1).recompute(parse_recompute("blocks")),
                             "tokens");
  model->to(gpu);
  model->train();
  TrainStep step(task, *model, *world,
                 TrainStepOptions().amp("bf16").cuda_graph(true).graph_warmup(1).optimizer(
                     FlatOptimizerOptions().name("adamw").lr(3e-3)));
  auto x = torch::randint(0, 128, {4, 32}, torch::kLong).to(gpu);
  data::Batch batch{{"input", x}, {"target", (x * 3 + 1).remainder(128)}};
  std::vector<double> losses;
  for (int i = 0; i < 6; ++i) losses.push_back(step.run(batch, true, 3e-3).loss.item<double>());
  EXPECT_FALSE(step.graphed());
  EXPECT_NE(step.graph_fallback().find("draws random numbers"), std::string::npos) << step.graph_fallback();
  EXPECT_LT(losses.back(), losses.front());
}

// The built-in GPT refuses --recompute with --cuda-graph and dropout up
// front, with the fix; without dropout the pair is accepted.
TEST(Recompute, CudaGraphWithDropoutIsRefusedForTheGpt) {
  auto lm_config = [](std::vector<std::string> args) {
    Config defaults;
    LmTask().add_flags(defaults);
    args.insert(args.begin(), {"ddptrain", "--task", "lm", "--recompute", "blocks", "--cuda-graph"});
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    return parse_cli(static_cast<int>(argv.size()), argv.data(), defaults);
  };
  const auto msg = testing::user_error([&] { LmTask::model_options(lm_config({"--dropout", "0.1"})); });
  EXPECT_NE(msg.find("--dropout 0.1"), std::string::npos) << msg;
  EXPECT_NE(msg.find("use --dropout 0"), std::string::npos) << msg;
  EXPECT_EQ(LmTask::model_options(lm_config({})).recompute().kind, RecomputePolicy::Kind::kBlocks);
}

}  // namespace
}  // namespace ddp
