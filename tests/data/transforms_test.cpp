// Crop and flip: correct pixels on a hand-made image, and draws that depend
// only on (seed, epoch, rank, position).
#include <gtest/gtest.h>

#include <vector>

#include "ddp/data/transforms.h"
#include "ddp/error.h"

namespace {

using ddp::data::AugmentOptions;
using ddp::data::DrawKey;
using ddp::data::augment;

// `copies` copies of one 1 x 4 x 4 image holding 1..16, row by row.
torch::Tensor ramp_batch(int64_t copies) {
  return torch::arange(1, 17, torch::kFloat).view({1, 1, 4, 4}).repeat({copies, 1, 1, 1});
}

// The 4 x 4 window at (dy, dx) of the image padded by `pad` with `fill`.
torch::Tensor reference_crop(const torch::Tensor& image, int64_t pad, int64_t dy, int64_t dx,
                             double fill) {
  const auto padded = torch::constant_pad_nd(image, {pad, pad, pad, pad}, fill);
  return padded.narrow(-2, dy, image.size(-2)).narrow(-1, dx, image.size(-1));
}

TEST(Augment, FlipOnlyMirrorsAboutHalfTheSamples) {
  const auto x = ramp_batch(200);
  const auto y = augment(x, AugmentOptions().crop(false).flip(true), DrawKey{1, 0, 0}, 0);
  int flipped = 0;
  for (int64_t b = 0; b < 200; ++b) {
    if (torch::equal(y[b], x[b].flip({2}))) {
      ++flipped;
    } else {
      EXPECT_TRUE(torch::equal(y[b], x[b])) << "sample " << b << " is neither original nor mirror";
    }
  }
  EXPECT_GT(flipped, 70);
  EXPECT_LT(flipped, 130);
  // The mirror is left-right: the first row reads 4 3 2 1.
  const auto mirror = x[0].flip({2});
  EXPECT_EQ(mirror[0][0][0].item<float>(), 4.0f);
}

TEST(Augment, CropMatchesAPaddedWindow) {
  const int64_t pad = 1;
  const double fill = -5.0;
  const auto x = ramp_batch(300);
  const auto y = augment(x, AugmentOptions().pad(pad).flip(false).fill({fill}), DrawKey{2, 0, 0}, 0);
  std::vector<int> seen(9, 0);
  for (int64_t b = 0; b < 300; ++b) {
    int match = -1;
    for (int64_t dy = 0; dy <= 2 * pad; ++dy)
      for (int64_t dx = 0; dx <= 2 * pad; ++dx)
        if (torch::equal(y[b], reference_crop(x[b], pad, dy, dx, fill))) match = int(dy * 3 + dx);
    ASSERT_GE(match, 0) << "sample " << b << " is no padded window:\n" << y[b];
    ++seen[match];
  }
  for (int i = 0; i < 9; ++i) EXPECT_GT(seen[i], 0) << "window " << i << " never drawn";
}

TEST(Augment, CropAndFlipTogether) {
  const auto x = ramp_batch(300);
  const auto y = augment(x, AugmentOptions().pad(2), DrawKey{3, 0, 0}, 0);
  for (int64_t b = 0; b < 300; ++b) {
    bool found = false;
    for (int64_t dy = 0; dy <= 4 && !found; ++dy)
      for (int64_t dx = 0; dx <= 4 && !found; ++dx) {
        const auto window = reference_crop(x[b], 2, dy, dx, 0.0);
        found = torch::equal(y[b], window) || torch::equal(y[b], window.flip({2}));
      }
    ASSERT_TRUE(found) << "sample " << b << ":\n" << y[b];
  }
}

TEST(Augment, DrawsDependOnlyOnKeyAndPosition) {
  const auto x = torch::randn({16, 3, 8, 8});
  const AugmentOptions o;
  const DrawKey key{11, 4, 1};
  const auto whole = augment(x, o, key, 100);
  EXPECT_TRUE(torch::equal(whole, augment(x, o, key, 100)));
  // The second half, built alone at its own position, matches.
  EXPECT_TRUE(torch::equal(whole.narrow(0, 8, 8), augment(x.narrow(0, 8, 8), o, key, 108)));
  // Any change of seed, epoch, rank or position changes the draws.
  EXPECT_FALSE(torch::equal(whole, augment(x, o, DrawKey{12, 4, 1}, 100)));
  EXPECT_FALSE(torch::equal(whole, augment(x, o, DrawKey{11, 5, 1}, 100)));
  EXPECT_FALSE(torch::equal(whole, augment(x, o, DrawKey{11, 4, 0}, 100)));
  EXPECT_FALSE(torch::equal(whole, augment(x, o, key, 101)));
}

TEST(Augment, SameResultForAnyThreadCount) {
  const auto x = torch::randn({64, 1, 28, 28});
  const int threads = at::get_num_threads();
  at::set_num_threads(1);
  const auto one = augment(x, AugmentOptions(), DrawKey{5, 2, 0}, 0);
  at::set_num_threads(std::max(2, threads));
  const auto many = augment(x, AugmentOptions(), DrawKey{5, 2, 0}, 0);
  at::set_num_threads(threads);
  EXPECT_TRUE(torch::equal(one, many));
}

TEST(Augment, NothingToDoLeavesTheBatchAlone) {
  const auto x = torch::randn({4, 2, 5, 5});
  EXPECT_TRUE(torch::equal(augment(x, AugmentOptions().crop(false).flip(false), {}, 0), x));
  EXPECT_TRUE(torch::equal(augment(x, AugmentOptions().pad(0).flip(false), {}, 0), x));
}

TEST(Augment, DefaultPaddingFollowsImageSize) {
  EXPECT_EQ(ddp::data::crop_padding(AugmentOptions(), 32), 4);
  EXPECT_EQ(ddp::data::crop_padding(AugmentOptions(), 28), 2);
  EXPECT_EQ(ddp::data::crop_padding(AugmentOptions().pad(3), 28), 3);
}

TEST(Augment, BadOptionsAreUserErrors) {
  const auto x = torch::zeros({2, 3, 4, 4});
  EXPECT_THROW(augment(x, AugmentOptions().pad(4), {}, 0), ddp::UserError);
  EXPECT_THROW(augment(x, AugmentOptions().fill({1.0}), {}, 0), ddp::UserError);
}

TEST(Augment, TransformChangesOnlyTheInput) {
  ddp::data::Batch batch{ramp_batch(8), torch::arange(8)};
  const auto before = batch.input().clone();
  ddp::data::make_augment(AugmentOptions().pad(1))(batch, DrawKey{9, 0, 0}, 0);
  EXPECT_TRUE(torch::equal(batch.input(), augment(before, AugmentOptions().pad(1), {9, 0, 0}, 0)));
  EXPECT_TRUE(torch::equal(batch.target(), torch::arange(8)));
}

}  // namespace
