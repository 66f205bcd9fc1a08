// All distributed state of one process: who am I, which device, which group.
//
// World reads the environment that a launcher leaves behind (ddptrain's own,
// torchrun, Slurm srun or Open MPI mpirun), rendezvouses through a TCPStore at
// MASTER_ADDR:MASTER_PORT and creates one process group (NCCL for CUDA, Gloo
// for CPU). Without any launcher it is rank 0 of 1, so the same code runs
// everywhere. Collectives go through the checked helpers below, which turn a
// timeout or a dead peer into a CollectiveError naming the rank and the call.
#pragma once

#include <chrono>
#include <memory>
#include <string>
#include <vector>

#include "ddp/compat.h"

namespace ddp {

/// Where this process sits in the job, as read from the environment.
struct Placement {
  int rank = 0;
  int world_size = 1;
  int local_rank = 0;
  int local_world_size = 1;
  std::string master_addr = "127.0.0.1";
  int master_port = 0;        // 0: pick a free port (only valid for world size 1)
  std::string source = "none";  // "ddptrain", "torchrun", "slurm", "mpi" or "none"

  /// True when some launcher (ours or another) started this process.
  bool launched() const { return source != "none"; }
};

/// Reads RANK/WORLD_SIZE/..., SLURM_* or OMPI_COMM_WORLD_*; "none" otherwise.
Placement placement_from_env();

/// First host of a Slurm node list such as "gpu[03-05,07],cpu1" -> "gpu03".
std::string first_slurm_host(const std::string& nodelist);

struct WorldOptions {
  std::string backend = "auto";                 // auto | nccl | gloo
  std::chrono::milliseconds timeout{std::chrono::minutes(30)};
  bool use_cuda = true;                         // bind a GPU when one is present
};

class World {
 public:
  /// Joins the job described by `where`. Blocks until every rank arrived or
  /// the timeout passed.
  World(const Placement& where, const WorldOptions& options = {});
  ~World();
  World(const World&) = delete;
  World& operator=(const World&) = delete;

  int rank() const { return where_.rank; }
  int size() const { return where_.world_size; }
  int local_rank() const { return where_.local_rank; }
  bool is_main() const { return where_.rank == 0; }
  const torch::Device& device() const { return device_; }
  const std::string& backend_name() const { return backend_name_; }
  const Placement& placement() const { return where_; }
  std::chrono::milliseconds timeout() const { return options_.timeout; }

  /// In-place sum (or other op) over all ranks; blocks until done.
  void all_reduce(torch::Tensor& t, const std::string& what,
                  c10d::ReduceOp op = c10d::ReduceOp::SUM);
  /// Starts an in-place sum; call wait() on the result.
  c10::intrusive_ptr<compat::Work> all_reduce_async(torch::Tensor& t);
  /// Starts a sum of parts[r] over the ranks into rank r's parts[r]
  /// (compat::reduce_scatter_parts: sizes may differ, parts may be empty;
  /// other ranks' parts are left unspecified); wait() on each result.
  std::vector<c10::intrusive_ptr<compat::Work>> reduce_scatter_async(std::vector<torch::Tensor>& parts);
  /// Whether this backend has a reduce_scatter for such parts (NCCL in
  /// LibTorch 2.3+); without it reduce_scatter_async() runs one reduce per part.
  bool has_reduce_scatter() const { return compat::has_uneven_reduce_scatter(pg_); }
  /// Waits for `work`, naming `what` and this rank if it fails or times out.
  void wait(const c10::intrusive_ptr<compat::Work>& work, const std::string& what);
  /// Copies `t` from `root` to every rank, in place.
  void broadcast(torch::Tensor& t, int root, const std::string& what);
  /// Starts that copy; call wait() on the result before `t` is read (or,
  /// on `root`, written).
  c10::intrusive_ptr<compat::Work> broadcast_async(torch::Tensor& t, int root);
  /// Every rank waits for every other.
  void barrier(const std::string& what);
  /// Rank `root` shares a string with all ranks through the store.
  std::string share_string(const std::string& key, const std::string& value_on_root, int root = 0);

  /// Releases the process group; called by the destructor.
  void shutdown();

 private:
  [[noreturn]] void fail(const std::string& what, const std::exception& e) const;
  /// Waits for `work` the way its device needs (see world.cpp).
  void settle(const c10::intrusive_ptr<compat::Work>& work) const;

  Placement where_;
  WorldOptions options_;
  torch::Device device_{torch::kCPU};
  std::string backend_name_;
  c10::intrusive_ptr<c10d::Store> store_;
  c10::intrusive_ptr<compat::Backend> pg_;
  int share_counter_ = 0;
};

/// Rank-0-only output, the way llm.c's printf0 works.
#define DDP_PRINT0(world, ...)          \
  do {                                  \
    if ((world).is_main()) {            \
      std::printf(__VA_ARGS__);         \
      std::fflush(stdout);              \
    }                                   \
  } while (0)

}  // namespace ddp
