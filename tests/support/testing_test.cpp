// The test harness's own promises: temp_dir()'s directories do not outlive
// a passing run (the suite used to leave ~1 GB in /tmp per run, which filled
// a CI machine's disk), and stay, named, when a test failed.
#include "support/testing.h"

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <regex>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

// The probe the tests below run in a child gtest process (skipped in the
// suite itself): it makes a directory with a file in it, prints where, and
// passes or fails as DDP_TEST_PROBE says.
TEST(Support, TempDirProbe) {
  const char* probe = std::getenv("DDP_TEST_PROBE");
  if (!probe) GTEST_SKIP() << "run by Support.TempDirsOf*";
  const std::string dir = temp_dir("probe");
  std::ofstream(dir + "/evidence.txt") << "kept when a test fails\n";
  std::printf("probe dir: %s\n", dir.c_str());
  EXPECT_STREQ(probe, "pass") << "failing on purpose";
}

std::string probe_dir(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex("probe dir: (\\S+)"))) return "";
  return m[1];
}

std::string self_exe() { return fs::read_symlink("/proc/self/exe").string(); }

}  // namespace

TEST(Support, TempDirsOfAPassingRunAreRemovedAtExit) {
  auto r = run_process({self_exe(), "--gtest_filter=Support.TempDirProbe"}, {{"DDP_TEST_PROBE", "pass"}}, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  const std::string dir = probe_dir(r.output);
  ASSERT_FALSE(dir.empty()) << r.output;
  EXPECT_FALSE(fs::exists(dir)) << dir << " outlived a passing run";
}

TEST(Support, TempDirsOfAFailedRunAreKeptAndNamed) {
  auto r = run_process({self_exe(), "--gtest_filter=Support.TempDirProbe"}, {{"DDP_TEST_PROBE", "fail"}}, 60);
  ASSERT_NE(r.exit_code, 0) << r.output;
  const std::string dir = probe_dir(r.output);
  ASSERT_FALSE(dir.empty()) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/evidence.txt")) << "a failed test's files are the evidence";
  EXPECT_NE(r.output.find("kept " + dir), std::string::npos) << r.output;
  fs::remove_all(dir);
}
