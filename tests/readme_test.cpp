// The README's commands and the scripts that run them say the same thing.
#include <sstream>

#include "support/testing.h"

namespace {

// The first line of `text` that contains `needle`, less a trailing comment
// ("  # ...") and surrounding blanks.
std::string command_line_with(const std::string& text, const std::string& needle) {
  std::istringstream lines(text);
  for (std::string line; std::getline(lines, line);) {
    if (line.find(needle) == std::string::npos) continue;
    const auto comment = line.find("  #");
    if (comment != std::string::npos) line.erase(comment);
    const auto first = line.find_first_not_of(' '), last = line.find_last_not_of(' ');
    return first == std::string::npos ? "" : line.substr(first, last - first + 1);
  }
  return "";
}

}  // namespace

// CI (.ci/run) runs exactly the test command the README's quick start gives.
TEST(Readme, CiRunsTheQuickStartsTestCommand) {
  const std::string root = DDP_SOURCE_DIR;
  const auto readme = command_line_with(ddp::testing::read_file(root + "/README.md"), "./setup.sh --tests");
  const auto ci = command_line_with(ddp::testing::read_file(root + "/.ci/run"), "./setup.sh --tests");
  ASSERT_FALSE(readme.empty()) << "README.md has no './setup.sh --tests' command";
  EXPECT_NE(readme.find("ctest"), std::string::npos) << readme;
  EXPECT_EQ(ci, readme);
}
