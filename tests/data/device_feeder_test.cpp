// The DeviceFeeder with a device stage: the loader and the stage run on a
// thread of the feeder's own, ahead of the consumer; batches arrive in
// order, errors reach the consumer's thread, and stopping early joins it.
#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <set>
#include <thread>

#include "ddp/data/device_feeder.h"
#include "ddp/error.h"
#include "support/testing.h"

#ifdef DDP_WITH_CUDA
#include <c10/cuda/CUDAStream.h>
#endif

namespace {

using namespace ddp::data;

// Adds 1000 to "input", notes the thread it ran on, and throws at one batch.
class TagStage : public DeviceStage {
 public:
  explicit TagStage(int throw_at = -1) : throw_at_(throw_at) {}
  void run(TensorDict& batch, torch::Device) override {
    threads.insert(std::this_thread::get_id());
    if (calls++ == throw_at_) throw ddp::UserError("stage failed at batch " + std::to_string(throw_at_) + ".");
    batch.input() = batch.input() + 1000;
  }
  std::set<std::thread::id> threads;
  std::atomic<int> calls{0};

 private:
  int throw_at_;
};

// Example i: input {i}, target i.
class Numbers : public Dataset {
 public:
  explicit Numbers(int64_t n) : n_(n) {}
  int64_t size() const override { return n_; }
  Example get(int64_t i) const override { return {torch::full({1}, static_cast<float>(i)), torch::tensor(i)}; }

 private:
  int64_t n_;
};

DatasetPtr numbers(int64_t n) { return std::make_shared<Numbers>(n); }

std::vector<int64_t> first(int64_t n) {
  std::vector<int64_t> v(static_cast<size_t>(n));
  for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = i;
  return v;
}

TEST(DeviceFeeder, StageRunsOnItsOwnThreadAndKeepsTheOrder) {
  Loader loader(numbers(30), first(30), LoaderOptions(4).workers(2));
  auto stage = std::make_shared<TagStage>();
  DeviceFeeder feeder(loader, torch::kCPU, nullptr, stage);
  int64_t expect = 0;
  while (auto b = feeder.next()) {
    for (int64_t j = 0; j < b->batch_size(); ++j, ++expect) {
      EXPECT_EQ(b->input()[j][0].item<float>(), 1000.f + static_cast<float>(expect));
      EXPECT_EQ(b->target()[j].item<int64_t>(), expect);
    }
  }
  EXPECT_EQ(expect, 30);
  EXPECT_FALSE(feeder.next().has_value()) << "after the end, the end again";
  EXPECT_EQ(stage->calls.load(), 8);
  ASSERT_EQ(stage->threads.size(), 1u);
  EXPECT_NE(*stage->threads.begin(), std::this_thread::get_id());
}

TEST(DeviceFeeder, StageErrorsReachTheConsumerInOrder) {
  Loader loader(numbers(40), first(40), LoaderOptions(4));
  DeviceFeeder feeder(loader, torch::kCPU, nullptr, std::make_shared<TagStage>(/*throw_at=*/2));
  EXPECT_TRUE(feeder.next().has_value());
  EXPECT_TRUE(feeder.next().has_value());
  const auto message = [&] {
    try {
      feeder.next();
    } catch (const ddp::UserError& e) {
      return std::string(e.what());
    }
    return std::string("no error");
  }();
  EXPECT_NE(message.find("stage failed at batch 2"), std::string::npos) << message;
  EXPECT_FALSE(feeder.next().has_value());
}

TEST(DeviceFeeder, StoppingEarlyJoinsTheStageThread) {
  Loader loader(numbers(400), first(400), LoaderOptions(4).workers(2));
  auto stage = std::make_shared<TagStage>();
  {
    DeviceFeeder feeder(loader, torch::kCPU, nullptr, stage);
    ASSERT_TRUE(feeder.next().has_value());
  }  // the destructor returns: no hang
  EXPECT_LE(stage->calls.load(), 4) << "the thread stays at most two batches ahead";
}

// start() runs the stage before the first next(): the trainer starts the
// next epoch's feeder before it validates, so its first batches are ready.
TEST(DeviceFeeder, StartRunsTheStageBeforeTheFirstNext) {
  Loader loader(numbers(12), first(12), LoaderOptions(4).workers(1));
  auto stage = std::make_shared<TagStage>();
  DeviceFeeder feeder(loader, torch::kCPU, nullptr, stage);
  feeder.start();
  feeder.start();  // a second call changes nothing
  for (int i = 0; i < 500 && stage->calls.load() < 2; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(stage->calls.load(), 2) << "two batches ahead, before anything asked for one";
  int64_t expect = 0;
  while (auto b = feeder.next())
    for (int64_t j = 0; j < b->batch_size(); ++j, ++expect)
      EXPECT_EQ(b->target()[j].item<int64_t>(), expect);
  EXPECT_EQ(expect, 12);
  EXPECT_EQ(stage->calls.load(), 3);
}

#ifdef DDP_WITH_CUDA
// Notes the priority of the stream the stage runs on.
class PriorityStage : public DeviceStage {
 public:
  void run(TensorDict&, torch::Device device) override {
    priority = c10::cuda::getCurrentCUDAStream(device.index()).priority();
  }
  std::atomic<int> priority{0};
};

// The stage and the copies run on a high-priority stream: the step's big
// kernels, queued on the main stream, must not hold back the small kernels
// that make the next batch (nvJPEG's, the resample), or the step waits.
TEST(DeviceFeeder, StageRunsOnAHighPriorityStream_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  const torch::Device gpu(torch::kCUDA, 0);
  const int high = c10::cuda::getStreamFromPool(/*isHighPriority=*/true, 0).priority();
  const int normal = c10::cuda::getStreamFromPool(/*isHighPriority=*/false, 0).priority();
  ASSERT_LT(high, normal) << "this GPU has no stream priorities";
  Loader loader(numbers(8), first(8), LoaderOptions(4).workers(1).pin_memory(true));
  auto stage = std::make_shared<PriorityStage>();
  DeviceFeeder feeder(loader, gpu, nullptr, stage);
  int batches = 0;
  while (auto b = feeder.next()) ++batches;
  EXPECT_EQ(batches, 2);
  EXPECT_EQ(stage->priority.load(), high);
}
#endif

}  // namespace
