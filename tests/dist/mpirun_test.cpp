// ddptrain under a real Open MPI mpirun (Debian's openmpi-bin, which
// `./setup.sh --tests` installs): the README's mpirun command, as written,
// trains one job of 2 ranks that read their places from mpirun's
// environment (OMPI_COMM_WORLD_*) and meet at MASTER_ADDR:MASTER_PORT.
#include <unistd.h>

#include <filesystem>
#include <sstream>
#include <string>
#include <vector>

#include "ddp/dist/launch.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

constexpr const char* kMpirun = "/usr/bin/mpirun";

// The README's lines that start an mpirun.
std::vector<std::string> mpirun_lines(const std::string& file) {
  std::vector<std::string> out;
  std::istringstream in(ddp::testing::read_file(file));
  for (std::string line; std::getline(in, line);)
    if (line.rfind("mpirun ", 0) == 0) out.push_back(line.substr(0, line.find('#')));
  return out;
}

TEST(Mpirun, DocumentedCommandRunsAsWritten) {
  DDP_SKIP_UNLESS_GLOO();
  if (!fs::exists(kMpirun)) GTEST_SKIP() << "no " << kMpirun << " (./setup.sh --tests installs openmpi-bin)";
  const auto lines = mpirun_lines(DDP_SOURCE_DIR "/README.md");
  ASSERT_EQ(lines.size(), 1u) << "the README's mpirun command";
  // As written, with 2 ranks, this host, a free port and this build's
  // ddptrain; Open MPI refuses root without --allow-run-as-root, and
  // oversubscribes a 2-core machine only when asked.
  std::vector<std::string> cmd;
  std::istringstream words(lines[0]);
  for (std::string w; words >> w;) {
    if (w.rfind("MASTER_ADDR=", 0) == 0) w = "MASTER_ADDR=127.0.0.1";
    if (w.rfind("MASTER_PORT=", 0) == 0) w = "MASTER_PORT=" + std::to_string(ddp::find_free_port());
    if (w == "./build/ddptrain") w = DDPTRAIN_EXE;
    if (!cmd.empty() && cmd.back() == "-np") w = "2";
    cmd.push_back(w);
  }
  cmd[0] = kMpirun;
  cmd.insert(cmd.begin() + 1, "--oversubscribe");
  if (::geteuid() == 0) cmd.insert(cmd.begin() + 1, "--allow-run-as-root");
  const auto dir = ddp::testing::temp_dir("mpirun");
  for (const char* f : {"--dataset", "synthetic", "--backend", "gloo", "--progress", "plain", "--timeout", "60",
                        "--epochs", "1", "--train-samples", "256", "--test-samples", "64", "--workers", "0",
                        "--save_path"})
    cmd.push_back(f);
  cmd.push_back(dir);
  auto r = ddp::testing::run_process(cmd, {}, 180);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 0 of 2 (mpi launcher)"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("world: 2 rank(s)"), std::string::npos) << r.output;
  EXPECT_EQ(ddp::testing::metrics_jsonl(dir).size(), 1u) << r.output;
}

}  // namespace
