// Starting worker processes on one node and watching them.
//
// `ddptrain --size N` re-executes its own binary N times with RANK,
// LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR and MASTER_PORT set,
// the way mp.spawn + env:// or torchrun do. The launcher forwards SIGINT and
// SIGTERM, and when one worker fails (non-zero exit or a signal) it stops the
// others within a grace period and reports which rank died and how. With
// max_restarts it starts the whole group again, like torchrun's elastic agent.
//
// The launcher (node 0's, with nnodes > 1) hosts the job's TCPStore on
// master_port before any worker starts, and the workers join it as clients;
// every key lives under a per-job secret (DDPTRAIN_JOB_TOKEN, see
// docs/security.md). A worker's exit 75 (preempted: it saved and stopped) is
// not a failure: the launcher waits for the others and exits 75.
//
// With nnodes > 1 one launcher runs per node, and the launchers report their
// node's end through the store: a rank that fails on one node stops the ranks
// of every node, and each launcher names that rank.
#pragma once

#include <string>
#include <vector>

namespace ddp {

struct Placement;  // ddp/dist/world.h

struct LaunchOptions {
  int nproc_per_node = 1;
  int nnodes = 1;
  int node_rank = 0;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;              // 0: choose a free port (single node only)
  std::vector<std::string> visible; // CUDA_VISIBLE_DEVICES entries; empty: leave as is
  std::vector<std::string> argv;    // the worker command line; argv[0] is the program
  int max_restarts = 0;
  double grace_seconds = 5.0;       // SIGTERM -> SIGKILL delay for survivors
  double rendezvous_timeout = 300;  // seconds a node waits to reach node 0 (multi-node)
  std::string program = "ddptrain"; // the name that the launcher's own lines begin with
};

/// Under this launcher a rank other than 0 waits this long before printing
/// a bad-input error (exit 2), so that when every rank meets the same error
/// only rank 0's line is printed; the launcher waits as long (and a little
/// more) for such a rank before blaming one whose peer merely went away.
constexpr double kRankErrorDeferSeconds = 2.0;

/// Runs the workers to completion; returns the exit code for the launcher.
/// A bad-input exit (2) is not restarted (it would fail the same way) and
/// adds no line of the launcher's: the rank has said what was wrong.
int launch_workers(const LaunchOptions& options);

/// A TCP port on this machine that nothing listens on right now (racy: the
/// launcher does not use it; tests do).
int find_free_port();

/// Whether something listens on `port` (on any address, as c10d binds).
bool port_in_use(int port);

/// "rank 1 exited with code 3", "rank 0 was killed by signal 9 (SIGKILL)".
std::string describe_exit(int rank, int wait_status);

/// Path of the running executable (/proc/self/exe).
std::string self_executable();

/// The command line that runs `program args` again the way this process was
/// started: under torchrun's agent, a torchrun command with this job's nodes,
/// ranks per node and rendezvous; else `program args` (ddptrain's launcher
/// and a plain start both start from the program itself). `where` is this
/// process's placement (World::placement()).
std::string relaunch_command(const std::string& program, const std::string& args, const Placement& where);

}  // namespace ddp
