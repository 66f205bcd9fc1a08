// Batches on the training device, one step ahead.
//
// Wraps a Loader (whose batches sit in pinned host memory on CUDA). On a GPU
// the copy of batch k+1 to the device, and its conversion to the model's
// memory format, run on a side stream while step k runs on the main stream;
// next() makes the main stream wait for that copy (an event, not a host
// sync). On CPU it simply hands the loader's batches on. It also counts the
// host time spent waiting for the loader, so the trainer can report whether
// the data path keeps up with the step.
#pragma once

#include <functional>
#include <memory>
#include <optional>

#include "ddp/data/loader.h"

namespace ddp::data {

class DeviceFeeder {
 public:
  using Prepare = std::function<torch::Tensor(const torch::Tensor&)>;
  /// `stage`, if any, finishes each batch on the device first (e.g. decodes
  /// its JPEGs there; see DeviceStage), on the same side stream; the loader
  /// and the stage then run on a thread of the feeder's own, up to two
  /// batches ahead, so the stage's host work overlaps the step's launch.
  DeviceFeeder(Loader& loader, torch::Device device, Prepare prepare = nullptr,
               std::shared_ptr<DeviceStage> stage = nullptr);
  ~DeviceFeeder();
  DeviceFeeder(const DeviceFeeder&) = delete;
  DeviceFeeder& operator=(const DeviceFeeder&) = delete;

  /// Starts finishing batches now instead of at the first next(): with a
  /// stage, its thread starts (the trainer starts the next epoch's feeder
  /// before validating). Without a stage it does nothing: the loader's
  /// workers already run ahead.
  void start();

  /// The next batch, on the device, ready to use on the current stream.
  std::optional<Batch> next();

  /// Seconds next() spent waiting for the loader so far (with a stage: for
  /// the stage thread, which waits for the loader).
  double wait_seconds() const { return wait_seconds_; }

 private:
  std::optional<Batch> fetch();
  void finish(Batch& batch);  // stage, copies to the device, prepare
  void stage_loop();
  std::optional<Batch> next_staged();

  Loader& loader_;
  torch::Device device_;
  Prepare prepare_;
  std::shared_ptr<DeviceStage> stage_;
  bool started_ = false;
  std::optional<Batch> ahead_;
  double wait_seconds_ = 0;
  struct Cuda;  // side stream and event (CUDA builds)
  std::unique_ptr<Cuda> cuda_;
  struct Staged;  // the stage thread and its queue
  std::unique_ptr<Staged> staged_;
};

}  // namespace ddp::data
