// setup.sh, the README's first command, on a machine short of disk: it stops
// before building with one line naming the free space and the fix, where it
// used to fill the disk and fail later with errors that hid the cause.
#include "support/testing.h"

#include <filesystem>

namespace fs = std::filesystem;
using namespace ddp::testing;

TEST(Setup, RefusesADiskTooSmallForTheBuildBeforeBuilding) {
  // A 64 MB tmpfs in a mount namespace of the child's own: nothing is
  // mounted outside it, and the mount goes when the child does.
  if (run_process({"unshare", "-m", "true"}, {}, 20).exit_code != 0)
    GTEST_SKIP() << "unshare -m needs root (or CAP_SYS_ADMIN)";
  const std::string dir = temp_dir("setup_disk");
  const std::string small = dir + "/small";
  fs::create_directories(small);
  const std::string script = "mount -t tmpfs -o size=64m tmpfs '" + small + "' && BUILD_DIR='" + small +
                             "/build' '" + DDP_SOURCE_DIR + "/setup.sh' --tests";
  auto r = run_process({"unshare", "-m", "sh", "-c", script}, {}, 120);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("MB free on the disk of " + small + "/build; building ddptrain ddp_tests ddp_testworker "
                          "needs about 3000 MB"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("BUILD_DIR=<a folder on a larger disk> ./setup.sh --tests"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("LibTorch"), std::string::npos) << "it went on to the packages:\n" << r.output;
  EXPECT_EQ(r.output.find("configure"), std::string::npos) << "it configured the build anyway:\n" << r.output;
}
