// `PROGRAM bench` in a program of your own times its task's own model and
// training_step, after --convert-layers as training does.
#include <gtest/gtest.h>

#include <cmath>

#include <nlohmann/json.hpp>

#include "support/testing.h"

namespace {

TEST(Bench, AProgramTimesItsOwnTasksStep) {
  const auto data = ddp::testing::temp_dir("bench_tabular_data");
  ddp::testing::write_sales_csvs(data, 200, 50);
  for (const std::string convert : {"on", "off"}) {
    auto r = ddp::testing::run_process({EXAMPLE_tabular, "bench", "--data_root", data, "--size", "1", "--backend",
                                        "gloo", "--batch", "32", "--bench-steps", "3", "--convert-layers", convert});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    const auto line = r.output.substr(r.output.rfind("{\""));
    const auto j = nlohmann::json::parse(line.substr(0, line.find('\n')));
    EXPECT_EQ(j["program"], "tabular") << line;  // the name it gave itself
    EXPECT_EQ(j["model"].get<std::string>().rfind("sales-mlp/", 0), 0u) << line;
    EXPECT_EQ(j["batch"], 32);
    EXPECT_EQ(j["converted_layers"], convert == "on" ? 3 : 0) << line;
    EXPECT_GT(j["ms_per_step"].get<double>(), 0);
    EXPECT_TRUE(std::isfinite(j["final_loss"].get<double>())) << line;
  }
}

}  // namespace
