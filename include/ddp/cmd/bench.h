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
#pragma once

#include "ddp/cli.h"
#include "ddp/dist/world.h"
#include "ddp/train/task.h"

namespace ddp {

/// `own_task`: the program's own task (nullptr: ddptrain's --model).
int run_bench(const Config& config, World& world, Task* own_task = nullptr);

}  // namespace ddp
