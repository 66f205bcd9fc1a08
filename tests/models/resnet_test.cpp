// ResNet: torchvision-identical state_dict names and shapes (against a key
// list that torchvision produced, when present, and hard-coded spot checks),
// torchvision's parameter counts, both stems, and initialisation.
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>

#include "ddp/models/resnet.h"
#include "support/testing.h"

namespace ddp::models {
namespace {

using Shape = std::vector<int64_t>;
using Entries = std::vector<std::pair<std::string, Shape>>;

ResNet make(int64_t depth, int64_t classes = 10, int64_t channels = 3,
            ResNetStem stem = ResNetStem::kImageNet) {
  return ResNet(ResNetOptions(depth).num_classes(classes).in_channels(channels).stem(stem));
}

// The C++ counterpart of state_dict(): parameters, then buffers.
std::map<std::string, Shape> state_shapes(torch::nn::Module& m) {
  std::map<std::string, Shape> out;
  for (const auto& p : m.named_parameters()) out[p.key()] = p.value().sizes().vec();
  for (const auto& b : m.named_buffers()) out[b.key()] = b.value().sizes().vec();
  return out;
}

bool is_buffer_name(const std::string& name) {
  for (const char* suffix : {".running_mean", ".running_var", ".num_batches_tracked"}) {
    const std::string s(suffix);
    if (name.size() > s.size() && name.compare(name.size() - s.size(), s.size(), s) == 0) return true;
  }
  return false;
}

Shape stride_of(const torch::nn::Conv2dImpl& conv) {
  const auto& s = *conv.options.stride();
  return {s[0], s[1]};
}

int64_t parameter_count(torch::nn::Module& m) {
  int64_t n = 0;
  for (const auto& p : m.parameters()) n += p.numel();
  return n;
}

TEST(ResNetTest, ParameterCountsEqualTorchvision) {
  // torchvision.models.resnetN(num_classes=1000): sum(p.numel() for p in m.parameters()).
  EXPECT_EQ(parameter_count(*make(18, 1000)), 11689512);
  EXPECT_EQ(parameter_count(*make(34, 1000)), 21797672);
  EXPECT_EQ(parameter_count(*make(50, 1000)), 25557032);
}

TEST(ResNetTest, StateDictMatchesTorchvisionKeyFile) {
  const std::string path = std::string(DDP_TEST_DATA_DIR) + "/resnet_keys.json";
  if (!std::filesystem::exists(path)) {
    GTEST_SKIP() << path << " not generated yet (torchvision key list, num_classes=10)";
  }
  std::ifstream f(path);
  const auto doc = nlohmann::json::parse(f);
  ASSERT_TRUE(doc.contains("models"));
  for (const auto& [name, depth] : std::vector<std::pair<std::string, int64_t>>{
           {"resnet18", 18}, {"resnet34", 34}, {"resnet50", 50}}) {
    SCOPED_TRACE(name + " (torch " + doc.value("torch", std::string("?")) + ")");
    ASSERT_TRUE(doc["models"].contains(name));
    Entries expected;
    for (const auto& e : doc["models"][name]) {
      expected.emplace_back(e[0].get<std::string>(), e[1].get<Shape>());
    }
    auto net = make(depth);
    const auto ours = state_shapes(*net);
    EXPECT_EQ(ours.size(), expected.size());
    for (const auto& [key, shape] : expected) {
      auto it = ours.find(key);
      if (it == ours.end()) {
        ADD_FAILURE() << "missing " << key;
      } else {
        EXPECT_EQ(it->second, shape) << key;
      }
    }
    // Same enumeration order as PyTorch, so positional optimizer state lines up too.
    std::vector<std::string> expected_params, our_params;
    for (const auto& e : expected) {
      if (!is_buffer_name(e.first)) expected_params.push_back(e.first);
    }
    for (const auto& p : net->named_parameters()) our_params.push_back(p.key());
    EXPECT_EQ(our_params, expected_params);
  }
}

TEST(ResNetTest, StateDictSpotChecksAgainstTorchvisionNames) {
  {
    auto net = make(18);
    const auto s = state_shapes(*net);
    EXPECT_EQ(s.size(), 122u);  // len(torchvision.models.resnet18().state_dict())
    EXPECT_EQ(s.at("conv1.weight"), (Shape{64, 3, 7, 7}));
    EXPECT_EQ(s.at("bn1.running_var"), (Shape{64}));
    EXPECT_EQ(s.at("bn1.num_batches_tracked"), (Shape{}));
    EXPECT_EQ(s.count("layer1.0.downsample.0.weight"), 0u);
    EXPECT_EQ(s.at("layer1.1.conv2.weight"), (Shape{64, 64, 3, 3}));
    EXPECT_EQ(s.at("layer2.0.downsample.0.weight"), (Shape{128, 64, 1, 1}));
    EXPECT_EQ(s.at("layer2.0.downsample.1.running_mean"), (Shape{128}));
    EXPECT_EQ(s.count("layer2.1.downsample.0.weight"), 0u);
    EXPECT_EQ(s.at("layer4.1.bn2.weight"), (Shape{512}));
    EXPECT_EQ(s.count("layer4.2.conv1.weight"), 0u);
    EXPECT_EQ(s.at("fc.weight"), (Shape{10, 512}));
    EXPECT_EQ(s.at("fc.bias"), (Shape{10}));
  }
  {
    auto net = make(34);
    const auto s = state_shapes(*net);
    EXPECT_EQ(s.size(), 218u);
    EXPECT_EQ(s.at("layer3.5.conv2.weight"), (Shape{256, 256, 3, 3}));
    EXPECT_EQ(s.count("layer3.6.conv1.weight"), 0u);
    EXPECT_EQ(s.at("fc.weight"), (Shape{10, 512}));
  }
  {
    auto net = make(50);
    const auto s = state_shapes(*net);
    EXPECT_EQ(s.size(), 320u);
    EXPECT_EQ(s.at("layer1.0.conv1.weight"), (Shape{64, 64, 1, 1}));
    EXPECT_EQ(s.at("layer1.0.conv3.weight"), (Shape{256, 64, 1, 1}));
    EXPECT_EQ(s.at("layer1.0.downsample.0.weight"), (Shape{256, 64, 1, 1}));
    EXPECT_EQ(s.at("layer1.1.conv1.weight"), (Shape{64, 256, 1, 1}));
    EXPECT_EQ(s.count("layer1.1.downsample.0.weight"), 0u);
    EXPECT_EQ(s.at("layer2.0.conv2.weight"), (Shape{128, 128, 3, 3}));
    EXPECT_EQ(s.at("layer4.2.bn3.weight"), (Shape{2048}));
    EXPECT_EQ(s.at("fc.weight"), (Shape{10, 2048}));
  }
}

TEST(ResNetTest, StrideSitsWhereTorchvisionPutsIt) {
  auto r50 = make(50);
  auto* b = r50->layer2[0]->as<Bottleneck>();
  ASSERT_NE(b, nullptr);
  EXPECT_EQ(stride_of(*b->conv1), (Shape{1, 1}));
  EXPECT_EQ(stride_of(*b->conv2), (Shape{2, 2}));  // v1.5: stride on the 3x3
  auto* d = b->downsample[0]->as<torch::nn::Conv2d>();
  ASSERT_NE(d, nullptr);
  EXPECT_EQ(stride_of(*d), (Shape{2, 2}));
  EXPECT_NE(b->downsample[1]->as<BatchNorm>(), nullptr);
}

TEST(ResNetTest, OutputShapesForEachDepthStemAndChannels) {
  torch::NoGradGuard no_grad;
  struct Case {
    int64_t depth, channels;
    ResNetStem stem;
    int64_t h, w;
    Shape features;
  };
  const std::vector<Case> cases = {
      {18, 1, ResNetStem::kSmall, 28, 28, {2, 512, 4, 4}},
      {18, 3, ResNetStem::kSmall, 32, 32, {2, 512, 4, 4}},
      {18, 3, ResNetStem::kImageNet, 64, 64, {2, 512, 2, 2}},
      {18, 1, ResNetStem::kImageNet, 224, 224, {2, 512, 7, 7}},
      {34, 3, ResNetStem::kSmall, 32, 40, {2, 512, 4, 5}},
      {34, 1, ResNetStem::kImageNet, 32, 32, {2, 512, 1, 1}},
      {50, 3, ResNetStem::kSmall, 32, 32, {2, 2048, 4, 4}},
      {50, 1, ResNetStem::kImageNet, 64, 64, {2, 2048, 2, 2}},
  };
  for (const auto& c : cases) {
    SCOPED_TRACE("resnet" + std::to_string(c.depth) + " C=" + std::to_string(c.channels) + " " +
                 std::to_string(c.h) + "x" + std::to_string(c.w));
    auto net = make(c.depth, 10, c.channels, c.stem);
    net->eval();
    auto x = torch::randn({2, c.channels, c.h, c.w});
    EXPECT_EQ(net->forward_features(x).sizes().vec(), c.features);
    EXPECT_EQ(net->forward(x).sizes().vec(), (Shape{2, 10}));
  }
}

TEST(ResNetTest, SmallStemIsA3x3Stride1ConvWithoutMaxPool) {
  torch::NoGradGuard no_grad;
  auto net = make(18, 10, 1, ResNetStem::kSmall);
  EXPECT_EQ(net->conv1->weight.sizes().vec(), (Shape{64, 1, 3, 3}));
  EXPECT_EQ(stride_of(*net->conv1), (Shape{1, 1}));
  // Full resolution into layer1: no stride and no max-pool in the stem.
  net->eval();
  auto stem = torch::relu(net->bn1(net->conv1(torch::randn({1, 1, 28, 28}))));
  EXPECT_EQ(net->layer1->forward(stem).sizes().vec(), (Shape{1, 64, 28, 28}));
  for (const auto& m : net->named_modules()) {
    EXPECT_EQ(m.value()->as<torch::nn::MaxPool2d>(), nullptr) << m.key();
  }
}

TEST(ResNetTest, EveryBatchNormIsDdpBatchNorm) {
  // convert_sync_batchnorm() can only switch ddp::BatchNorm.
  for (const auto& [depth, expected] : std::vector<std::pair<int64_t, int>>{{18, 20}, {50, 53}}) {
    auto net = make(depth);
    int ours = 0;
    for (const auto& m : net->modules()) {
      if (m->as<BatchNorm>()) ++ours;
      EXPECT_EQ(m->as<torch::nn::BatchNorm2d>(), nullptr);
    }
    EXPECT_EQ(ours, expected) << "resnet" << depth;
  }
}

TEST(ResNetTest, InitialisationFollowsTorchvision) {
  torch::manual_seed(0);
  auto net = make(18);
  // He-normal with fan_out: std = sqrt(2 / (out_channels * k * k)).
  const auto w = net->layer4[0]->as<BasicBlock>()->conv2->weight;
  EXPECT_NEAR(w.std().item<double>(), std::sqrt(2.0 / (512 * 9)), 0.02 * std::sqrt(2.0 / (512 * 9)));
  EXPECT_NEAR(w.mean().item<double>(), 0.0, 1e-3);
  for (const auto& m : net->modules()) {
    if (auto* bn = m->as<BatchNorm>()) {
      EXPECT_TRUE(bn->weight.eq(1).all().item<bool>());
      EXPECT_TRUE(bn->bias.eq(0).all().item<bool>());
    }
  }
}

TEST(ResNetTest, ZeroInitResidualZeroesTheLastNormOfEachBranch) {
  auto r18 = ResNet(ResNetOptions(18).zero_init_residual(true));
  for (const auto& m : r18->modules()) {
    if (auto* b = m->as<BasicBlock>()) {
      EXPECT_TRUE(b->bn2->weight.eq(0).all().item<bool>());
      EXPECT_TRUE(b->bn1->weight.eq(1).all().item<bool>());
    }
  }
  EXPECT_TRUE(r18->bn1->weight.eq(1).all().item<bool>());
  auto r50 = ResNet(ResNetOptions(50).zero_init_residual(true));
  int blocks = 0;
  for (const auto& m : r50->modules()) {
    if (auto* b = m->as<Bottleneck>()) {
      ++blocks;
      EXPECT_TRUE(b->bn3->weight.eq(0).all().item<bool>());
      EXPECT_TRUE(b->bn2->weight.eq(1).all().item<bool>());
    }
  }
  EXPECT_EQ(blocks, 16);
}

TEST(ResNetTest, BackwardReachesEveryParameter) {
  auto net = make(18, 10, 1, ResNetStem::kSmall);
  auto y = net->forward(torch::randn({4, 1, 16, 16}));
  torch::nn::functional::cross_entropy(y, torch::tensor({0, 1, 2, 3})).backward();
  for (const auto& p : net->named_parameters()) {
    ASSERT_TRUE(p.value().grad().defined()) << p.key();
    EXPECT_GT(p.value().grad().abs().sum().item<double>(), 0.0) << p.key();
  }
}

}  // namespace
}  // namespace ddp::models
