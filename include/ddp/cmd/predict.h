// `predict`: a trained model on data, written to a file.
//
//   ./train predict --checkpoint RUN/best.pt --split test --out preds.csv
//
// In ddptrain and in every program built from the template (ddp::main
// dispatches it). The task and its model are built with the flags of the
// run that wrote the checkpoint (its config in the header), the weights
// loaded as export reads them (with --ema, the averages), and the task's
// predict_step() runs on every sample of the split exactly once, sharded
// over the ranks like validation (--size N, torchrun), without the padding
// a training sampler adds. Rank 0 writes the rows in the dataset's order:
// .csv with a header of the names (a name of k > 1 values per sample gives
// columns name_0 .. name_(k-1)), or .npy in NumPy's format (one name).
// Every rank's rows reach rank 0 in one all-reduce per name, summed as
// integers of the values' bits, so a value arrives exactly (a float sum
// would turn -0 into +0).
#pragma once

#include <string>

#include <torch/torch.h>

#include "ddp/cli.h"
#include "ddp/train/task.h"

namespace ddp {

/// The flags `predict` runs with: those of the run that wrote
/// --checkpoint, with the ones given now that do not change the model or
/// its data (and paths: --data_root). UserError for a missing checkpoint,
/// a bad --out, or a flag that would build another model.
Config predict_config(const Config& now);

/// Runs predict on this rank (see above); returns the exit code.
int run_predict(const Config& config, World& world, Task& task);

/// `t` as a .npy file (NumPy format 1.0, C order, little-endian), written
/// atomically. bfloat16, which NumPy lacks, is written as float32.
void write_npy(const std::string& path, const torch::Tensor& t);

/// Named tensors of equal first dimension as CSV: a header, then one row
/// per index of that dimension; each value written in the fewest digits
/// that read back to it. Written atomically.
void write_csv(const std::string& path, const TensorMap& columns);

}  // namespace ddp
