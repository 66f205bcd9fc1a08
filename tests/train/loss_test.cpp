// Losses and the broadcast guard that catches the seed template's bug.
#include "ddp/error.h"
#include "ddp/train/loss.h"
#include "support/testing.h"

namespace {

TEST(Loss, SeedBugIsRefusedNamingBothShapes) {
  // The seed: MSE between B x 1000 logits and a B x 1 scalar label.
  auto out = torch::randn({4, 1000});
  auto label = torch::randint(0, 100, {4, 1}).to(torch::kFloat);
  try {
    ddp::compute_loss(out, label, ddp::LossOptions().kind("mse"));
    FAIL() << "no error";
  } catch (const ddp::UserError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("[4, 1000]"), std::string::npos) << m;
    EXPECT_NE(m.find("[4, 1]"), std::string::npos) << m;
    EXPECT_NE(m.find("broadcast"), std::string::npos) << m;
  }
}

TEST(Loss, CrossEntropyChecksShapesAndTypes) {
  EXPECT_THROW(ddp::compute_loss(torch::randn({4, 10}), torch::zeros({4, 1}, torch::kLong), {}), ddp::UserError);
  EXPECT_THROW(ddp::compute_loss(torch::randn({4, 10}), torch::zeros({4}), {}), ddp::UserError);
  auto logits = torch::tensor({{2.0, 0.0, -1.0}, {0.5, 0.5, 3.0}});
  auto y = torch::tensor({0, 2}, torch::kLong);
  auto expected = torch::nll_loss(torch::log_softmax(logits, 1), y).item<double>();
  EXPECT_NEAR(ddp::compute_loss(logits, y, {}).item<double>(), expected, 1e-6);
}

TEST(Loss, LabelSmoothingMatchesItsDefinition) {
  auto logits = torch::tensor({{2.0, 0.0, -1.0}, {0.5, 0.5, 3.0}});
  auto y = torch::tensor({0, 2}, torch::kLong);
  const double eps = 0.1;
  // Target distribution: 1 - eps + eps/K on the label, eps/K elsewhere.
  auto logp = torch::log_softmax(logits, 1);
  auto target = torch::full({2, 3}, eps / 3);
  target[0][0] += 1 - eps;
  target[1][2] += 1 - eps;
  double expected = -(target * logp).sum(1).mean().item<double>();
  EXPECT_NEAR(ddp::compute_loss(logits, y, ddp::LossOptions().label_smoothing(eps)).item<double>(), expected, 1e-6);
}

TEST(Loss, RegressionLosses) {
  auto a = torch::tensor({1.0, 2.0, 3.0}), b = torch::tensor({1.0, 0.0, 6.0});
  EXPECT_NEAR(ddp::compute_loss(a, b, ddp::LossOptions().kind("mse")).item<double>(), (0 + 4 + 9) / 3.0, 1e-6);
  EXPECT_NEAR(ddp::compute_loss(a, b, ddp::LossOptions().kind("l1")).item<double>(), (0 + 2 + 3) / 3.0, 1e-6);
}

}  // namespace
