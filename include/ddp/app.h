// The program around the trainer: parse flags, launch or join, build, fit.
//
// ddp::main() is what `ddptrain` and the copyable template both call. It
// parses the flags, and then either starts local workers (when no launcher
// started this process and more than one rank is wanted) or runs as one
// worker: joins the World and runs the Trainer on the task, which brings
// the data, the model, the loss and the metrics (train/task.h). Errors become one line on stderr and an exit code.
#pragma once

#include <functional>
#include <string>

#include "ddp/cli.h"
#include "ddp/nn.h"
#include "ddp/train/task.h"
#include "ddp/train/trainer.h"
#include "ddp/dist/world.h"

namespace ddp {

/// Loads the dataset the flags name. Data the user named (--data_root or
/// --dataset) that is missing or of another kind is a UserError saying what
/// was found; only the bare run falls back to synthetic data, with a banner.
/// `device` is where training runs: image folders decode on it with
/// --image-decode gpu, or auto on a CUDA device of a build with nvJPEG.
data::Splits load_data(const Config& config, bool verbose, torch::Device device = torch::kCPU);

/// Keeps memory that LibTorch frees in glibc's heap instead of unmapping
/// it (app.cpp says why); ddp::main() calls it first. Benchmarks of a part
/// of ddptrain call it too, so that they allocate as ddptrain does.
void keep_freed_memory_in_heap();

/// Your program as its users see it: the name that its --help, errors and
/// printed commands use, and the line that --help opens with.
///
///   return ddp::main(argc, argv, std::make_shared<MyTask>(),
///                    ddp::ProgramOptions("train").description("finds the square in noisy images"));
struct ProgramOptions {
  /* implicit */ ProgramOptions(std::string name = "") : name_(std::move(name)) {}
  /// The program's name; "": the file name it was started as.
  TORCH_ARG(std::string, name);
  /// One line on what it trains, first in --help.
  TORCH_ARG(std::string, description);
};

/// Runs the program with `task` (your own, or nullptr: ddptrain's built-in
/// one that --task names); returns the process exit code.
int main(int argc, char** argv, std::shared_ptr<Task> task = nullptr, ProgramOptions program = {});

}  // namespace ddp
