// metrics.jsonl writer.
#include "ddp/metrics.h"

#include <fstream>
#include <sstream>
#include <vector>

#include "ddp/error.h"

namespace ddp {

nlohmann::json EpochMetrics::to_json() const {
  return {{"epoch", epoch},     {"train_loss", train_loss},       {"test_loss", test_loss},
          {"test_acc", test_acc}, {"lr", lr},                      {"epoch_seconds", epoch_seconds},
          {"samples_per_second", samples_per_second}};
}

void MetricsLog::append(const EpochMetrics& m) const {
  if (path_.empty()) return;
  std::ofstream f(path_, std::ios::app);
  check_user(static_cast<bool>(f), "cannot write " + path_ + ".", "check that --save_path is writable.");
  f << m.to_json().dump() << "\n";
  f.flush();
}

void MetricsLog::truncate_to(int64_t epochs) const {
  if (path_.empty()) return;
  std::ifstream in(path_);
  std::vector<std::string> keep;
  std::string line;
  while (std::getline(in, line) && static_cast<int64_t>(keep.size()) < epochs)
    if (!line.empty()) keep.push_back(line);
  in.close();
  std::ofstream out(path_, std::ios::trunc);
  for (const auto& l : keep) out << l << "\n";
}

}  // namespace ddp
