// metrics.jsonl, metrics.csv, the TensorBoard event file and curves.svg.
#include "ddp/io/metrics.h"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "ddp/io/checkpoint.h"
#include "ddp/error.h"
#include "ddp/io/plot.h"
#include "ddp/io/tensorboard.h"

namespace fs = std::filesystem;

namespace ddp {
namespace {

// metrics.csv's fixed columns; the task's metrics follow, in name order.
const std::vector<std::string> kCsvBase = {"kind", "epoch", "step", "wall_time", "train_loss",
                                           "lr", "epoch_seconds", "samples_per_second"};

double unix_now() {
  return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

std::string num(double v) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.10g", v);
  return buf;
}

std::string wall(double t) {
  char buf[40];
  std::snprintf(buf, sizeof(buf), "%.3f", t);
  return buf;
}

std::string csv_row(const StepMetrics& s) {
  return "step," + std::to_string(s.epoch) + "," + std::to_string(s.step) + "," + wall(s.wall_time) + "," +
         num(s.train_loss) + "," + num(s.lr) + ",," + num(s.samples_per_second);
}

std::string join(const std::vector<std::string>& cells) {
  std::string out;
  for (size_t i = 0; i < cells.size(); ++i) out += (i ? "," : "") + cells[i];
  return out;
}

std::vector<std::string> split_csv(const std::string& line) {
  std::vector<std::string> cells;
  std::stringstream ss(line);
  std::string cell;
  while (std::getline(ss, cell, ',')) cells.push_back(cell);
  if (!line.empty() && line.back() == ',') cells.emplace_back();
  return cells;
}

// A step row back from its cells (the fixed columns come first).
StepMetrics parse_step_row(const std::vector<std::string>& c, const std::string& path) {
  try {
    StepMetrics s;
    s.epoch = std::stoll(c.at(1));
    s.step = std::stoll(c.at(2));
    s.wall_time = std::stod(c.at(3));
    s.train_loss = std::stod(c.at(4));
    s.lr = std::stod(c.at(5));
    s.samples_per_second = std::stod(c.at(7));
    return s;
  } catch (const std::exception&) {
    throw UserError("corrupt step row in " + path + ".", "delete the file to start a fresh one.");
  }
}

int64_t parse_epoch_of(const std::vector<std::string>& c, const std::string& path) {
  try {
    return std::stoll(c.at(1));
  } catch (const std::exception&) {
    throw UserError("corrupt epoch row in " + path + ".", "delete the file to start a fresh one.");
  }
}

void write_step_scalars(EventWriter& w, const StepMetrics& s) {
  w.add_scalar("train/loss", s.train_loss, s.step, s.wall_time);
  w.add_scalar("train/lr", s.lr, s.step, s.wall_time);
  w.add_scalar("train/samples_per_second", s.samples_per_second, s.step, s.wall_time);
}

void write_epoch_scalars(EventWriter& w, const EpochMetrics& m) {
  w.add_scalar("train/epoch_loss", m.train_loss, m.step, m.wall_time);
  for (const auto& [name, v] : m.values) w.add_scalar(metric_tag(name), v, m.step, m.wall_time);
}

const char* const kFixedKeys[] = {"epoch", "step", "wall_time", "train_loss", "lr",
                                  "epoch_seconds", "samples_per_second", "monitor", "goal"};

// JSON has no NaN (an R squared of a constant target): null stands for it.
nlohmann::json number(double v) { return std::isfinite(v) ? nlohmann::json(v) : nlohmann::json(); }

}  // namespace

std::string metric_tag(const std::string& name) {
  const auto cut = name.find('_');
  if (cut == std::string::npos) return "metrics/" + name;
  std::string rest = name.substr(cut + 1);
  return name.substr(0, cut) + "/" + (rest == "acc" ? "accuracy" : rest);
}

bool is_fraction_metric(const std::string& name) {
  return name.size() >= 4 && name.compare(name.size() - 4, 4, "_acc") == 0;
}

std::string metric_label(const std::string& name) {
  std::string tag = metric_tag(name);
  if (tag.rfind("metrics/", 0) == 0) return name;
  tag[tag.find('/')] = ' ';
  return tag;
}

double EpochMetrics::value(const std::string& name) const {
  auto it = values.find(name);
  return it == values.end() ? std::nan("") : it->second;
}

nlohmann::json EpochMetrics::to_json() const {
  nlohmann::json j = {{"epoch", epoch},
                      {"step", step},
                      {"wall_time", wall_time},
                      {"train_loss", number(train_loss)},
                      {"lr", lr},
                      {"epoch_seconds", epoch_seconds},
                      {"samples_per_second", samples_per_second}};
  for (const auto& [name, v] : values) j[name] = number(v);
  if (!monitor.empty()) {
    j["monitor"] = monitor;
    j["goal"] = goal;
  }
  return j;
}

EpochMetrics EpochMetrics::from_json(const nlohmann::json& j) {
  auto real = [](const nlohmann::json& v) { return v.is_number() ? v.get<double>() : std::nan(""); };
  EpochMetrics m;
  m.epoch = j.at("epoch").get<int64_t>();
  m.step = j.value("step", int64_t{0});  // absent in runs from before it was recorded
  m.wall_time = j.value("wall_time", 0.0);
  m.train_loss = real(j.at("train_loss"));
  m.lr = j.at("lr").get<double>();
  m.epoch_seconds = j.at("epoch_seconds").get<double>();
  m.samples_per_second = j.at("samples_per_second").get<double>();
  m.monitor = j.value("monitor", std::string());
  m.goal = j.value("goal", std::string("min"));
  for (const auto& [key, v] : j.items()) {
    if (std::find(std::begin(kFixedKeys), std::end(kFixedKeys), key) != std::end(kFixedKeys)) continue;
    if (v.is_number() || v.is_null()) m.values[key] = real(v);
  }
  // Runs from before "monitor" was recorded were classifiers.
  if (m.monitor.empty() && m.values.count("test_acc")) {
    m.monitor = "test_acc";
    m.goal = "max";
  }
  return m;
}

std::vector<EpochMetrics> read_epoch_metrics(const std::string& jsonl_path) {
  std::vector<EpochMetrics> out;
  std::ifstream in(jsonl_path);
  std::string line;
  for (int n = 1; std::getline(in, line); ++n) {
    if (line.empty()) continue;
    try {
      out.push_back(EpochMetrics::from_json(nlohmann::json::parse(line)));
    } catch (const nlohmann::json::exception& e) {
      throw UserError(jsonl_path + " line " + std::to_string(n) + " is not an epoch record: " + e.what() + ".",
                      "the file may be cut short by a crash; delete that line.");
    }
  }
  return out;
}

MetricsLog::MetricsLog(std::string path) : path_(std::move(path)) {
  if (!path_.empty()) dir_ = fs::path(path_).parent_path().string();
  if (dir_.empty()) dir_ = ".";
}

MetricsLog::~MetricsLog() = default;

std::string MetricsLog::file(const std::string& name) const { return dir_ + "/" + name; }

EventWriter& MetricsLog::events() {
  if (!events_) events_ = std::make_unique<EventWriter>(dir_, unix_now());
  return *events_;
}

void MetricsLog::append_csv(const std::string& row) {
  const auto csv = file("metrics.csv");
  std::error_code ec;
  const bool fresh = !fs::exists(csv, ec) || fs::file_size(csv, ec) == 0;
  if (columns_.empty()) {
    // An existing file (a resumed run) keeps its header.
    std::ifstream in(csv);
    std::string header;
    columns_ = !fresh && std::getline(in, header) ? split_csv(header) : kCsvBase;
  }
  std::ofstream f(csv, std::ios::app);
  check_user(static_cast<bool>(f), "cannot write " + csv + ".", "check that --save_path is writable.");
  if (fresh) f << join(columns_) << "\n";
  if (!row.empty()) f << row << "\n";
  f.flush();
}

std::string MetricsLog::epoch_row(const EpochMetrics& m) const {
  std::vector<std::string> cells = {"epoch", std::to_string(m.epoch), std::to_string(m.step), wall(m.wall_time),
                                    num(m.train_loss), num(m.lr), num(m.epoch_seconds), num(m.samples_per_second)};
  for (size_t i = kCsvBase.size(); i < columns_.size(); ++i) {
    auto it = m.values.find(columns_[i]);
    cells.push_back(it == m.values.end() ? "" : num(it->second));
  }
  return join(cells);
}

void MetricsLog::rewrite_csv(const std::vector<std::string>& columns) {
  const auto csv_path = file("metrics.csv");
  std::ifstream in(csv_path);
  std::string line, out = join(columns) + "\n";
  std::vector<std::string> old;
  if (std::getline(in, line)) old = split_csv(line);
  while (std::getline(in, line)) {
    if (line.empty()) continue;
    const auto cells = split_csv(line);
    std::vector<std::string> moved(columns.size());
    for (size_t i = 0; i < old.size() && i < cells.size(); ++i) {
      auto at = std::find(columns.begin(), columns.end(), old[i]);
      if (at != columns.end()) moved[static_cast<size_t>(at - columns.begin())] = cells[i];
    }
    out += join(moved) + "\n";
  }
  in.close();
  write_file_atomic(csv_path, out);
  columns_ = columns;
}

void MetricsLog::log_step(StepMetrics s) {
  if (path_.empty()) return;
  if (s.wall_time == 0) s.wall_time = unix_now();
  if (columns_.empty()) append_csv("");  // only reads or writes the header
  // Step rows leave the task's metric columns empty.
  append_csv(csv_row(s) + std::string(columns_.size() > kCsvBase.size() ? columns_.size() - kCsvBase.size() : 0, ','));
  write_step_scalars(events(), s);
}

void MetricsLog::append(EpochMetrics m) {
  if (path_.empty()) return;
  if (m.wall_time == 0) m.wall_time = unix_now();
  std::ofstream f(path_, std::ios::app);
  check_user(static_cast<bool>(f), "cannot write " + path_ + ".", "check that --save_path is writable.");
  f << m.to_json().dump() << "\n";
  f.flush();
  if (columns_.empty()) append_csv("");  // only reads or writes the header
  std::vector<std::string> columns = columns_;
  for (const auto& [name, v] : m.values)
    if (std::find(columns.begin(), columns.end(), name) == columns.end()) columns.push_back(name);
  if (columns != columns_) {
    std::sort(columns.begin() + static_cast<long>(kCsvBase.size()), columns.end());
    rewrite_csv(columns);
  }
  append_csv(epoch_row(m));
  write_epoch_scalars(events(), m);
  epochs_.push_back(m);
  write_curves_svg(file("curves.svg"), epochs_);
}

void MetricsLog::truncate_to(int64_t epochs, int64_t steps) {
  if (path_.empty()) return;
  // metrics.jsonl: the kept epochs, which also feed curves.svg.
  epochs_.clear();
  std::string jsonl;
  for (const auto& m : read_epoch_metrics(path_)) {
    if (m.epoch > epochs) continue;
    epochs_.push_back(m);
    jsonl += m.to_json().dump() + "\n";
  }
  write_file_atomic(path_, jsonl);

  // metrics.csv: the kept epoch rows and the step rows up to `steps`.
  const auto csv_path = file("metrics.csv");
  std::ifstream in(csv_path);
  std::string line;
  if (std::getline(in, line)) columns_ = split_csv(line);
  if (columns_.empty()) columns_ = kCsvBase;
  std::string csv = join(columns_) + "\n";
  std::vector<StepMetrics> kept_steps;
  while (std::getline(in, line)) {
    const auto c = split_csv(line);
    if (c.empty() || (c[0] != "step" && c[0] != "epoch")) continue;  // the header, blank lines
    if (c[0] == "epoch") {
      if (parse_epoch_of(c, csv_path) <= epochs) csv += line + "\n";
      continue;
    }
    const auto s = parse_step_row(c, csv_path);
    if (steps >= 0 ? s.step <= steps : s.epoch <= epochs) {
      kept_steps.push_back(s);
      csv += line + "\n";
    }
  }
  in.close();
  write_file_atomic(csv_path, csv);

  // Event files cannot be cut in place: one new file replaces them all.
  events_.reset();
  for (const auto& e : fs::directory_iterator(dir_))
    if (is_event_file_name(e.path().filename().string())) fs::remove(e.path());
  for (const auto& s : kept_steps) write_step_scalars(events(), s);
  for (const auto& m : epochs_) write_epoch_scalars(events(), m);

  if (epochs_.empty()) fs::remove(file("curves.svg"));
  else write_curves_svg(file("curves.svg"), epochs_);
}

}  // namespace ddp
