// The Loader: batches in index order for any worker count, bounded
// read-ahead, clean early stop and worker errors rethrown in order.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <numeric>
#include <stdexcept>
#include <thread>
#include <vector>

#include "ddp/data/loader.h"
#include "ddp/data/synthetic.h"
#include "ddp/data/transforms.h"
#include "ddp/error.h"

namespace {

using ddp::data::Batch;
using ddp::data::Example;
using ddp::data::Loader;
using ddp::data::LoaderOptions;

// Example i is the scalar input {i} with target i, built by the default
// get_batch. It counts calls, can be slowed down, and throws for one index.
class CountingDataset : public ddp::data::Dataset {
 public:
  explicit CountingDataset(int64_t n, int64_t throw_at = -1, int sleep_ms = 0)
      : n_(n), throw_at_(throw_at), sleep_ms_(sleep_ms) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override {
    if (sleep_ms_ > 0) std::this_thread::sleep_for(std::chrono::milliseconds(sleep_ms_));
    if (i == throw_at_) throw std::runtime_error("cannot read sample " + std::to_string(i));
    ++calls;
    return {torch::full({1}, static_cast<float>(i)), torch::tensor(i)};
  }
  std::vector<int64_t> input_shape() const override { return {1}; }
  int64_t num_classes() const override { return 0; }
  std::string name() const override { return "counting"; }

  mutable std::atomic<int64_t> calls{0};

 private:
  int64_t n_, throw_at_;
  int sleep_ms_;
};

// A random order of 0..n-1, from torch's global generator.
std::vector<int64_t> shuffled(int64_t n) {
  auto perm = torch::randperm(n, torch::TensorOptions().dtype(torch::kLong));
  return {perm.data_ptr<int64_t>(), perm.data_ptr<int64_t>() + n};
}

std::vector<Batch> drain(Loader& loader) {
  std::vector<Batch> out;
  while (auto b = loader.next()) out.push_back(std::move(*b));
  return out;
}

TEST(Loader, BatchesFollowTheIndexOrder) {
  torch::manual_seed(0);
  auto data = std::make_shared<CountingDataset>(50);
  const auto indices = shuffled(50);
  for (int64_t workers : {0, 1, 3}) {
    Loader loader(data, indices, LoaderOptions(8).workers(workers));
    EXPECT_EQ(loader.num_batches(), 7);
    const auto batches = drain(loader);
    ASSERT_EQ(batches.size(), 7u);
    std::vector<int64_t> seen;
    for (const auto& b : batches)
      for (int64_t j = 0; j < b.target().size(0); ++j) seen.push_back(b.target()[j].item<int64_t>());
    EXPECT_EQ(seen, indices) << "workers=" << workers;
    EXPECT_EQ(batches.back().input().size(0), 2);  // 50 = 6 * 8 + 2
    EXPECT_EQ(batches.front().input().sizes(), (std::vector<int64_t>{8, 1}));
    EXPECT_EQ(loader.batches_done(), 7);
    EXPECT_FALSE(loader.next().has_value());  // stays exhausted
  }
}

TEST(Loader, DropLastDropsThePartialBatch) {
  auto data = std::make_shared<CountingDataset>(50);
  std::vector<int64_t> indices(50);
  std::iota(indices.begin(), indices.end(), 0);
  for (int64_t workers : {0, 2}) {
    Loader loader(data, indices, LoaderOptions(8).drop_last(true).workers(workers));
    EXPECT_EQ(loader.num_batches(), 6);
    const auto batches = drain(loader);
    ASSERT_EQ(batches.size(), 6u);
    for (const auto& b : batches) EXPECT_EQ(b.input().size(0), 8);
    EXPECT_EQ(batches.back().target()[7].item<int64_t>(), 47);
  }
  Loader exact(data, std::vector<int64_t>(indices.begin(), indices.begin() + 48),
               LoaderOptions(8).drop_last(true));
  EXPECT_EQ(exact.num_batches(), 6);
}

TEST(Loader, EmptyIndexList) {
  auto data = std::make_shared<CountingDataset>(10);
  Loader loader(data, {}, LoaderOptions(4).workers(2));
  EXPECT_EQ(loader.num_batches(), 0);
  EXPECT_FALSE(loader.next().has_value());
}

TEST(Loader, SameBatchesForAnyWorkerCountWithAugmentation) {
  const auto splits = ddp::data::make_synthetic(300, 10, 5);
  torch::manual_seed(1);
  const auto indices = shuffled(300);
  auto options = [](int64_t workers) {
    return LoaderOptions(32)
        .workers(workers)
        .prefetch(3)
        .seed(7)
        .epoch(2)
        .rank(1)
        .transform(ddp::data::make_augment(ddp::data::AugmentOptions()));
  };
  Loader reference_loader(splits.train, indices, options(0));
  const auto reference = drain(reference_loader);
  ASSERT_EQ(reference.size(), 10u);
  for (int64_t workers : {1, 3}) {
    Loader loader(splits.train, indices, options(workers));
    const auto batches = drain(loader);
    ASSERT_EQ(batches.size(), reference.size());
    for (size_t k = 0; k < batches.size(); ++k) {
      EXPECT_TRUE(torch::equal(batches[k].input(), reference[k].input())) << "batch " << k;
      EXPECT_TRUE(torch::equal(batches[k].target(), reference[k].target())) << "batch " << k;
    }
  }
  // The transform ran: batch 0 differs from the plain gather.
  const std::vector<int64_t> first(indices.begin(), indices.begin() + 32);
  EXPECT_FALSE(torch::equal(reference[0].input(), splits.train->get_batch(first).input()));
}

TEST(Loader, ReadsAtMostPrefetchBatchesAhead) {
  auto data = std::make_shared<CountingDataset>(400);
  std::vector<int64_t> indices(400);
  std::iota(indices.begin(), indices.end(), 0);
  // Waits until the workers have read `expected` samples, then a little
  // longer to catch any that read further.
  auto settle = [&](int64_t expected) {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    while (data->calls.load() < expected && std::chrono::steady_clock::now() < deadline)
      std::this_thread::sleep_for(std::chrono::milliseconds(5));
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
    return data->calls.load();
  };
  Loader loader(data, indices, LoaderOptions(10).workers(3).prefetch(2));
  EXPECT_EQ(settle(20), 20);  // two batches of 10, no more
  ASSERT_TRUE(loader.next().has_value());
  EXPECT_EQ(settle(30), 30);
}

TEST(Loader, StoppingEarlyJoinsWithoutHanging) {
  auto data = std::make_shared<CountingDataset>(1000, -1, /*sleep_ms=*/1);
  std::vector<int64_t> indices(1000);
  std::iota(indices.begin(), indices.end(), 0);
  const auto t0 = std::chrono::steady_clock::now();
  {
    Loader loader(data, indices, LoaderOptions(16).workers(3).prefetch(4));
    ASSERT_TRUE(loader.next().has_value());
    ASSERT_TRUE(loader.next().has_value());
  }  // destroyed with workers mid-batch and batches waiting
  {
    Loader never_read(data, indices, LoaderOptions(16).workers(2));
  }
  const double seconds =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  EXPECT_LT(seconds, 5.0);
  EXPECT_LT(data->calls.load(), 1000);  // it did not read the whole epoch
}

TEST(Loader, WorkerErrorIsRethrownAtItsBatch) {
  auto data = std::make_shared<CountingDataset>(100, /*throw_at=*/37);
  std::vector<int64_t> indices(100);
  std::iota(indices.begin(), indices.end(), 0);
  for (int64_t workers : {0, 1, 3}) {
    Loader loader(data, indices, LoaderOptions(10).workers(workers).prefetch(4));
    for (int k = 0; k < 3; ++k) ASSERT_TRUE(loader.next().has_value()) << "batch " << k;
    try {
      loader.next();
      ADD_FAILURE() << "batch 3 holds index 37 and should have thrown, workers=" << workers;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find("cannot read sample 37"), std::string::npos) << e.what();
    }
    EXPECT_THROW(loader.next(), std::runtime_error);  // spent
  }
}

TEST(Loader, BadOptionsAreUserErrors) {
  auto data = std::make_shared<CountingDataset>(10);
  EXPECT_THROW(Loader(data, {0, 1}, LoaderOptions(0)), ddp::UserError);
  EXPECT_THROW(Loader(data, {0, 1}, LoaderOptions(2).workers(-1)), ddp::UserError);
  EXPECT_THROW(Loader(data, {0, 1}, LoaderOptions(2).workers(1).prefetch(0)), ddp::UserError);
  EXPECT_THROW(Loader(data, {0, 10}, LoaderOptions(2)), c10::Error);  // index outside the data
}

TEST(Loader, PinMemoryIsHarmlessWithoutCuda) {
  auto data = std::make_shared<CountingDataset>(10);
  Loader loader(data, {3, 1, 4}, LoaderOptions(2).pin_memory(true).workers(1));
  auto b = loader.next();
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->target()[1].item<int64_t>(), 1);
  if (!torch::cuda::is_available()) {
    EXPECT_FALSE(b->input().is_pinned());
  }
}

}  // namespace

// Each worker runs one intra-op thread, as PyTorch's DataLoader workers do;
// the training thread keeps its own count. (Before the fix the workers
// copied the training thread's count: workers x cores OpenMP threads.)
class ThreadCountDataset : public ddp::data::Dataset {
 public:
  int64_t size() const override { return 8; }
  Example get(int64_t i) const override {
    return {torch::full({1}, static_cast<float>(at::get_num_threads())), torch::tensor(i)};
  }
};

TEST(Loader, WorkersRunOneIntraOpThreadAndLeaveTheCallersCount) {
  const int before = at::get_num_threads();
  at::set_num_threads(2);
  Loader loader(std::make_shared<ThreadCountDataset>(), {0, 1, 2, 3, 4, 5, 6, 7}, LoaderOptions(4).workers(2));
  for (const auto& b : drain(loader)) EXPECT_TRUE(torch::all(b.input() == 1).item<bool>()) << b.input();
  EXPECT_EQ(at::get_num_threads(), 2);
  at::set_num_threads(before);
}
