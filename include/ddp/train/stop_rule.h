// A --stop-at rule: METRIC>=V, METRIC<=V, or MONITOR=V (V reached in the
// monitor's direction). One parser, which the command line's check and the
// trainer both call, so that what is accepted is what is obeyed.
#pragma once

#include <string>

namespace ddp {

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
