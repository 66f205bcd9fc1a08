// The choosing split: carving validation out of train, and metric names.
#include "ddp/train/validation.h"

#include <sstream>
#include <tuple>

#include "ddp/data/shards.h"  // StreamDataset
#include "ddp/data/subset.h"
#include "ddp/error.h"

namespace ddp {

namespace {
bool starts_with(const std::string& s, const std::string& prefix) { return s.compare(0, prefix.size(), prefix) == 0; }
}  // namespace

std::string metric_for_split(const std::string& name, const std::string& prefix) {
  for (const std::string known : {kValPrefix, kTestPrefix})
    if (starts_with(name, known)) return prefix + name.substr(known.size());
  return prefix + name;
}

Metrics with_split_prefix(const Metrics& metrics, const std::string& prefix) {
  Metrics out;
  for (const auto& [name, v] : metrics) out[metric_for_split(name, prefix)] = v;
  return out;
}

void add_validation_split(data::Splits& data, const Config& c) {
  // An image folder's loader holds out --val-split per class itself.
  if (data.val) {
    std::ostringstream fraction;
    fraction << c.val_split;
    check_user(!c.was_given("val-split") || c.dataset == "imagefolder",
               "--val-split " + fraction.str() + " would carve a validation split out of " +
                   data.train->name() + ", but the task's make_data() gives its own (" + data.val->name() + ").",
               "drop --val-split, or leave Splits::val empty in make_data() to carve one.");
  } else if (c.val_split > 0) {
    check_user(!dynamic_cast<const data::StreamDataset*>(data.train.get()),
               "--val-split cannot carve a validation split out of " + data.train->name() +
                   ": streamed shards are read in order, not by index.",
               "write the validation data as shards of its own and give them as the task's Splits::val, or drop "
               "--val-split.");
    std::tie(data.train, data.val) = data::carve_validation(data.train, c.val_split, static_cast<uint64_t>(c.seed));
  }
  check_user(!c.test_every_epoch || data.val,
             "--test-every-epoch evaluates test beside a validation split, and this run has none: test is "
             "evaluated every epoch already, and chooses.",
             "add --val-split 0.1 to hold out a validation split, or drop --test-every-epoch.");
  if (data.val && !data.test) data.test = data::empty_like(data.val, "no test split");
}

StopRule stop_rule_for_split(const Config& c, const std::string& prefix) {
  StopRule rule = parse_stop_rule(c.stop_at);
  if (rule.empty() && c.stop_at_acc > 0) {
    std::ostringstream value;
    value << c.stop_at_acc;
    rule = {"test_acc", StopRule::Way::kAtLeast, c.stop_at_acc, value.str()};
  }
  if (!rule.empty()) rule.metric = metric_for_split(rule.metric, prefix);
  return rule;
}

}  // namespace ddp
