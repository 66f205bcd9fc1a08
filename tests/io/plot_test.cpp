// curves.svg: well-formed, one marker and polyline vertex per epoch, and
// vertices placed linearly in the data.
#include <cmath>
#include <filesystem>
#include <regex>

#include "ddp/io/plot.h"
#include "support/testing.h"

namespace {

// Checks that tags nest and close, attributes are quoted, and text has no
// raw '<' or '&'; returns "" or what is wrong.
std::string xml_problem(const std::string& doc) {
  std::vector<std::string> open;
  size_t at = 0;
  if (doc.rfind("<?xml", 0) == 0) at = doc.find("?>") + 2;
  while (at < doc.size()) {
    const size_t lt = doc.find('<', at);
    const std::string text = doc.substr(at, lt == std::string::npos ? std::string::npos : lt - at);
    if (text.find('&') != std::string::npos && !std::regex_search(text, std::regex("&(amp|lt|gt|quot|apos);")))
      return "raw & in text: " + text;
    if (lt == std::string::npos) break;
    const size_t gt = doc.find('>', lt);
    if (gt == std::string::npos) return "unclosed tag at " + std::to_string(lt);
    std::string tag = doc.substr(lt + 1, gt - lt - 1);
    if (tag.find('<') != std::string::npos) return "'<' inside a tag: " + tag;
    if (tag[0] == '/') {
      if (open.empty() || open.back() != tag.substr(1)) return "mismatched </" + tag.substr(1) + ">";
      open.pop_back();
    } else {
      const bool self_closing = tag.back() == '/';
      if (self_closing) tag.pop_back();
      static const std::regex element(R"(^[a-zA-Z][\w-]*(\s+[\w:-]+="[^"<]*")*\s*$)");
      if (!std::regex_match(tag, element)) return "malformed tag: <" + tag + ">";
      if (!self_closing) open.push_back(tag.substr(0, tag.find_first_of(" \n")));
    }
    at = gt + 1;
  }
  if (!open.empty()) return "unclosed <" + open.back() + ">";
  return "";
}

std::vector<std::pair<double, double>> polyline(const std::string& svg, const std::string& css_class) {
  std::smatch m;
  const std::regex re("<polyline class=\"series " + css_class + "\"[^>]* points=\"([^\"]*)\"");
  EXPECT_TRUE(std::regex_search(svg, m, re)) << css_class;
  std::vector<std::pair<double, double>> points;
  std::stringstream ss(m.size() > 1 ? m[1].str() : "");
  std::string xy;
  while (ss >> xy) points.emplace_back(std::stod(xy.substr(0, xy.find(','))), std::stod(xy.substr(xy.find(',') + 1)));
  return points;
}

std::vector<double> labels(const std::string& svg, const std::string& css_class) {
  std::vector<double> out;
  const std::regex re("<text class=\"" + css_class + "\"[^>]*>([^<]*)</text>");
  for (std::sregex_iterator it(svg.begin(), svg.end(), re), end; it != end; ++it) out.push_back(std::stod((*it)[1]));
  return out;
}

using ddp::testing::count;

std::vector<ddp::EpochMetrics> run_of(std::vector<double> train, std::vector<double> test, std::vector<double> acc) {
  std::vector<ddp::EpochMetrics> out;
  for (size_t i = 0; i < train.size(); ++i) {
    ddp::EpochMetrics m;
    m.epoch = static_cast<int64_t>(i) + 1;
    m.train_loss = train[i];
    m.values["test_loss"] = test[i];
    m.values["test_acc"] = acc[i];
    out.push_back(m);
  }
  return out;
}

TEST(Plot, CurvesSvgIsWellFormedWithAPointPerEpoch) {
  const auto svg = ddp::curves_svg(run_of({1.2, 0.7, 0.5, 0.42, 0.4}, {0.9, 0.6, 0.55, 0.5, 0.49},
                                          {0.62, 0.78, 0.83, 0.85, 0.86}));
  EXPECT_EQ(xml_problem(svg), "");
  EXPECT_NE(svg.find("<svg xmlns=\"http://www.w3.org/2000/svg\""), std::string::npos);
  for (const char* series : {"train-loss", "test-loss", "test-acc"}) {
    EXPECT_EQ(polyline(svg, series).size(), 5u) << series;
    EXPECT_EQ(count(svg, std::string("<circle class=\"") + series + "\""), 5u) << series;
  }
  for (const char* legend : {">train loss<", ">test loss<", ">test accuracy<", ">epoch<"})
    EXPECT_NE(svg.find(legend), std::string::npos) << legend;
  EXPECT_EQ(count(svg, "class=\"axes\""), 2u);
  // Every epoch has an x tick in both panels.
  EXPECT_EQ(labels(svg, "xtick"), (std::vector<double>{1, 2, 3, 4, 5, 1, 2, 3, 4, 5}));
  EXPECT_EQ(xml_problem("<svg><g></svg>"), "mismatched </svg>");  // the checker itself can fail
}

TEST(Plot, VerticesAreLinearInEpochAndValue) {
  const std::vector<double> train{2.0, 1.1, 0.8, 0.65}, test{1.5, 1.0, 0.9, 0.95}, acc{0.4, 0.7, 0.75, 0.8};
  const auto svg = ddp::curves_svg(run_of(train, test, acc));
  const auto ticks = labels(svg, "ytick");
  ASSERT_GE(ticks.size(), 4u);
  for (auto [name, values] : std::vector<std::pair<std::string, std::vector<double>>>{
           {"train-loss", train}, {"test-loss", test}, {"test-acc", {40, 70, 75, 80}}}) {
    const auto p = polyline(svg, name);
    ASSERT_EQ(p.size(), values.size()) << name;
    // x: equal spacing for consecutive epochs; y: one scale for every point,
    // larger values higher up (smaller y).
    const double dx = p[1].first - p[0].first, scale = (p[1].second - p[0].second) / (values[1] - values[0]);
    EXPECT_GT(dx, 0);
    EXPECT_LT(scale, 0);
    for (size_t i = 1; i < p.size(); ++i) {
      EXPECT_NEAR(p[i].first - p[i - 1].first, dx, 0.02) << name;
      EXPECT_NEAR(p[i].second - p[0].second, scale * (values[i] - values[0]), 0.02) << name << " " << i;
    }
  }
  // The loss panel's y ticks span both loss series.
  const double lo = *std::min_element(ticks.begin(), ticks.end()), hi = *std::max_element(ticks.begin(), ticks.end());
  EXPECT_LE(lo, 0.65);
  EXPECT_GE(hi, 2.0);
}

TEST(Plot, OneEpochAndMissingValuesStillDraw) {
  const auto one = ddp::curves_svg(run_of({0.5}, {0.6}, {0.8}));
  EXPECT_EQ(xml_problem(one), "");
  EXPECT_EQ(polyline(one, "train-loss").size(), 1u);
  EXPECT_EQ(count(one, "<circle class=\"test-acc\""), 1u);
  const auto gap = ddp::curves_svg(run_of({0.5, 0.4, 0.3}, {0.6, NAN, 0.4}, {0.8, 0.82, 0.84}));
  EXPECT_EQ(xml_problem(gap), "");
  EXPECT_EQ(polyline(gap, "test-loss").size(), 2u);
  EXPECT_EQ(gap.find("nan"), std::string::npos);
  EXPECT_EQ(xml_problem(ddp::curves_svg({})), "");
}

TEST(Plot, WriteLeavesOnlyTheFinishedFile) {
  const auto dir = ddp::testing::temp_dir("plot");
  const auto runs = run_of({0.5, 0.4}, {0.6, 0.5}, {0.8, 0.9});
  ddp::write_curves_svg(dir + "/curves.svg", {runs[0]});
  ddp::write_curves_svg(dir + "/curves.svg", runs);
  EXPECT_EQ(ddp::testing::read_file(dir + "/curves.svg"), ddp::curves_svg(runs));
  size_t files = 0;
  for (const auto& e : std::filesystem::directory_iterator(dir)) files += e.is_regular_file();
  EXPECT_EQ(files, 1u);
}

}  // namespace
