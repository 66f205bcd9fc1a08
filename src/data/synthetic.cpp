// Rendering of the synthetic dataset.
#include "ddp/data/synthetic.h"

#include <ATen/CPUGeneratorImpl.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <numeric>
#include <vector>

#include "ddp/data/counter_rng.h"
#include "ddp/data/identity.h"
#include "ddp/data/tensor_dataset.h"
#include "ddp/error.h"

namespace ddp::data {
namespace {

constexpr int64_t kClasses = 10;
constexpr int kSide = 28;
constexpr int kGrid = 4;                    // 4 x 4 cells of 7 x 7 pixels
constexpr int kBlobs = 4;                   // lit cells per class
constexpr int kMaxShared = 2;               // cells any two classes may share
constexpr int kMaxShift = 3;                // whole-image shift, pixels each way
constexpr double kJitter = 1.0;             // extra per-blob shift, pixels each way
constexpr double kNoise = 0.40;             // half-width of the pixel noise, 0..1 scale

// Tags that keep the hash streams of different purposes apart.
constexpr uint64_t kTagPattern = 0x70617474, kTagLabels = 0x6c61626c, kTagSample = 0x73616d70;

struct Blob {
  double cy, cx, sigma;
};
using Pattern = std::array<Blob, kBlobs>;

// Each class lights four grid cells, with a class-specific offset and width
// per blob. Cell sets are redrawn until every pair of classes shares at most
// kMaxShared cells; that keeps the classes apart without making any one of
// them own a pixel.
std::array<Pattern, kClasses> make_patterns(uint64_t seed) {
  std::array<Pattern, kClasses> patterns{};
  std::vector<std::array<int, kBlobs>> cells;
  for (int64_t c = 0; c < kClasses; ++c) {
    for (uint64_t attempt = 0;; ++attempt) {
      KeyedRandom rng(hash_words({seed, kTagPattern, static_cast<uint64_t>(c), attempt}));
      std::array<int, kGrid * kGrid> order{};
      std::iota(order.begin(), order.end(), 0);
      for (int i = 0; i < kBlobs; ++i)  // partial Fisher-Yates: the first kBlobs
        std::swap(order[i], order[i + rng.below(kGrid * kGrid - i)]);
      std::array<int, kBlobs> mine{};
      std::copy_n(order.begin(), kBlobs, mine.begin());
      bool distinct = true;
      for (const auto& other : cells) {
        int shared = 0;
        for (int a : mine) shared += std::count(other.begin(), other.end(), a);
        distinct = distinct && shared <= kMaxShared;
      }
      if (!distinct) continue;
      cells.push_back(mine);
      // Off-centre by up to 1.5 pixels, so two classes sharing a cell still
      // draw it differently.
      const double pitch = kSide / static_cast<double>(kGrid);
      for (int b = 0; b < kBlobs; ++b) {
        patterns[c][b] = {(mine[b] / kGrid + 0.5) * pitch - 0.5 + rng.uniform(-1.5, 1.5),
                          (mine[b] % kGrid + 0.5) * pitch - 0.5 + rng.uniform(-1.5, 1.5),
                          rng.uniform(1.6, 2.8)};
      }
      break;
    }
  }
  return patterns;
}

// Labels come in blocks of 10 holding each class once, in a shuffled order,
// so any prefix is balanced to within one sample per class.
torch::Tensor make_labels(int64_t n, uint64_t seed, uint64_t split) {
  auto labels = torch::empty({n}, torch::kLong);
  int64_t* out = labels.data_ptr<int64_t>();
  for (int64_t block = 0; block * kClasses < n; ++block) {
    KeyedRandom rng(hash_words({seed, kTagLabels, split, static_cast<uint64_t>(block)}));
    std::array<int64_t, kClasses> order{};
    std::iota(order.begin(), order.end(), 0);
    for (int64_t i = kClasses - 1; i > 0; --i) std::swap(order[i], order[rng.below(i + 1)]);
    for (int64_t i = 0; i < kClasses && block * kClasses + i < n; ++i)
      out[block * kClasses + i] = order[i];
  }
  return labels;
}

void render(const Pattern& pattern, KeyedRandom& rng, uint8_t* out) {
  const double dy = static_cast<double>(rng.below(2 * kMaxShift + 1) - kMaxShift);
  const double dx = static_cast<double>(rng.below(2 * kMaxShift + 1) - kMaxShift);
  // The class's blobs, each nudged and dimmed a little, plus one fainter
  // distractor in a random cell, which no class owns.
  std::array<Blob, kBlobs + 1> blobs{};
  std::array<double, kBlobs + 1> brightness{};
  for (int b = 0; b < kBlobs; ++b) {
    blobs[b] = {pattern[b].cy + dy + rng.uniform(-kJitter, kJitter),
                pattern[b].cx + dx + rng.uniform(-kJitter, kJitter), pattern[b].sigma};
    brightness[b] = rng.uniform(0.55, 1.0);
  }
  const int64_t cell = rng.below(kGrid * kGrid);
  const double pitch = kSide / static_cast<double>(kGrid);
  blobs[kBlobs] = {(cell / kGrid + 0.5) * pitch - 0.5 + rng.uniform(-kJitter, kJitter),
                   (cell % kGrid + 0.5) * pitch - 0.5 + rng.uniform(-kJitter, kJitter),
                   rng.uniform(1.6, 2.8)};
  brightness[kBlobs] = rng.uniform(0.3, 0.6);

  // A Gaussian blob is separable, so 2 x 28 exponentials per blob suffice.
  std::array<std::array<double, kSide>, kBlobs + 1> gy{}, gx{};
  for (size_t b = 0; b < blobs.size(); ++b) {
    const double inv = 1.0 / (2.0 * blobs[b].sigma * blobs[b].sigma);
    for (int i = 0; i < kSide; ++i) {
      gy[b][i] = brightness[b] * std::exp(-(i - blobs[b].cy) * (i - blobs[b].cy) * inv);
      gx[b][i] = std::exp(-(i - blobs[b].cx) * (i - blobs[b].cx) * inv);
    }
  }
  for (int y = 0; y < kSide; ++y) {
    for (int x = 0; x < kSide; ++x) {
      double v = 0;
      for (size_t b = 0; b < blobs.size(); ++b) v += gy[b][y] * gx[b][x];
      v = std::min(v, 1.0) + kNoise * (rng.uniform() + rng.uniform() - 1.0);  // triangular noise
      out[y * kSide + x] = static_cast<uint8_t>(std::lround(std::clamp(v, 0.0, 1.0) * 255.0));
    }
  }
}

torch::Tensor make_images(const torch::Tensor& labels, const std::array<Pattern, kClasses>& patterns,
                          uint64_t seed, uint64_t split) {
  const int64_t n = labels.size(0);
  auto images = torch::empty({n, 1, kSide, kSide}, torch::kByte);
  uint8_t* base = images.data_ptr<uint8_t>();
  const int64_t* label = labels.data_ptr<int64_t>();
  at::parallel_for(0, n, 256, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      KeyedRandom rng(hash_words({seed, kTagSample, split, static_cast<uint64_t>(i)}));
      render(patterns[label[i]], rng, base + i * kSide * kSide);
    }
  });
  return images;
}

}  // namespace

Splits make_synthetic(int64_t n_train, int64_t n_test, uint64_t seed) {
  check_user(n_train >= 1 && n_test >= 0,
             "synthetic dataset sizes " + std::to_string(n_train) + " (train) / " +
                 std::to_string(n_test) + " (test) are invalid.",
             "ask for at least one train sample and no negative count.");
  const auto patterns = make_patterns(seed);
  const torch::Tensor train_labels = make_labels(n_train, seed, 0);
  const torch::Tensor test_labels = make_labels(n_test, seed, 1);
  const torch::Tensor train_images = make_images(train_labels, patterns, seed, 0);
  const torch::Tensor test_images = make_images(test_labels, patterns, seed, 1);

  // Normalise with the train split's own statistics, as for real data.
  // Integer sums over the bytes are exact and need no float copy.
  uint64_t sum = 0, sum_sq = 0;
  const uint8_t* p = train_images.data_ptr<uint8_t>();
  for (int64_t i = 0, n = train_images.numel(); i < n; ++i) {
    sum += p[i];
    sum_sq += uint64_t{p[i]} * p[i];
  }
  const double count = static_cast<double>(train_images.numel());
  const double mean = static_cast<double>(sum) / count / 255.0;
  const double var = static_cast<double>(sum_sq) / count / (255.0 * 255.0) - mean * mean;
  const double std = std::sqrt(std::max(var, 1e-12));

  Splits splits;
  splits.mean = {mean};
  splits.std = {std};
  splits.synthetic = true;
  // Of the images made, not of the parameters that made them: a resumed
  // run of another ddptrain whose generator draws differently stops.
  splits.train = std::make_shared<ImageTensorDataset>(train_images, train_labels, splits.mean, splits.std, kClasses,
                                                      "synthetic (train)",
                                                      Fingerprint().add(train_images).add(train_labels).hex());
  splits.test = std::make_shared<ImageTensorDataset>(test_images, test_labels, splits.mean, splits.std, kClasses,
                                                     "synthetic (test)",
                                                     Fingerprint().add(test_images).add(test_labels).hex());
  return splits;
}

namespace {

class DiscRadiusDataset : public Dataset {
 public:
  DiscRadiusDataset(int64_t size, uint64_t seed, std::string name) : size_(size), seed_(seed), name_(std::move(name)) {}
  int64_t size() const override { return size_; }
  Example get(int64_t index) const override {
    auto gen = at::make_generator<at::CPUGeneratorImpl>(seed_ * 1000003 + static_cast<uint64_t>(index));
    auto u = torch::rand({4}, gen);
    const double radius = 3 + 8 * u[0].item<double>();  // 3 .. 11 pixels
    const double cy = radius + (27 - 2 * radius) * u[1].item<double>();
    const double cx = radius + (27 - 2 * radius) * u[2].item<double>();
    auto rows = torch::arange(28, torch::kFloat).view({28, 1}), cols = torch::arange(28, torch::kFloat).view({1, 28});
    auto dist = ((rows - cy).pow(2) + (cols - cx).pow(2)).sqrt();
    auto disc = torch::sigmoid((radius - dist) * 2.0) * (1.5 + 0.5 * u[3].item<double>());
    auto image = (disc + 0.3 * torch::randn({28, 28}, gen)).unsqueeze(0);
    return {image, torch::tensor({static_cast<float>((radius - 3) / 8)})};
  }
  std::vector<int64_t> input_shape() const override { return {1, 28, 28}; }
  std::string name() const override { return name_; }
  // Made per sample from (seed, index) alone: its parameters say it all.
  std::string fingerprint() const override { return "disc-radius seed " + std::to_string(seed_); }

 private:
  int64_t size_;
  uint64_t seed_;
  std::string name_;
};

}  // namespace

Splits make_synthetic_regression(int64_t n_train, int64_t n_test, uint64_t seed) {
  Splits s;
  s.train = std::make_shared<DiscRadiusDataset>(n_train, 2 * seed + 1, "disc-radius (train)");
  s.test = std::make_shared<DiscRadiusDataset>(n_test, 2 * seed + 2, "disc-radius (test)");
  s.mean = {0.0};
  s.std = {1.0};
  s.synthetic = true;
  return s;
}

}  // namespace ddp::data
