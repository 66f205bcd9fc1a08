#include "ddp/train/stop_rule.h"

#include <cmath>
#include <cstdlib>

#include "ddp/error.h"

namespace ddp {

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
