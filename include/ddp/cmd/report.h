// `ddptrain report RUN_DIR`: what a finished (or running) run did.
//
// Reads the run directory's config.json, metrics.jsonl and checkpoint
// names and prints a short summary: the configuration that matters, epochs
// done, final and best test accuracy, train loss, throughput, wall time and
// the checkpoints present. Nothing is loaded into LibTorch, so it is quick
// and works on a machine without the run's GPUs.
#pragma once

#include <string>
#include <vector>

namespace ddp {

/// The summary of `run_dir`. Throws UserError naming the path when it is
/// not a ddptrain run directory (with a hint, e.g. the runs it contains).
std::string run_report(const std::string& run_dir);

/// The `report` subcommand; `args` are the words after "report".
/// Returns the exit code; UserError propagates to the caller.
int report_command(const std::vector<std::string>& args);

}  // namespace ddp
