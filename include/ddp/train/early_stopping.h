// Early stopping (--patience, --min-delta) and the best K checkpoints
// (--save-top-k), both on the task's monitor: the metric that chooses
// best.pt, from whichever split validates.
//
// Rank 0 decides both. Early stopping's decision then reaches every rank
// in one all-reduce that every rank makes at every validation while
// --patience is on (a flag checked across ranks), so no rank waits in a
// collective that another skipped, even when a task's on_epoch_end() left
// the ranks with different metrics. Top-k writes and removes files only,
// which is rank 0's work alone. Both survive a resume: the patience counter
// is in every checkpoint (TrainState), and the top-k list is re-derived
// from the run directory's files, which a resume from an older checkpoint
// has already cleared of the abandoned branch's (set_aside_later_checkpoints).
#pragma once

#include <string>
#include <vector>

#include "ddp/io/checkpoint.h"
#include "ddp/train/task.h"

namespace ddp {

/// Counts this validation's `value` against patience's best (Lightning's
/// and Keras' rule: an improvement beats the best by more than `min_delta`
/// in the monitor's direction; NaN never improves). True when `patience`
/// validations in a row have not improved.
bool patience_run_out(const Monitor& monitor, double value, double min_delta, int64_t patience, TrainState& state);

/// A top-k checkpoint: its file, its monitor value and its epoch.
struct RankedCheckpoint {
  std::string path;
  double value = 0;
  int64_t epoch = 0;
};

/// "epoch=3-test_loss=0.4123.pt": the epoch and the monitor's value, as
/// Lightning's ModelCheckpoint names its files.
std::string top_k_name(int64_t epoch, const std::string& metric, double value);

/// The top-k checkpoints directly in `dir` (named by top_k_name for the
/// monitor's metric, whose header says the value), best first; of equal
/// values, the earlier epoch first.
std::vector<RankedCheckpoint> top_k_checkpoints(const std::string& dir, const Monitor& monitor);

/// Whether an epoch whose monitor is `value` enters the best `k` of `dir`.
bool enters_top_k(const std::string& dir, const Monitor& monitor, int64_t k, double value);

/// Removes the top-k checkpoints of `dir` past the best `k`.
void prune_top_k(const std::string& dir, const Monitor& monitor, int64_t k);

}  // namespace ddp
