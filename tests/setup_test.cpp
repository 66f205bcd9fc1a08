// setup.sh, the README's first command, on a machine short of disk: it stops
// before building with one line naming the free space and the fix, where it
// used to fill the disk and fail later with errors that hid the cause; and
// a build already there counts, so a rebuild is not refused.
#include "support/testing.h"

#include <filesystem>

namespace fs = std::filesystem;
using namespace ddp::testing;

namespace {

// setup.sh --tests with its build folder on a tmpfs of `size_mb` that
// already holds `existing_mb` of build files, in a mount namespace of the
// child's own: nothing is mounted outside it, and the mount goes with it.
ProcessResult setup_on_small_disk(const std::string& dir, int size_mb, int existing_mb,
                                  const std::string& env_prefix = "") {
  const std::string disk = dir + "/disk";
  fs::create_directories(disk);
  std::string script = "mount -t tmpfs -o size=" + std::to_string(size_mb) + "m tmpfs '" + disk + "' && mkdir -p '" +
                       disk + "/build'";
  if (existing_mb > 0) script += " && fallocate -l " + std::to_string(existing_mb) + "M '" + disk + "/build/objects'";
  script += " && " + env_prefix + " BUILD_DIR='" + disk + "/build' '" + DDP_SOURCE_DIR + "/setup.sh' --tests";
  return run_process({"unshare", "-m", "sh", "-c", script}, {}, 120);
}

bool can_mount() { return run_process({"unshare", "-m", "true"}, {}, 20).exit_code == 0; }

}  // namespace

TEST(Setup, RefusesADiskTooSmallForTheBuildBeforeBuilding) {
  if (!can_mount()) GTEST_SKIP() << "unshare -m needs root (or CAP_SYS_ADMIN)";
  const std::string dir = temp_dir("setup_disk");
  auto r = setup_on_small_disk(dir, 64, 0);
  EXPECT_EQ(r.exit_code, 1) << r.output;
  EXPECT_NE(r.output.find("MB free on the disk of " + dir + "/disk/build; building ddptrain ddp_tests ddp_testworker "
                          "needs about 3000 MB more"),
            std::string::npos)
      << r.output;
  EXPECT_NE(r.output.find("BUILD_DIR=<a folder on a larger disk> ./setup.sh --tests"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("LibTorch"), std::string::npos) << "it went on to the packages:\n" << r.output;
  EXPECT_EQ(r.output.find("configure"), std::string::npos) << "it configured the build anyway:\n" << r.output;
}

// 1,800 MB free is too little for a new build with the tests, and enough
// for a rebuild of one that holds 1,300 MB. The run stops at configure,
// just past the check, on a generator CMake does not have (and Torch_DIR,
// given, leaves the packages step to look at the headers alone).
TEST(Setup, CountsTheSpaceABuildAlreadyThereHolds) {
  if (!can_mount()) GTEST_SKIP() << "unshare -m needs root (or CAP_SYS_ADMIN)";
  for (const char* h : {"CLI/CLI.hpp", "nlohmann/json.hpp", "gtest/gtest.h", "zlib.h", "jpeglib.h", "png.h"})
    if (!fs::exists(std::string("/usr/include/") + h)) GTEST_SKIP() << "no /usr/include/" << h;
  const std::string dir = temp_dir("setup_rebuild");
  auto r = setup_on_small_disk(dir, 3100, 1300, "Torch_DIR=" + dir + "/no-torch DDP_CMAKE_ARGS=-GNoSuchGenerator");
  EXPECT_EQ(r.output.find("MB free on the disk"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("configure"), std::string::npos) << "it stopped before configuring:\n" << r.output;
  EXPECT_NE(r.output.find("NoSuchGenerator"), std::string::npos) << r.output;
  EXPECT_EQ(r.exit_code, 1) << r.output;
}
