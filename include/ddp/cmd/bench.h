// `ddptrain bench`: times the training step alone.
//
// Builds the --model for 3 x --image-size² inputs and 1000 classes (the
// shape of torchvision's ImageNet models), puts one random batch on the
// device, and runs the same TrainStep that training uses (with --amp,
// --cuda-graph, --channels-last, --optimizer): warm-up steps first, then
// --bench-steps timed steps. Rank 0 prints one JSON line with ms/step,
// images/s over all ranks and peak GPU memory, so bench/ scripts can put it
// beside PyTorch's numbers.
//
// In a program of your own (`./train bench`), it times your task's own
// model and training_step instead: on the first --batch samples of its
// training split, after --convert-layers as training does; one JSON line
// with ms/step and samples/s.
//
// With --largest-batch (one GPU), it first searches the largest batch whose
// step fits in the GPU's memory, as Lightning's
// batch-size finder does, in one process: from --batch, doubling until a
// step runs out of memory, then bisecting. A line per try (its "fits"), then
// the largest batch's line, timed over --bench-steps (its "largest": true).
#pragma once

#include <cstdint>
#include <functional>

#include "ddp/cli.h"
#include "ddp/dist/world.h"
#include "ddp/train/task.h"

namespace ddp {

/// `own_task`: the program's own task (nullptr: ddptrain's --model).
int run_bench(const Config& config, World& world, Task* own_task = nullptr);

/// The largest batch for which `fits` holds, where it holds up to some batch
/// and not above: `fits(start)`, then doubling until it fails, then
/// bisecting between the last batch that fit and the first that did not.
/// 0 when not even 1 fits. Each batch is tried at most once.
int64_t largest_fitting_batch(int64_t start, const std::function<bool(int64_t)>& fits);

}  // namespace ddp
