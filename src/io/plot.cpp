// Hand-written SVG for curves.svg (see plot.h for why not a library).
#include "ddp/io/plot.h"

#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <sstream>

#include "ddp/error.h"

namespace ddp {
namespace {

constexpr double kPanelWidth = 480, kHeight = 340;
constexpr double kLeft = 64, kRight = 20, kTop = 44, kBottom = 52;  // plot-area margins in a panel

struct Series {
  std::string name, css_class, color;
  std::vector<std::pair<double, double>> points;  // (epoch, value), finite only
};

// Axis range and ticks at 1, 2 or 5 times a power of ten.
struct Axis {
  double lo = 0, hi = 1, step = 1;
  std::vector<double> ticks() const {
    std::vector<double> t;
    for (double v = std::ceil(lo / step - 1e-9) * step; v <= hi + step * 1e-6; v += step)
      t.push_back(std::abs(v) < step * 1e-9 ? 0 : v);
    return t;
  }
};

Axis nice_axis(double lo, double hi, int target_ticks, bool integer) {
  if (!(hi > lo)) {
    const double pad = lo == 0 ? 1 : std::abs(lo) * 0.1;
    lo -= pad;
    hi += pad;
  }
  const double raw = (hi - lo) / target_ticks;
  const double mag = std::pow(10, std::floor(std::log10(raw)));
  double step = mag;
  for (double m : {1.0, 2.0, 5.0, 10.0})
    if (m * mag >= raw) {
      step = m * mag;
      break;
    }
  if (integer) step = std::max(1.0, std::round(step));
  return {std::floor(lo / step) * step, std::ceil(hi / step) * step, step};
}

std::string fmt(double v, int precision = 2) {
  std::ostringstream os;
  os.setf(std::ios::fixed);
  os.precision(precision);
  os << v;
  return os.str();
}

// Tick label: as few decimals as the step needs.
std::string tick_label(double v, double step) {
  int decimals = 0;
  while (decimals < 6 && std::abs(step * std::pow(10, decimals) - std::round(step * std::pow(10, decimals))) > 1e-6)
    ++decimals;
  return fmt(v, decimals);
}

// One panel at horizontal offset `x0`: frame, grid, ticks, series, legend.
// The legend goes where the curves usually are not: top right for losses
// (they fall), bottom right for accuracy (it rises).
void draw_panel(std::ostringstream& svg, double x0, const std::string& title, const std::vector<Series>& series,
                const Axis& xa, double y_floor, double y_ceil, bool legend_at_bottom) {
  double lo = 1e300, hi = -1e300;
  for (const auto& s : series)
    for (const auto& p : s.points) lo = std::min(lo, p.second), hi = std::max(hi, p.second);
  if (lo > hi) lo = hi = 0;
  Axis ya = nice_axis(lo, hi, 5, false);
  ya.lo = std::max(ya.lo, y_floor);
  ya.hi = std::min(ya.hi, y_ceil);
  const double left = x0 + kLeft, right = x0 + kPanelWidth - kRight, top = kTop, bottom = kHeight - kBottom;
  auto px = [&](double x) { return left + (x - xa.lo) / (xa.hi - xa.lo) * (right - left); };
  auto py = [&](double y) { return bottom - (y - ya.lo) / (ya.hi - ya.lo) * (bottom - top); };

  svg << "<g class=\"panel\">\n";
  svg << "<text x=\"" << fmt((left + right) / 2) << "\" y=\"24\" text-anchor=\"middle\" font-size=\"15\">" << title
      << "</text>\n";
  for (double t : ya.ticks()) {
    if (t < ya.lo - 1e-12 || t > ya.hi + 1e-12) continue;
    svg << "<line class=\"grid\" x1=\"" << fmt(left) << "\" y1=\"" << fmt(py(t)) << "\" x2=\"" << fmt(right)
        << "\" y2=\"" << fmt(py(t)) << "\" stroke=\"#e4e4e4\"/>\n";
    svg << "<text class=\"ytick\" x=\"" << fmt(left - 6) << "\" y=\"" << fmt(py(t) + 4)
        << "\" text-anchor=\"end\">" << tick_label(t, ya.step) << "</text>\n";
  }
  for (double t : xa.ticks()) {
    svg << "<line x1=\"" << fmt(px(t)) << "\" y1=\"" << fmt(bottom) << "\" x2=\"" << fmt(px(t)) << "\" y2=\""
        << fmt(bottom + 5) << "\" stroke=\"#333\"/>\n";
    svg << "<text class=\"xtick\" x=\"" << fmt(px(t)) << "\" y=\"" << fmt(bottom + 19)
        << "\" text-anchor=\"middle\">" << tick_label(t, xa.step) << "</text>\n";
  }
  svg << "<polyline class=\"axes\" points=\"" << fmt(left) << "," << fmt(top) << " " << fmt(left) << ","
      << fmt(bottom) << " " << fmt(right) << "," << fmt(bottom) << "\" fill=\"none\" stroke=\"#333\"/>\n";
  svg << "<text x=\"" << fmt((left + right) / 2) << "\" y=\"" << fmt(kHeight - 12)
      << "\" text-anchor=\"middle\">epoch</text>\n";

  for (const auto& s : series) {
    svg << "<polyline class=\"series " << s.css_class << "\" fill=\"none\" stroke=\"" << s.color
        << "\" stroke-width=\"2\" points=\"";
    for (size_t i = 0; i < s.points.size(); ++i)
      svg << (i ? " " : "") << fmt(px(s.points[i].first)) << "," << fmt(py(s.points[i].second));
    svg << "\"/>\n";
    for (const auto& p : s.points)
      svg << "<circle class=\"" << s.css_class << "\" cx=\"" << fmt(px(p.first)) << "\" cy=\"" << fmt(py(p.second))
          << "\" r=\"3\" fill=\"" << s.color << "\"/>\n";
  }
  double ly = legend_at_bottom ? bottom - 10 - 18 * static_cast<double>(series.size() - 1) : top + 14;
  for (const auto& s : series) {
    svg << "<line class=\"legend\" x1=\"" << fmt(right - 130) << "\" y1=\"" << fmt(ly - 4) << "\" x2=\""
        << fmt(right - 108) << "\" y2=\"" << fmt(ly - 4) << "\" stroke=\"" << s.color << "\" stroke-width=\"2\"/>\n";
    svg << "<text x=\"" << fmt(right - 102) << "\" y=\"" << fmt(ly) << "\">" << s.name << "</text>\n";
    ly += 18;
  }
  svg << "</g>\n";
}

}  // namespace

namespace {

bool is_loss(const std::string& name) { return name.size() >= 5 && name.compare(name.size() - 5, 5, "_loss") == 0; }

// The right panel's metric: the monitor unless it is a loss (already on the
// left), else R squared where there is one, else the first other metric.
std::string second_panel_metric(const std::vector<EpochMetrics>& epochs) {
  if (epochs.empty()) return "";
  const auto& last = epochs.back();
  if (!last.monitor.empty() && !is_loss(last.monitor)) return last.monitor;
  std::string pick;
  for (const auto& [name, v] : last.values)
    if (!is_loss(name) && (pick.empty() || (name.size() > 3 && name.compare(name.size() - 3, 3, "_r2") == 0))) pick = name;
  return pick;
}

std::string css_class(std::string name) {
  std::replace(name.begin(), name.end(), '_', '-');
  return name;
}

}  // namespace

std::string curves_svg(const std::vector<EpochMetrics>& epochs) {
  static const char* const kColors[] = {"#ff7f0e", "#d62728", "#9467bd", "#8c564b", "#e377c2"};
  // Left: every loss (train, test, and the task's own *_loss metrics).
  std::vector<Series> losses = {{"train loss", "train-loss", "#1f77b4", {}}};
  std::vector<std::string> loss_names;
  for (const auto& m : epochs)
    for (const auto& [name, v] : m.values)
      if (is_loss(name) && std::find(loss_names.begin(), loss_names.end(), name) == loss_names.end())
        loss_names.push_back(name);
  for (size_t i = 0; i < loss_names.size(); ++i)
    losses.push_back({metric_label(loss_names[i]), css_class(loss_names[i]), kColors[i % 5], {}});
  // Right: one more metric (accuracy in per cent).
  const std::string other = second_panel_metric(epochs);
  const bool percent = is_fraction_metric(other);
  Series right{metric_label(other), css_class(other), "#2ca02c", {}};
  for (const auto& m : epochs) {
    const double e = static_cast<double>(m.epoch);
    if (std::isfinite(m.train_loss)) losses[0].points.emplace_back(e, m.train_loss);
    for (size_t i = 0; i < loss_names.size(); ++i)
      if (std::isfinite(m.value(loss_names[i]))) losses[i + 1].points.emplace_back(e, m.value(loss_names[i]));
    if (!other.empty() && std::isfinite(m.value(other))) right.points.emplace_back(e, (percent ? 100 : 1) * m.value(other));
  }
  double first = epochs.empty() ? 1 : static_cast<double>(epochs.front().epoch);
  double last = epochs.empty() ? 1 : static_cast<double>(epochs.back().epoch);
  // The x axis spans the epochs with a little room, so that the first and
  // last markers stay clear of the frame; a single epoch sits in the middle.
  Axis xa = nice_axis(first, last, 8, true);
  const double room = first == last ? 1 : 0.03 * (last - first);
  xa.lo = first - room;
  xa.hi = last + room;

  std::ostringstream svg;
  svg << "<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n"
      << "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"" << fmt(2 * kPanelWidth, 0) << "\" height=\""
      << fmt(kHeight, 0) << "\" viewBox=\"0 0 " << fmt(2 * kPanelWidth, 0) << " " << fmt(kHeight, 0)
      << "\" font-family=\"sans-serif\" font-size=\"12\">\n"
      << "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>\n";
  draw_panel(svg, 0, "loss", losses, xa, -1e300, 1e300, false);
  if (other.empty())
    draw_panel(svg, kPanelWidth, "no other metric", {}, xa, -1e300, 1e300, true);
  else
    draw_panel(svg, kPanelWidth, metric_label(other) + (percent ? " (%)" : ""), {right}, xa, percent ? 0 : -1e300,
               percent ? 100 : 1e300, true);
  svg << "</svg>\n";
  return svg.str();
}

// Temp file + rename, so a viewer or a kill never meets half a file; but no
// fsync as for checkpoints: a picture lost to a power cut is redrawn after
// the next epoch, and an fsync per epoch can stall training on a busy disk.
void write_curves_svg(const std::string& path, const std::vector<EpochMetrics>& epochs) {
  const std::string tmp = path + ".tmp." + std::to_string(::getpid());
  {
    std::ofstream f(tmp, std::ios::binary | std::ios::trunc);
    check_user(static_cast<bool>(f), "cannot write " + tmp + ".", "check that --save_path is writable.");
    f << curves_svg(epochs);
    check_user(static_cast<bool>(f.flush()), "cannot write " + tmp + ".", "check that --save_path has space.");
  }
  if (std::rename(tmp.c_str(), path.c_str()) != 0) {
    std::remove(tmp.c_str());
    throw UserError("cannot replace " + path + ".", "check that --save_path is writable.");
  }
}

}  // namespace ddp
