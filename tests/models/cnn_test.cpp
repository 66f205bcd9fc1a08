// The small CNN: shapes for any channel count and input of 8 px or more, its
// size, SyncBatchNorm-ready norms, and that it can fit a batch.
#include <map>

#include "ddp/models/cnn.h"
#include "support/testing.h"

namespace ddp::models {
namespace {

using Shape = std::vector<int64_t>;

TEST(CnnTest, OutputShapesForChannelsAndSizes) {
  torch::NoGradGuard no_grad;
  struct Case {
    int64_t channels, h, w, grid;
  };
  for (const auto& c : std::vector<Case>{{1, 28, 28, 7}, {3, 32, 32, 7}, {1, 8, 8, 2},
                                         {3, 96, 64, 7}, {2, 28, 40, 7}}) {
    SCOPED_TRACE(std::to_string(c.channels) + "x" + std::to_string(c.h) + "x" + std::to_string(c.w));
    auto net = Cnn(CnnOptions().in_channels(c.channels).num_classes(7).grid(c.grid));
    auto y = net->forward(torch::randn({3, c.channels, c.h, c.w}));
    EXPECT_EQ(y.sizes().vec(), (Shape{3, 7}));
  }
}

TEST(CnnTest, LayersAndParameterCount) {
  auto net = Cnn(CnnOptions());
  std::map<std::string, Shape> s;
  for (const auto& p : net->named_parameters()) s[p.key()] = p.value().sizes().vec();
  EXPECT_EQ(s.at("conv1.weight"), (Shape{32, 1, 3, 3}));
  EXPECT_EQ(s.at("conv2.weight"), (Shape{64, 32, 3, 3}));
  EXPECT_EQ(s.at("fc1.weight"), (Shape{128, 64 * 7 * 7}));
  EXPECT_EQ(s.at("fc2.weight"), (Shape{10, 128}));
  int64_t n = 0;
  for (const auto& p : net->parameters()) n += p.numel();
  // conv 288 + 18432, batch norms 64 + 128, fc 401536 + 1290.
  EXPECT_EQ(n, 421738);
}

TEST(CnnTest, BatchNormsAreDdpBatchNorm) {
  auto net = Cnn(CnnOptions().in_channels(3));
  int ours = 0;
  for (const auto& m : net->modules()) {
    if (m->as<BatchNorm>()) ++ours;
    EXPECT_EQ(m->as<torch::nn::BatchNorm2d>(), nullptr);
  }
  EXPECT_EQ(ours, 2);
}

TEST(CnnTest, FitsASmallBatch) {
  torch::manual_seed(0);
  auto net = Cnn(CnnOptions());
  auto x = torch::randn({32, 1, 28, 28});
  auto y = torch::randint(0, 10, {32}, torch::kLong);
  torch::optim::Adam opt(net->parameters(), torch::optim::AdamOptions(1e-3));
  double first = 0, last = 0;
  for (int step = 0; step < 30; ++step) {
    opt.zero_grad();
    auto loss = torch::nn::functional::cross_entropy(net->forward(x), y);
    loss.backward();
    opt.step();
    (step == 0 ? first : last) = loss.item<double>();
  }
  EXPECT_LT(last, 0.2 * first);
  net->eval();
  torch::NoGradGuard no_grad;
  EXPECT_GT(net->forward(x).argmax(1).eq(y).to(torch::kFloat).mean().item<double>(), 0.9);
}

}  // namespace
}  // namespace ddp::models
