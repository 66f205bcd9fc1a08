#include "ddp/train/stop_rule.h"

#include <cmath>
#include <cstdlib>

#include "ddp/error.h"

namespace ddp {

bool Monitor::better(double value, double than) const {
  if (std::isnan(value)) return false;
  if (std::isnan(than)) return true;
  return goal == Goal::kMin ? value < than : value > than;
}

Monitor parse_monitor(const std::string& text, const Monitor& otherwise) {
  if (text.empty()) return otherwise;
  const auto colon = text.rfind(':');
  const std::string goal = colon == std::string::npos ? "" : text.substr(colon + 1);
  check_user(colon != std::string::npos && colon > 0 && (goal == "min" || goal == "max"),
             "--monitor '" + text + "' is not NAME:min or NAME:max.",
             "name the metric and whether lower or higher is better, e.g. --monitor loss:min or --monitor acc:max.");
  return {text.substr(0, colon), goal == "min" ? Goal::kMin : Goal::kMax};
}

std::string StopRule::str() const {
  if (empty()) return "";
  return metric + (way == Way::kAtLeast ? ">=" : way == Way::kAtMost ? "<=" : "=") + value_text;
}

bool StopRule::reached(double v, bool higher_is_better) const {
  const bool up = way == Way::kAtLeast || (way == Way::kMonitors && higher_is_better);
  return up ? v >= value : v <= value;
}

StopRule parse_stop_rule(const std::string& text) {
  StopRule rule;
  if (text.empty()) return rule;
  const auto op = text.find_first_of("<>=");
  const auto eq = text.find('=');
  // NAME=V, NAME>=V or NAME<=V: one operator, a name before it, a number after.
  bool ok = op != std::string::npos && op > 0 && eq != std::string::npos && (eq == op || eq == op + 1);
  if (ok) {
    rule.metric = text.substr(0, op);
    rule.way = eq == op ? StopRule::Way::kMonitors : text[op] == '>' ? StopRule::Way::kAtLeast : StopRule::Way::kAtMost;
    rule.value_text = text.substr(eq + 1);
    char* end = nullptr;
    rule.value = std::strtod(rule.value_text.c_str(), &end);
    ok = !rule.value_text.empty() && end && *end == '\0' && std::isfinite(rule.value);
  }
  check_user(ok, "--stop-at '" + text + "' is not METRIC=VALUE, METRIC>=VALUE or METRIC<=VALUE.",
             "e.g. --stop-at test_acc=0.93 or --stop-at test_loss<=0.3.");
  return rule;
}

}  // namespace ddp
