// Multi-node jobs: two ddptrain launchers (--nnodes 2 --node-rank 0/1) form
// one job and train together over real Gloo and real TCP.
//
// Each "node" is a network namespace with its own address on a veth pair
// (10.200.0.1 and 10.200.0.2), so the two launchers can reach each other only
// the way two machines would. Where namespaces cannot be made (not root, no
// CAP_NET_ADMIN, no iproute2) both launchers run on loopback instead; the
// test prints "netns unavailable: <reason>; using loopback" and records the
// network it used as the property "network".
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <filesystem>
#include <fstream>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/dist/launch.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::Child;
using ddp::testing::finish_process;
using ddp::testing::ProcessResult;
using ddp::testing::run_process;
using ddp::testing::start_process;

std::string first_line(const std::string& s) { return s.substr(0, s.find('\n')); }

// Two nodes: two network namespaces joined by a veth pair, or loopback.
class TwoNodes {
 public:
  TwoNodes() {
    const std::string id = std::to_string(getpid());
    ns_[0] = "ddpn" + id + "a";
    ns_[1] = "ddpn" + id + "b";
    veth_[0] = "ddpv" + id + "a";
    veth_[1] = "ddpv" + id + "b";
    remove();  // names carry our pid: anything by that name is stale
    const std::vector<std::vector<std::string>> steps{
        {"netns", "add", ns_[0]},
        {"netns", "add", ns_[1]},
        {"link", "add", veth_[0], "type", "veth", "peer", "name", veth_[1]},
        {"link", "set", veth_[0], "netns", ns_[0]},
        {"link", "set", veth_[1], "netns", ns_[1]},
        {"-n", ns_[0], "addr", "add", "10.200.0.1/24", "dev", veth_[0]},
        {"-n", ns_[1], "addr", "add", "10.200.0.2/24", "dev", veth_[1]},
        {"-n", ns_[0], "link", "set", "lo", "up"},
        {"-n", ns_[1], "link", "set", "lo", "up"},
        {"-n", ns_[0], "link", "set", veth_[0], "up"},
        {"-n", ns_[1], "link", "set", veth_[1], "up"},
        {"netns", "exec", ns_[1], "true"},
    };
    for (const auto& step : steps) {
      std::vector<std::string> argv{"ip"};
      argv.insert(argv.end(), step.begin(), step.end());
      auto r = run_process(argv, {}, 30);
      if (r.exit_code != 0) {
        reason_ = "'ip";
        for (const auto& s : step) reason_ += " " + s;
        reason_ += "' failed (exit " + std::to_string(r.exit_code) + (r.exit_code == 127 ? ", iproute2 missing?" : "") +
                   "): " + first_line(r.output);
        remove();
        break;
      }
    }
    netns_ = reason_.empty();
    if (netns_) {
      ::testing::Test::RecordProperty("network", "netns " + ns_[0] + " 10.200.0.1, " + ns_[1] + " 10.200.0.2 (veth)");
      std::printf("two nodes: network namespaces %s (10.200.0.1) and %s (10.200.0.2) over a veth pair\n",
                  ns_[0].c_str(), ns_[1].c_str());
    } else {
      ::testing::Test::RecordProperty("network", "loopback (netns unavailable: " + reason_ + ")");
      std::printf("netns unavailable: %s; using loopback\n", reason_.c_str());
    }
    std::fflush(stdout);
  }
  ~TwoNodes() {
    if (netns_) remove();
  }

  bool netns() const { return netns_; }
  /// The address of `node` as the other node sees it.
  std::string address(int node) const { return netns_ ? (node == 0 ? "10.200.0.1" : "10.200.0.2") : "127.0.0.1"; }
  /// `argv` run on `node`.
  std::vector<std::string> on(int node, std::vector<std::string> argv) const {
    if (netns_) argv.insert(argv.begin(), {"ip", "netns", "exec", ns_[node]});
    return argv;
  }

 private:
  void remove() {
    for (int i = 0; i < 2; ++i) {
      run_process({"ip", "netns", "del", ns_[i]}, {}, 30);
      run_process({"ip", "link", "del", veth_[i]}, {}, 30);
    }
  }

  std::string ns_[2], veth_[2], reason_;
  bool netns_ = false;
};

// ddptrain on `node` of 2, with `size` local ranks, on the built-in synthetic
// data (no dataset needed).
std::vector<std::string> node_args(const TwoNodes& net, int node, int port, const std::string& save_path,
                                   std::vector<std::string> extra, int size = 2) {
  std::vector<std::string> a{DDPTRAIN_EXE, "--nnodes", "2", "--node-rank", std::to_string(node),
                             "--address", net.address(0), "--port", std::to_string(port),
                             "--size", std::to_string(size), "--backend", "gloo", "--dataset", "synthetic",
                             "--model", "cnn", "--save_path", save_path, "--progress", "plain", "--timeout", "60"};
  a.insert(a.end(), extra.begin(), extra.end());
  return net.on(node, a);
}

using ddp::testing::count;

using ddp::testing::metrics_under;

TEST(MultiNode, TwoLaunchersFormOneJobAndTrain) {
  DDP_SKIP_UNLESS_GLOO();
  TwoNodes net;
  const int port = ddp::find_free_port();
  const auto save0 = ddp::testing::temp_dir("mn_node0"), save1 = ddp::testing::temp_dir("mn_node1");
  const std::vector<std::string> run{"--epochs", "1", "--train-samples", "2048", "--test-samples", "512",
                                     "--log-every", "4"};
  // Node 1 first: it must wait for node 0 rather than fail.
  const auto t0 = std::chrono::steady_clock::now();
  Child c1 = start_process(node_args(net, 1, port, save1, run));
  Child c0 = start_process(node_args(net, 0, port, save0, run));
  ProcessResult r0 = finish_process(c0, 300), r1 = finish_process(c1, 60);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  ASSERT_EQ(r0.exit_code, 0) << r0.output << "\n--- node 1 ---\n" << r1.output;
  ASSERT_EQ(r1.exit_code, 0) << r1.output << "\n--- node 0 ---\n" << r0.output;

  // One job of 4 ranks: rank 0 (on node 0) reports it, once; two separate
  // jobs of 2 would each print "world: 2 rank(s)" and write metrics.
  EXPECT_EQ(count(r0.output, "world: 4 rank(s), backend gloo"), 1u) << r0.output;
  EXPECT_NE(r0.output.find("rank 0 of 4 (ddptrain launcher)"), std::string::npos) << r0.output;
  EXPECT_EQ(r1.output.find("world: "), std::string::npos) << "only rank 0 prints\n" << r1.output;
  EXPECT_EQ(r1.output.find("train_loss"), std::string::npos) << r1.output;
  EXPECT_EQ(count(r0.output, "epoch 1/1  train_loss"), 1u) << r0.output;

  // The metrics of the job, once, written by rank 0 on node 0.
  auto m0 = metrics_under(save0), m1 = metrics_under(save1);
  EXPECT_TRUE(m1.empty()) << "node 1 wrote metrics";
  ASSERT_EQ(m0.size(), 1u);
  EXPECT_EQ(m0[0]["epoch"], 1);
  EXPECT_GT(m0[0]["test_acc"].get<double>(), 0.5) << r0.output;  // the synthetic task is learnable; chance is 0.1
  std::printf("one job of 4 ranks on 2 nodes: %.1f s, test_acc %.3f\n", seconds, m0[0]["test_acc"].get<double>());
}

// A rank that fails on one node stops the launcher of the other node within
// seconds, and both launchers name that rank.
class MultiNodeFailure : public ::testing::TestWithParam<int> {};

TEST_P(MultiNodeFailure, StopsTheOtherNodeAndNamesTheRank) {
  DDP_SKIP_UNLESS_GLOO();
  const int failed_rank = GetParam();  // ranks 0, 1 live on node 0; 2, 3 on node 1
  const int failed_node = failed_rank / 2, other_node = 1 - failed_node;
  TwoNodes net;
  const int port = ddp::find_free_port();
  const auto save = ddp::testing::temp_dir("mn_fail");
  // Long enough that only a failure ends it early.
  const std::vector<std::string> run{"--epochs", "50", "--train-samples", "4096", "--test-samples", "256",
                                     "--log-every", "1", "--inject-fault", std::to_string(failed_rank) + ":5"};
  Child c0 = start_process(node_args(net, 0, port, save + "/0", run));
  Child c1 = start_process(node_args(net, 1, port, save + "/1", run));
  Child& failing = failed_node == 0 ? c0 : c1;
  Child& other = failed_node == 0 ? c1 : c0;

  ProcessResult rf = finish_process(failing, 300);
  const auto failed_at = std::chrono::steady_clock::now();
  ProcessResult ro = finish_process(other, 60);
  const double stop_seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - failed_at).count();
  const std::string both = "--- node " + std::to_string(failed_node) + " ---\n" + rf.output + "\n--- node " +
                           std::to_string(other_node) + " ---\n" + ro.output;

  const std::string cause = "rank " + std::to_string(failed_rank) + " exited with code 1 on node " +
                            std::to_string(failed_node);
  EXPECT_NE(rf.output.find("injected failure (--inject-fault) at step 5"), std::string::npos) << both;
  EXPECT_EQ(rf.exit_code, 1) << both;
  EXPECT_NE(rf.output.find("ddptrain: worker failed: " + cause), std::string::npos) << both;
  // The other node's launcher stops too, names the rank, and does so quickly
  // (a poll, then at most the 5 s grace before SIGKILL).
  EXPECT_NE(ro.exit_code, 0) << both;
  EXPECT_EQ(ro.output.find("[test harness: killed after timeout]"), std::string::npos) << both;
  EXPECT_NE(ro.output.find("ddptrain: worker failed: " + cause), std::string::npos) << both;
  EXPECT_LT(stop_seconds, 20) << both;
  EXPECT_TRUE(metrics_under(save).empty()) << "the job must not have finished an epoch\n" << both;
  std::printf("rank %d failed on node %d; node %d's launcher stopped %.1f s after node %d's\n", failed_rank,
              failed_node, other_node, stop_seconds, failed_node);
}

INSTANTIATE_TEST_SUITE_P(Ranks, MultiNodeFailure, ::testing::Values(3, 0),
                         [](const auto& info) { return "Rank" + std::to_string(info.param); });

// --max-restarts across nodes: both launchers see the failure, both restart,
// and the restarted ranks form the job again under fresh store keys.
TEST(MultiNode, MaxRestartsRestartsEveryNode) {
  DDP_SKIP_UNLESS_GLOO();
  TwoNodes net;
  const int port = ddp::find_free_port();
  const auto save = ddp::testing::temp_dir("mn_restart");
  const std::vector<std::string> run{"--epochs", "1", "--train-samples", "1024", "--test-samples", "256",
                                     "--max-restarts", "1", "--inject-fault", "3:2"};
  // The injected failure fires in the first attempt only.
  Child c0 = start_process(node_args(net, 0, port, save, run));
  Child c1 = start_process(node_args(net, 1, port, save + "/1", run));
  ProcessResult r0 = finish_process(c0, 300), r1 = finish_process(c1, 60);
  const std::string both = r0.output + "\n--- node 1 ---\n" + r1.output;
  ASSERT_EQ(r0.exit_code, 0) << both;
  ASSERT_EQ(r1.exit_code, 0) << both;
  for (const auto* r : {&r0, &r1})
    EXPECT_NE(r->output.find("rank 3 exited with code 1 on node 1; restart 1 of 1"), std::string::npos) << both;
  EXPECT_EQ(count(r0.output, "world: 4 rank(s)"), 2u) << both;  // the first attempt and the restart
  EXPECT_EQ(metrics_under(save).size(), 1u) << both;
}

// Node 1 with fewer ranks than node 0 would compute colliding ranks: both
// launchers stop with a line that says so.
TEST(MultiNode, DifferentSizesPerNodeAreAnError) {
  DDP_SKIP_UNLESS_GLOO();
  TwoNodes net;
  const int port = ddp::find_free_port();
  const auto save = ddp::testing::temp_dir("mn_size");
  const std::vector<std::string> run{"--epochs", "1", "--train-samples", "256", "--test-samples", "64"};
  Child c0 = start_process(node_args(net, 0, port, save, run, 2));
  Child c1 = start_process(node_args(net, 1, port, save, run, 1));
  ProcessResult r1 = finish_process(c1, 120);
  const auto node1_done = std::chrono::steady_clock::now();
  ProcessResult r0 = finish_process(c0, 60);
  const double node0_after = std::chrono::duration<double>(std::chrono::steady_clock::now() - node1_done).count();
  const std::string both = r0.output + "\n--- node 1 ---\n" + r1.output;
  EXPECT_EQ(r1.exit_code, ddp::exit_code::kUsage) << both;
  EXPECT_NE(r1.output.find("node 1 has --size 1 but node 0 has --size 2"), std::string::npos) << both;
  EXPECT_NE(r1.output.find("give every node the same --size"), std::string::npos) << both;
  EXPECT_NE(r0.exit_code, 0) << both;
  EXPECT_NE(r0.output.find("node 1 has --size 1 but node 0 has --size 2"), std::string::npos) << both;
  EXPECT_EQ(r0.output.find("[test harness: killed after timeout]"), std::string::npos) << both;
  EXPECT_LT(node0_after, 20) << both;  // a poll, then at most the 5 s grace
}

// A flag that changes a collective's sequence or a buffer's layout, given
// to one node only: the job stops before training, in one line that names
// the flag, each node's value and its ranks. Unchecked, --log-every and
// --stop-at made the ranks issue different collectives (Gloo aborts rank 0;
// NCCL hangs), and --channels-last summed gradient buckets of two layouts
// as raw memory without a word.
struct FlagDiffersCase {
  std::string name;
  std::vector<std::string> node0, node1;  // each node's own flags
  std::string expect;
};
void PrintTo(const FlagDiffersCase& c, std::ostream* os) { *os << c.name; }

class FlagDiffersBetweenNodes : public ::testing::TestWithParam<FlagDiffersCase> {};

TEST_P(FlagDiffersBetweenNodes, StopsTheJobInOneLineNamingTheFlagAndRanks) {
  DDP_SKIP_UNLESS_GLOO();
  const auto& c = GetParam();
  TwoNodes net;
  const int port = ddp::find_free_port();
  const auto save = ddp::testing::temp_dir("mn_flags");
  // Two epochs of two steps per rank: room for every flag's divergence to
  // show (a log line at step 1, a stop after epoch 1). --timeout bounds a
  // collective that one rank never joins.
  const std::vector<std::string> run{"--epochs", "2", "--train-samples", "256", "--test-samples", "64",
                                     "--sanity-val-steps", "0", "--workers", "0", "--timeout", "20"};
  auto with = [&](std::vector<std::string> own) {
    own.insert(own.begin(), run.begin(), run.end());
    return own;
  };
  const auto t0 = std::chrono::steady_clock::now();
  Child c0 = start_process(node_args(net, 0, port, save + "/0", with(c.node0), 1));
  Child c1 = start_process(node_args(net, 1, port, save + "/1", with(c.node1), 1));
  ProcessResult r0 = finish_process(c0, 120), r1 = finish_process(c1, 60);
  const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  const std::string both = r0.output + "\n--- node 1 ---\n" + r1.output;
  EXPECT_EQ(r0.exit_code, ddp::exit_code::kUsage) << both;
  EXPECT_NE(r1.exit_code, 0) << both;
  EXPECT_NE(r0.output.find(c.expect), std::string::npos) << both;
  EXPECT_NE(r0.output.find("Hint: give every node the same " + c.expect.substr(0, c.expect.find(' '))),
            std::string::npos) << both;
  EXPECT_EQ(count(both, " differs between ranks"), 1u) << "one line for the job\n" << both;
  EXPECT_EQ(both.find("[test harness: killed after timeout]"), std::string::npos) << both;
  EXPECT_EQ(both.find("EnforceNotMet"), std::string::npos) << both;
  EXPECT_TRUE(metrics_under(save).empty()) << "no epoch may finish\n" << both;
  EXPECT_LT(seconds, 60) << both;
}

INSTANTIATE_TEST_SUITE_P(
    Flags, FlagDiffersBetweenNodes,
    ::testing::Values(
        FlagDiffersCase{"LogEvery", {}, {"--log-every", "1"},
                        "--log-every differs between ranks: rank 0 (node 0) has 50, rank 1 (node 1) has 1."},
        FlagDiffersCase{"StopAt", {}, {"--stop-at", "test_acc>=0.01"},
                        "--stop-at differs between ranks: rank 0 (node 0) has '', rank 1 (node 1) has 'test_acc>=0.01'."},
        FlagDiffersCase{"ChannelsLast", {"--channels-last", "on"}, {"--channels-last", "off"},
                        "--channels-last differs between ranks: rank 0 (node 0) has on, rank 1 (node 1) has off."}),
    [](const auto& info) { return info.param.name; });

// ---- bad multi-node input: one line naming the value and the fix, exit 2, no hang ----

struct BadNodeCase {
  std::string name;
  std::vector<std::string> args;  // after --nnodes 2
  std::string expect;
};

// ctest -N and gtest print the case by name, not as raw bytes.
void PrintTo(const BadNodeCase& c, std::ostream* os) { *os << c.name; }

class BadMultiNodeInput : public ::testing::TestWithParam<BadNodeCase> {};

// A port that a socket listens on, on every address, for the test binary's life.
std::string busy_port() {
  static const int port = [] {
    const int p = ddp::find_free_port();
    const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_ANY);
    a.sin_port = htons(static_cast<uint16_t>(p));
    if (::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a)) != 0 || ::listen(fd, 1) != 0) return 0;
    return p;
  }();
  return std::to_string(port);
}

TEST_P(BadMultiNodeInput, OneLineErrorAndExitCode) {
  DDP_SKIP_UNLESS_GLOO();
  const auto& c = GetParam();
  std::vector<std::string> argv{DDPTRAIN_EXE, "--nnodes", "2", "--size", "1", "--backend", "gloo",
                                "--dataset", "synthetic", "--epochs", "1", "--train-samples", "64",
                                "--test-samples", "64", "--save_path", ddp::testing::temp_dir("mn_bad"),
                                "--progress", "none", "--timeout", "5"};
  argv.insert(argv.end(), c.args.begin(), c.args.end());
  auto r = run_process(argv, {}, 60);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_LT(r.seconds, 30) << r.output;  // --timeout 5 bounds the wait for node 0
  EXPECT_NE(r.output.find(c.expect), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("Hint:"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << "a stack trace leaked\n" << r.output;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadMultiNodeInput,
    ::testing::Values(
        BadNodeCase{"PortMissing", {"--node-rank", "1", "--address", "127.0.0.1"}, "--port is required with --nnodes 2"},
        BadNodeCase{"AddressDoesNotResolve", {"--node-rank", "1", "--address", "no-such-host.invalid", "--port", "29555"},
                    "--address 'no-such-host.invalid' does not resolve"},
        // TEST-NET-2 (RFC 5737): no ddptrain there. Where a transparent proxy
        // accepts every connection, node 1 "reaches" it and hears nothing.
        BadNodeCase{"AddressUnreachable", {"--node-rank", "1", "--address", "198.51.100.1", "--port", "29555"},
                    "198.51.100.1:29555"},
        BadNodeCase{"NobodyListens", {"--node-rank", "1", "--address", "127.0.0.1", "--port", std::to_string(ddp::find_free_port())},
                    "could not reach node 0 at --address 127.0.0.1:"},
        BadNodeCase{"Node0AddressIsNotLocal", {"--node-rank", "0", "--address", "198.51.100.1", "--port", "29555"},
                    "--address 198.51.100.1 is not an address of this machine, but --node-rank 0 hosts the job"},
        BadNodeCase{"Node0PortInUse", {"--node-rank", "0", "--address", "127.0.0.1", "--port", busy_port()},
                    "node 0 could not open the job's rendezvous store on port"}),
    [](const auto& info) { return info.param.name; });

// The flag check that exists in the command line parser: exit 2 at once.
TEST(MultiNode, NodeRankOutsideNnodesIsAnError) {
  auto r = run_process({DDPTRAIN_EXE, "--nnodes", "2", "--node-rank", "2", "--port", "29555"}, {}, 30);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_NE(r.output.find("--node-rank 2 is outside [0, 2)"), std::string::npos) << r.output;
  EXPECT_LT(r.seconds, 10);
}

}  // namespace
