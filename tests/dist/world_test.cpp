// Environment detection (torchrun, Slurm, Open MPI) and a real one-rank group.
#include <cstdlib>
#include <memory>

#include "ddp/compat.h"
#include "ddp/error.h"
#include "ddp/dist/grad_sync.h"
#include "ddp/dist/world.h"
#include "support/testing.h"

namespace {

// Sets variables for one test and restores the previous state afterwards.
class ScopedEnv {
 public:
  explicit ScopedEnv(std::map<std::string, std::string> vars) {
    for (const char* k : {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                          "MASTER_PORT", "DDPTRAIN_LAUNCHER", "SLURM_PROCID", "SLURM_NTASKS",
                          "SLURM_LOCALID", "SLURM_NTASKS_PER_NODE", "SLURM_STEP_NODELIST",
                          "SLURM_JOB_NODELIST", "SLURM_NODELIST", "SLURM_STEP_TASKS_PER_NODE",
                          "OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_SIZE",
                          "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_LOCAL_SIZE"}) {
      if (const char* v = std::getenv(k)) saved_[k] = v;
      unsetenv(k);
    }
    for (const auto& [k, v] : vars) setenv(k.c_str(), v.c_str(), 1);
    set_ = vars;
  }
  ~ScopedEnv() {
    for (const auto& [k, v] : set_) unsetenv(k.c_str());
    for (const auto& [k, v] : saved_) setenv(k.c_str(), v.c_str(), 1);
  }
 private:
  std::map<std::string, std::string> saved_, set_;
};

TEST(Placement, NoLauncherIsRankZeroOfOne) {
  ScopedEnv e({});
  auto p = ddp::placement_from_env();
  EXPECT_EQ(p.source, "none");
  EXPECT_EQ(p.rank, 0);
  EXPECT_EQ(p.world_size, 1);
  EXPECT_FALSE(p.launched());
}

TEST(Placement, Torchrun) {
  ScopedEnv e({{"RANK", "3"}, {"WORLD_SIZE", "8"}, {"LOCAL_RANK", "1"}, {"LOCAL_WORLD_SIZE", "2"},
               {"MASTER_ADDR", "10.1.2.3"}, {"MASTER_PORT", "29400"}});
  auto p = ddp::placement_from_env();
  EXPECT_EQ(p.source, "torchrun");
  EXPECT_EQ(p.rank, 3);
  EXPECT_EQ(p.world_size, 8);
  EXPECT_EQ(p.local_rank, 1);
  EXPECT_EQ(p.local_world_size, 2);
  EXPECT_EQ(p.master_addr, "10.1.2.3");
  EXPECT_EQ(p.master_port, 29400);
}

TEST(Placement, Slurm) {
  ScopedEnv e({{"SLURM_PROCID", "5"}, {"SLURM_NTASKS", "8"}, {"SLURM_LOCALID", "1"},
               {"SLURM_NTASKS_PER_NODE", "4(x2)"}, {"SLURM_STEP_NODELIST", "gpu[07-08]"},
               {"MASTER_PORT", "29111"}});
  auto p = ddp::placement_from_env();
  EXPECT_EQ(p.source, "slurm");
  EXPECT_EQ(p.rank, 5);
  EXPECT_EQ(p.world_size, 8);
  EXPECT_EQ(p.local_rank, 1);
  EXPECT_EQ(p.local_world_size, 4);
  EXPECT_EQ(p.master_addr, "gpu07");
  EXPECT_EQ(p.master_port, 29111);
}

TEST(Placement, OpenMpi) {
  ScopedEnv e({{"OMPI_COMM_WORLD_RANK", "1"}, {"OMPI_COMM_WORLD_SIZE", "2"},
               {"OMPI_COMM_WORLD_LOCAL_RANK", "1"}, {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
               {"MASTER_ADDR", "127.0.0.1"}});
  auto p = ddp::placement_from_env();
  EXPECT_EQ(p.source, "mpi");
  EXPECT_EQ(p.rank, 1);
  EXPECT_EQ(p.world_size, 2);
  EXPECT_EQ(p.master_port, 29500);
}

TEST(Placement, BadValuesAreUserErrors) {
  {
    ScopedEnv e({{"RANK", "x"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}});
    EXPECT_THROW(ddp::placement_from_env(), ddp::UserError);
  }
  {
    ScopedEnv e({{"RANK", "2"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1"}});
    EXPECT_THROW(ddp::placement_from_env(), ddp::UserError);
  }
  {
    ScopedEnv e({{"RANK", "0"}, {"WORLD_SIZE", "2"}});
    EXPECT_THROW(ddp::placement_from_env(), ddp::UserError);
  }
}

TEST(Placement, SlurmHostList) {
  EXPECT_EQ(ddp::first_slurm_host("gpu[03-05,07],cpu1"), "gpu03");
  EXPECT_EQ(ddp::first_slurm_host("node1,node2"), "node1");
  EXPECT_EQ(ddp::first_slurm_host("single"), "single");
}

TEST(World, SingleRankGroupOverRealStore) {
  DDP_SKIP_UNLESS_GLOO();
  ddp::Placement p;
  p.source = "test";
  ddp::WorldOptions o;
  o.use_cuda = false;
  ddp::World w(p, o);
  EXPECT_EQ(w.backend_name(), "gloo");
  auto t = torch::ones({3});
  w.all_reduce(t, "one-rank sum");
  EXPECT_TRUE(torch::equal(t, torch::ones({3})));
  EXPECT_EQ(w.share_string("k", "v"), "v");
}

TEST(World, NcclWithoutGpuIsUserError) {
  if (torch::cuda::is_available()) GTEST_SKIP() << "a GPU is present";
  ddp::Placement p;
  ddp::WorldOptions o;
  o.backend = "nccl";
  EXPECT_THROW(ddp::World w(p, o), ddp::UserError);
}

// A world of one rank over NCCL.
std::unique_ptr<ddp::World> one_rank_nccl() {
  ddp::WorldOptions o;
  o.backend = "nccl";
  return std::make_unique<ddp::World>(ddp::Placement(), o);
}

TEST(World, OneRankOverNccl_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto world = one_rank_nccl();
  auto& w = *world;
  EXPECT_EQ(w.backend_name(), "nccl");
  EXPECT_TRUE(w.device().is_cuda());
  auto t = torch::ones({4}, torch::TensorOptions().device(w.device()));
  w.all_reduce(t, "one-rank NCCL sum");
  EXPECT_TRUE(torch::equal(t.cpu(), torch::ones({4})));
}

// reduce_scatter_async on one GPU: with LibTorch 2.3+ NCCL's own
// reduce_scatter (the sum over one rank is the part itself), in place on a
// part of a larger buffer; the rest of the buffer is left alone.
TEST(World, OneRankReduceScatterOverNccl_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto world = one_rank_nccl();
  auto& w = *world;
  auto buffer = torch::arange(10, torch::TensorOptions().dtype(torch::kFloat).device(w.device()));
  const auto before = buffer.cpu();
  std::vector<torch::Tensor> parts{buffer.narrow(0, 3, 5)};
  for (auto& work : w.reduce_scatter_async(parts)) w.wait(work, "one-rank reduce-scatter");
  EXPECT_TRUE(torch::equal(buffer.cpu(), before));
  EXPECT_EQ(w.has_reduce_scatter(), ddp::sharded_reduction(w) == ddp::GradientReduction::kReduceScatter);
  // NCCL from LibTorch 2.3 takes the parts in one reduce_scatter: this test
  // fails if that path silently becomes the per-owner reduces.
  EXPECT_EQ(w.has_reduce_scatter(), DDP_TORCH_AT_LEAST(2, 3));
}

}  // namespace
