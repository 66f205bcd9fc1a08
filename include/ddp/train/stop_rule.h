// What a run follows: the monitor (a task's monitor(), or --monitor) and a
// --stop-at rule: METRIC>=V, METRIC<=V, or MONITOR=V (V reached in the
// monitor's direction). One parser each, which the command line's check and
// the trainer both call, so that what is accepted is what is obeyed.
#pragma once

#include <string>

namespace ddp {

enum class Goal { kMin, kMax };

/// The metric that picks best.pt, that --stop-at compares against by
/// default, and that `ddptrain report` summarises. It is read on the
/// validation split when there is one: "test_acc" (or "acc") then means
/// val_acc.
struct Monitor {
  std::string metric = "test_loss";
  Goal goal = Goal::kMin;
  /// True if `value` is better than `than` (anything beats NaN).
  bool better(double value, double than) const;
  const char* goal_name() const { return goal == Goal::kMin ? "min" : "max"; }
};

/// Parses --monitor's NAME:min or NAME:max; "" gives `otherwise` (the
/// task's), other text a UserError that names it.
Monitor parse_monitor(const std::string& text, const Monitor& otherwise);

struct StopRule {
  enum class Way { kAtLeast, kAtMost, kMonitors };  // >=, <=, = (the monitor's direction)
  std::string metric;                               // "": no rule
  Way way = Way::kAtLeast;
  double value = 0;
  std::string value_text;  // as written, for messages

  bool empty() const { return metric.empty(); }
  /// The rule as written ("val_acc>=0.9").
  std::string str() const;
  /// Whether `v` reaches the value; `higher_is_better` says the way of '='.
  bool reached(double v, bool higher_is_better) const;
};

/// Parses --stop-at's text; "" gives an empty rule, and text that is not
/// one of the three forms a UserError that names it.
StopRule parse_stop_rule(const std::string& text);

}  // namespace ddp
