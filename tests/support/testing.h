// Shared helpers for the test suite: running real processes, temporary
// directories, a world of one rank, and skipping tests whose hardware is
// absent.
#pragma once

#include <gtest/gtest.h>
#include <torch/torch.h>

#include "ddp/cli.h"
#include "ddp/compat.h"
#include "ddp/data/tensor_dataset.h"

#include <nlohmann/json_fwd.hpp>

#include <functional>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace ddp {
class World;
}

namespace ddp::testing {

struct ProcessResult {
  int exit_code = -1;   // 128 + signal when killed by a signal
  std::string output;   // stdout and stderr together
  double seconds = 0;
};

/// Runs `argv` with extra environment `env`, killing it after
/// `timeout_seconds`; returns its exit code and combined output.
ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env = {},
                          double timeout_seconds = 300);

/// A process running in the background, its output going to `log`.
struct Child {
  int pid = -1;
  std::string log;
};
Child start_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env = {});
/// Waits for `child` (killing it after the timeout); returns like run_process.
ProcessResult finish_process(Child& child, double timeout_seconds = 300);
/// Waits until `child`'s output contains `text`; false on timeout or exit.
bool wait_for_output(const Child& child, const std::string& text, double timeout_seconds = 120);

/// A fresh empty directory under the system temp dir. It is removed after
/// the process's last test when all passed, and kept (named on stderr) when
/// one failed.
std::string temp_dir(const std::string& tag);

/// The first file named `name` under `dir`, searched recursively, or "".
std::string find_file(const std::string& dir, const std::string& name);

/// The records of the first metrics.jsonl under `dir` (a run directory, or
/// a --save_path holding one), one JSON object per line.
std::vector<nlohmann::json> metrics_jsonl(const std::string& dir);

/// Every metrics.jsonl record under `save_path`, in all its run directories.
std::vector<nlohmann::json> metrics_under(const std::string& save_path);

/// The one run directory under `save_path` (a failure, and "", unless there
/// is exactly one).
std::string only_run_dir(const std::string& save_path);

/// The in-memory image dataset behind `d` (a failure if it is another kind).
const ddp::data::ImageTensorDataset& as_images(const ddp::data::DatasetPtr& d);

/// How often `what` occurs in `text` (a line printed once, say).
size_t count(const std::string& text, const std::string& what);

/// Where the real Fashion-MNIST lives, or "" if it is not installed.
std::string fashion_mnist_root();

/// Reads a whole file; "" if it does not exist.
std::string read_file(const std::string& path);

/// The message of the ddp::UserError that `f` throws; a test failure (and
/// "") if it throws something else or nothing.
std::string user_error(const std::function<void()>& f);

/// parse_cli on these flags (the program name is added).
ddp::Config parse_args(std::vector<std::string> args);

/// A world of this process alone: Gloo on the CPU, or NCCL on a GPU.
std::unique_ptr<ddp::World> one_rank_world(bool cuda = false);

/// examples/tabular's data: DIR/train.csv and DIR/test.csv with the header
/// x0,...,x7,store,sales; sales depends on x0..x5 (a product and a sine
/// among them) and on the store (12 of them), with a little noise.
void write_sales_csvs(const std::string& dir, int train_rows, int test_rows);

/// MNIST-shaped data for --dataset mnist (or auto): DIR's four IDX files of
/// n_train and n_test 28 x 28 images of random pixels and labels 0..9, drawn
/// from `seed` (each split its own draws: the test split does not depend on
/// n_train); raw files, or gzip-compressed (.gz) with `gz`.
void write_mnist_like(const std::string& dir, int n_train, int n_test, unsigned seed, bool gz = false);

}  // namespace ddp::testing

/// Tests that need CPU ranks (Gloo) skip in NCCL-only builds.
#define DDP_SKIP_UNLESS_GLOO() \
  do { if (!ddp::compat::kHasGloo) GTEST_SKIP() << "built without Gloo (CUDA wheel LibTorch)"; } while (0)

/// GPU tests end in _CUDA and skip cleanly where there is no GPU.
#define DDP_SKIP_UNLESS_CUDA() \
  do { if (!torch::cuda::is_available()) GTEST_SKIP() << "no CUDA GPU here"; } while (0)
