// convert_layers: torch::nn layers inside Sequentials become ddp::nn's with
// the same tensors (state_dict names and values, the same objects), the
// activations after them folded in; what cannot be swapped safely is kept
// and named; a converted model trains to the same bits as the unconverted
// one on CPU, directly and through a program built from the examples.
#include <gtest/gtest.h>

#include <ATen/CPUGeneratorImpl.h>

#include "ddp/io/torch_pickle.h"
#include "ddp/models/registry.h"
#include "ddp/train/lm_task.h"
#include "ddp/nn.h"
#include "support/testing.h"

namespace {

using ddp::nn::Activation;

// A small model with each kind of layer in a Sequential, a member layer
// beside it, and a ModuleList.
struct MixedImpl : torch::nn::Module {
  MixedImpl()
      : body(register_module(
            "body", torch::nn::Sequential(torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)),
                                          torch::nn::BatchNorm2d(4), torch::nn::ReLU(), torch::nn::Flatten(),
                                          torch::nn::Linear(4 * 6 * 6, 32),
                                          torch::nn::GELU(torch::nn::GELUOptions().approximate("tanh")),
                                          torch::nn::LayerNorm(torch::nn::LayerNormOptions({32})),
                                          torch::nn::Linear(32, 16), torch::nn::ReLU()))),
        listed(register_module("listed", torch::nn::ModuleList(torch::nn::Linear(16, 16)))),
        head(register_module("head", torch::nn::Linear(16, 5))) {}

  torch::Tensor forward(const torch::Tensor& x) {
    return head(listed[0]->as<torch::nn::Linear>()->forward(body->forward(x)));
  }

  torch::nn::Sequential body;
  torch::nn::ModuleList listed;
  torch::nn::Linear head;
};
TORCH_MODULE(Mixed);

Mixed make_mixed(uint64_t seed) {
  torch::manual_seed(seed);
  return Mixed();
}

std::string kept_why(const ddp::nn::LayerConversion& c, const std::string& path) {
  for (const auto& [p, why] : c.kept)
    if (p == path) return why;
  return "";
}

TEST(ConvertLayers, SequentialLayersBecomeDdpNnHoldingTheSameTensors) {
  auto model = make_mixed(1);
  std::map<std::string, torch::Tensor> before;
  for (const auto& p : model->named_parameters()) before[p.key()] = p.value();
  for (const auto& b : model->named_buffers()) before[b.key()] = b.value().clone();

  const auto c = ddp::nn::convert_layers(*model);
  EXPECT_EQ(c.linear, 2);
  EXPECT_EQ(c.layer_norm, 1);
  EXPECT_EQ(c.batch_norm, 1);
  EXPECT_EQ(c.folded_activations, 3) << "ReLU after the BatchNorm, GELU and ReLU after the Linears";
  // The Sequential itself is the object the member points at, now holding
  // the new layers under the old names.
  auto& body = *model->body;
  ASSERT_EQ(body.size(), 9u);
  auto* bn = dynamic_cast<ddp::BatchNormImpl*>(body.ptr(1).get());
  ASSERT_NE(bn, nullptr);
  EXPECT_TRUE(bn->options.relu());
  EXPECT_NE(dynamic_cast<torch::nn::IdentityImpl*>(body.ptr(2).get()), nullptr);
  auto* fc = dynamic_cast<ddp::nn::LinearImpl*>(body.ptr(4).get());
  ASSERT_NE(fc, nullptr);
  EXPECT_EQ(fc->activation, Activation::kGeluTanh);
  EXPECT_NE(dynamic_cast<ddp::nn::LayerNormImpl*>(body.ptr(6).get()), nullptr);
  EXPECT_EQ(dynamic_cast<ddp::nn::LinearImpl*>(body.ptr(7).get())->activation, Activation::kRelu);
  // Names and values unchanged; parameters are the same tensors.
  std::map<std::string, torch::Tensor> after;
  for (const auto& p : model->named_parameters()) after[p.key()] = p.value();
  for (const auto& b : model->named_buffers()) after[b.key()] = b.value();
  ASSERT_EQ(before.size(), after.size());
  for (const auto& [name, t] : before) {
    ASSERT_TRUE(after.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, after[name])) << name;
  }
  for (const auto& p : model->named_parameters()) EXPECT_TRUE(p.value().is_same(before[p.key()])) << p.key();
  // The member and the ModuleList's layer stay, named with why.
  EXPECT_EQ(kept_why(c, "head").rfind("a member of ", 0), 0u) << kept_why(c, "head");
  EXPECT_NE(kept_why(c, "head").find("MixedImpl"), std::string::npos) << kept_why(c, "head");
  EXPECT_EQ(kept_why(c, "listed.0"), "in a ModuleList");
  EXPECT_NE(c.summary().find("4 converted to ddp::nn (2 Linear, 1 LayerNorm, 1 BatchNorm; 3 activation(s) folded in)"),
            std::string::npos) << c.summary();
  EXPECT_NE(c.summary().find("declare them as ddp::nn::Linear"), std::string::npos) << c.summary();
  // Converting again finds nothing more to convert.
  EXPECT_EQ(ddp::nn::convert_layers(*model).converted(), 0);
}

TEST(ConvertLayers, RefusesWhatItCannotSwapSafely) {
  // A layer that its Sequential and a member both hold: the owner may call
  // it through the member, so it stays one layer.
  struct SharedImpl : torch::nn::Module {
    SharedImpl() : fc(torch::nn::Linear(4, 4)) {
      seq = register_module("seq", torch::nn::Sequential(fc, torch::nn::ReLU()));
    }
    torch::nn::Linear fc;
    torch::nn::Sequential seq{nullptr};
  };
  auto shared = std::make_shared<SharedImpl>();
  auto c = ddp::nn::convert_layers(*shared);
  EXPECT_EQ(c.converted(), 0);
  EXPECT_EQ(kept_why(c, "seq.0"), "also held outside its Sequential");
  EXPECT_NE(dynamic_cast<torch::nn::ReLUImpl*>(shared->seq->ptr(1).get()), nullptr) << "the ReLU stays too";
  // A cumulative-average BatchNorm, which ddp::BatchNorm does not keep.
  torch::nn::Sequential seq(torch::nn::BatchNorm1d(torch::nn::BatchNorm1dOptions(3).momentum(c10::nullopt)));
  c = ddp::nn::convert_layers(*seq);
  EXPECT_EQ(c.converted(), 0);
  EXPECT_EQ(kept_why(c, "0"), "momentum nullopt");
  // The model itself: its caller holds it.
  torch::nn::Linear bare(3, 3);
  c = ddp::nn::convert_layers(*bare);
  EXPECT_EQ(kept_why(c, "(the model)"), "the caller holds it");
}

// ddptrain's own models chose their layers (the GPT runs its kernels on
// torch::nn::Linear's weights): nothing converted, nothing reported as
// kept for the user to fix, so a built-in model's run prints no layers line.
TEST(ConvertLayers, LeavesDdptrainsOwnModelsAsTheyAre) {
  std::vector<std::pair<std::string, std::shared_ptr<torch::nn::Module>>> models;
  for (const auto& name : ddp::models::model_names()) {
    ddp::models::ModelSpec spec;
    spec.name = name;
    models.emplace_back(name, ddp::models::make_model(spec));
  }
  ddp::LmTask lm;
  models.emplace_back("gpt", lm.make_gpt(ddp::models::GptOptions(), "bytes"));
  ASSERT_GE(models.size(), 5u);
  for (const auto& [name, model] : models) {
    const auto before = model->named_parameters(true);
    const auto conversion = ddp::nn::convert_layers(*model);
    EXPECT_EQ(conversion.converted(), 0) << name;
    EXPECT_TRUE(conversion.kept.empty()) << name << ": " << conversion.summary();
    const auto after = model->named_parameters(true);
    ASSERT_EQ(after.size(), before.size()) << name;
    for (const auto& p : before) EXPECT_TRUE(after[p.key()].is_same(p.value())) << name << " " << p.key();
  }
}

TEST(ConvertLayers, DrawsNoRandomNumbers) {
  auto model = make_mixed(2);
  torch::manual_seed(5);
  ddp::nn::convert_layers(*model);
  const auto drawn = torch::rand({4});
  torch::manual_seed(5);
  EXPECT_TRUE(torch::equal(drawn, torch::rand({4})));
}

// 50 AdamW steps of a converted model and of the same model unconverted,
// on the same batches: the same weights and buffers to the bit on CPU.
TEST(ConvertLayers, FiftyStepTrajectoryEqualsTheUnconverted) {
  auto plain = make_mixed(3), fast = make_mixed(3);
  ASSERT_EQ(ddp::nn::convert_layers(*fast).converted(), 4);
  torch::optim::AdamW opt_a(plain->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::optim::AdamW opt_b(fast->parameters(), torch::optim::AdamWOptions(1e-2));
  torch::manual_seed(4);
  for (int step = 0; step < 50; ++step) {
    auto x = torch::randn({8, 3, 6, 6}), y = torch::randint(0, 5, {8}, torch::kLong);
    for (auto [model, opt] : {std::pair<Mixed*, torch::optim::AdamW*>{&plain, &opt_a}, {&fast, &opt_b}}) {
      opt->zero_grad();
      torch::nn::functional::cross_entropy((*model)(x), y).backward();
      opt->step();
    }
  }
  auto pa = plain->named_parameters(), pb = fast->named_parameters();
  for (const auto& p : pa) EXPECT_TRUE(torch::equal(p.value(), pb[p.key()])) << p.key();
  auto ba = plain->named_buffers(), bb = fast->named_buffers();
  for (const auto& b : ba) EXPECT_TRUE(torch::equal(b.value(), bb[b.key()])) << b.key();
}

// Through a program: examples/tabular's MLP is torch::nn layers in a
// Sequential. Its start line says what was converted, and its trained
// model, optimizer state and metrics equal --convert-layers off's bits.
TEST(ConvertLayers, TheTabularExampleConvertsItsMlpAndTrainsTheSameBits) {
  DDP_SKIP_UNLESS_GLOO();
  const auto data = ddp::testing::temp_dir("convert_tabular_data");
  ddp::testing::write_sales_csvs(data, 800, 200);
  std::map<std::string, std::map<std::string, torch::Tensor>> states;
  for (const std::string mode : {"on", "off"}) {
    const auto out = ddp::testing::temp_dir("convert_tabular_" + mode);
    auto r = ddp::testing::run_process({EXAMPLE_tabular, "--data_root", data, "--size", "1", "--backend", "gloo",
                                        "--epochs", "2", "--batch", "16", "--lr", "1e-2", "--workers", "0",
                                        "--progress", "plain", "--save_path", out, "--save_epoch", "1", "--convert-layers", mode});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const bool said = r.output.find("layers: 3 converted to ddp::nn (3 Linear; 2 activation(s) folded in)") !=
                      std::string::npos;
    EXPECT_EQ(said, mode == "on") << r.output;
    for (auto& [name, t] : ddp::read_state_dict(ddp::testing::find_file(out, "epoch_2.pt"),
                                                [](const std::string& n) { return n != "ddptrain"; }))
      states[mode][name] = t;
  }
  ASSERT_EQ(states["on"].size(), states["off"].size());
  std::string names;
  for (const auto& [name, t] : states["on"]) names += name + " ";
  EXPECT_NE(names.find("mlp.4.bias"), std::string::npos) << "the Sequential's names are kept: " << names;
  for (const auto& [name, t] : states["off"]) {
    ASSERT_TRUE(states["on"].count(name)) << name;
    if (t.defined()) {
      EXPECT_TRUE(torch::equal(t, states["on"][name])) << name;
    }
  }
}

}  // namespace
