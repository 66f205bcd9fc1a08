// `PROGRAM report RUN_DIR`: what a finished (or running) run did.
//
// Reads the run directory's config.json, metrics.jsonl and checkpoint
// names and prints a short summary: the configuration that matters, epochs
// done, final and best test accuracy, train loss, throughput, wall time and
// the checkpoints present. Nothing is loaded into LibTorch, so it is quick
// and works on a machine without the run's GPUs.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp {

/// What a run trains, in its task's words: the flags say `--model cnn`
/// and `--dataset auto` also for a task that brings its own model and
/// data. The trainer writes it to RUN_DIR/run.json; report reads it.
struct RunCard {
  std::string program;   // e.g. "train"
  std::string model;     // Task::arch()
  std::string data;      // the train split's Dataset::name()
  int64_t train_samples = 0, test_samples = 0;
  std::string monitor, goal;  // e.g. "test_mae", "min"
};
void write_run_card(const std::string& run_dir, const RunCard& card);

/// The summary of `run_dir`. Throws UserError naming the path when it is
/// not a run directory (with a hint, e.g. the runs it contains); `program`
/// names the program in its lines.
std::string run_report(const std::string& run_dir, const std::string& program = "ddptrain");

/// The `report` subcommand; `args` are the words after "report".
/// Returns the exit code; UserError propagates to the caller.
int report_command(const std::vector<std::string>& args, const std::string& program = "ddptrain");

}  // namespace ddp
