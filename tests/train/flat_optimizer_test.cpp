// The flat optimizer against LibTorch's per-tensor optimizers, and the
// claim that its kernel count does not grow with the number of tensors.
#include <ATen/record_function.h>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/train/flat_optimizer.h"
#include "ddp/dist/grad_sync.h"
#include "ddp/dist/param_slots.h"
#include "ddp/io/checkpoint.h"
#include "ddp/io/torch_pickle.h"
#include "ddp/train/train_step.h"
#include "support/testing.h"

namespace {

struct Case {
  std::string name;
  double weight_decay;
  double momentum = 0.9;  // SGD
};

// Runs `steps` updates with random gradients on the same start, once with
// FlatOptimizer over one flat buffer and once with torch::optim over the
// separate tensors that the flat buffer is cut into; returns max |diff|.
double max_difference(const Case& c, const torch::Device& device, int steps) {
  torch::manual_seed(0);
  const std::vector<int64_t> sizes{7, 300, 1, 64, 1000};
  int64_t total = 0;
  for (auto n : sizes) total += n;
  auto start = torch::randn({total}, torch::TensorOptions().device(device));
  auto flat = start.clone();
  auto flat_grad = torch::zeros_like(flat);
  ddp::FlatOptimizer flat_opt({flat}, {flat_grad},
                              ddp::FlatOptimizerOptions().name(c.name).lr(0.01).weight_decay(c.weight_decay).momentum(c.momentum));
  std::vector<torch::Tensor> params;
  for (auto& piece : start.clone().split_with_sizes(sizes)) params.push_back(piece.clone().requires_grad_());
  std::unique_ptr<torch::optim::Optimizer> ref;
  if (c.name == "sgd")
    ref = std::make_unique<torch::optim::SGD>(params, torch::optim::SGDOptions(0.01).momentum(c.momentum).weight_decay(c.weight_decay));
  else if (c.name == "adam")
    ref = std::make_unique<torch::optim::Adam>(params, torch::optim::AdamOptions(0.01).weight_decay(c.weight_decay));
  else
    ref = std::make_unique<torch::optim::AdamW>(params, torch::optim::AdamWOptions(0.01).weight_decay(c.weight_decay));
  for (int s = 0; s < steps; ++s) {
    auto g = torch::randn({total}, flat.options());
    flat_grad.copy_(g);
    const double lr = 0.01 * (1.0 + 0.1 * s);  // a changing schedule
    flat_opt.set_lr(lr);
    flat_opt.step();
    auto pieces = g.split_with_sizes(sizes);
    for (size_t i = 0; i < params.size(); ++i) params[i].mutable_grad() = pieces[i].clone();
    for (auto& group : ref->param_groups()) group.options().set_lr(lr);
    ref->step();
  }
  EXPECT_EQ(flat_opt.steps_taken(), steps);
  std::vector<torch::Tensor> detached;
  for (auto& p : params) detached.push_back(p.detach());
  auto expected = torch::cat(detached);
  // The two must also have moved away from the start (the test can fail).
  EXPECT_GT((flat - start).abs().max().item<double>(), 1e-3);
  return (flat - expected).abs().max().item<double>();
}

// Names the case in gtest's and ctest's listings (not raw bytes).
void PrintTo(const Case& c, std::ostream* os) { *os << c.name << " wd=" << c.weight_decay << " momentum=" << c.momentum; }

class FlatOptimizerEquals : public ::testing::TestWithParam<Case> {};

TEST_P(FlatOptimizerEquals, PerTensorOptimizerOnCpu) {
  EXPECT_LE(max_difference(GetParam(), torch::kCPU, 20), 1e-6);
}

TEST_P(FlatOptimizerEquals, PerTensorOptimizerOnGpu_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  // The fused kernels reorder the arithmetic: equal to fp32 rounding.
  EXPECT_LE(max_difference(GetParam(), torch::Device(torch::kCUDA, 0), 20), 2e-5);
}

INSTANTIATE_TEST_SUITE_P(Kinds, FlatOptimizerEquals,
                         ::testing::Values(Case{"sgd", 0.0}, Case{"sgd", 5e-4}, Case{"sgd", 5e-4, 0.0}, Case{"adam", 0.0},
                                           Case{"adam", 1e-2}, Case{"adamw", 0.05}),
                         [](const auto& info) {
                           return info.param.name + (info.param.weight_decay > 0 ? "_wd" : "") +
                                  (info.param.name == "sgd" && info.param.momentum == 0 ? "_no_momentum" : "");
                         });

// Operators dispatched by one optimizer step over GradSync's flat buffers,
// for an MLP of `layers` Linear layers (2 tensors each).
int64_t ops_per_step(int layers, const std::string& optimizer) {
  torch::nn::Sequential net;
  for (int i = 0; i < layers; ++i) net->push_back(torch::nn::Linear(8, 8));
  auto world = ddp::testing::one_rank_world();
  ddp::GradSync sync(*net, *world);
  // Built on the GradSync, as the trainer does: with every parameter used,
  // its step is the whole-buffer one.
  ddp::FlatOptimizer opt(sync, ddp::FlatOptimizerOptions().name(optimizer));
  net->forward(torch::randn({4, 8})).sum().backward();
  sync.finish();
  opt.step();  // first step (lazy paths, if any)
  static std::atomic<int64_t> count{0};
  count = 0;
  auto handle = at::addThreadLocalCallback(at::RecordFunctionCallback(
      [](const at::RecordFunction&) -> std::unique_ptr<at::ObserverContext> {
        ++count;
        return nullptr;
      }));
  opt.step();
  at::removeCallback(handle);
  return count.load();
}

TEST(FlatOptimizer, OperatorCountDoesNotGrowWithParameterTensors) {
  DDP_SKIP_UNLESS_GLOO();
  for (const std::string name : {"sgd", "adamw"}) {
    const auto few = ops_per_step(2, name), many = ops_per_step(40, name);
    EXPECT_GT(few, 0) << name;
    EXPECT_EQ(few, many) << name << ": 4 tensors took " << few << " operators, 80 tensors took " << many;
  }
}

// step(found_inf, max_grad_norm) against clip_grad_norm_'s arithmetic done
// by hand before a plain step(), over steps that alternate between clipped
// (norm ~300 against a maximum of 1) and unclipped (norm ~0.3) gradients,
// so that Adam's moments mix the two scales. Returns the largest relative
// difference of the parameters and of the gradients left behind.
std::pair<double, double> clipped_against_by_hand(const torch::Device& device) {
  torch::manual_seed(0);
  const double max_norm = 1.0;
  auto start = torch::randn({1000}, torch::TensorOptions().device(device));
  auto pa = start.clone(), ga = torch::zeros_like(pa), pb = start.clone(), gb = torch::zeros_like(pb);
  const auto opts = ddp::FlatOptimizerOptions().name("adamw").lr(0.01).weight_decay(0.1);
  ddp::FlatOptimizer a({pa}, {ga}, opts), b({pb}, {gb}, opts);
  double grad_diff = 0;
  for (int s = 0; s < 6; ++s) {
    auto g = torch::randn({1000}, pa.options()) * (s % 2 == 0 ? 10.0 : 0.01);
    ga.copy_(g);
    gb.copy_(g);
    a.step({}, max_norm);
    auto coef = (max_norm / (gb.norm(2) + 1e-6)).clamp_max(1.0);
    gb.mul_(coef);
    b.step();
    // Left clipped: the clipped steps' gradients are 1/300 of g.
    EXPECT_LE(ga.norm(2).item<double>(), max_norm * (1 + 1e-5)) << "step " << s;
    grad_diff = std::max(grad_diff, ((ga - gb).abs().max() / gb.abs().max()).item<double>());
  }
  const double param_diff = ((pa - pb).abs().max() / (pb - start).abs().max()).item<double>();
  return {param_diff, grad_diff};
}

TEST(FlatOptimizer, ClipsAsClipGradNormThenSteps) {
  auto [params, grads] = clipped_against_by_hand(torch::kCPU);
  EXPECT_EQ(params, 0.0);  // the same multiply, then the same step
  EXPECT_EQ(grads, 0.0);
}

TEST(FlatOptimizer, ClipsInsideTheFusedAdamKernel_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  if (!ddp::compat::kHasFusedOptimizers) GTEST_SKIP() << "no fused optimizers in this LibTorch: the CPU test covers the multiply";
  // The fused kernel divides by the inverse of the coefficient: an fp32
  // rounding of the clipped gradients apart, no more.
  auto [params, grads] = clipped_against_by_hand(torch::Device(torch::kCUDA, 0));
  EXPECT_LE(params, 1e-5);
  EXPECT_LE(grads, 1e-6);
}

// Built on a GradSync with bf16 copies, the fused step leaves them equal to
// the updated parameters (ddptrain's Adam kernel writes them where it runs;
// elsewhere the next window casts): the next step's window casts nothing.
TEST(FlatOptimizer, LeavesTheNextStepsBf16CopiesCurrent_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  torch::nn::Sequential net(torch::nn::Linear(16, 32), torch::nn::Linear(32, 8));
  net->to(torch::Device(torch::kCUDA, 0));
  auto world = ddp::testing::one_rank_world(true);
  ddp::GradSync sync(*net, *world);
  ddp::FlatOptimizer opt(sync, ddp::FlatOptimizerOptions().name("adamw").lr(0.01).weight_decay(0.1));
  auto weight = net->parameters().front();
  sync.bf16_copies(true);
  ddp::param_slots::bf16_copy(weight);  // asks for the copies
  sync.bf16_copies(false);
  for (int s = 0; s < 3; ++s) {
    SCOPED_TRACE("step " + std::to_string(s));
    sync.bf16_copies(true);
    net->forward(torch::randn({4, 16}, weight.options())).pow(2).sum().backward();
    sync.bf16_copies(false);
    sync.finish();
    opt.step({}, 0.5);
#ifdef DDP_WITH_CUDA_KERNELS
    if (ddp::compat::kHasFusedOptimizers) {
      EXPECT_TRUE(sync.bf16_copies_current()) << "written by the kernel";
      EXPECT_TRUE(torch::equal(sync.bf16_flat(0), sync.flat_params().front().to(torch::kBFloat16)));
    }
#endif
    sync.refresh_bf16_copies();  // what a window would do: a cast where they are not current
    EXPECT_TRUE(torch::equal(sync.bf16_flat(0), sync.flat_params().front().to(torch::kBFloat16)));
    sync.zero_grad(true);
  }
}

// GradientsAfterStep::kDropped (what TrainStep passes, as it sets the
// gradients to none right after): the same parameters, bit for bit, as
// kRead, over clipped steps and an unused parameter's missed steps, whose
// fix-ups read the clipped gradients; where ddptrain's Adam kernel runs,
// the steps whose fix-ups read none leave the gradients unclipped.
TEST(FlatOptimizer, DroppedGradientsStepAsReadOnes_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto world = ddp::testing::one_rank_world(true);
  const torch::Device gpu(torch::kCUDA, 0);
  struct Run {
    torch::nn::Sequential net{torch::nn::Linear(16, 16), torch::nn::Linear(16, 8)};
    std::unique_ptr<ddp::GradSync> sync;
    std::unique_ptr<ddp::FlatOptimizer> opt;
  };
  auto make = [&] {
    torch::manual_seed(4);
    auto r = std::make_unique<Run>();
    r->net->to(gpu);
    r->sync = std::make_unique<ddp::GradSync>(*r->net, *world);
    r->opt = std::make_unique<ddp::FlatOptimizer>(
        *r->sync, ddp::FlatOptimizerOptions().name("adamw").lr(0.01).weight_decay(0.1));
    return r;
  };
  auto read = make(), dropped = make();
  torch::manual_seed(5);
  int unclipped_left = 0;
  for (bool use_second : {true, true, false, true, true}) {
    auto x = torch::randn({4, 16}, gpu) * 50;  // gradients far above the clip norm
    torch::Tensor grads_before;
    for (auto* r : {read.get(), dropped.get()}) {
      r->sync->zero_grad();
      auto h = r->net[0]->as<torch::nn::Linear>()->forward(x);
      if (use_second) h = r->net[1]->as<torch::nn::Linear>()->forward(h);
      h.pow(2).sum().backward();
      r->sync->finish();
      grads_before = r->sync->flat_grads().front().clone();
      r->opt->step({}, 0.5, r == read.get() ? ddp::GradientsAfterStep::kRead : ddp::GradientsAfterStep::kDropped);
    }
    if (torch::equal(dropped->sync->flat_grads().front(), grads_before)) ++unclipped_left;
    for (size_t i = 0; i < read->net->parameters().size(); ++i)
      ASSERT_TRUE(torch::equal(read->net->parameters()[i], dropped->net->parameters()[i])) << "parameter " << i;
  }
#ifdef DDP_WITH_CUDA_KERNELS
  // Steps 1-2: no fix-up; step 3: the unused layer is put back, which reads
  // no gradient; steps 4-5: it is stepped again on its own (it missed a
  // step), which reads its clipped gradient.
  if (ddp::compat::kHasFusedOptimizers) EXPECT_EQ(unclipped_left, 3) << "the kernel's store skipped, where nothing reads it";
#endif
}

TEST(FlatOptimizer, UnknownNameAndMismatchedBuffersAreErrors) {
  auto a = torch::zeros({3});
  EXPECT_THROW(ddp::FlatOptimizer({a}, {a.clone()}, ddp::FlatOptimizerOptions().name("lbfgs")), ddp::UserError);
  EXPECT_THROW(ddp::FlatOptimizer({a}, {torch::zeros({4})}, ddp::FlatOptimizerOptions()), c10::Error);
}

TEST(FlatOptimizer, StateRoundTripsThroughATensorMap) {
  auto p = torch::randn({10}), g = torch::randn({10});
  ddp::FlatOptimizer a({p}, {g}, ddp::FlatOptimizerOptions().name("adamw"));
  a.step();
  a.step();
  ddp::TensorMap state;
  a.save(state);
  auto p2 = p.clone(), g2 = g.clone();
  ddp::FlatOptimizer b({p2}, {g2}, ddp::FlatOptimizerOptions().name("adamw"));
  b.load(state);
  EXPECT_EQ(b.steps_taken(), 2);
  a.step();
  b.step();
  EXPECT_TRUE(torch::equal(p, p2));
  ddp::FlatOptimizer c({p2.clone()}, {g2.clone()}, ddp::FlatOptimizerOptions().name("sgd"));
  EXPECT_THROW(c.load(state), ddp::UserError);
}

// Adam's per-parameter step count (PyTorch's state["step"]): a layer left
// out of a step does not count it, and the counts survive a checkpoint.
TEST(FlatOptimizer, PerParameterStepCountsSkipUnusedStepsAndRoundTrip) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = ddp::testing::one_rank_world();
  auto run = [&](torch::nn::Sequential& net, ddp::GradSync& sync, ddp::FlatOptimizer& opt, bool use_second) {
    sync.zero_grad();
    auto h = net[0]->as<torch::nn::Linear>()->forward(torch::ones({2, 4}));
    if (use_second) h = net[1]->as<torch::nn::Linear>()->forward(h);
    h.sum().backward();
    sync.finish();
    opt.step();
  };
  torch::manual_seed(0);
  torch::nn::Sequential a(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  ddp::GradSync sync_a(*a, *world);
  ddp::FlatOptimizer opt_a(sync_a, ddp::FlatOptimizerOptions().name("adamw").weight_decay(0.1));
  for (bool use : {true, false, false, true}) run(a, sync_a, opt_a, use);
  EXPECT_EQ(opt_a.steps_taken(), 4);
  EXPECT_EQ(opt_a.parameter_steps(), (std::vector<int64_t>{4, 4, 2, 2}));
  ddp::TensorMap state;
  opt_a.save(state);

  torch::manual_seed(1);
  torch::nn::Sequential b(torch::nn::Linear(4, 4), torch::nn::Linear(4, 4));
  {
    torch::NoGradGuard no_grad;
    for (size_t i = 0; i < a->parameters().size(); ++i) b->parameters()[i].copy_(a->parameters()[i]);
  }
  ddp::GradSync sync_b(*b, *world);
  ddp::FlatOptimizer opt_b(sync_b, ddp::FlatOptimizerOptions().name("adamw").weight_decay(0.1));
  opt_b.load(state);
  EXPECT_EQ(opt_b.parameter_steps(), opt_a.parameter_steps());
  for (bool use : {true, false}) {
    run(a, sync_a, opt_a, use);
    run(b, sync_b, opt_b, use);
  }
  for (size_t i = 0; i < a->parameters().size(); ++i)
    EXPECT_TRUE(torch::equal(a->parameters()[i], b->parameters()[i])) << "parameter " << i;
}

// clip_grad_norm_ against what PyTorch 1.13 itself did to a small CNN's
// gradients (tools/gen_clip_grad_norm_testdata.py ->
// tests/testdata/clip_grad_norm.pt): the generator's Net, registered in the
// same order under the same names.
struct ClipNetImpl : torch::nn::Module {
  ClipNetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(1, 8, 3).padding(1).bias(false)));
    bn1 = register_module("bn1", torch::nn::BatchNorm2d(8));
    fc1 = register_module("fc1", torch::nn::Linear(8 * 8 * 8, 64));
    fc2 = register_module("fc2", torch::nn::Linear(64, 10));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::max_pool2d(torch::relu(bn1(conv1(x))), 2);
    return fc2(torch::relu(fc1(x.flatten(1))));
  }
  torch::nn::Conv2d conv1{nullptr};
  torch::nn::BatchNorm2d bn1{nullptr};
  torch::nn::Linear fc1{nullptr}, fc2{nullptr};
};
TORCH_MODULE(ClipNet);

struct ClipReference {
  std::map<std::string, torch::Tensor> t;
  int64_t steps = 0;
  double max_norm = 0;
  ClipReference() {
    for (auto& [k, v] : ddp::read_state_dict(DDP_TEST_DATA_DIR "/clip_grad_norm.pt")) t[k] = v;
    steps = t.at("coef").numel();
    max_norm = t.at("max_norm").item<double>();
  }
  const torch::Tensor& at(const std::string& key) const { return t.at(key); }
  void load_initial(ClipNet& net) const {
    torch::NoGradGuard no_grad;
    for (auto& item : net->named_parameters()) item.value().copy_(at("initial." + item.key()));
  }
};

// The fail-first test of issue 44 item 9: handed PyTorch's gradients,
// step() leaves exactly the gradients that clip_grad_norm_ left (its
// coefficient, bit for bit), not those of one norm over the flat buffer.
TEST(FlatOptimizer, ClipsBitForBitAsPyTorchsClipGradNorm) {
  DDP_SKIP_UNLESS_GLOO();
  const ClipReference ref;
  ClipNet net;
  auto world = ddp::testing::one_rank_world();
  ddp::GradSync sync(*net, *world);
  // lr 0: the step leaves the parameters and only clips.
  ddp::FlatOptimizer opt(sync, ddp::FlatOptimizerOptions().name("sgd").lr(0).momentum(0));
  int differing = 0;
  for (int64_t s = 0; s < ref.steps; ++s) {
    const auto coef = ref.at("coef")[s];
    ASSERT_LT(coef.item<float>(), 1.0f) << "step " << s << " must clip, or the test shows nothing";
    for (auto& item : net->named_parameters())
      item.value().mutable_grad().copy_(ref.at("grad." + std::to_string(s) + "." + item.key()));
    sync.finish();
    opt.step({}, ref.max_norm, ddp::GradientsAfterStep::kRead);
    bool same = true;
    for (auto& item : net->named_parameters()) {
      const auto want = ref.at("grad." + std::to_string(s) + "." + item.key()) * coef;
      same = same && torch::equal(item.value().grad(), want);
    }
    if (!same) {
      ++differing;
      ADD_FAILURE() << "step " << s << ": the clipped gradients differ from clip_grad_norm_'s (its total norm "
                    << ref.at("total_norm")[s].item<double>() << ")";
    }
    sync.zero_grad();
  }
  EXPECT_EQ(differing, 0);
}

// The generator's run through TrainStep on one rank: plain SGD with
// clipping gives PyTorch's losses and parameters.
TEST(TrainStep, ClippedSgdFollowsPyTorch) {
  DDP_SKIP_UNLESS_GLOO();
  const ClipReference ref;
  ClipNet net;
  ref.load_initial(net);
  class Task : public ddp::Task {
   public:
    explicit Task(ClipNet n) : net_(std::move(n)) {}
    ddp::StepOutput training_step(const ddp::data::Batch& b) override {
      return torch::nn::functional::cross_entropy(net_->forward(b.input()), b.target());
    }
    ddp::TensorMap validation_step(const ddp::data::Batch&) override { return {}; }

   private:
    ClipNet net_;
  } task(net);
  auto world = ddp::testing::one_rank_world();
  const double lr = 0.05;
  ddp::TrainStep step(task, *net, *world,
                      ddp::TrainStepOptions().clip_grad_norm(ref.max_norm).optimizer(
                          ddp::FlatOptimizerOptions().name("sgd").lr(lr).momentum(0)));
  double loss_diff = 0;
  for (int64_t s = 0; s < ref.steps; ++s) {
    auto out = step.run(ddp::data::Batch(ref.at("x." + std::to_string(s)), ref.at("y." + std::to_string(s))),
                        /*last_micro=*/true, lr);
    const double want = ref.at("loss")[s].item<double>();
    loss_diff = std::max(loss_diff, std::abs(out.loss.item<double>() - want) / want);
  }
  double param_diff = 0;
  for (auto& item : net->named_parameters())
    param_diff = std::max(param_diff, (item.value().detach() - ref.at("final." + item.key())).abs().max().item<double>());
  RecordProperty("max_rel_loss_diff", c10::str(loss_diff));
  RecordProperty("max_abs_param_diff", c10::str(param_diff));
  EXPECT_LE(loss_diff, 1e-6);
  EXPECT_LE(param_diff, 1e-6);
}

// Issue 44 item 3: the flat optimizer's state across a change of
// --channels-last. A two-layer CNN (convolution weights of 6 and 8 input
// channels, whose memory order differs between the formats) trains 3 steps
// of AdamW in one format, is saved as a checkpoint, and resumes for 3 more
// in the other; the result is set against a straight 6-step run in the
// second format.
struct LayoutNetImpl : torch::nn::Module {
  LayoutNetImpl() {
    conv1 = register_module("conv1", torch::nn::Conv2d(torch::nn::Conv2dOptions(2, 6, 3).padding(1)));
    conv2 = register_module("conv2", torch::nn::Conv2d(torch::nn::Conv2dOptions(6, 8, 3).padding(1)));
    fc = register_module("fc", torch::nn::Linear(8, 4));
  }
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(conv2(torch::relu(conv1(x))));
    return fc(x.mean({2, 3}));
  }
  torch::nn::Conv2d conv1{nullptr}, conv2{nullptr};
  torch::nn::Linear fc{nullptr};
};
TORCH_MODULE(LayoutNet);

class LayoutTask : public ddp::Task {
 public:
  explicit LayoutTask(LayoutNet n) : net_(std::move(n)) {}
  ddp::StepOutput training_step(const ddp::data::Batch& b) override {
    return torch::nn::functional::cross_entropy(net_->forward(b.input()), b.target());
  }
  ddp::TensorMap validation_step(const ddp::data::Batch&) override { return {}; }

 private:
  LayoutNet net_;
};

// A ddptrain from before the state recorded its layout: no "layout"
// entry, and the moments as the flat buffers hold them in memory
// (channels-last slices for the 4-D weights where the writer ran so).
struct WithoutLayout : ddp::Stateful {
  WithoutLayout(const ddp::Stateful& s, const ddp::GradSync& g) : inner(s), sync(g) {}
  void save(ddp::TensorMap& state) const override {
    inner.save(state);
    state.erase("layout");
    if (!sync.options().channels_last()) return;
    for (auto& [key, t] : state) {
      if (key.rfind("m/", 0) != 0 && key.rfind("v/", 0) != 0) continue;
      const size_t k = std::stoul(key.substr(2));
      auto raw = t.clone();
      for (size_t i = 0; i < sync.param_slices().size(); ++i) {
        if (sync.param_slices()[i].flat != k) continue;
        auto dst = sync.param_view(raw, i, true);
        if (dst.dim() == 4) dst.copy_(sync.param_view(t, i, false));
      }
      t = raw;
    }
  }
  void load(const ddp::TensorMap&) override {}
  const ddp::Stateful& inner;
  const ddp::GradSync& sync;
};

struct LayoutRun {
  LayoutNet net;
  LayoutTask task;
  std::unique_ptr<ddp::World> world;
  std::unique_ptr<ddp::TrainStep> step;
  explicit LayoutRun(bool channels_last) : net((torch::manual_seed(3), LayoutNet())), task(net), world(ddp::testing::one_rank_world()) {
    step = std::make_unique<ddp::TrainStep>(
        task, *net, *world,
        ddp::TrainStepOptions().channels_last(channels_last).optimizer(ddp::FlatOptimizerOptions().name("adamw").lr(0.01)));
  }
  void train(int from, int to) {
    for (int s = from; s < to; ++s) {
      auto g = torch::Generator(at::detail::createCPUGenerator(100 + s));
      auto x = torch::randn({8, 2, 6, 6}, g);
      auto y = torch::randint(0, 4, {8}, g);
      step->run(ddp::data::Batch(x, y), /*last_micro=*/true, 0.01);
    }
  }
};

// The largest difference of conv2's weight between a run resumed from the
// first format into the second and a straight run in the second.
// `writer_flag`: the --channels-last that the checkpoint's header records;
// `old_writer`: the state is written without its layout, as before.
double resumed_against_straight(bool first, bool then, const std::string& writer_flag = "", bool old_writer = false) {
  const std::string path = ddp::testing::temp_dir("layout_resume") + "/epoch_1.pt";
  {
    LayoutRun a(first);
    a.train(0, 3);
    ddp::CheckpointMeta meta;
    meta.config = {{"channels-last", writer_flag.empty() ? (first ? "on" : "off") : writer_flag}};
    WithoutLayout old(*a.step, a.step->sync());
    ddp::save_checkpoint(path, *a.net, old_writer ? static_cast<const ddp::Stateful*>(&old) : a.step.get(), meta);
  }
  LayoutRun b(then);
  ddp::load_checkpoint(path, *b.net, b.step.get(), torch::kCPU, "");
  b.train(3, 6);
  LayoutRun straight(then);
  straight.train(0, 6);
  return (b.net->conv2->weight - straight.net->conv2->weight).abs().max().item<double>();
}

TEST(FlatOptimizer, StateResumesAcrossChannelsLastOnToOff) {
  DDP_SKIP_UNLESS_GLOO();
  const double diff = resumed_against_straight(true, false);
  RecordProperty("max_abs_diff", c10::str(diff));
  EXPECT_LE(diff, 1e-5) << "conv2.weight after resuming a channels-last run without it";
}

TEST(FlatOptimizer, StateResumesAcrossChannelsLastOffToOn) {
  DDP_SKIP_UNLESS_GLOO();
  const double diff = resumed_against_straight(false, true);
  RecordProperty("max_abs_diff", c10::str(diff));
  EXPECT_LE(diff, 1e-5) << "conv2.weight after resuming a contiguous run with channels-last";
}

// Checkpoints of an older ddptrain hold the state in the writer's format,
// which its header tells (--channels-last on, or auto on a GPU): read both
// ways; and the control: the same run without the switch, so the bound
// above is one that a scrambled state breaks.
TEST(FlatOptimizer, StateOfOlderCheckpointsResumesInTheWritersFormat) {
  DDP_SKIP_UNLESS_GLOO();
  EXPECT_LE(resumed_against_straight(true, false, "on", /*old_writer=*/true), 1e-5);
  EXPECT_LE(resumed_against_straight(false, true, "off", /*old_writer=*/true), 1e-5);
  EXPECT_LE(resumed_against_straight(false, true, "auto", /*old_writer=*/true), 1e-5) << "auto on a CPU: contiguous";
  EXPECT_LE(resumed_against_straight(true, true), 1e-5);
  EXPECT_GT(resumed_against_straight(true, false, "off", /*old_writer=*/true), 1e-4)
      << "a header that names the wrong format must scramble the state, or these tests show nothing";
}

}  // namespace
