// ddp_testworker: the program multi-process tests start through the real
// launcher. `ddp_testworker --launch N SCENARIO OUTDIR [ARGS...]` spawns N
// ranks of itself with ddp::launch_workers; each rank joins a real Gloo group
// over TCP loopback and runs SCENARIO, writing its results under OUTDIR.
#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <limits>
#include <thread>

#include <unistd.h>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/dist/grad_sync.h"
#include "ddp/dist/param_slots.h"
#include "ddp/dist/signals.h"
#include "ddp/dist/launch.h"
#include "ddp/dist/signals.h"
#include "ddp/dist/sync_batchnorm.h"
#include "ddp/dist/world.h"
#include "ddp/models/recompute.h"
#include "ddp/train/flat_optimizer.h"
#include "ddp/train/lm_task.h"
#include "ddp/train/train_step.h"
#include "ddp/app.h"
#include "ddp/train/trainer.h"
#include "support/counting_allocator.h"
#include "two_inputs/task.h"

namespace {

using namespace ddp;

// Conv -> BatchNorm -> ReLU -> pool -> Linear: small, but it exercises every
// path of SyncBatchNorm and gradient sync.
struct TinyNetImpl : torch::nn::Module {
  TinyNetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)))),
        bn(register_module("bn", BatchNorm2d(4))),
        fc(register_module("fc", torch::nn::Linear(64, 3))) {}
  torch::Tensor forward(torch::Tensor x) {
    x = torch::relu(bn(conv(x)));
    x = torch::avg_pool2d(x, 2).flatten(1);
    return fc(x);
  }
  torch::nn::Conv2d conv;
  BatchNorm bn;
  torch::nn::Linear fc;
};
TORCH_MODULE(TinyNet);

torch::Tensor flat_state(torch::nn::Module& m) {
  std::vector<torch::Tensor> parts;
  for (auto& p : m.parameters()) parts.push_back(p.detach().flatten().to(torch::kDouble));
  for (auto& b : m.buffers()) parts.push_back(b.detach().flatten().to(torch::kDouble));
  return torch::cat(parts);
}

void save(const torch::Tensor& t, const std::string& path) { torch::save(t, path); }

// 5 SGD steps on a global batch of 16 per step, split into `accum`
// micro-batches, each micro-batch split evenly across ranks.
void equivalence(World& world, const std::string& out, int accum, bool sync_bn) {
  torch::manual_seed(100 + world.rank());  // different on purpose: the broadcast must fix it
  TinyNet net;
  if (sync_bn) convert_sync_batchnorm(*net, world);
  GradSync sync(*net, world);
  torch::optim::SGD opt(net->parameters(), torch::optim::SGDOptions(0.1).momentum(0.9));
  const int64_t G = 16, W = world.size(), micro = G / accum, per_rank = micro / W;
  for (int step = 0; step < 5; ++step) {
    torch::manual_seed(1234 + step);
    auto x = torch::randn({G, 3, 8, 8}) * 2 + 0.5;
    auto y = torch::randint(0, 3, {G}, torch::kLong);
    sync.zero_grad();
    for (int m = 0; m < accum; ++m) {
      const int64_t start = m * micro + world.rank() * per_rank;
      auto xb = x.narrow(0, start, per_rank), yb = y.narrow(0, start, per_rank);
      auto run = [&] {
        auto loss = torch::nll_loss(torch::log_softmax(net->forward(xb), 1), yb) / accum;
        loss.backward();
      };
      if (m + 1 < accum) {
        auto guard = sync.no_sync();
        run();
      } else {
        run();
      }
    }
    sync.finish();
    opt.step();
  }
  save(flat_state(*net), out + "/state_rank" + std::to_string(world.rank()) + ".pt");
}

struct DeepLinearImpl : torch::nn::Module {
  DeepLinearImpl() {
    for (int i = 0; i < 6; ++i) layers.push_back(register_module("l" + std::to_string(i), torch::nn::Linear(64, 64)));
  }
  torch::Tensor forward(torch::Tensor x) {
    for (auto& l : layers) x = torch::tanh(recompute ? ddp::recompute(l, x) : l(x));
    return x;
  }
  std::vector<torch::nn::Linear> layers;
  bool recompute = false;  // each layer under ddp::recompute
};
TORCH_MODULE(DeepLinear);

// (ARGS: "recompute" to run each layer under ddp::recompute.)
void overlap(World& world, const std::string& out, bool recompute) {
  DeepLinear net;
  net->recompute = recompute;
  GradSync sync(*net, world, GradSyncOptions().bucket_cap_mb(0.01));
  sync.zero_grad();
  net->forward(torch::randn({32, 64})).sum().backward();
  const size_t during = sync.launched_during_backward();
  sync.finish();
  std::FILE* f = std::fopen((out + "/overlap_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%zu %zu\n", during, sync.num_buckets());
  std::fclose(f);
}

// Issue 44 item 6: a branch that runs only where the rank's batch asks for
// it ("branch" flags: the first half of the global batch, rank 0's), with
// SyncBatchNorm, one parameter per bucket, through TrainStep. Rank 0's
// backward reaches the branch's buckets before SyncBatchNorm's all-reduce;
// rank 1's never reaches them. 3 SGD steps on a global batch of 16.
struct BranchNetImpl : torch::nn::Module {
  BranchNetImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)))),
        bn(register_module("bn", BatchNorm2d(4))),
        fc(register_module("fc", torch::nn::Linear(64, 3))),
        branch(register_module("branch", torch::nn::Linear(64, 3))) {}
  torch::nn::Conv2d conv;
  BatchNorm bn;
  torch::nn::Linear fc, branch;
};
TORCH_MODULE(BranchNet);

class BranchTask : public Task {
 public:
  explicit BranchTask(BranchNet net) : net_(std::move(net)) {}
  StepOutput training_step(const data::Batch& b) override {
    auto h = torch::avg_pool2d(torch::relu(net_->bn(net_->conv(b.input()))), 2).flatten(1);
    auto out = net_->fc(h);
    const auto& flags = b.at("branch");
    if (flags.any().item<bool>()) out = out + net_->branch(h) * flags.unsqueeze(1);
    return torch::nll_loss(torch::log_softmax(out, 1), b.target());
  }
  TensorMap validation_step(const data::Batch&) override { return {}; }

 private:
  BranchNet net_;
};

void syncbn_branch(World& world, const std::string& out) {
  torch::manual_seed(100);
  BranchNet net;
  convert_sync_batchnorm(*net, world);
  BranchTask task(net);
  TrainStep step(task, *net, world,
                 TrainStepOptions().bucket_cap_mb(0.0001).optimizer(FlatOptimizerOptions().name("sgd").lr(0.1).momentum(0.9)));
  const int64_t G = 16, per_rank = G / world.size(), start = world.rank() * per_rank;
  for (int s = 0; s < 3; ++s) {
    torch::manual_seed(1234 + s);
    auto x = torch::randn({G, 3, 8, 8}) * 2 + 0.5;
    auto y = torch::randint(0, 3, {G}, torch::kLong);
    auto flags = (torch::arange(G) < G / 2).to(torch::kFloat);
    data::Batch b{{"input", x.narrow(0, start, per_rank)},
                  {"target", y.narrow(0, start, per_rank)},
                  {"branch", flags.narrow(0, start, per_rank)}};
    step.run(b, /*last_micro=*/true, 0.1);
  }
  save(flat_state(*net), out + "/state_rank" + std::to_string(world.rank()) + ".pt");
}

// fc2 is never used; fc1 only on rank 0. Nothing may hang, and the gradients
// must agree across ranks (the unused ones contribute zeros).
struct TwoHeadsImpl : torch::nn::Module {
  TwoHeadsImpl()
      : fc0(register_module("fc0", torch::nn::Linear(4, 4))),
        fc1(register_module("fc1", torch::nn::Linear(4, 4))),
        fc2(register_module("fc2", torch::nn::Linear(4, 4))) {}
  torch::nn::Linear fc0, fc1, fc2;
};
TORCH_MODULE(TwoHeads);

void unused(World& world, const std::string& out) {
  torch::manual_seed(7);
  TwoHeads net;
  GradSync sync(*net, world, GradSyncOptions().bucket_cap_mb(0.0001));
  for (int step = 0; step < 3; ++step) {
    sync.zero_grad();
    auto h = net->fc0(torch::ones({2, 4}));
    if (world.rank() == 0) h = net->fc1(h);
    h.sum().backward();
    sync.finish();
  }
  std::vector<torch::Tensor> g;
  for (auto& p : net->parameters()) g.push_back(p.grad().flatten().to(torch::kDouble));
  save(torch::cat(g), out + "/grads_rank" + std::to_string(world.rank()) + ".pt");
}

// Parameters of uneven sizes (35, 5, 15, 13, 3 elements; the last unused
// on rank 1) in buckets of one parameter each, so that the ranks' parts of
// the flat buffer start inside buckets. Each gradient is an integer
// pattern of the rank, so every sum is exact: over its part, each rank's
// reduce-scattered gradients must equal the all-reduced ones bit for bit,
// and the used flags must agree, in each of 3 steps (gradients set to none
// in between, so that the values a reduce leaves outside a rank's part
// must not leak into the next step). Writes "max_diff flags_equal".
struct Uneven : torch::nn::Module {
  std::vector<torch::Tensor> p;
  Uneven() {
    const std::vector<std::vector<int64_t>> shapes{{7, 5}, {5}, {3, 5}, {13}, {3}};
    for (size_t i = 0; i < shapes.size(); ++i)
      p.push_back(register_parameter("p" + std::to_string(i), torch::zeros(shapes[i])));
  }
};

void reduce_scatter(World& world, const std::string& out) {
  // Whole gradients (the reference); reduce-scattered; ZeRO-2 over an
  // all-reduce (keeping the norms); ZeRO-2 reduce-scattered.
  Uneven whole, parts, zero2, zero2_rs;
  for (auto* m : {&whole, &parts, &zero2, &zero2_rs}) m->to(world.device());
  const auto o = GradSyncOptions().bucket_cap_mb(0.0001);
  GradSync ar(whole, world, o);
  GradSync rs(parts, world, GradSyncOptions(o).reduction(GradientReduction::kReduceScatter));
  GradSync z2(zero2, world, GradSyncOptions(o).shard_gradients(true).gradient_norms(true));
  GradSync z2rs(zero2_rs, world, GradSyncOptions(o).shard_gradients(true).reduction(GradientReduction::kReduceScatter));
  TORCH_CHECK(rs.gradients_sharded() && !ar.gradients_sharded() && rs.num_buckets() == 5,
              "expected 5 buckets, reduce-scattered in one GradSync only");
  TORCH_CHECK(z2.gradient_storage_sharded() && z2rs.gradient_storage_sharded() && !rs.gradient_storage_sharded(),
              "expected ZeRO-2 storage in two GradSyncs");
  double max_diff = 0;
  bool flags_equal = true, grads_none = true;
  for (int step = 0; step < 3; ++step) {
    for (auto* m : {&whole, &parts, &zero2, &zero2_rs}) {
      auto& sync = m == &whole ? ar : m == &parts ? rs : m == &zero2 ? z2 : z2rs;
      sync.zero_grad(/*set_to_none=*/true);
      torch::Tensor loss = torch::zeros({}, world.device());
      for (size_t i = 0; i < m->p.size(); ++i) {
        if (i == 4 && world.rank() == 1) continue;
        const auto n = m->p[i].numel();
        auto w = (torch::arange(n, m->p[i].options()) + 1 + 100 * world.rank() + 10 * step).view_as(m->p[i]);
        loss = loss + (m->p[i] * w).sum();
      }
      loss.backward();
      sync.finish();
    }
    for (size_t k = 0; k < ar.flat_grads().size(); ++k) {
      const auto part = shard_range(ar.flat_grads()[k].numel(), world.size(), world.rank());
      const auto want = ar.flat_grads()[k].narrow(0, part.lo, part.len);
      for (auto* sync : {&rs, &z2, &z2rs}) {
        TORCH_CHECK(sync->owned_gradients(k).numel() == part.len, "owned_gradients is not this rank's part");
        if (part.len > 0) max_diff = std::max(max_diff, (sync->owned_gradients(k) - want).abs().max().item<double>());
      }
    }
    // ZeRO-2 over an all-reduce keeps each parameter's norm as the whole gradient's.
    std::vector<torch::Tensor> slices;
    for (const auto& s : ar.param_slices()) slices.push_back(ar.flat_grads()[s.flat].narrow(0, s.offset, s.numel));
    const auto norms = compat::per_tensor_norms(slices);
    TORCH_CHECK(z2.gradient_norms().size() == norms.size() && z2rs.gradient_norms().empty(), "norms kept where asked");
    for (size_t i = 0; i < norms.size(); ++i)
      max_diff = std::max(max_diff, (z2.gradient_norms()[i] - norms[i]).abs().item<double>());
    for (auto* sync : {&rs, &z2, &z2rs})
      // Every parameter is used on some rank (the last on rank 0 only). The
      // all-reduced flags are averaged with their bucket, the others not.
      flags_equal = flags_equal && torch::equal(ar.usage().used_anywhere > 0, sync->usage().used_anywhere > 0) &&
                    (sync->usage().used_anywhere > 0).all().item<bool>();
    for (auto& p : zero2.p) grads_none = grads_none && !p.grad().defined();
  }
  std::FILE* f = std::fopen((out + "/rs_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%g %d\n", max_diff, flags_equal && grads_none ? 1 : 0);
  // Gradient bytes: ZeRO-2's own, the unsharded run's, the most in buckets at once, the largest bucket.
  std::fprintf(f, "%lld %lld %lld %lld\n", static_cast<long long>(z2.gradient_bytes()),
               static_cast<long long>(ar.gradient_bytes()), static_cast<long long>(z2.peak_bucket_bytes()),
               static_cast<long long>(64 * sizeof(float)));
  std::fclose(f);
}

// ZeRO-1 ("zero1") or ZeRO-2 ("zero2") on a stack of 32 Linear(128, 128)
// layers (2.1 MB of fp32 parameters), SGD, buckets of one layer (66 KB):
// the CPU allocator's bytes live once the step is made, and at most over 3
// steps on batches of 4 (activations are small), above what was live
// before the model. Writes "live peak".
struct Stack : Net {
  torch::nn::Sequential layers;
  Stack() {
    for (int i = 0; i < 32; ++i) layers->push_back(torch::nn::Linear(128, 128));
    register_module("layers", layers);
  }
  torch::Tensor forward(torch::Tensor x) override { return layers->forward(x); }
};

void zero_memory(World& world, const std::string& out, const std::string& stage) {
  const auto& alloc = ddp::testing::counting_allocator();
  const int64_t before = alloc.live();
  int64_t live = 0, peak = 0;
  {
    torch::manual_seed(3);
    auto net = std::make_shared<Stack>();
    TrainStep step(*net, world,
                   TrainStepOptions()
                       .bucket_cap_mb(0.07)
                       .shard_optimizer(true)
                       .shard_gradients(stage == "zero2")
                       .optimizer(FlatOptimizerOptions().name("sgd").lr(0.01).momentum(0.9))
                       .loss(LossOptions().kind("mse")));
    live = alloc.live() - before;
    alloc.reset_peak();
    for (int s = 0; s < 3; ++s) {
      torch::manual_seed(10 * s + world.rank());
      step.run(torch::randn({4, 128}), torch::randn({4, 128}), /*last_micro=*/true, 0.01);
    }
    peak = alloc.peak() - before;
  }
  std::FILE* f = std::fopen((out + "/mem_" + stage + "_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%lld %lld\n", static_cast<long long>(live), static_cast<long long>(peak));
  std::fclose(f);
}

// fc0 is frozen, fc1 trains, fc2 gets no gradient on any rank; AdamW with
// weight decay. PyTorch leaves fc0 and fc2 untouched (their .grad is None).
void frozen(World& world, const std::string& out) {
  torch::manual_seed(7);
  TwoHeads net;
  for (auto& p : net->fc0->parameters()) p.set_requires_grad(false);
  auto copy = [](torch::nn::Module& m) {
    std::vector<torch::Tensor> v;
    for (auto& p : m.parameters()) v.push_back(p.detach().clone());
    return v;
  };
  GradSync sync(*net, world);
  const auto fc0 = copy(*net->fc0), fc2 = copy(*net->fc2);
  FlatOptimizer opt(sync, FlatOptimizerOptions().name("adamw").lr(0.1).weight_decay(0.1));
  for (int step = 0; step < 3; ++step) {
    sync.zero_grad();
    net->fc1(net->fc0(torch::ones({2, 4}))).sum().backward();
    sync.finish();
    opt.step();
  }
  auto changed = [](const std::vector<torch::Tensor>& before, torch::nn::Module& m) {
    const auto now = m.parameters();
    bool any = false;
    for (size_t i = 0; i < now.size(); ++i) any = any || !torch::equal(before[i], now[i].detach());
    return any;
  };
  std::FILE* f = std::fopen((out + "/frozen_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%d %d\n", changed(fc0, *net->fc0) ? 1 : 0, changed(fc2, *net->fc2) ? 1 : 0);
  std::fclose(f);
}

// The model of tools/gen_unused_params_testdata.py: a trunk, a head, a
// branch that the task uses on some steps only, and a late layer first used
// at step 3.
struct BranchyImpl : torch::nn::Module {
  BranchyImpl()
      : fc0(register_module("fc0", torch::nn::Linear(3, 4))),
        head(register_module("head", torch::nn::Linear(4, 2))),
        branch(register_module("branch", torch::nn::Linear(4, 2))),
        late(register_module("late", torch::nn::Linear(4, 2))) {}
  torch::nn::Linear fc0, head, branch, late;
};
TORCH_MODULE(Branchy);

class BranchyTask : public Task {
 public:
  // With `recompute`, the trunk and both optional branches run under
  // ddp::recompute (models/recompute.h): the same values and gradients.
  BranchyTask(Branchy net, std::vector<int> branch_steps, std::vector<int> late_steps, bool recompute = false)
      : net_(std::move(net)), branch_(std::move(branch_steps)), late_(std::move(late_steps)), recompute_(recompute) {}
  StepOutput training_step(const data::Batch& b) override {
    auto uses = [this](const std::vector<int>& steps) { return std::count(steps.begin(), steps.end(), step_) > 0; };
    auto layer = [this](torch::nn::Linear l, const torch::Tensor& x) {
      return recompute_ ? ddp::recompute(l, x) : l->forward(x);
    };
    auto trunk = [this](const std::vector<torch::Tensor>& in) {
      return std::vector<torch::Tensor>{torch::tanh(net_->fc0(in[0]))};
    };
    auto h = recompute_ ? ddp::recompute(trunk, {b.input()}, net_->fc0->parameters())[0] : trunk({b.input()})[0];
    auto y = net_->head(h);
    if (uses(branch_)) y = y + layer(net_->branch, h);
    if (uses(late_)) y = y + layer(net_->late, h);
    ++step_;
    return torch::mse_loss(y, b.target());
  }
  TensorMap validation_step(const data::Batch&) override { return {}; }

 private:
  Branchy net_;
  std::vector<int> branch_, late_;
  bool recompute_ = false;
  int step_ = 0;
};

// PyTorch's reference run (ARGS: the JSON file, the optimizer, and
// "recompute" to run parts of the model under ddp::recompute, or "shard"
// for the optimizer state sharded over the ranks): each rank
// trains the Branchy model through TrainStep on its own batches and writes
// its final parameters, in state_dict order.
void unused_reference(World& world, const std::string& out, const std::string& json_path, const std::string& name,
                      const std::string& variant) {
  const bool recompute = variant == "recompute";
  std::ifstream in(json_path);
  check_user(in.good(), "cannot read " + json_path + ".", "pass tests/testdata/unused_params.json.");
  const auto data = nlohmann::json::parse(in);
  const int rank = world.rank();
  auto tensor = [](const nlohmann::json& values) { return torch::tensor(values.get<std::vector<float>>()); };
  Branchy net;
  {
    torch::NoGradGuard no_grad;
    for (auto& item : net->named_parameters())
      item.value().copy_(tensor(data["initial"][item.key()]).view_as(item.value()));
  }
  net->to(world.device());
  BranchyTask task(net, data["branch_steps"][rank].get<std::vector<int>>(),
                   data["late_steps"][rank].get<std::vector<int>>(), recompute);
  const auto& o = data["optimizers"][name];
  auto opt = FlatOptimizerOptions().name(name).lr(o["lr"].get<double>()).weight_decay(o["weight_decay"].get<double>());
  if (o.contains("momentum")) opt.momentum(o["momentum"].get<double>());
  // "shard-rs": the gradients reduce-scattered even where the backend has
  // no reduce_scatter (Gloo: one reduce per rank's part); "shard-grads":
  // ZeRO-2.
  TrainStep step(task, *net, world,
                 TrainStepOptions()
                     .optimizer(opt)
                     .shard_optimizer(variant == "shard" || variant == "shard-rs")
                     .shard_gradients(variant == "shard-grads")
                     .gradient_reduction(variant == "shard-rs" ? GradientReduction::kReduceScatter
                                                               : GradientReduction::kAuto));
  for (const auto& xy : data["batches"][rank]) {
    auto x = tensor(xy[0]).view({-1, 3}).to(world.device()), y = tensor(xy[1]).view({-1, 2}).to(world.device());
    step.run(data::Batch(x, y), /*last_micro=*/true, opt.lr());
  }
  step.wait_for_parameters();  // "shard": the last step's gather
  save(flat_state(*net).cpu(), out + "/params_rank" + std::to_string(rank) + ".pt");
}

// ZeRO-1's asynchronous parameter gather (ARGS: none): a sharded and an
// unsharded TrainStep of the same model (AdamW, biases in a flat buffer of
// their own; 3 ranks cut both buffers unevenly) train on the same batches
// in one process. After each run() the sharded step's gather is pending
// (waited for by nobody yet), a checkpoint of it is refused, and once
// waited for, by each of the readers in turn, its parameters are the
// unsharded step's bit for bit; no forward begins with it pending. Writes
// "pending refused equal waited buffers forwards_saw_pending" per rank:
// the counts over the steps, and buffers waited for.
struct UnevenNet : Net {
  torch::nn::Linear a{5, 7}, b{7, 3};
  UnevenNet() {
    register_module("a", a);
    register_module("b", b);
  }
  torch::Tensor forward(torch::Tensor x) override { return b(torch::tanh(a(x))); }
};

// Trains an UnevenNet, and counts the forwards that began with the
// sharded optimizer's gather (`watch`) still pending.
struct WatchingTask : Task {
  UnevenNet& net;
  const FlatOptimizer* watch = nullptr;
  int forwards_saw_pending = 0;
  explicit WatchingTask(UnevenNet& n) : net(n) {}
  StepOutput training_step(const data::Batch& b) override {
    if (watch && watch->parameters_pending()) ++forwards_saw_pending;
    return torch::mse_loss(net.forward(b.input()), b.target());
  }
  TensorMap validation_step(const data::Batch&) override { return {}; }
};

void zero_async(World& world, const std::string& out) {
  auto make = [&](bool sharded, std::shared_ptr<UnevenNet>& net, std::unique_ptr<WatchingTask>& task) {
    torch::manual_seed(11);
    net = std::make_shared<UnevenNet>();
    task = std::make_unique<WatchingTask>(*net);
    return std::make_unique<TrainStep>(
        *task, *net, world,
        TrainStepOptions()
            .shard_optimizer(sharded)
            .optimizer(FlatOptimizerOptions().name("adamw").lr(0.05).weight_decay(0.1).no_decay_1d(true)));
  };
  std::shared_ptr<UnevenNet> plain_net, sharded_net;
  std::unique_ptr<WatchingTask> plain_task, sharded_task;
  auto plain = make(false, plain_net, plain_task);
  auto sharded = make(true, sharded_net, sharded_task);
  sharded_task->watch = &sharded->optimizer();
  auto params = [](TrainStep& s) { return torch::cat(s.sync().flat_params()).clone(); };
  int pending = 0, refused = 0, equal = 0;
  const int steps = 5;
  for (int s = 0; s < steps; ++s) {
    torch::manual_seed(100 * s + world.rank());
    auto x = torch::randn({6, 5}), y = torch::randn({6, 3});
    plain->run(x, y, /*last_micro=*/true, 0.05);
    sharded->run(x, y, /*last_micro=*/true, 0.05);  // waits for the last step's gather before its forward
    pending += sharded->optimizer().parameters_pending() ? 1 : 0;
    TensorMap state;
    try {
      sharded->save(state);
    } catch (const c10::Error& e) {
      refused += std::string(e.what()).find("still being gathered") != std::string::npos ? 1 : 0;
    }
    // The readers that wait: wait_for_parameters() itself, a checkpoint's
    // gather of the state, and the next run() (checked by the task).
    if (s % 3 == 0) sharded->wait_for_parameters();
    else if (s % 3 == 1) sharded->gather_optimizer_state();
    else continue;
    equal += torch::equal(params(*plain), params(*sharded)) ? 1 : 0;
  }
  sharded->wait_for_parameters();
  equal += torch::equal(params(*plain), params(*sharded)) ? 1 : 0;
  std::FILE* f = std::fopen((out + "/zero_async_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%d %d %d %lld %zu %d\n", pending, refused, equal,
               static_cast<long long>(sharded->optimizer().buffers_waited()), sharded->sync().flat_params().size(),
               sharded_task->forwards_saw_pending);
  std::fclose(f);
}

// ddptrain's GPT under LmTask with a sharded optimizer (ARGS: none): its
// forward waits for the gather part by part (TrainStep::wait_by_part).
// A sharded and an unsharded step train the same 3-block GPT on the same
// batches (6 steps; after the odd ones the gather is waited for and the
// weights compared, the even ones leave it to the next forward); the
// sharded one's GptImpl::before_part is wrapped to record,
// after each part's wait, the gather's pieces still pending. Writes
// "equal forwards in_order first_block_left last_left" per rank: steps
// whose waited-for parameters equal the unsharded run's, forwards that
// began with a gather pending, those whose gather was started part by
// part in the forward's order and whose parts were waited for in the order
// -1, 0, 1, 2, 3, each taking its own pieces only (those of later parts
// all still pending after it) with fewer pending after each, the fewest pieces
// left pending after block 0's wait over those forwards, and the most left
// after the last part's.
void zero_gpt_parts(World& world, const std::string& out) {
  const auto o = models::GptOptions().n_layer(3).n_head(2).n_embd(16).block_size(8).vocab_size(32);
  auto make = [&](bool sharded, LmTask& task) {
    torch::manual_seed(5);
    auto model = task.make_gpt(o, "bytes");
    return std::make_unique<TrainStep>(task, *model, world,
                                       TrainStepOptions().shard_optimizer(sharded).optimizer(
                                           FlatOptimizerOptions().name("adamw").lr(0.01).weight_decay(0.1)));
  };
  LmTask plain_task, sharded_task;
  auto plain = make(false, plain_task);
  auto sharded = make(true, sharded_task);
  auto& gpt = *sharded_task.gpt();
  const auto installed = gpt.before_part;
  if (!installed) throw std::runtime_error("TrainStep installed no per-part wait on the GPT");
  std::vector<std::pair<int64_t, int64_t>> seen;  // (part, pieces pending after its wait)
  const auto& opt = sharded->optimizer();
  bool exact = true;  // each part's wait took its own pieces: those of later parts all still pending
  gpt.before_part = [&](int64_t part) {
    installed(part);
    seen.emplace_back(part, opt.pieces_pending());
    const auto pending = opt.pending_parts();
    const auto& started = opt.started_parts();
    const auto later = std::count_if(started.begin(), started.end(), [&](int64_t p) { return p > part; });
    exact = exact && static_cast<int64_t>(pending.size()) == later &&
            std::all_of(pending.begin(), pending.end(), [&](int64_t p) { return p > part; });
  };
  int equal = 0, forwards = 0, in_order = 0;
  int64_t first_block_left = std::numeric_limits<int64_t>::max(), last_left = 0;
  for (int s = 0; s < 6; ++s) {
    torch::manual_seed(100 * s + world.rank());
    data::Batch b{{"input", torch::randint(0, 32, {4, 8}, torch::kLong)}, {"target", torch::randint(0, 32, {4, 8}, torch::kLong)}};
    plain->run(b, /*last_micro=*/true, 0.01);
    const bool was_pending = opt.parameters_pending();
    seen.clear();
    exact = true;
    // The gather in flight was started part by part, in the forward's order.
    const auto& started = opt.started_parts();
    const bool started_in_order = std::is_sorted(started.begin(), started.end()) && !started.empty() &&
                                  started.front() == -1 && started.back() == 3;
    sharded->run(b, /*last_micro=*/true, 0.01);
    if (was_pending) {
      ++forwards;
      bool ok = seen.size() == 5 && exact && started_in_order;
      for (size_t i = 0; ok && i < seen.size(); ++i) {
        ok = seen[i].first == static_cast<int64_t>(i) - 1 && (i == 0 || seen[i].second < seen[i - 1].second);
      }
      in_order += ok ? 1 : 0;
      if (seen.size() == 5) {
        first_block_left = std::min(first_block_left, seen[1].second);
        last_left = std::max(last_left, seen[4].second);
      }
    }
    if (s % 2 == 0) continue;  // the next forward begins with this step's gather pending
    sharded->wait_for_parameters();
    equal += torch::equal(torch::cat(plain->sync().flat_params()), torch::cat(sharded->sync().flat_params())) ? 1 : 0;
  }
  std::FILE* f = std::fopen((out + "/gpt_parts_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%d %d %d %lld %lld\n", equal, forwards, in_order, static_cast<long long>(first_block_left),
               static_cast<long long>(last_left));
  std::fclose(f);
}

// A rank that never joins the gather (ARGS: "stall" or "throw"): rank 0's
// step() returns with its gather pending, and its wait fails, naming the
// gather, instead of hanging. Rank 0 writes "returned" before it waits.
void zero_gather_dead(World& world, const std::string& out, const std::string& how) {
  torch::manual_seed(3);
  auto p = torch::randn({10}), g = torch::randn({10});
  FlatOptimizer opt({p}, {g}, FlatOptimizerOptions().name("sgd").lr(0.1).shard_over(&world));
  if (world.rank() == 1) {
    if (how == "stall") std::this_thread::sleep_for(std::chrono::hours(1));
    throw std::runtime_error("injected failure on rank 1 before the gather");
  }
  opt.step();
  std::FILE* f = std::fopen((out + "/returned").c_str(), "w");
  std::fprintf(f, "%d\n", opt.parameters_pending() ? 1 : 0);
  std::fclose(f);
  opt.wait_for_parameters();
}

// Ranks hold 5 and 11 samples: the forward output, the input gradient and
// the running statistics must equal plain batch norm over all 16 samples,
// which every rank can compute itself as the reference.
void syncbn_unequal(World& world, const std::string& out) {
  torch::manual_seed(5);
  auto x_all = torch::randn({16, 4, 5, 5}) * 3 + 1;
  auto w_all = torch::randn({16, 4, 5, 5});  // fixed upstream gradient
  const int64_t start = world.rank() == 0 ? 0 : 5, count = world.rank() == 0 ? 5 : 11;
  auto bn = BatchNorm2d(4);
  convert_sync_batchnorm(*bn, world);
  auto x = x_all.narrow(0, start, count).clone().requires_grad_();
  auto y = bn->forward(x);
  (y * w_all.narrow(0, start, count)).sum().backward();

  auto ref_bn = BatchNorm2d(4);
  auto xr = x_all.clone().requires_grad_();
  auto yr = ref_bn->forward(xr);
  (yr * w_all).sum().backward();
  const double dy = (y - yr.narrow(0, start, count)).abs().max().item<double>();
  const double dx = (x.grad() - xr.grad().narrow(0, start, count)).abs().max().item<double>();
  const double dm = (bn->running_mean - ref_bn->running_mean).abs().max().item<double>();
  const double dv = (bn->running_var - ref_bn->running_var).abs().max().item<double>();
  std::FILE* f = std::fopen((out + "/unequal_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%.3g %.3g %.3g %.3g\n", dy, dx, dm, dv);
  std::fclose(f);
}

// The two-input example's validation over this world, with the same seeded
// weights on every rank: rank 0 writes the metrics and the totals behind
// them. (ARGS: more flags, e.g. --test-samples 1001.)
void task_metric(World& world, const std::string& out, int argc, char** argv) {
  two_inputs::WeightedTask task;
  Config defaults;
  task.add_flags(defaults);
  std::vector<const char*> args = {"task_metric", "--save_path", nullptr, "--progress", "none", "--sync-bn", "off"};
  const std::string runs = out + "/runs";
  args[2] = runs.c_str();
  for (int i = 0; i < argc; ++i) args.push_back(argv[i]);
  Config c = parse_cli(static_cast<int>(args.size()), args.data(), defaults);
  torch::manual_seed(7);
  Trainer trainer(c, world, task);
  const Metrics m = trainer.validate();
  if (!world.is_main()) return;
  std::FILE* f = std::fopen((out + "/metrics_world" + std::to_string(world.size()) + ".txt").c_str(), "w");
  for (const auto& [name, v] : m) std::fprintf(f, "%s %.17g\n", name.c_str(), v);
  std::fclose(f);
}

// The built-in regression, changed as MODE says. A validation metric that
// turns NaN while training goes on finite: a metric of its own that divides
// by a zero count ("metric"), or a scale buffer that is used only in eval
// mode and made infinite after the second step, as a broken running
// statistic would be ("buffer"). Or test_loss scripted to 1.0, 0.5, 2.0 over
// the epochs ("scripted"), for best.pt. (ARGS: MODE, then more flags.)
struct ScaledNetImpl : Net {
  std::shared_ptr<Net> inner;
  torch::Tensor scale;
  explicit ScaledNetImpl(std::shared_ptr<Net> net) : inner(register_module("inner", std::move(net))) {
    scale = register_buffer("scale", torch::ones({1}));
  }
  torch::Tensor forward(torch::Tensor x) override { return is_training() ? inner->forward(x) : inner->forward(x) * scale; }
};

class NotFiniteTask : public RegressionTask {
 public:
  explicit NotFiniteTask(std::string mode) : mode_(std::move(mode)) {}
  std::shared_ptr<Net> make_net(const Config& config, const data::Splits& data) override {
    auto net = RegressionTask::make_net(config, data);
    if (mode_ != "buffer") return net;
    scaled_ = std::make_shared<ScaledNetImpl>(net);
    return scaled_;
  }
  // "random": both steps draw from the global generator, so a draw made
  // elsewhere (by the validation before training) would change the run.
  // "logged": a scalar logged every step (the batch's mean |target|, which
  // differs from batch to batch); "logged_stop": that, and a stop asked for
  // on rank 0 at step 3, mid-epoch, as a SIGTERM would.
  StepOutput training_step(const data::Batch& batch) override {
    auto out = RegressionTask::training_step(batch);
    if (mode_ == "random") out.loss = out.loss * (1 + torch::rand({}));
    if (mode_.rfind("logged", 0) == 0) out.logs["train_target_abs"] = batch.target().abs().mean();
    return out;
  }
  TensorMap validation_step(const data::Batch& batch) override {
    if (mode_ == "bad_validation") throw UserError("validation_step() failed on purpose.");
    if (mode_ == "random") (void)torch::rand({8});
    auto sums = RegressionTask::validation_step(batch);
    sums["huge"] = (batch.target().abs() > 1e30).sum().to(torch::kDouble);  // always 0
    return sums;
  }
  Metrics validation_metrics(const Totals& totals) override {
    auto m = RegressionTask::validation_metrics(totals);
    if (mode_ == "metric") m["test_huge_share"] = totals.at("huge").item<double>() / totals.at("huge").item<double>();
    if (mode_ == "scripted") {  // by epoch (the steps say which: it survives a resume); the validation
                                // before training (--sanity-val-steps) reads epoch 1's
      const double losses[] = {1.0, 0.5, 2.0, 0.8, 0.45, 0.9, 3.0};
      m["test_loss"] = losses[std::min<int64_t>(std::max<int64_t>(epoch_, 1), 7) - 1];
    }
    return m;
  }
  void on_step_end(const StepEnd& step) override {
    if (scaled_ && step.step == 2) scaled_->scale.fill_(std::numeric_limits<double>::infinity());
    epoch_ = step.epoch;
    if (mode_ == "logged_stop" && step.step == 3 && std::getenv("RANK") && std::string(std::getenv("RANK")) == "0")
      request_stop();
  }

 private:
  std::string mode_;
  std::shared_ptr<ScaledNetImpl> scaled_;
  int64_t epoch_ = 0;  // of the last training step
};

void not_finite(World& world, const std::string& out, int argc, char** argv) {
  if (argc < 1)
    throw std::runtime_error("not_finite needs MODE (metric, buffer, scripted, bad_validation, random, logged or logged_stop)");
  NotFiniteTask task(argv[0]);
  Config defaults;
  task.add_flags(defaults);
  const std::string runs = out + "/runs";
  std::vector<const char*> args = {"not_finite", "--save_path", runs.c_str(), "--progress", "plain"};
  for (int i = 1; i < argc; ++i) args.push_back(argv[i]);
  Config c = parse_cli(static_cast<int>(args.size()), args.data(), defaults);
  torch::manual_seed(c.seed);  // as ddptrain's run_worker does: runs repeat
  Trainer trainer(c, world, task);
  trainer.fit();
}

// The built-in classifier whose validation_step sleeps MS milliseconds a
// batch: in the validation before training ("sanity") or in the epochs'
// ("epoch"). Each rank says when a slow validation begins, so that a test
// can signal during it. A stop signal must not wait for such a validation.
// (ARGS: MS, sanity|epoch, then flags; MS 0: a straight run to compare.)
class SlowValidationTask : public ClassificationTask {
 public:
  SlowValidationTask(int ms, bool in_sanity) : ms_(ms), in_sanity_(in_sanity) {}
  TensorMap validation_step(const data::Batch& batch) override {
    if (ms_ > 0 && (in_sanity_ ? steps_ == 0 : steps_ > 0)) {
      if (!said_) std::printf("slow validation begins after step %lld\n", static_cast<long long>(steps_));
      std::fflush(stdout);
      said_ = true;
      std::this_thread::sleep_for(std::chrono::milliseconds(ms_));
    }
    return ClassificationTask::validation_step(batch);
  }
  void on_step_end(const StepEnd& step) override {
    steps_ = step.step;
    said_ = false;
  }

 private:
  int ms_;
  bool in_sanity_;
  int64_t steps_ = 0;
  bool said_ = false;
};

void slow_validation(World& world, const std::string& out, int argc, char** argv) {
  if (argc < 2) throw std::runtime_error("slow_validation needs MS and sanity|epoch");
  install_stop_handlers(std::getenv("RANK") ? getppid() : 0);  // as ddptrain's workers: SIGTERM checkpoints
  SlowValidationTask task(std::atoi(argv[0]), std::string(argv[1]) == "sanity");
  const std::string runs = out + "/runs";
  std::vector<const char*> args = {"slow_validation", "--save_path", runs.c_str(), "--progress", "plain"};
  for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
  Config c = parse_cli(static_cast<int>(args.size()), args.data(), Config());
  torch::manual_seed(c.seed);
  Trainer trainer(c, world, task);
  trainer.fit();
}

// Eval mode with track_running_stats=false normalises each batch by its own
// statistics and must not communicate: rank 0 runs 1 batch, rank 1 runs 3.
void syncbn_eval(World& world, const std::string& out) {
  auto bn = BatchNorm(BatchNormOptions(4).track_running_stats(false));
  convert_sync_batchnorm(*bn, world);
  bn->eval();
  torch::NoGradGuard no_grad;
  double worst = 0;
  for (int b = 0; b < (world.rank() == 0 ? 1 : 3); ++b) {
    torch::manual_seed(10 * world.rank() + b);
    auto x = torch::randn({3 + b, 4, 5, 5}) * 2 + 1;
    auto local = torch::batch_norm(x, bn->weight, bn->bias, {}, {}, true, 0.1, 1e-5, false);
    worst = std::max(worst, (bn->forward(x) - local).abs().max().item<double>());
  }
  std::FILE* f = std::fopen((out + "/eval_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
  std::fprintf(f, "%.3g\n", worst);
  std::fclose(f);
}

// A short run of the built-in classifier with local batch norm (--sync-bn
// off): every rank writes its model's buffers afterwards.
void local_bn_buffers(World& world, const std::string& out) {
  ClassificationTask task;
  const std::string runs = out + "/runs";
  const char* args[] = {"local_bn", "--save_path", runs.c_str(), "--progress", "none", "--sync-bn", "off",
                        "--dataset", "synthetic", "--train-samples", "512", "--test-samples", "64",
                        "--batch", "32", "--epochs", "1"};
  Config c = parse_cli(static_cast<int>(std::size(args)), args, Config());
  torch::manual_seed(3);
  Trainer trainer(c, world, task);
  trainer.fit();
  std::vector<torch::Tensor> parts;
  for (const auto& b : trainer.model().buffers()) parts.push_back(b.detach().flatten().to(torch::kDouble));
  save(torch::cat(parts), out + "/buffers_rank" + std::to_string(world.rank()) + ".pt");
}

// Throws from backward, where it sits: between the layers, so that the
// later layers' gradients are in (and their buckets launched) when it does.
struct ThrowInBackward : torch::autograd::Function<ThrowInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list) {
    throw std::runtime_error("injected failure in backward");
  }
};

// A step that stops in backward, then more steps (ARGS: reset | no-reset |
// skip). reset: GradSync::abandon_step() after the failure; no-reset:
// nothing (the defect of issue 13, item 4); skip: no failed step at all,
// the reference. Every rank writes its parameters after the last step.
void abandon(World& world, const std::string& out, const std::string& mode) {
  torch::manual_seed(3);
  DeepLinear net;
  GradSync sync(*net, world, GradSyncOptions().bucket_cap_mb(0.01));
  FlatOptimizer opt(sync, FlatOptimizerOptions().name("sgd").lr(0.1).momentum(0.9));
  for (int step = 0; step < 4; ++step) {
    const bool fails = step == 1;
    if (fails && mode == "skip") continue;
    torch::manual_seed(50 + 10 * step + world.rank());
    auto x = torch::randn({8, 64});
    sync.zero_grad();
    auto h = x;
    for (size_t l = 0; l < net->layers.size(); ++l) {
      if (fails && l == 3) h = ThrowInBackward::apply(h);
      h = torch::tanh(net->layers[l](h));
    }
    try {
      h.pow(2).mean().backward();
    } catch (const std::exception&) {
      if (!fails) throw;
      if (mode == "reset") sync.abandon_step();
      // The failed step's all-reduces finish before the next step begins
      // (Gloo's barrier waits for them), so that no-reset fails the same
      // way every time rather than by timing.
      world.barrier("after the failed step");
      continue;
    }
    sync.finish();
    opt.step();
  }
  save(flat_state(*net), out + "/params_rank" + std::to_string(world.rank()) + ".pt");
}

// y = x W^T whose weight gradient goes into W's slot (param_slots.h): as
// ddptrain's CUDA linear layers write theirs.
struct SlotLinear : torch::autograd::Function<SlotLinear> {
  static torch::Tensor forward(torch::autograd::AutogradContext* ctx, torch::Tensor x, torch::Tensor w) {
    ctx->save_for_backward({x, w});
    return x.matmul(w.t());
  }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    auto s = ctx->get_saved_variables();
    auto dw = param_slots::take_gradient_slot(s[1]);
    if (!dw.defined()) throw std::runtime_error("param_slots: no slot for the weight");
    at::mm_out(dw, grads[0].t(), s[0]);
    return {grads[0].matmul(s[1]), dw};
  }
};

// Each rank writes its own weight gradient into the slot (two steps, small
// buckets); after finish(), .grad must be the ranks' average, computed here
// from both ranks' inputs.
void slots(World& world, const std::string& out) {
  torch::manual_seed(4);
  torch::nn::Linear a(6, 8), b(8, 8);
  torch::nn::Sequential net(a, b);
  GradSync sync(*net, world, GradSyncOptions().bucket_cap_mb(0.0001));
  for (int step = 0; step < 2; ++step) {
    auto input = [&](int rank) {
      torch::manual_seed(100 + 10 * step + rank);
      return torch::randn({4, 8});
    };
    const auto x = input(world.rank());
    sync.zero_grad(/*set_to_none=*/true);
    torch::tanh(SlotLinear::apply(x, b->weight)).pow(2).sum().backward();
    sync.finish();
    torch::Tensor want = torch::zeros({8, 8});
    for (int rank = 0; rank < world.size(); ++rank) {
      auto w = b->weight.detach().clone().requires_grad_();
      torch::tanh(input(rank).matmul(w.t())).pow(2).sum().backward();
      want += w.grad() / world.size();
    }
    save(b->weight.grad().clone(), out + "/slot_rank" + std::to_string(world.rank()) + ".pt");
    save(want, out + "/want_rank" + std::to_string(world.rank()) + ".pt");
  }
}

// Reads a value back to the host in backward: fine eagerly, and an error
// in a CUDA graph capture, which then fails half-way through backward.
struct SyncInBackward : torch::autograd::Function<SyncInBackward> {
  static torch::Tensor forward(torch::autograd::AutogradContext*, torch::Tensor x) { return x.clone(); }
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext*, torch::autograd::variable_list g) {
    if (g[0].sum().item<float>() == 12345.0f) std::fprintf(stderr, "improbable\n");
    return g;
  }
};

struct SyncingTask : Task {
  explicit SyncingTask(DeepLinear net) : net(std::move(net)) {}
  StepOutput training_step(const data::Batch& b) override {
    auto h = b.input();
    for (size_t l = 0; l < net->layers.size(); ++l) {
      if (l == 3) h = SyncInBackward::apply(h);
      h = torch::tanh(net->layers[l](h));
    }
    return torch::mse_loss(h, b.target());
  }
  TensorMap validation_step(const data::Batch&) override { return {}; }
  DeepLinear net;
};

// TrainStep with --cuda-graph whose capture fails in backward (ARGS: graph
// | eager): every rank writes its losses and final parameters, and rank 0
// why it fell back.
void capture_fallback(World& world, const std::string& out, const std::string& mode) {
  torch::manual_seed(4);
  DeepLinear net;
  net->to(world.device());
  SyncingTask task(net);
  TrainStep step(task, *net, world,
                 TrainStepOptions()
                     .cuda_graph(mode == "graph")
                     .graph_warmup(2)
                     .bucket_cap_mb(0.01)
                     .optimizer(FlatOptimizerOptions().name("adamw").lr(0.01).weight_decay(0.1)));
  std::vector<torch::Tensor> losses;
  for (int s = 0; s < 6; ++s) {
    torch::manual_seed(70 + 10 * s + world.rank());
    auto x = torch::randn({8, 64}).to(world.device()), y = torch::randn({8, 64}).to(world.device());
    losses.push_back(step.run(data::Batch(x, y), /*last_micro=*/true, 0.01).loss.to(torch::kDouble).cpu());
  }
  const std::string r = std::to_string(world.rank());
  save(torch::stack(losses), out + "/losses_rank" + r + ".pt");
  save(flat_state(*net), out + "/params_rank" + r + ".pt");
  std::FILE* f = std::fopen((out + "/fallback_rank" + r + ".txt").c_str(), "w");
  std::fprintf(f, "%s\n", step.graph_fallback().c_str());
  std::fclose(f);
}

int run_scenario(const std::string& scenario, const std::string& out, int argc, char** argv) {
  WorldOptions wo;
  wo.use_cuda = std::getenv("DDP_TEST_CUDA") != nullptr;
  if (const char* t = std::getenv("DDP_TEST_TIMEOUT_MS")) wo.timeout = std::chrono::milliseconds(std::atoi(t));
  World world(placement_from_env(), wo);
  if (scenario == "equivalence") {
    equivalence(world, out, argc > 0 ? std::atoi(argv[0]) : 1, !(argc > 1 && std::string(argv[1]) == "local-bn"));
  } else if (scenario == "syncbn_unequal") {
    syncbn_unequal(world, out);
  } else if (scenario == "frozen") {
    frozen(world, out);
  } else if (scenario == "syncbn_eval") {
    syncbn_eval(world, out);
  } else if (scenario == "overlap") {
    overlap(world, out, argc > 0 && std::string(argv[0]) == "recompute");
  } else if (scenario == "syncbn_branch") {
    syncbn_branch(world, out);
  } else if (scenario == "unused") {
    unused(world, out);
  } else if (scenario == "reduce_scatter") {
    reduce_scatter(world, out);
  } else if (scenario == "zero_memory") {
    zero_memory(world, out, argc > 0 ? argv[0] : "zero1");
  } else if (scenario == "param_slots") {
    slots(world, out);
  } else if (scenario == "abandon") {
    abandon(world, out, argc > 0 ? argv[0] : "reset");
  } else if (scenario == "capture_fallback") {
    capture_fallback(world, out, argc > 0 ? argv[0] : "graph");
  } else if (scenario == "zero_async") {
    zero_async(world, out);
  } else if (scenario == "zero_gpt_parts") {
    zero_gpt_parts(world, out);
  } else if (scenario == "zero_gather_dead") {
    zero_gather_dead(world, out, argc > 0 ? argv[0] : "throw");
  } else if (scenario == "unused_reference") {
    if (argc < 2) throw std::runtime_error("unused_reference needs JSON and OPTIMIZER");
    unused_reference(world, out, argv[0], argv[1], argc > 2 ? argv[2] : "");
  } else if (scenario == "local_bn_buffers") {
    local_bn_buffers(world, out);
  } else if (scenario == "task_metric") {
    task_metric(world, out, argc, argv);
  } else if (scenario == "not_finite") {
    not_finite(world, out, argc, argv);
  } else if (scenario == "slow_validation") {
    slow_validation(world, out, argc, argv);
  } else if (scenario == "throw") {
    if (world.rank() == 1) throw std::runtime_error("injected failure on rank 1");
    auto t = torch::ones({1});
    world.all_reduce(t, "waiting for rank 1");
  } else if (scenario == "mismatch") {
    // Rank 1 builds a different head: GradSync must refuse, on every rank.
    torch::nn::Sequential net(torch::nn::Linear(4, 4), torch::nn::Linear(4, world.rank() == 1 ? 5 : 3));
    GradSync sync(*net, world);
  } else if (scenario == "preempt") {
    // Rank 1 stops at once; rank 0 takes a while to "save" first.
    if (world.rank() == 0) {
      std::this_thread::sleep_for(std::chrono::milliseconds(1500));
      std::fclose(std::fopen((out + "/rank0_done").c_str(), "w"));
    }
    throw Preempted("stopped by a signal (test)");
  } else if (scenario == "share") {
    // Rank 0 shares late, so that a foreign write would come first.
    if (world.rank() == 0) std::this_thread::sleep_for(std::chrono::milliseconds(1500));
    const std::string got = world.share_string("resume", "from rank 0");
    std::FILE* f = std::fopen((out + "/share_rank" + std::to_string(world.rank()) + ".txt").c_str(), "w");
    std::fprintf(f, "%s", got.c_str());
    std::fclose(f);
  } else if (scenario == "stall_grad") {
    // Rank 1 never joins the gradient all-reduce.
    DeepLinear net;
    net->to(world.device());
    GradSync sync(*net, world);
    if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::hours(1));
    net->forward(torch::randn({8, 64}, torch::TensorOptions().device(world.device()))).sum().backward();
    sync.finish();
    (void)net->layers[0]->weight.grad().sum().item<float>();
  } else if (scenario == "stall") {
    if (world.rank() == 1) std::this_thread::sleep_for(std::chrono::hours(1));
    auto t = torch::ones({1});
    world.all_reduce(t, "waiting for the stalled rank");
  } else {
    throw std::runtime_error("unknown scenario " + scenario);
  }
  world.barrier("end of scenario");
  return 0;
}

// A program with a tabular task, as a user writes one from the template:
// rows of 8 float features and a store id, and a target that depends on
// them; no images anywhere (so --augment must not reach it). Its optimizer
// exempts biases and the store embedding from weight decay.
class RowsDataset : public data::Dataset {
 public:
  RowsDataset(int64_t size, uint64_t seed) : size_(size), seed_(seed) {}
  int64_t size() const override { return size_; }
  data::Example get(int64_t index) const override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + static_cast<uint64_t>(index));
    auto features = torch::randn({8}, gen);
    const int64_t store = index % 5;
    return {{"features", features},
            {"store", torch::tensor(store, torch::kLong)},
            {"target", (features.slice(0, 0, 4).sum() + 0.5 * static_cast<double>(store)).reshape({1})}};
  }
  std::string name() const override { return "rows"; }

 private:
  int64_t size_;
  uint64_t seed_;
};

struct RowsNetImpl : torch::nn::Module {
  RowsNetImpl()
      : store(register_module("store", torch::nn::Embedding(5, 2))), head(register_module("head", torch::nn::Linear(10, 1))) {}
  torch::Tensor forward(const data::Batch& b) { return head(torch::cat({b.at("features"), store(b.at("store"))}, 1)); }
  torch::nn::Embedding store;
  torch::nn::Linear head;
};
TORCH_MODULE(RowsNet);

struct RowsTask : Task {
  RowsNet net{nullptr};
  // --own-val N: the task gives its own validation split of N rows (0: none).
  void add_flags(Config& c) override { c.add_flag("--own-val", "rows of the task's own validation split (0: none)", 0); }
  data::Splits make_data(const Config& c, World&) override {
    data::Splits s;
    s.train = std::make_shared<RowsDataset>(c.train_samples > 0 ? c.train_samples : 256, 1);
    s.test = std::make_shared<RowsDataset>(c.test_samples > 0 ? c.test_samples : 64, 2);
    if (const int val = c.flag<int>("own-val"); val > 0) s.val = std::make_shared<RowsDataset>(val, 3);
    return s;
  }
  ModulePtr make_model(const Config&, const data::Splits&) override {
    arch_ = "rows-linear";
    net = RowsNet();
    return net.ptr();
  }
  void configure_optimizer(const Config&, OptimizerSetup& setup) override { decay_matrices_only(setup.optimizer, *net); }
  StepOutput training_step(const data::Batch& b) override { return torch::mse_loss(net(b), b.target()); }
  TensorMap validation_step(const data::Batch& b) override {
    const auto err = (net(b) - b.target()).abs().to(torch::kDouble);
    return {{"abs_error", err.sum()}, {"count", torch::full({}, static_cast<double>(b.target().size(0)), torch::kDouble)}};
  }
  Monitor monitor() const override { return {"test_abs_error", Goal::kMin}; }
};

}  // namespace

int main(int argc, char** argv) {
  // `ddp_testworker --rows-program FLAGS...`: ddp::main with RowsTask, as a
  // program named "rows" (argv[0] is its name, as a shell gives it).
  if (argc >= 2 && std::strcmp(argv[1], "--rows-program") == 0) {
    std::vector<char*> args{const_cast<char*>("rows")};
    for (int i = 2; i < argc; ++i) args.push_back(argv[i]);
    return ddp::main(static_cast<int>(args.size()), args.data(), std::make_shared<RowsTask>());
  }
  try {
    if (argc >= 4 && std::strcmp(argv[1], "--launch") == 0) {
      LaunchOptions lo;
      lo.nproc_per_node = std::atoi(argv[2]);
      if (const char* port = std::getenv("DDP_TEST_PORT")) lo.master_port = std::atoi(port);
      lo.argv.push_back(self_executable());
      for (int i = 3; i < argc; ++i) lo.argv.push_back(argv[i]);
      return launch_workers(lo);
    }
    if (argc < 3) {
      std::fprintf(stderr, "usage: ddp_testworker [--launch N] SCENARIO OUTDIR [ARGS...]\n");
      return 2;
    }
    return run_scenario(argv[1], argv[2], argc - 3, argv + 3);
  } catch (const ddp::UserError& e) {
    std::fprintf(stderr, "ddp_testworker rank %s: error: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "0", e.what());
    return ddp::exit_code::kUsage;
  } catch (const ddp::Preempted& e) {
    return ddp::exit_code::kPreempted;
  } catch (const ddp::CollectiveError& e) {
    std::fprintf(stderr, "ddp_testworker rank %s: error: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "0", e.what());
    return ddp::exit_code::kPeerFailed;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "ddp_testworker rank %s: error: %s\n", std::getenv("RANK") ? std::getenv("RANK") : "0", e.what());
    return 1;
  }
}
