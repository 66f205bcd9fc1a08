// The GPT (src/models/gpt.cpp): nanoGPT's parameter names, GPT-2's sizes
// and initialisation, logits equal to PyTorch's for the same weights, the
// tied embedding/head under the flat parameter buffer and in checkpoints,
// and LmTask's weight decay on matrices and embeddings only. Reference
// values: tests/testdata/make_gpt_reference.py.
#include <cmath>
#include <fstream>
#include <sstream>

#include <nlohmann/json.hpp>
#include <torch/csrc/autograd/profiler_legacy.h>

#include "ddp/cli.h"
#include "ddp/dist/grad_sync.h"
#include "ddp/dist/world.h"
#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/io/torch_pickle.h"
#include "ddp/models/gpt.h"
#include "ddp/models/registry.h"
#include "ddp/train/lm_task.h"
#include "ddp/train/train_step.h"
#include "support/testing.h"

namespace ddp::models {
namespace {

nlohmann::json reference() {
  std::ifstream f(std::string(DDP_TEST_DATA_DIR) + "/gpt_tiny_expected.json");
  return nlohmann::json::parse(f);
}
const std::string kStateDict = std::string(DDP_TEST_DATA_DIR) + "/gpt_tiny_state_dict.pt";

GptOptions tiny() { return GptOptions().n_layer(2).n_head(2).n_embd(16).block_size(8).vocab_size(32); }

torch::Tensor tensor_of(const nlohmann::json& j, std::vector<int64_t> shape, torch::Dtype dtype) {
  if (dtype == torch::kLong) {
    std::vector<int64_t> v;
    for (const auto& row : j)
      for (const auto& x : row) v.push_back(x.get<int64_t>());
    return torch::tensor(v, torch::kLong).reshape(shape);
  }
  return torch::tensor(j.get<std::vector<double>>(), torch::kDouble).to(dtype).reshape(shape);
}

std::vector<std::string> names_of(const torch::nn::Module& m) {
  std::vector<std::string> out;
  for (const auto& p : m.named_parameters()) out.push_back(p.key());
  return out;
}

TEST(Gpt, ParameterNamesAreNanoGptsGpt2Names) {
  Gpt model(tiny());
  EXPECT_EQ(names_of(*model), reference()["names"].get<std::vector<std::string>>());
  // Without biases: the same names less every .bias, as nanoGPT's bias=False.
  Gpt no_bias(tiny().bias(false));
  std::vector<std::string> expected;
  for (const auto& n : reference()["names"].get<std::vector<std::string>>())
    if (n.size() < 5 || n.compare(n.size() - 5, 5, ".bias") != 0) expected.push_back(n);
  EXPECT_EQ(names_of(*no_bias), expected);
}

TEST(Gpt, Gpt2PresetHas124MParameters) {
  const auto o = gpt_preset("gpt2");
  EXPECT_EQ(o.n_layer(), 12);
  EXPECT_EQ(o.block_size(), 1024);
  EXPECT_EQ(o.vocab_size(), 50304);
  Gpt model(o);
  // nanoGPT prints 123.69M for this configuration (without the position
  // embedding); the tied weight counts once.
  EXPECT_EQ(model->num_params(), 124475904);
  EXPECT_EQ(model->num_params(/*non_embedding=*/true), 123689472);
  EXPECT_EQ(gpt_from_arch(gpt_arch(o)).n_embd(), 768);
  EXPECT_EQ(gpt_arch(gpt_from_arch(gpt_arch(o))), gpt_arch(o));
}

// GPT-2's larger sizes, as nanoGPT's from_pretrained names them: their
// parameter counts (V C + T C + L (12 C^2 + 13 C) + 2 C, the tied head once;
// counted by the 124M model's test above for gpt2) are GPT-2's 350M, 774M
// and 1558M, and each width splits into its heads. (Not built here: 1.5B
// parameters are 6 GB.)
TEST(Gpt, LargerGpt2PresetsHaveGpt2sSizes) {
  auto count = [](const GptOptions& o) {
    const double v = o.vocab_size(), t = o.block_size(), c = o.n_embd(), l = o.n_layer();
    return v * c + t * c + l * (12 * c * c + 13 * c) + 2 * c;
  };
  EXPECT_NEAR(count(gpt_preset("gpt2")), 124475904, 0.5);  // the formula, checked against the built model above
  const std::vector<std::pair<std::string, double>> sizes = {{"gpt2-medium", 350e6}, {"gpt2-large", 774e6}, {"gpt2-xl", 1558e6}};
  for (const auto& [name, params] : sizes) {
    const auto o = gpt_preset(name);
    EXPECT_TRUE(is_gpt(name));
    EXPECT_EQ(o.block_size(), 1024);
    EXPECT_EQ(o.n_embd() % o.n_head(), 0) << name;
    EXPECT_NEAR(count(o) / params, 1.0, 0.015) << name << ": " << count(o);
    EXPECT_EQ(gpt_arch(gpt_from_arch(gpt_arch(o))), gpt_arch(o));
  }
  EXPECT_EQ(gpt_preset("gpt2-xl").n_head(), 25);
  EXPECT_FALSE(is_gpt("gpt2-huge"));
  EXPECT_THROW(gpt_preset("gpt2-huge"), UserError);
}

TEST(Gpt, HeadIsTheEmbeddingTensorAfterMovesAndCasts) {
  Gpt model(tiny());
  EXPECT_TRUE(model->lm_head->weight.is_same(model->transformer->wte->weight));
  model->to(torch::kDouble);
  EXPECT_TRUE(model->lm_head->weight.is_same(model->transformer->wte->weight));
  EXPECT_EQ(model->lm_head->weight.scalar_type(), torch::kDouble);
  auto named = model->named_parameters();
  EXPECT_TRUE(named["lm_head.weight"].is_same(named["transformer.wte.weight"]));
}

TEST(Gpt, InitialisationIsGpt2s) {
  torch::manual_seed(0);
  Gpt model(GptOptions().n_layer(4).n_head(4).n_embd(128).block_size(64).vocab_size(256));
  auto named = model->named_parameters();
  const double residual = 0.02 / std::sqrt(8.0);
  EXPECT_NEAR(named["transformer.h.0.attn.c_attn.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(named["transformer.h.1.mlp.c_fc.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(named["transformer.wte.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(named["transformer.wpe.weight"].std().item<double>(), 0.02, 0.001);
  EXPECT_NEAR(named["transformer.h.3.attn.c_proj.weight"].std().item<double>(), residual, residual * 0.05);
  EXPECT_NEAR(named["transformer.h.2.mlp.c_proj.weight"].std().item<double>(), residual, residual * 0.05);
  EXPECT_EQ(named["transformer.h.0.attn.c_attn.bias"].abs().sum().item<double>(), 0.0);
  EXPECT_TRUE(torch::equal(named["transformer.h.0.ln_1.weight"], torch::ones({128})));
  EXPECT_TRUE(torch::equal(named["transformer.ln_f.weight"], torch::ones({128})));
  EXPECT_EQ(named["transformer.ln_f.bias"].abs().sum().item<double>(), 0.0);
}

// PyTorch's state_dict loads as it is (both names of the tied weight), and
// the logits equal PyTorch's for the same weights and tokens.
TEST(Gpt, LogitsEqualPyTorchsForTheSameWeights) {
  const auto ref = reference();
  Gpt model(tiny());
  auto report = load_pretrained(kStateDict, *model, torch::kCPU);
  EXPECT_EQ(report.loaded.size(), 29u) << report.summary();
  EXPECT_TRUE(model->lm_head->weight.is_same(model->transformer->wte->weight)) << "loading broke the tie";
  model->eval();
  torch::NoGradGuard no_grad;
  auto logits = model->forward(tensor_of(ref["idx"], {2, 8}, torch::kLong));
  auto expected = tensor_of(ref["logits"], {2, 8, 32}, torch::kFloat);
  EXPECT_LE((logits - expected).abs().max().item<double>(), 1e-5);
  EXPECT_GT(expected.abs().max().item<double>(), 0.5);  // not all near zero
}

TEST(Gpt, FutureTokensDoNotChangeEarlierLogits) {
  torch::manual_seed(1);
  Gpt model(tiny());
  model->eval();
  torch::NoGradGuard no_grad;
  auto a = torch::randint(0, 32, {1, 8}, torch::kLong);
  auto b = a.clone();
  b.index_put_({0, torch::indexing::Slice(5)}, (b.index({0, torch::indexing::Slice(5)}) + 1) % 32);
  auto la = model->forward(a), lb = model->forward(b);
  EXPECT_TRUE(torch::allclose(la.slice(1, 0, 5), lb.slice(1, 0, 5), 0, 1e-6));
  EXPECT_FALSE(torch::allclose(la.slice(1, 5), lb.slice(1, 5), 0, 1e-3));
  EXPECT_NE(testing::user_error([&] { model->forward(torch::zeros({1, 9}, torch::kLong)); }).find("longer than the model's context of 8"),
            std::string::npos);
}

// The bias is part of the linear op (addmm), as in PyTorch's nn.Linear: no
// separate add_ pass per layer. (The C++ frontend's torch::nn::Linear adds it
// in place after a matmul for 3-D input: 4.6 ms of a GPT-2 step on an H200.)
// The ops a training forward records, counted by name. Only the forward:
// LibTorch 2.x's autograd engine sums a residual stream's two gradients
// with add_, which is no bias.
TEST(Gpt, LinearLayersAddTheirBiasInsideTheMatmul) {
  torch::manual_seed(1);
  Gpt model(tiny());
  model->train();
  auto idx = torch::randint(0, 32, {2, 8}, torch::kLong);
  std::stringstream trace;
  torch::Tensor logits;
  {
    torch::autograd::profiler::RecordProfile profile(trace);
    logits = model->forward(idx);
  }
  torch::nn::functional::cross_entropy(logits.reshape({-1, 32}), idx.reshape({-1})).backward();
  const std::string t = trace.str();
  auto count = [&](const std::string& op) {
    size_t n = 0;
    for (size_t p = t.find("\"" + op + "\""); p != std::string::npos; p = t.find("\"" + op + "\"", p + 1)) ++n;
    return n;
  };
  EXPECT_EQ(count("aten::addmm"), 4u * 2);  // c_attn, c_proj, c_fc, c_proj per block, 2 blocks
  EXPECT_EQ(count("aten::add_"), 0u) << "a bias added in place after a matmul";
}

// Under GradSync's flat buffers the tied weight is one slice: its gradient
// is the sum over the embedding and the head (PyTorch's), and one SGD step
// moves it once, for both names.
TEST(Gpt, TiedWeightIsOneSliceOfTheFlatBufferWithTheSummedGradient) {
  DDP_SKIP_UNLESS_GLOO();
  const auto ref = reference();
  auto world = testing::one_rank_world();
  LmTask task;
  auto module = task.make_gpt(tiny(), "bytes");
  load_pretrained(kStateDict, *module, torch::kCPU);
  auto& gpt = task.gpt();
  const auto w0 = gpt->transformer->wte->weight.detach().clone();
  const double lr = 0.5;
  TrainStep step(task, *module, *world,
                 TrainStepOptions().optimizer(FlatOptimizerOptions().name("sgd").lr(lr).momentum(0).weight_decay(0)));
  // Every slice starts 256-byte aligned (64 floats): the flat buffer holds
  // each distinct tensor once, padded.
  auto padded = [](int64_t n) { return (n + 63) / 64 * 64; };
  int64_t distinct = 0;
  for (const auto& p : gpt->parameters()) distinct += padded(p.numel());
  distinct -= padded(gpt->lm_head->weight.numel());
  int64_t flat = 0;
  for (const auto& f : step.sync().flat_params()) flat += f.numel();
  EXPECT_EQ(flat, distinct) << "the tied weight must have one slice";

  data::Batch batch{{"input", tensor_of(ref["idx"], {2, 8}, torch::kLong)},
                    {"target", tensor_of(ref["targets"], {2, 8}, torch::kLong)}};
  // A micro-step without the optimizer leaves the gradient in the buffer.
  auto out = step.run(batch, /*last_micro=*/false, lr);
  EXPECT_NEAR(out.loss.item<double>(), ref["loss"].get<double>(), 1e-5);
  const auto grad = tensor_of(ref["wte_grad"], {32, 16}, torch::kFloat);
  EXPECT_LE((gpt->transformer->wte->weight.grad() - grad).abs().max().item<double>(), 1e-5);
  EXPECT_TRUE(gpt->lm_head->weight.grad().is_same(gpt->transformer->wte->weight.grad()));
  // The second micro-step adds the same gradient, and the step applies both once.
  step.run(batch, /*last_micro=*/true, lr);
  EXPECT_TRUE(gpt->lm_head->weight.is_same(gpt->transformer->wte->weight));
  EXPECT_LE((gpt->transformer->wte->weight.detach() - (w0 - lr * 2 * grad)).abs().max().item<double>(), 1e-5);
}

// LmTask's AdamW has nanoGPT's two groups: with a zero gradient a step only
// decays, and it shrinks every matrix and embedding (the tied one once) by
// 1 - lr * wd and leaves the biases and LayerNorm weights as they were.
TEST(Gpt, LmTaskDecaysMatricesAndEmbeddingsOnly) {
  DDP_SKIP_UNLESS_GLOO();
  auto world = testing::one_rank_world();
  LmTask task;
  auto module = task.make_gpt(tiny(), "bytes");
  {
    torch::NoGradGuard no_grad;  // biases start at 0, where decay would not show
    for (auto& p : module->parameters())
      if (p.dim() < 2) p.uniform_(0.5, 1.5);
  }
  const double lr = 0.1, wd = 0.1;
  OptimizerSetup setup{FlatOptimizerOptions().name("adamw").lr(lr).weight_decay(wd), LrScheduleOptions()};
  task.configure_optimizer(Config(), setup);
  TrainStep step(task, *module, *world, TrainStepOptions().optimizer(setup.optimizer));
  std::vector<torch::Tensor> before;
  for (const auto& p : module->parameters()) before.push_back(p.detach().clone());
  step.optimizer().step();  // the gradients are GradSync's zeroed buffers
  int decayed = 0, kept = 0;
  const auto params = module->named_parameters();
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& name = params[i].key();
    const auto& p = params[i].value();
    if (p.dim() < 2) {
      EXPECT_TRUE(torch::equal(p, before[i])) << name << " must not decay";
      ++kept;
    } else {
      EXPECT_TRUE(torch::allclose(p, before[i] * (1 - lr * wd), 0, 1e-7)) << name << " must decay once";
      ++decayed;
    }
  }
  EXPECT_GT(kept, 0);
  EXPECT_GT(decayed, 0);
}

// A checkpoint holds both names, as PyTorch's state_dict; loading restores
// both from it and the two stay one tensor.
TEST(Gpt, CheckpointHoldsBothNamesAndLoadingKeepsTheTie) {
  Gpt model(tiny());
  load_pretrained(kStateDict, *model, torch::kCPU);
  const auto dir = testing::temp_dir("gpt_ckpt");
  save_checkpoint(dir + "/c.pt", *model, nullptr, CheckpointMeta{TrainState(), gpt_arch(tiny()) + "/bytes", {}});
  torch::Tensor wte, head;
  for (const auto& [name, t] : read_state_dict(dir + "/c.pt")) {
    if (name == "model/transformer.wte.weight") wte = t;
    if (name == "model/lm_head.weight") head = t;
  }
  ASSERT_TRUE(wte.defined() && head.defined());
  EXPECT_TRUE(torch::equal(wte, head));
  // Written once and shared, as torch.save shares the storage of a tied weight.
  EXPECT_EQ(wte.data_ptr(), head.data_ptr());

  torch::manual_seed(7);
  Gpt other(tiny());
  EXPECT_FALSE(torch::equal(other->transformer->wte->weight, wte));
  load_checkpoint(dir + "/c.pt", *other, nullptr, torch::kCPU, gpt_arch(tiny()) + "/bytes");
  EXPECT_TRUE(torch::equal(other->transformer->wte->weight, wte));
  EXPECT_TRUE(other->lm_head->weight.is_same(other->transformer->wte->weight));
  // The export is nanoGPT's state_dict: the same names in the same order.
  export_state_dict(*other, dir + "/sd.pt");
  std::vector<std::string> names;
  for (const auto& [name, t] : read_state_dict(dir + "/sd.pt")) names.push_back(name);
  EXPECT_EQ(names, reference()["names"].get<std::vector<std::string>>());
}

// --gelu tanh: the MLP computes GPT-2's tanh GELU (LibTorch's "tanh"
// approximation), not the exact one; the architecture string says so and
// reads back, and one without the suffix (every checkpoint from before the
// option) reads as the exact GELU.
TEST(Gpt, TanhGeluIsGpt2sApproximationAndTheArchSaysSo) {
  torch::manual_seed(6);
  auto o = tiny().gelu(GptGelu::kTanh);
  GptMlp tanh_mlp(o), exact_mlp(tiny());
  exact_mlp->c_fc->weight.data().copy_(tanh_mlp->c_fc->weight);
  exact_mlp->c_fc->bias.data().copy_(tanh_mlp->c_fc->bias);
  exact_mlp->c_proj->weight.data().copy_(tanh_mlp->c_proj->weight);
  exact_mlp->c_proj->bias.data().copy_(tanh_mlp->c_proj->bias);
  auto x = torch::randn({3, 5, 16}) * 2;
  auto want = torch::linear(torch::gelu(torch::linear(x, tanh_mlp->c_fc->weight, tanh_mlp->c_fc->bias), "tanh"),
                            tanh_mlp->c_proj->weight, tanh_mlp->c_proj->bias);
  EXPECT_TRUE(torch::allclose(tanh_mlp(x), want, 1e-6, 1e-6));
  EXPECT_GT((tanh_mlp(x) - exact_mlp(x)).abs().max().item<double>(), 1e-5) << "the two GELUs differ";
  EXPECT_NE(gpt_arch(o).find("/gelu-tanh"), std::string::npos);
  EXPECT_EQ(gpt_from_arch(gpt_arch(o)).gelu(), GptGelu::kTanh);
  EXPECT_EQ(gpt_from_arch(gpt_arch(o) + "/bytes").gelu(), GptGelu::kTanh);
  EXPECT_EQ(gpt_from_arch("gpt/L2/H2/C16/T8/V32/bias1/drop0/bytes").gelu(), GptGelu::kExact);
  EXPECT_EQ(gpt_arch(tiny()).find("gelu"), std::string::npos);
  // The task's flag builds it.
  auto lm_config = [](std::vector<std::string> args) {
    Config defaults;
    LmTask().add_flags(defaults);
    args.insert(args.begin(), "ddptrain");
    std::vector<const char*> argv;
    for (const auto& a : args) argv.push_back(a.c_str());
    return parse_cli(static_cast<int>(argv.size()), argv.data(), defaults);
  };
  EXPECT_EQ(LmTask::model_options(lm_config({"--task", "lm", "--gelu", "tanh"})).gelu(), GptGelu::kTanh);
  EXPECT_EQ(LmTask::model_options(lm_config({"--task", "lm"})).gelu(), GptGelu::kExact);
  EXPECT_NE(ddp::testing::user_error([&] { lm_config({"--task", "lm", "--gelu", "quick"}); }).find("quick"),
            std::string::npos);
}

TEST(Gpt, ImageTasksRefuseGptModelsWithAHint) {
  ModelSpec spec;
  spec.name = "gpt-nano";
  const auto msg = testing::user_error([&] { make_model(spec); });
  EXPECT_NE(msg.find("--task lm --model gpt-nano"), std::string::npos) << msg;
  EXPECT_NE(testing::user_error([] { Gpt(GptOptions().n_embd(30).n_head(4)); }).find("not a multiple of its 4 heads"),
            std::string::npos);
}

}  // namespace
}  // namespace ddp::models
