// The run summary behind `PROGRAM report`, and the run card it reads.
#include "ddp/cmd/report.h"

#include <algorithm>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <sstream>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/io/checkpoint.h"  // write_file_atomic
#include "ddp/io/metrics.h"
#include "ddp/io/progress.h"

namespace fs = std::filesystem;

namespace ddp {
namespace {

std::string usage(const std::string& program) {
  return "usage: " + program + " report RUN_DIR  (a directory such as checkpoint/train_<timestamp>)";
}

// Run directories directly under `dir`, newest name last.
std::vector<std::string> runs_under(const fs::path& dir) {
  std::vector<std::string> runs;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir, ec))
    if (e.is_directory() && fs::exists(e.path() / "config.json")) runs.push_back(e.path().string());
  std::sort(runs.begin(), runs.end());
  return runs;
}

nlohmann::json read_json(const fs::path& dir, const char* name) {
  const auto path = (dir / name).string();
  std::ifstream in(path);
  try {
    return nlohmann::json::parse(in);
  } catch (const nlohmann::json::exception& e) {
    throw UserError(path + " is not valid JSON (" + e.what() + ").", "the run directory may be damaged.");
  }
}

std::string value_of(const nlohmann::json& config, const char* key) {
  if (!config.contains(key)) return "?";
  const auto& v = config[key];
  return v.is_string() ? v.get<std::string>() : v.dump();
}

// "--train-samples 0" means every sample.
std::string samples(const nlohmann::json& config, const char* key) {
  const auto v = value_of(config, key);
  return v == "0" ? "all" : v;
}

std::string fixed(double v, int decimals) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(decimals);
  os << v;
  return os.str();
}

}  // namespace

void write_run_card(const std::string& run_dir, const RunCard& card) {
  const nlohmann::json j = {{"program", card.program},
                            {"model", card.model},
                            {"data", card.data},
                            {"train_samples", card.train_samples},
                            {"test_samples", card.test_samples},
                            {"monitor", card.monitor},
                            {"goal", card.goal}};
  write_file_atomic(run_dir + "/run.json", j.dump(2) + "\n");
}

std::string run_report(const std::string& run_dir, const std::string& program) {
  const fs::path dir(run_dir);
  std::error_code ec;
  check_user(fs::is_directory(dir, ec), "report: '" + run_dir + "' is not a directory.",
             "pass a run directory, e.g. checkpoint/train_<timestamp> (the 'run dir' that training prints).");
  if (!fs::exists(dir / "config.json")) {
    const auto runs = runs_under(dir);
    check_user(false, "report: '" + run_dir + "' is not a run directory of " + program + " (it has no config.json).",
               runs.empty() ? "pass the 'run dir' that training prints, e.g. checkpoint/train_<timestamp>."
                            : "it holds " + std::to_string(runs.size()) + " run(s); pass one, e.g. " + runs.back() + ".");
  }
  const auto config = read_json(dir, "config.json");
  // Runs before run.json existed: the flags alone.
  const auto card = fs::exists(dir / "run.json") ? read_json(dir, "run.json") : nlohmann::json::object();
  const auto epochs = read_epoch_metrics((dir / "metrics.jsonl").string());

  std::ostringstream out;
  out << "run          " << run_dir << "\n";
  if (card.empty())
    out << "config       " << (config.contains("task") ? "task " + value_of(config, "task") + ", " : std::string())
        << "model " << value_of(config, "model") << ", " << value_of(config, "optimizer") << " lr "
        << value_of(config, "lr") << " (" << value_of(config, "schedule") << "), weight decay "
        << value_of(config, "weight-decay") << ", batch " << value_of(config, "batch") << " per rank, dataset "
        << value_of(config, "dataset") << " (" << samples(config, "train-samples") << " train, "
        << samples(config, "test-samples") << " test), seed " << value_of(config, "seed") << "\n";
  else  // the task's own words for its model and data; the flags may name built-in ones it ignores
    out << "program      " << value_of(card, "program") << "\n"
        << "model        " << value_of(card, "model") << "\n"
        << "data         " << value_of(card, "data") << " (" << value_of(card, "train_samples") << " train, "
        << value_of(card, "test_samples") << " test)\n"
        << "config       " << value_of(config, "optimizer") << " lr " << value_of(config, "lr") << " ("
        << value_of(config, "schedule") << "), weight decay " << value_of(config, "weight-decay") << ", batch "
        << value_of(config, "batch") << " per rank, seed " << value_of(config, "seed") << "; monitor "
        << value_of(card, "monitor") << " (" << value_of(card, "goal") << ")\n";
  out << "epochs       " << epochs.size() << " of " << value_of(config, "epochs") << " done\n";
  if (!epochs.empty()) {
    const auto& last = epochs.back();
    double seconds = 0, samples_per_second = 0;
    for (const auto& m : epochs) seconds += m.epoch_seconds, samples_per_second += m.samples_per_second;
    // The monitor metric first, with its best epoch; then the task's other
    // metrics at the last epoch, by name.
    auto shown = [](const std::string& name, double v) {
      return is_fraction_metric(name) ? fixed(100 * v, 2) + "%" : fixed(v, 4);
    };
    auto padded = [](std::string label) { return label + std::string(label.size() < 12 ? 13 - label.size() : 1, ' '); };
    const std::string monitor = last.monitor;
    if (!monitor.empty()) {
      const bool want_max = last.goal == "max";
      const EpochMetrics* best = nullptr;
      for (const auto& m : epochs) {
        const double v = m.value(monitor);
        if (std::isfinite(v) && (!best || (want_max ? v > best->value(monitor) : v < best->value(monitor)))) best = &m;
      }
      out << padded(metric_label(monitor)) << "final " << shown(monitor, last.value(monitor)) << " (epoch " << last.epoch << ")";
      if (best)
        out << ", best " << shown(monitor, best->value(monitor)) << " (epoch " << best->epoch << "), "
            << (want_max ? "higher" : "lower") << " is better";
      out << "\n";
    }
    for (const auto& [name, v] : last.values)
      if (name != monitor) out << padded(metric_label(name)) << "final " << shown(name, v) << "\n";
    out << "train loss   " << fixed(epochs.front().train_loss, 4) << " (epoch " << epochs.front().epoch << ") -> "
        << fixed(last.train_loss, 4) << " (epoch " << last.epoch << ")\n";
    out << "throughput   " << fixed(samples_per_second / static_cast<double>(epochs.size()), 0)
        << " samples/s (mean of epochs), last epoch " << fixed(last.samples_per_second, 0) << "\n";
    out << "wall time    " << format_duration(seconds) << " (" << fixed(seconds, 1) << " s over the epochs)\n";
  } else {
    out << "             no epoch has finished yet\n";
  }
  // With a validation split, test is evaluated once, on best.pt, at the end.
  if (fs::exists(dir / "test.json")) {
    const auto test = read_json(dir, "test.json");
    const std::string on = test.value("checkpoint", "").empty()
                               ? "the last weights"
                               : "best.pt (epoch " + std::to_string(test.value("epoch", 0)) + ")";
    out << "test         on " << on << ":";
    for (const auto& [name, v] : test.items())
      if (v.is_number() && name != "epoch")
        out << "  " << name << " "
            << (is_fraction_metric(name) ? fixed(100 * v.get<double>(), 2) + "%" : fixed(v.get<double>(), 4));
    out << "\n";
  }
  std::vector<std::string> checkpoints;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().extension() == ".pt") checkpoints.push_back(e.path().filename().string());
  std::sort(checkpoints.begin(), checkpoints.end());
  out << "checkpoints ";
  for (const auto& c : checkpoints) out << " " << c;
  out << (checkpoints.empty() ? " none" : "") << "\n";
  return out.str();
}

int report_command(const std::vector<std::string>& args, const std::string& program) {
  if (args.size() == 1 && (args[0] == "-h" || args[0] == "--help")) {
    std::cout << usage(program) << "\n";
    return exit_code::kOk;
  }
  check_user(args.size() == 1, std::string("report takes one run directory, got ") + std::to_string(args.size()) +
                                   " argument(s).", usage(program));
  std::cout << run_report(args[0], program);
  return exit_code::kOk;
}

}  // namespace ddp
