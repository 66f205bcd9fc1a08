// Which split chooses, and how its metrics are named.
//
// With a validation split (the task's own, or --val-split's carve of the
// training set) validation chooses: the monitor, best.pt and --stop-at read
// its metrics, named val_*, and test (test_*) is evaluated on best.pt at the
// end, and every epoch with --test-every-epoch, but never chooses. Without
// one, test chooses, as ddptrain always did. A task writes its metric names
// once: validation_metrics() may name them test_X (as the default and every
// older task does) or plain X, and each gets the prefix of the split it was
// computed on; its monitor and --stop-at may name either too.
#pragma once

#include <string>

#include "ddp/cli.h"
#include "ddp/data/dataset.h"
#include "ddp/train/stop_rule.h"
#include "ddp/train/task.h"

namespace ddp {

inline constexpr const char* kValPrefix = "val_";
inline constexpr const char* kTestPrefix = "test_";

/// `name` as split `prefix` reports it: a val_ or test_ prefix swapped for
/// `prefix`, any other name prefixed ("acc" -> "val_acc").
std::string metric_for_split(const std::string& name, const std::string& prefix);

/// Every name of `metrics` through metric_for_split.
Metrics with_split_prefix(const Metrics& metrics, const std::string& prefix);

/// Gives `data` the validation split that --val-split asks for: carved out
/// of train (seeded by --seed, the same on any number of ranks) unless the
/// task gave its own; a UserError when the task gave its own and
/// --val-split was given too. A task's data without a test split gets an
/// empty one when it has a validation split.
void add_validation_split(data::Splits& data, const Config& config);

/// The --stop-at rule (or --stop-at-acc's) with its metric named as the
/// choosing split reports it; empty when neither flag is given.
StopRule stop_rule_for_split(const Config& config, const std::string& prefix);

}  // namespace ddp
