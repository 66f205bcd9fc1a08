// The synthetic dataset: reproducible, balanced, not readable off one
// pixel, and learnable by a linear model in a few hundred steps.
#include <gtest/gtest.h>

#include <vector>

#include "ddp/data/synthetic.h"
#include "ddp/data/tensor_dataset.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

using ddp::data::ImageTensorDataset;
using ddp::data::make_synthetic;

using ddp::testing::as_images;

TEST(Synthetic, ShapesNamesAndFlag) {
  const auto s = make_synthetic(100, 30, 1);
  EXPECT_TRUE(s.synthetic);
  EXPECT_EQ(s.train->size(), 100);
  EXPECT_EQ(s.test->size(), 30);
  EXPECT_EQ(s.train->input_shape(), (std::vector<int64_t>{1, 28, 28}));
  EXPECT_EQ(s.train->num_classes(), 10);
  EXPECT_NE(s.train->name().find("synthetic"), std::string::npos);
  EXPECT_NE(s.test->name().find("synthetic"), std::string::npos);
  ASSERT_EQ(s.mean.size(), 1u);
  ASSERT_EQ(s.std.size(), 1u);
  EXPECT_GT(s.std[0], 0.0);
}

TEST(Synthetic, DeterministicGivenSeedAndSizeIndependent) {
  const auto a = make_synthetic(500, 100, 7);
  const auto b = make_synthetic(500, 100, 7);
  EXPECT_TRUE(torch::equal(as_images(a.train).images(), as_images(b.train).images()));
  EXPECT_TRUE(torch::equal(as_images(a.test).labels(), as_images(b.test).labels()));
  // Sample i does not depend on how many are generated.
  const auto small = make_synthetic(120, 10, 7);
  EXPECT_TRUE(torch::equal(as_images(small.train).images(),
                           as_images(a.train).images().narrow(0, 0, 120)));
  // Another seed gives other data; train and test are different samples.
  const auto c = make_synthetic(500, 100, 8);
  EXPECT_FALSE(torch::equal(as_images(a.train).images(), as_images(c.train).images()));
  EXPECT_FALSE(torch::equal(as_images(a.train).images().narrow(0, 0, 100),
                            as_images(a.test).images()));
}

TEST(Synthetic, SameDataForAnyThreadCount) {
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = make_synthetic(600, 10, 3);
  at::set_num_threads(std::max(2, threads));
  const auto many = make_synthetic(600, 10, 3);
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(as_images(one.train).images(), as_images(many.train).images()));
}

TEST(Synthetic, BalancedClasses) {
  const auto s = make_synthetic(1000, 205, 0);
  EXPECT_TRUE(torch::equal(torch::bincount(as_images(s.train).labels()),
                           torch::full({10}, 100, torch::kLong)));
  const auto test_counts = torch::bincount(as_images(s.test).labels(), {}, 10);
  EXPECT_LE((test_counts.max() - test_counts.min()).item<int64_t>(), 1) << test_counts;
  // Not in a fixed cycle: the first blocks of 10 are ordered differently.
  const auto l = as_images(s.train).labels();
  EXPECT_FALSE(torch::equal(l.narrow(0, 0, 10), l.narrow(0, 10, 10)));
}

TEST(Synthetic, NormalisedWithItsOwnStatistics) {
  const auto s = make_synthetic(2000, 10, 0);
  std::vector<int64_t> all(2000);
  for (int64_t i = 0; i < 2000; ++i) all[i] = i;
  const auto x = s.train->get_batch(all).input();
  EXPECT_NEAR(x.mean().item<double>(), 0.0, 1e-3);
  EXPECT_NEAR(x.std().item<double>(), 1.0, 1e-3);
}

// The best classifier that looks at one pixel only (a lookup table from the
// pixel's value, in 16 bins, to the most frequent class) stays far from the
// accuracy a model reaches.
TEST(Synthetic, NoSinglePixelGivesTheClass) {
  const auto s = make_synthetic(3000, 10, 0);
  const auto& d = as_images(s.train);
  const int64_t n = d.size(), pixels = 28 * 28;
  const auto bins = d.images().view({n, pixels}).to(torch::kLong).div(16, "floor");  // 0..15
  const auto pixel = torch::arange(pixels, torch::kLong).unsqueeze(0).expand({n, pixels});
  const auto label = d.labels().unsqueeze(1).expand({n, pixels});
  const auto cell = (pixel * 16 + bins) * 10 + label;
  const auto counts = torch::bincount(cell.reshape(-1), {}, pixels * 16 * 10)
                          .view({pixels, 16, 10});
  const auto best = std::get<0>(counts.max(2)).sum(1).to(torch::kDouble) / n;  // per pixel
  const double top = best.max().item<double>();
  EXPECT_LT(top, 0.35) << "one pixel predicts the class " << top * 100 << "% of the time";
  EXPECT_GT(top, 0.12);  // but pixels do carry signal
}

TEST(Synthetic, LinearModelLearnsIt) {
  torch::manual_seed(0);
  const auto s = make_synthetic(4000, 1000, 0);
  std::vector<int64_t> all_train(4000), all_test(1000);
  for (int64_t i = 0; i < 4000; ++i) all_train[i] = i;
  for (int64_t i = 0; i < 1000; ++i) all_test[i] = i;
  const auto train = s.train->get_batch(all_train);
  const auto test = s.test->get_batch(all_test);

  torch::nn::Linear model(28 * 28, 10);
  torch::optim::Adam opt(model->parameters(), torch::optim::AdamOptions(1e-3));
  for (int step = 0; step < 300; ++step) {
    const auto idx = torch::randint(4000, {64}, torch::kLong);
    const auto x = train.input().index_select(0, idx).flatten(1);
    const auto y = train.target().index_select(0, idx);
    opt.zero_grad();
    const auto loss = torch::nn::functional::cross_entropy(model->forward(x), y);
    loss.backward();
    opt.step();
  }
  torch::NoGradGuard no_grad;
  const auto predicted = model->forward(test.input().flatten(1)).argmax(1);
  const double accuracy = predicted.eq(test.target()).to(torch::kDouble).mean().item<double>();
  EXPECT_GT(accuracy, 0.85) << "chance is 0.1";
}

TEST(Synthetic, BadSizesAreUserErrors) {
  EXPECT_THROW(make_synthetic(0, 10, 0), ddp::UserError);
  EXPECT_THROW(make_synthetic(10, -1, 0), ddp::UserError);
}

}  // namespace
