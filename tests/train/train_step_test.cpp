// The training step: channels-last, clipping, fp16 rules, and CUDA graphs
// against eager execution.
#include "ddp/dist/param_slots.h"
#include "ddp/dist/sync_batchnorm.h"
#include "ddp/error.h"
#include "ddp/models/registry.h"
#include "ddp/train/train_step.h"
#include "support/small_gpt.h"
#include "support/testing.h"

namespace {

using ddp::testing::one_rank_world;

std::shared_ptr<ddp::Net> small_resnet(const torch::Device& device) {
  torch::manual_seed(1);
  ddp::models::ModelSpec spec;
  spec.name = "resnet18";
  spec.stem = "small";
  spec.in_channels = 3;
  spec.input_hw = {16, 16};
  spec.num_classes = 10;
  auto m = ddp::models::make_model(spec);
  m->to(device);
  return m;
}

// Losses of `steps` training steps on seeded random batches.
std::vector<double> trajectory(ddp::TrainStepOptions options, const torch::Device& device, int steps, int batch = 16) {
  auto world = one_rank_world(device.is_cuda());
  auto model = small_resnet(device);
  model->train();
  ddp::TrainStep step(*model, *world, options);
  auto gen = torch::make_generator<at::CPUGeneratorImpl>(7);
  std::vector<double> losses;
  std::vector<torch::Tensor> on_device;
  // Four batches, seen in turn: the model can fit them, so the loss falls.
  std::vector<torch::Tensor> xs, ys;
  for (int i = 0; i < 4; ++i) {
    xs.push_back(torch::randn({batch, 3, 16, 16}, gen).to(device));
    ys.push_back(torch::randint(0, 10, {batch}, gen, torch::kLong).to(device));
  }
  const double lr = options.optimizer().lr();
  for (int i = 0; i < steps; ++i) on_device.push_back(step.run(step.prepare(xs[i % 4]), ys[i % 4], true, lr));
  for (auto& l : on_device) losses.push_back(l.item<double>());
  if (options.cuda_graph()) {
    EXPECT_TRUE(step.graphed()) << step.graph_fallback();
  }
  return losses;
}

using ddp::testing::max_rel_diff;

// Deterministic cuDNN without autotuning for one test; the settings are
// restored afterwards.
struct DeterministicCuDNN {
  DeterministicCuDNN()
      : deterministic(at::globalContext().deterministicCuDNN()), benchmark(at::globalContext().benchmarkCuDNN()) {
    at::globalContext().setDeterministicCuDNN(true);
    at::globalContext().setBenchmarkCuDNN(false);
  }
  ~DeterministicCuDNN() {
    at::globalContext().setDeterministicCuDNN(deterministic);
    at::globalContext().setBenchmarkCuDNN(benchmark);
  }
  bool deterministic, benchmark;
};

ddp::TrainStepOptions sgd() {
  return ddp::TrainStepOptions().optimizer(ddp::FlatOptimizerOptions().name("sgd").lr(0.05));
}

TEST(TrainStep, ChannelsLastGivesTheSameLossesOnCpu) {
  DDP_SKIP_UNLESS_GLOO();
  // Step 2's loss is computed with the weights step 1 updated through the
  // channels-last views; later steps only amplify rounding (lr 0.05).
  auto plain = trajectory(sgd(), torch::kCPU, 2);
  auto cl = trajectory(sgd().channels_last(true), torch::kCPU, 2);
  EXPECT_LE(max_rel_diff(cl, plain), 1e-4);
}

TEST(TrainStep, ClippingBoundsTheUpdate) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = one_rank_world(false);
  auto model = small_resnet(torch::kCPU);
  ddp::TrainStep step(*model, *world,
                      ddp::TrainStepOptions().clip_grad_norm(0.01).optimizer(
                          ddp::FlatOptimizerOptions().name("sgd").momentum(0).lr(1.0)));
  auto before = step.sync().flat_params().front().clone();
  step.run(torch::randn({8, 3, 16, 16}), torch::randint(0, 10, {8}), true, 1.0);
  // Plain SGD with lr 1 moves the parameters by exactly the clipped gradient.
  const double moved = (step.sync().flat_params().front() - before).norm().item<double>();
  EXPECT_NEAR(moved, 0.01, 1e-4);
}

TEST(TrainStep, Fp16OnCpuIsAUserError) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = one_rank_world(false);
  auto model = small_resnet(torch::kCPU);
  try {
    ddp::TrainStep step(*model, *world, sgd().amp("fp16"));
    FAIL() << "fp16 on CPU was accepted";
  } catch (const ddp::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("--amp bf16"), std::string::npos) << e.what();
  }
}

TEST(TrainStep, CudaGraphOnCpuFallsBackWithAReason) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = one_rank_world(false);
  auto model = small_resnet(torch::kCPU);
  ddp::TrainStep step(*model, *world, sgd().cuda_graph(true));
  EXPECT_NE(step.graph_fallback().find("CUDA"), std::string::npos);
  EXPECT_FALSE(step.graphed());
}

// Loading a checkpoint's state marks the bf16 copies stale: the weights
// were written before it, maybe where no version counter saw it (here
// through .data(), as a collective would), and the copies must not be
// read as current.
TEST(TrainStep, LoadMarksTheBf16CopiesStale) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = one_rank_world(false);
  auto model = small_resnet(torch::kCPU);
  ddp::TrainStep step(*model, *world, sgd());
  auto& sync = step.sync();
  auto weight = model->parameters().front();
  sync.bf16_copies(true);
  ddp::param_slots::bf16_copy(weight);  // asks for the copies: made when the window closes
  sync.bf16_copies(false);
  sync.bf16_copies(true);  // cast
  sync.bf16_copies(false);
  ASSERT_TRUE(sync.bf16_copies_current());
  {
    torch::NoGradGuard no_grad;
    weight.data().add_(1.0);  // unseen by the version counters
  }
  ASSERT_TRUE(sync.bf16_copies_current()) << "the control: a write through .data() is not seen";
  ddp::TensorMap state;
  step.save(state);
  step.load(state);
  EXPECT_FALSE(sync.bf16_copies_current());
  sync.refresh_bf16_copies();
  EXPECT_TRUE(torch::equal(sync.bf16_flat(0), sync.flat_params().front().to(torch::kBFloat16)));
}

// --ema against an average computed here, apart from ddptrain's kernels,
// from the weights after each step: a_n = d_n a_(n-1) + (1 - d_n) w_n in
// double, with d_n = min(DECAY, (1 + n) / (10 + n)), from the initial
// weights. 12 steps at 0.5 cross from the warm-up (n < 8) to the cap.
TEST(TrainStep, EmaIsTheWarmedUpAverageOfEachStepsWeights) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = one_rank_world(false);
  auto model = small_resnet(torch::kCPU);
  const double decay = 0.5;
  ddp::TrainStep step(*model, *world, sgd().ema(decay));
  ASSERT_NE(step.ema(), nullptr);
  const auto flat = step.sync().flat_params().front();
  auto reference = flat.to(torch::kDouble);
  auto gen = torch::make_generator<at::CPUGeneratorImpl>(3);
  for (int n = 0; n < 12; ++n) {
    step.run(torch::randn({8, 3, 16, 16}, gen), torch::randint(0, 10, {8}, gen, torch::kLong), true, 0.05);
    const double d = std::min(decay, (1.0 + n) / (10.0 + n));
    reference = d * reference + (1 - d) * flat.to(torch::kDouble);
  }
  EXPECT_EQ(step.ema()->updates(), 12);
  const auto average = step.ema()->averages().front();
  EXPECT_LE((average.to(torch::kDouble) - reference).abs().max().item<double>(), 1e-6);
  EXPECT_GT((flat.to(torch::kDouble) - reference).abs().max().item<double>(), 1e-4) << "the control: the weights moved";

  // Swapped in, each parameter holds its own average (average_of), and the
  // weights come back bit for bit.
  const auto weights = flat.clone();
  const auto named = model->named_parameters();
  {
    auto swapped = step.averaged_weights();
    ASSERT_TRUE(torch::equal(flat, average));
    for (const auto& p : named) EXPECT_TRUE(torch::equal(p.value(), step.ema()->average_of(p.key()))) << p.key();
  }
  EXPECT_TRUE(torch::equal(flat, weights));

  // The checkpoint's state gives another step the same average and count.
  ddp::TensorMap state;
  step.save(state);
  EXPECT_TRUE(state.count("ema/" + named.begin()->key()));
  auto model2 = small_resnet(torch::kCPU);
  ddp::TrainStep step2(*model2, *world, sgd().ema(decay));
  step2.load(state);
  EXPECT_EQ(step2.ema()->updates(), 12);
  EXPECT_TRUE(torch::equal(step2.ema()->averages().front(), average));
  // A run without --ema has none to give.
  ddp::TensorMap without;
  auto model3 = small_resnet(torch::kCPU);
  ddp::TrainStep plain(*model3, *world, sgd());
  plain.save(without);
  const auto error = ddp::testing::user_error([&] { step2.load(without); });
  EXPECT_NE(error.find("no average of the weights"), std::string::npos) << error;
}

// On a GPU the update is captured with the step: every replay moves the
// average (its count, read from the device, is the step count), to the
// eager run's values up to rounding.
TEST(TrainStep, EmaIsCapturedWithTheStep_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  DeterministicCuDNN deterministic;
  const torch::Device gpu(torch::kCUDA, 0);
  auto run = [&](bool graph) {
    auto world = one_rank_world(true);
    auto model = small_resnet(gpu);
    model->train();
    ddp::TrainStep step(*model, *world,
                        ddp::TrainStepOptions().optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(1e-3)).ema(0.9).cuda_graph(graph));
    auto gen = torch::make_generator<at::CPUGeneratorImpl>(5);
    auto x = torch::randn({16, 3, 16, 16}, gen).to(gpu);
    auto y = torch::randint(0, 10, {16}, gen, torch::kLong).to(gpu);
    for (int i = 0; i < 10; ++i) step.run(x, y, true, 1e-3);
    EXPECT_EQ(step.graphed(), graph) << step.graph_fallback();
    EXPECT_EQ(step.ema()->updates(), 10);
    return step.ema()->averages().front().cpu();
  };
  const auto eager = run(false), graphed = run(true);
  EXPECT_LE((eager - graphed).abs().max().item<double>(), 1e-5);
}

// 50 steps graphed and eager: the same loss trajectory to rounding.
TEST(TrainStep, GraphedEqualsEagerFp32_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  DeterministicCuDNN deterministic;
  auto adam = ddp::TrainStepOptions().optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(1e-3)).channels_last(true);
  const torch::Device gpu(torch::kCUDA, 0);
  auto eager = trajectory(adam, gpu, 50);
  auto graphed = trajectory(adam.cuda_graph(true), gpu, 50);
  EXPECT_LT(eager.back(), eager.front());
  EXPECT_LE(max_rel_diff(graphed, eager), 1e-4) << ::testing::PrintToString(graphed) << " vs " << ::testing::PrintToString(eager);
}

// Two eager runs from the same seed give the same losses (deterministic
// cuDNN): the baseline the graphed comparisons rest on.
TEST(TrainStep, EagerIsRepeatable_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  DeterministicCuDNN deterministic;
  auto adam = ddp::TrainStepOptions().optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(1e-3)).channels_last(true);
  const torch::Device gpu(torch::kCUDA, 0);
  auto a = trajectory(adam, gpu, 10);
  auto b = trajectory(adam, gpu, 10);
  EXPECT_LE(max_rel_diff(a, b), 1e-6) << ::testing::PrintToString(a) << " vs " << ::testing::PrintToString(b);
}

TEST(TrainStep, GraphedEqualsEagerBf16_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  DeterministicCuDNN deterministic;
  auto adam =
      ddp::TrainStepOptions().amp("bf16").optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(1e-3)).channels_last(true);
  const torch::Device gpu(torch::kCUDA, 0);
  auto eager = trajectory(adam, gpu, 50);
  auto graphed = trajectory(adam.cuda_graph(true), gpu, 50);
  EXPECT_LT(eager.back(), eager.front());
  EXPECT_LE(max_rel_diff(graphed, eager), 2e-2) << ::testing::PrintToString(graphed) << " vs " << ::testing::PrintToString(eager);
}

// ddptrain's batch-norm kernels with the ReLU and residual add fused in
// give the same 50-step trajectory as the same kernels followed by separate
// ReLU and add ops: each fused op reproduces the separate ops' bits.
TEST(TrainStep, FusedBatchNormReluEqualsUnfusedBf16_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::have_nhwc_batchnorm_kernels()) GTEST_SKIP() << "built without ddptrain's CUDA kernels";
  DeterministicCuDNN deterministic;
  auto adam =
      ddp::TrainStepOptions().amp("bf16").optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(1e-3)).channels_last(true);
  const torch::Device gpu(torch::kCUDA, 0);
  auto fused = trajectory(adam, gpu, 50);
  ddp::use_fused_batchnorm_relu(false);
  auto unfused = trajectory(adam, gpu, 50);
  ddp::use_fused_batchnorm_relu(true);
  EXPECT_LT(fused.back(), fused.front());
  EXPECT_LE(max_rel_diff(fused, unfused), 1e-6) << ::testing::PrintToString(fused) << " vs " << ::testing::PrintToString(unfused);
}

// fp16 with dynamic loss scaling: eager trains, and the captured step (the
// unscale, inf check, skipped update and scale update all inside the graph)
// gives the same trajectory.
TEST(TrainStep, Fp16GraphedEqualsEager_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  DeterministicCuDNN deterministic;
  const torch::Device gpu(torch::kCUDA, 0);
  auto opts = ddp::TrainStepOptions().amp("fp16").optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(1e-3));
  auto eager = trajectory(opts, gpu, 50);
  for (double l : eager) EXPECT_TRUE(std::isfinite(l));
  EXPECT_LT(eager.back(), eager.front());
  auto graphed = trajectory(opts.cuda_graph(true), gpu, 50);
  EXPECT_LE(max_rel_diff(graphed, eager), 2e-2) << ::testing::PrintToString(graphed) << " vs " << ::testing::PrintToString(eager);
}

// An overflowing step is skipped and halves the scale, in the graph too: the
// first step's scaled loss (x 2^16) overflows fp16 activations' gradients
// here, as the diagnostic run on the H200 showed.
TEST(TrainStep, Fp16OverflowSkipsTheStepAndHalvesTheScale_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const torch::Device gpu(torch::kCUDA, 0);
  for (bool graph : {false, true}) {
    auto world = one_rank_world(true);
    auto model = small_resnet(gpu);
    model->train();
    ddp::TrainStep step(*model, *world,
                        ddp::TrainStepOptions().amp("fp16").cuda_graph(graph).optimizer(
                            ddp::FlatOptimizerOptions().name("adamw").lr(0.05)));
    auto gen = torch::make_generator<at::CPUGeneratorImpl>(7);
    auto x = step.prepare(torch::randn({16, 3, 16, 16}, gen).to(gpu));
    auto y = torch::randint(0, 10, {16}, gen, torch::kLong).to(gpu);
    std::vector<double> losses, scales;
    for (int i = 0; i < 8; ++i) {
      losses.push_back(step.run(x, y, true, 0.05).item<double>());
      scales.push_back(step.loss_scale().item<double>());
    }
    EXPECT_EQ(step.graphed(), graph) << step.graph_fallback();
    // Wherever the scale halved, that step was skipped: the next loss is the same.
    int skipped = 0;
    for (size_t i = 1; i + 1 < scales.size(); ++i)
      if (scales[i] < scales[i - 1]) {
        ++skipped;
        EXPECT_NEAR(losses[i + 1], losses[i], 1e-6 * std::abs(losses[i])) << "step " << i << " overflowed but changed the weights";
      }
    EXPECT_GE(skipped, 1) << ::testing::PrintToString(scales);
    for (double l : losses) EXPECT_TRUE(std::isfinite(l));
  }
}

}  // namespace

namespace {

// --cuda-graph on a task that reads a value back to the host in backward:
// the capture fails half-way through backward (issue 13, item 4). The
// fallback's eager steps must equal a run that never tried to capture:
// losses and final parameters, on every rank.
void expect_fallback_equals_eager(int ranks) {
  const auto graph = ddp::testing::temp_dir("fallback_graph"), eager = ddp::testing::temp_dir("fallback_eager");
  const std::map<std::string, std::string> env{{"DDP_TEST_CUDA", "1"}};
  auto a = ddp::testing::run_process({DDP_TESTWORKER, "--launch", std::to_string(ranks), "capture_fallback", graph, "graph"},
                                     env, 300);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = ddp::testing::run_process({DDP_TESTWORKER, "--launch", std::to_string(ranks), "capture_fallback", eager, "eager"},
                                     env, 300);
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(ddp::testing::read_file(graph + "/fallback_rank0.txt").find("capture failed"), std::string::npos)
      << "the capture was meant to fail: " << a.output;
  for (int rank = 0; rank < ranks; ++rank) {
    const std::string r = std::to_string(rank);
    for (const std::string what : {"losses", "params"}) {
      torch::Tensor got, want;
      torch::load(got, graph + "/" + what + "_rank" + r + ".pt");
      torch::load(want, eager + "/" + what + "_rank" + r + ".pt");
      const double diff = (got - want).abs().max().item<double>();
      EXPECT_LE(diff, 1e-5 * std::max(1.0, want.abs().max().item<double>())) << what << " on rank " << rank;
    }
  }
}

TEST(TrainStep, FailedCaptureFallsBackToTheStepsOfANeverCapturedRun_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  expect_fallback_equals_eager(1);
}

// With two ranks the failed capture has launched (recorded) buckets when it
// stops: the eager steps after it must not take them for done.
TEST(TrainStep, FailedCaptureFallsBackToTheStepsOfANeverCapturedRun_MultiCUDA) {
  if (!torch::cuda::is_available() || torch::cuda::device_count() < 2) GTEST_SKIP() << "needs 2 GPUs";
  expect_fallback_equals_eager(2);
}

}  // namespace
