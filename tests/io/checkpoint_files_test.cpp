// The files under a checkpoint: atomic writes that fail loudly when the disk
// does, run directories, epoch file names. Real files, a real full file
// system (a small tmpfs) and real file-size limits (RLIMIT_FSIZE).
#include <signal.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/io/torch_pickle.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

// A Linear(width, width) with every weight set to `fill`.
torch::nn::Linear model_of(int64_t width, double fill) {
  torch::nn::Linear m(width, width);
  torch::NoGradGuard no_grad;
  for (auto& p : m->parameters()) p.fill_(fill);
  return m;
}

bool all_equal(const torch::nn::Module& m, double value) {
  for (const auto& p : m.parameters())
    if (!torch::all(p == value).item<bool>()) return false;
  return true;
}

// No "<name>.tmp.<pid>" left beside the target.
bool has_temp_files(const std::string& dir) {
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(".tmp.") != std::string::npos) return true;
  return false;
}

// A tmpfs of `bytes` mounted on a fresh directory, unmounted at the end;
// empty when this process may not mount.
struct SmallDisk {
  std::string dir;
  explicit SmallDisk(size_t bytes) {
    auto d = ddp::testing::temp_dir("small_disk");
    const std::string opts = "size=" + std::to_string(bytes);
    if (::mount("tmpfs", d.c_str(), "tmpfs", 0, opts.c_str()) == 0) dir = d;
  }
  ~SmallDisk() {
    if (!dir.empty()) ::umount2(dir.c_str(), MNT_DETACH);
  }
};

// A quick one-rank run on synthetic data, saving every epoch.
std::vector<std::string> quick_run(const std::string& save_path, std::vector<std::string> extra) {
  std::vector<std::string> a{DDPTRAIN_EXE, "--model", "cnn", "--size", "1", "--backend", "gloo", "--save_path",
                             save_path, "--dataset", "synthetic", "--train-samples", "128", "--test-samples",
                             "64", "--batch", "64", "--progress", "none", "--timeout", "60"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

using ddp::testing::only_run_dir;

}  // namespace

// A save that does not fit on the disk throws a UserError naming the file
// and the system's reason; the checkpoint it would have replaced still loads
// with its old weights, and no temporary file is left.
TEST(AtomicWrite, FullDiskFailsCleanlyAndKeepsThePreviousCheckpoint) {
  SmallDisk disk(64 * 1024);
  if (disk.dir.empty()) GTEST_SKIP() << "cannot mount a tmpfs here (" << std::strerror(errno) << ")";
  const std::string path = disk.dir + "/best.pt";
  auto small = model_of(8, 0.5);
  ddp::save_checkpoint(path, *small, nullptr, ddp::CheckpointMeta{});
  auto big = model_of(160, 1.5);  // ~100 KB of weights: more than the disk holds
  const auto msg = ddp::testing::user_error([&] { ddp::save_checkpoint(path, *big, nullptr, ddp::CheckpointMeta{}); });
  EXPECT_NE(msg.find(path), std::string::npos) << msg;
  EXPECT_NE(msg.find(std::strerror(ENOSPC)), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  EXPECT_FALSE(has_temp_files(disk.dir));
  auto loaded = model_of(8, 0);
  ASSERT_NO_THROW(ddp::load_checkpoint(path, *loaded, nullptr, torch::kCPU, ""));
  EXPECT_TRUE(all_equal(*loaded, 0.5));

  // The same for a plain file (config.json and friends).
  ddp::write_file_atomic(disk.dir + "/config.json", "{}\n");
  const auto msg2 = ddp::testing::user_error(
      [&] { ddp::write_file_atomic(disk.dir + "/config.json", std::string(200 * 1024, 'x')); });
  EXPECT_NE(msg2.find(std::strerror(ENOSPC)), std::string::npos) << msg2;
  EXPECT_EQ(ddp::testing::read_file(disk.dir + "/config.json"), "{}\n");
  EXPECT_FALSE(has_temp_files(disk.dir));
}

// Without mount rights: a child process whose files may not grow past
// 16 KB (RLIMIT_FSIZE, SIGXFSZ ignored so that write() fails with EFBIG).
TEST(AtomicWrite, FileSizeLimitFailsCleanlyAndKeepsThePreviousCheckpoint) {
  const auto dir = ddp::testing::temp_dir("fsize");
  const std::string path = dir + "/best.pt", report = dir + "/report.txt";
  auto small = model_of(8, 0.5);
  ddp::save_checkpoint(path, *small, nullptr, ddp::CheckpointMeta{});
  const pid_t pid = ::fork();
  ASSERT_GE(pid, 0);
  if (pid == 0) {
    ::signal(SIGXFSZ, SIG_IGN);
    rlimit lim{16 * 1024, 16 * 1024};
    ::setrlimit(RLIMIT_FSIZE, &lim);
    int code = 0;
    std::string what = "no error";
    try {
      auto big = model_of(160, 1.5);
      ddp::save_checkpoint(path, *big, nullptr, ddp::CheckpointMeta{});
      code = 1;
    } catch (const ddp::UserError& e) {
      what = e.what();
    } catch (const std::exception& e) {
      what = std::string("not a UserError: ") + e.what();
      code = 2;
    }
    std::ofstream(report) << what.substr(0, 1000);  // 1000 bytes fit under the limit
    ::_exit(code);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(pid, &status, 0), pid);
  const auto what = ddp::testing::read_file(report);
  ASSERT_TRUE(WIFEXITED(status)) << "child died with status " << status;
  EXPECT_EQ(WEXITSTATUS(status), 0) << what;
  EXPECT_NE(what.find(path), std::string::npos) << what;
  EXPECT_NE(what.find(std::strerror(EFBIG)), std::string::npos) << what;
  EXPECT_FALSE(has_temp_files(dir));
  auto loaded = model_of(8, 0);
  ASSERT_NO_THROW(ddp::load_checkpoint(path, *loaded, nullptr, torch::kCPU, ""));
  EXPECT_TRUE(all_equal(*loaded, 0.5));
}

TEST(RunDir, EpochOfAcceptsOnlyEpochDigitsPt) {
  EXPECT_EQ(ddp::epoch_of("epoch_3.pt"), 3);
  EXPECT_EQ(ddp::epoch_of("epoch_0012.pt"), 12);
  for (const char* name : {"epoch_x.pt", "epoch_.pt", "epoch_3.pt.tmp.12", "epoch_-1.pt", "epoch_3x.pt", "best.pt",
                           "epoch_99999999999999999999999.pt", "xepoch_3.pt"})
    EXPECT_FALSE(ddp::epoch_of(name).has_value()) << name;
}

// Jobs that start in the same second under one --save_path each get their
// own directory: mkdir is the test, so there is no window between a check
// and the create.
TEST(RunDir, ConcurrentCreatorsGetDistinctDirectories) {
  const auto save_path = ddp::testing::temp_dir("race") + "/runs";
  for (int round = 0; round < 200; ++round) {
    const std::string stem = "train_" + std::to_string(round);
    std::vector<std::string> made(8);
    std::vector<std::thread> threads;
    std::atomic<size_t> ready{0};
    for (size_t t = 0; t < made.size(); ++t)
      threads.emplace_back([&, t] {
        for (++ready; ready < made.size();) {  // start together, so that the calls overlap
        }
        made[t] = ddp::make_run_dir(save_path, stem);
      });
    for (auto& t : threads) t.join();
    std::set<std::string> distinct(made.begin(), made.end());
    ASSERT_EQ(distinct.size(), made.size()) << "round " << round << ": two jobs share a run directory";
    for (const auto& d : made) EXPECT_TRUE(fs::is_directory(d)) << d;
  }
  EXPECT_NE(ddp::testing::user_error([] { ddp::make_run_dir("/proc/no_such_dir", "train_x"); }).find("/proc/no_such_dir"),
            std::string::npos);
}

// --resume epoch_1.pt, a bare file name: the run continues in the current
// directory (not in "/").
TEST(RunDir, BareResumeFileNameContinuesInTheCurrentDirectory) {
  DDP_SKIP_UNLESS_GLOO();
  const auto save_path = ddp::testing::temp_dir("bare_resume");
  auto first = ddp::testing::run_process(quick_run(save_path, {"--epochs", "1"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto run_dir = only_run_dir(save_path);
  ASSERT_TRUE(fs::exists(run_dir + "/epoch_1.pt")) << first.output;
  const bool root_had_metrics = fs::exists("/metrics.jsonl"), root_had_epoch2 = fs::exists("/epoch_2.pt");
  std::string cmd = "cd '" + run_dir + "' && exec";
  for (const auto& a : quick_run(save_path, {"--epochs", "2", "--reschedule", "--resume", "epoch_1.pt"})) cmd += " '" + a + "'";
  auto second = ddp::testing::run_process({"/bin/sh", "-c", cmd});
  // Undo what the defect would have written into "/" (never what was there).
  if (!root_had_metrics) fs::remove("/metrics.jsonl");
  if (!root_had_epoch2) fs::remove("/epoch_2.pt");
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_TRUE(fs::exists(run_dir + "/epoch_2.pt")) << second.output;
  EXPECT_NE(ddp::testing::read_file(run_dir + "/metrics.jsonl").find("\"epoch\":2"), std::string::npos);
}

// Files that only look like epoch checkpoints (epoch_x.pt, a number too
// large for int64) neither break --resume auto nor --keep-last, and are left
// alone.
TEST(RunDir, StrayEpochFilesAreIgnoredByResumeAndKeepLast) {
  DDP_SKIP_UNLESS_GLOO();
  const auto save_path = ddp::testing::temp_dir("stray");
  auto first = ddp::testing::run_process(quick_run(save_path, {"--epochs", "1"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto run_dir = only_run_dir(save_path);
  const std::string strays[] = {run_dir + "/epoch_x.pt", run_dir + "/epoch_99999999999999999999999.pt"};
  for (const auto& s : strays) fs::copy_file(run_dir + "/epoch_1.pt", s);
  fs::last_write_time(run_dir + "/epoch_1.pt", fs::file_time_type::clock::now() - std::chrono::hours(1));
  auto second = ddp::testing::run_process(quick_run(save_path, {"--epochs", "3", "--reschedule", "--resume", "auto", "--keep-last", "1"}));
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_NE(second.output.find("resume: " + run_dir + "/epoch_1.pt"), std::string::npos) << second.output;
  EXPECT_FALSE(fs::exists(run_dir + "/epoch_1.pt"));
  EXPECT_FALSE(fs::exists(run_dir + "/epoch_2.pt"));
  EXPECT_TRUE(fs::exists(run_dir + "/epoch_3.pt"));
  for (const auto& s : strays) EXPECT_TRUE(fs::exists(s)) << s;
}

// ---- the checkpoint format: PyTorch's torch.save zip, read by our reader ----

// Python's torch.load(path, weights_only=True) opens a checkpoint: the model
// under "model/", the header as JSON bytes under "ddptrain".
TEST(CheckpointFormat, PythonLoadsACheckpointWithWeightsOnly) {
  const std::string python = "/usr/bin/python3";
  if (ddp::testing::run_process({python, "-c", "import torch"}, {}, 120).exit_code != 0)
    GTEST_SKIP() << python << " has no torch module: cannot check that PyTorch reads checkpoints";
  const auto dir = ddp::testing::temp_dir("ckpt_python");
  torch::nn::Sequential model(torch::nn::Linear(3, 2), torch::nn::BatchNorm1d(2));
  {
    torch::NoGradGuard no_grad;
    model->named_parameters()["0.weight"].copy_(torch::arange(6, torch::kFloat).reshape({2, 3}) / 10);
    model->named_buffers()["1.num_batches_tracked"].fill_(7);
  }
  ddp::CheckpointMeta meta;
  meta.arch = "tiny";
  meta.state.epoch = 4;
  meta.state.step = 123;
  meta.config = {{"lr", 0.5}};
  ddp::save_checkpoint(dir + "/epoch_4.pt", *model, nullptr, meta);
  const std::string script = R"(
import json, sys, torch
ck = torch.load(sys.argv[1], weights_only=True)
meta = json.loads(bytes(ck['ddptrain'].tolist()).decode())
assert meta['format'] == 3 and meta['arch'] == 'tiny' and meta['config'] == {'lr': 0.5}, meta
assert meta['state']['epoch'] == 4 and meta['state']['step'] == 123, meta
m = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
m.load_state_dict({k[len('model/'):]: v for k, v in ck.items() if k.startswith('model/')}, strict=True)
assert torch.equal(m[0].weight, torch.arange(6.).reshape(2, 3) / 10)
assert m[1].num_batches_tracked.item() == 7
assert ck['rng/cpu'].dtype == torch.uint8
print('python read the checkpoint')
)";
  auto r = ddp::testing::run_process({python, "-c", script, dir + "/epoch_4.pt"}, {}, 300);
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("python read the checkpoint"), std::string::npos) << r.output;
}

// A checkpoint of format 2 (a TorchScript archive, as ddptrain wrote before)
// is refused with one line, by every command that takes a checkpoint,
// without being opened by TorchScript's loader.
TEST(CheckpointFormat, OldTorchScriptCheckpointIsRefusedWithOneLine) {
  const auto dir = ddp::testing::temp_dir("ckpt_old");
  const std::string old = dir + "/epoch_1.pt";
  torch::nn::Linear model(2, 2);
  {
    torch::serialize::OutputArchive archive, weights;
    archive.write("ddptrain", c10::IValue(nlohmann::json{{"format", 2}, {"arch", ""}}.dump()));
    for (const auto& p : model->named_parameters()) weights.write(p.key(), p.value().detach());
    archive.write("model", weights);
    archive.save_to(old);
  }
  auto expect_refused = [&](const std::string& msg) {
    EXPECT_NE(msg.find(old), std::string::npos) << msg;
    EXPECT_NE(msg.find("older ddptrain"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  };
  expect_refused(ddp::testing::user_error([&] { ddp::load_checkpoint(old, *model, nullptr, torch::kCPU, ""); }));
  expect_refused(ddp::testing::user_error([&] { ddp::load_pretrained(old, *model, torch::kCPU); }));
  expect_refused(ddp::testing::user_error([&] { ddp::export_weights(old, dir + "/w.pt"); }));
  EXPECT_FALSE(ddp::is_checkpoint(old));
  // Named by --resume's search too (it once said the run "holds no checkpoint").
  expect_refused(ddp::testing::user_error([&] { ddp::find_latest_checkpoint(dir); }));
  EXPECT_FALSE(fs::exists(dir + "/w.pt"));
}

// `export CK OUT` must not destroy a checkpoint: neither its own input
// (export best.pt best.pt once replaced the checkpoint with its weights) nor
// another checkpoint; it refuses in one line and leaves both as they were.
// Over any other file (an earlier export) it writes as torch.save would.
TEST(Export, RefusesToWriteOverACheckpoint) {
  const auto dir = ddp::testing::temp_dir("export_over");
  torch::nn::Linear model(3, 2);
  ddp::CheckpointMeta meta;
  ddp::save_checkpoint(dir + "/best.pt", *model, nullptr, meta);
  ddp::save_checkpoint(dir + "/epoch_1.pt", *model, nullptr, meta);
  const auto best = ddp::testing::read_file(dir + "/best.pt"), epoch = ddp::testing::read_file(dir + "/epoch_1.pt");
  for (const std::string& out : {dir + "/best.pt", dir + "/./best.pt", dir + "/epoch_1.pt"}) {
    SCOPED_TRACE(out);
    const auto msg = ddp::testing::user_error([&] { ddp::export_weights(dir + "/best.pt", out); });
    EXPECT_NE(msg.find(out), std::string::npos) << msg;
    EXPECT_NE(msg.find("checkpoint"), std::string::npos) << msg;
    EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
  }
  EXPECT_EQ(ddp::testing::read_file(dir + "/best.pt"), best);
  EXPECT_EQ(ddp::testing::read_file(dir + "/epoch_1.pt"), epoch);
  ddp::export_weights(dir + "/best.pt", dir + "/w.pt");
  ddp::export_weights(dir + "/best.pt", dir + "/w.pt");  // over its own earlier export: fine
  EXPECT_EQ(ddp::read_state_dict(dir + "/w.pt").size(), 2u);
}

// Within a run, --resume picks the checkpoint furthest along (the step in
// its header), not the newest file: a `cp -r` or a `touch` reorders the
// times, and resuming epoch 1's checkpoint once retrained epoch 2 over the
// finished run. Across runs (--resume auto over a --save_path) the run
// written last wins, and within it again the furthest step.
TEST(RunDir, ResumePicksTheFurthestStepNotTheNewestFile) {
  const auto save_path = ddp::testing::temp_dir("furthest");
  torch::nn::Linear model(2, 2);
  auto save = [&](const std::string& path, int64_t epoch, int64_t step, int minutes_ago) {
    fs::create_directories(fs::path(path).parent_path());
    ddp::CheckpointMeta meta;
    meta.state.epoch = epoch;
    meta.state.step = step;
    ddp::save_checkpoint(path, *model, nullptr, meta);
    fs::last_write_time(path, fs::file_time_type::clock::now() - std::chrono::minutes(minutes_ago));
  };
  const std::string a = save_path + "/train_a", b = save_path + "/train_b";
  save(a + "/epoch_1.pt", 1, 10, 60);
  save(a + "/epoch_2.pt", 2, 20, 90);  // older file, further along
  save(a + "/preempt.pt", 2, 15, 30);  // newest file, behind epoch 2
  EXPECT_EQ(ddp::find_latest_checkpoint(a), a + "/epoch_2.pt");
  EXPECT_EQ(ddp::resume_checkpoint(a, save_path), a + "/epoch_2.pt");
  // Run b was written after run a: auto resumes b, though a got further.
  save(b + "/epoch_1.pt", 1, 5, 10);
  save(b + "/preempt.pt", 1, 7, 20);
  EXPECT_EQ(ddp::resume_checkpoint("auto", save_path), b + "/preempt.pt");
}

// Issue 44 item 1: a run resumed from an older checkpoint of its run
// directory (epoch 2 of 4) once had --keep-last 1 delete the epoch_3.pt it
// had just written (pruning kept the highest epoch numbers, the abandoned
// epoch_4.pt among them), and the printed resume command then loaded that old
// epoch 4. The resumed run is a new branch: the later files move aside into
// abandoned-<time>/, nothing of either branch is deleted that the live
// branch does not supersede, and the newest checkpoint is the live branch's.
TEST(RunDir, ResumeFromAnOlderCheckpointSetsTheLaterOnesAsideAndKeepsItsOwn) {
  DDP_SKIP_UNLESS_GLOO();
  const auto save_path = ddp::testing::temp_dir("older_resume");
  auto first = ddp::testing::run_process(quick_run(save_path, {"--epochs", "4", "--save_epoch", "1", "--sanity-val-steps", "0"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto run_dir = only_run_dir(save_path);
  const std::string epoch4 = ddp::testing::read_file(run_dir + "/epoch_4.pt");
  ASSERT_FALSE(epoch4.empty()) << first.output;
  auto second = ddp::testing::run_process(
      {DDPTRAIN_EXE, "--resume", run_dir + "/epoch_2.pt", "--epochs", "3", "--reschedule", "--keep-last", "1"});
  ASSERT_EQ(second.exit_code, 0) << second.output;
  // What this run wrote survives, and is what a resume of the run finds.
  EXPECT_TRUE(fs::exists(run_dir + "/epoch_3.pt")) << second.output;
  EXPECT_FALSE(fs::exists(run_dir + "/epoch_4.pt"));
  EXPECT_FALSE(fs::exists(run_dir + "/epoch_2.pt"));  // the live branch's older file: --keep-last 1
  EXPECT_EQ(ddp::find_latest_checkpoint(run_dir), run_dir + "/epoch_3.pt");
  EXPECT_EQ(ddp::resume_checkpoint(run_dir, save_path), run_dir + "/epoch_3.pt");
  EXPECT_EQ(ddp::resume_checkpoint("auto", save_path), run_dir + "/epoch_3.pt");
  EXPECT_NE(second.output.find("--resume " + run_dir + "\n"), std::string::npos) << second.output;
  // The abandoned branch's later work is kept, byte for byte, with its log.
  std::string aside;
  for (const auto& e : fs::directory_iterator(run_dir))
    if (e.is_directory() && e.path().filename().string().rfind("abandoned-", 0) == 0) aside = e.path().string();
  ASSERT_FALSE(aside.empty()) << second.output;
  EXPECT_EQ(ddp::testing::read_file(aside + "/epoch_4.pt"), epoch4);
  EXPECT_TRUE(fs::exists(aside + "/epoch_3.pt"));
  EXPECT_NE(ddp::testing::read_file(aside + "/metrics.jsonl").find("\"epoch\":4"), std::string::npos);
  EXPECT_NE(second.output.find(aside), std::string::npos) << "the run says where the later files went";
  // The live branch's log: epochs 1-3, the third from this run.
  const auto rows = ddp::testing::metrics_jsonl(run_dir);
  ASSERT_EQ(rows.size(), 3u);
  EXPECT_EQ(rows.back()["epoch"], 3);
}

// Issue 44 item 10: a SIGKILL during a checkpoint write leaves a
// checkpoint-sized <name>.tmp.<pid> that nothing removed. A run that starts
// in the directory removes those of processes that are dead on this host,
// and only those: never a live process's, nor one another host wrote (whose
// pid says nothing here), nor a file that merely has ".tmp." in its name.
TEST(RunDir, StaleTempFilesOfDeadProcessesGoAtStart) {
  DDP_SKIP_UNLESS_GLOO();
  const auto save_path = ddp::testing::temp_dir("stale_tmp");
  auto first = ddp::testing::run_process(quick_run(save_path, {"--epochs", "1", "--sanity-val-steps", "0"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto run_dir = only_run_dir(save_path);
  const pid_t dead = fork();
  if (dead == 0) _exit(0);
  ASSERT_GT(dead, 0);
  ASSERT_EQ(waitpid(dead, nullptr, 0), dead);
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  const std::string d = std::to_string(dead), live = std::to_string(getpid());
  const std::vector<std::string> stale{"epoch_2.pt.tmp." + d, "epoch_2.pt.tmp." + d + "." + host};
  const std::vector<std::string> kept{"epoch_3.pt.tmp." + live, "epoch_3.pt.tmp." + live + "." + host,
                                      "epoch_4.pt.tmp." + d + ".another-host.example", "notes.tmp.txt"};
  for (const auto& name : stale) fs::copy_file(run_dir + "/epoch_1.pt", run_dir + "/" + name);
  for (const auto& name : kept) fs::copy_file(run_dir + "/epoch_1.pt", run_dir + "/" + name);
  auto second = ddp::testing::run_process({DDPTRAIN_EXE, "--resume", run_dir, "--epochs", "2", "--reschedule"});
  ASSERT_EQ(second.exit_code, 0) << second.output;
  EXPECT_TRUE(fs::exists(run_dir + "/epoch_2.pt")) << second.output;
  for (const auto& name : stale) EXPECT_FALSE(fs::exists(run_dir + "/" + name)) << name << " (a dead process's) is left";
  for (const auto& name : kept) EXPECT_TRUE(fs::exists(run_dir + "/" + name)) << name << " was removed";
}

// ---- resuming a run safely (ux review B2-B5) ----

namespace resume_guard {

using ddp::testing::only_run_dir;
using ddp::testing::run_process;

// Every file under `dir` (recursively) with its bytes: what a run that
// writes nothing leaves exactly as it was.
std::map<std::string, std::string> contents(const std::string& dir) {
  std::map<std::string, std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir))
    out[e.path().string()] = e.is_regular_file() ? ddp::testing::read_file(e.path().string()) : "<dir>";
  return out;
}

// The lines of a refused run's output that say "error:": a refusal says it
// in exactly one.
std::vector<std::string> error_lines(const std::string& output) {
  std::vector<std::string> out;
  std::istringstream in(output);
  for (std::string line; std::getline(in, line);)
    if (line.find("error:") != std::string::npos) out.push_back(line);
  return out;
}

void truncate_to(const std::string& path, uintmax_t size) { fs::resize_file(path, size); }

// The one "error:" line of a run refused with exit 2 ("", and a failure,
// for anything else).
std::string refusal(const ddp::testing::ProcessResult& r) {
  EXPECT_EQ(r.exit_code, 2) << r.output;
  const auto lines = error_lines(r.output);
  EXPECT_EQ(lines.size(), 1u) << r.output;
  return lines.size() == 1 ? lines[0] : "";
}

// A finished one-epoch run under `save_path` (quick_run): its directory.
std::string one_epoch_run(const std::string& save_path) {
  auto r = run_process(quick_run(save_path, {"--epochs", "1", "--sanity-val-steps", "0"}));
  EXPECT_EQ(r.exit_code, 0) << r.output;
  return only_run_dir(save_path);
}

}  // namespace resume_guard

// B2: run B (newer) has only damaged checkpoints. --resume auto once went on
// with the older run A without a word, and --resume B said B "holds no
// checkpoint". Both now stop in one line naming B's damaged file and why it
// could not be read, and nothing of either run changes.
TEST(RunDir, DamagedNewestRunIsNamedNotSkippedForAnOlderRun) {
  DDP_SKIP_UNLESS_GLOO();
  using namespace resume_guard;
  const auto save_path = ddp::testing::temp_dir("damaged_auto");
  auto a = run_process(quick_run(save_path + "/a", {"--epochs", "1", "--sanity-val-steps", "0"}));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  auto b = run_process(quick_run(save_path + "/b", {"--epochs", "2", "--save_epoch", "1", "--sanity-val-steps", "0", "--seed", "5"}));
  ASSERT_EQ(b.exit_code, 0) << b.output;
  // One --save_path holding both runs, A written before B.
  const std::string run_a = save_path + "/train_a", run_b = save_path + "/train_b";
  fs::rename(only_run_dir(save_path + "/a"), run_a);
  fs::rename(only_run_dir(save_path + "/b"), run_b);
  for (const char* f : {"epoch_1.pt", "best.pt"}) fs::last_write_time(run_a + "/" + f, fs::file_time_type::clock::now() - std::chrono::hours(1));
  for (const auto& e : fs::directory_iterator(run_b))
    if (e.path().extension() == ".pt") truncate_to(e.path().string(), 5000);
  const auto before = contents(save_path);

  auto resumed = run_process(quick_run(save_path, {"--resume", "auto", "--epochs", "3", "--reschedule"}));
  EXPECT_EQ(resumed.output.find("resume: " + run_a), std::string::npos) << "auto crossed into the older run:\n" << resumed.output;
  const std::string line_auto = refusal(resumed);
  EXPECT_NE(line_auto.find(run_b + "/epoch_2.pt"), std::string::npos) << line_auto;
  EXPECT_NE(line_auto.find("not a complete PyTorch zip file"), std::string::npos) << line_auto;

  auto named = run_process({DDPTRAIN_EXE, "--resume", run_b, "--epochs", "3", "--reschedule"});
  EXPECT_EQ(named.output.find("holds no checkpoint"), std::string::npos) << named.output;
  const std::string line_named = refusal(named);
  EXPECT_NE(line_named.find(run_b + "/epoch_2.pt"), std::string::npos) << line_named;
  EXPECT_EQ(contents(save_path), before) << "a refused resume changed a file";
  // "holds no checkpoint" stays for a directory that holds none.
  fs::create_directories(save_path + "/empty");
  auto empty = run_process({DDPTRAIN_EXE, "--resume", save_path + "/empty"});
  EXPECT_NE(empty.output.find("holds no checkpoint"), std::string::npos) << empty.output;
}

// B2: a damaged epoch_3.pt beside an intact epoch_2.pt. --resume RUN once
// resumed epoch 2 without a word and overwrote the damaged file with its own
// epoch 3. Now it stops in one line naming epoch_3.pt, with the explicit
// command as the fix; that command keeps the damaged file (moved aside with
// the branch it belongs to, byte for byte) and says where it went.
TEST(RunDir, DamagedLaterCheckpointStopsResumeAndAnExplicitOlderResumeKeepsIt) {
  DDP_SKIP_UNLESS_GLOO();
  using namespace resume_guard;
  const auto save_path = ddp::testing::temp_dir("damaged_later");
  auto first = run_process(quick_run(save_path, {"--epochs", "3", "--save_epoch", "1", "--sanity-val-steps", "0"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto run = only_run_dir(save_path);
  truncate_to(run + "/epoch_3.pt", fs::file_size(run + "/epoch_3.pt") / 2);
  const std::string damaged = ddp::testing::read_file(run + "/epoch_3.pt");
  const auto before = contents(save_path);

  auto refused = run_process({DDPTRAIN_EXE, "--resume", run, "--epochs", "4", "--reschedule"});
  const std::string line_refused = refusal(refused);
  EXPECT_NE(line_refused.find(run + "/epoch_3.pt"), std::string::npos) << line_refused;
  EXPECT_NE(line_refused.find("--resume " + run + "/epoch_2.pt"), std::string::npos) << line_refused;
  EXPECT_EQ(contents(save_path), before) << "a refused resume changed a file";

  auto explicit_older = run_process({DDPTRAIN_EXE, "--resume", run + "/epoch_2.pt", "--epochs", "3"});
  ASSERT_EQ(explicit_older.exit_code, 0) << explicit_older.output;
  EXPECT_TRUE(ddp::is_checkpoint(run + "/epoch_3.pt")) << explicit_older.output;
  std::string aside;
  for (const auto& e : fs::directory_iterator(run))
    if (e.is_directory() && e.path().filename().string().rfind("abandoned-", 0) == 0) aside = e.path().string();
  ASSERT_FALSE(aside.empty()) << explicit_older.output;
  EXPECT_EQ(ddp::testing::read_file(aside + "/epoch_3.pt"), damaged);
  EXPECT_NE(explicit_older.output.find(aside), std::string::npos) << explicit_older.output;
}

// B2's control: a damaged checkpoint that is older and behind an intact one
// does not block, and one that may be further along (a later epoch, a
// preempt.pt, a newer file) does, naming itself and the intact one.
TEST(RunDir, OnlyADamagedCheckpointThatMayBeFurtherAlongBlocksResume) {
  const auto dir = ddp::testing::temp_dir("damaged_rules");
  torch::nn::Linear model(2, 2);
  auto save = [&](const std::string& name, int64_t epoch, int64_t step, int minutes_ago) {
    ddp::CheckpointMeta meta;
    meta.state.epoch = epoch;
    meta.state.step = step;
    ddp::save_checkpoint(dir + "/" + name, *model, nullptr, meta);
    fs::last_write_time(dir + "/" + name, fs::file_time_type::clock::now() - std::chrono::minutes(minutes_ago));
  };
  auto damage = [&](const std::string& name, int minutes_ago) {
    std::ofstream(dir + "/" + name, std::ios::binary) << "PK\x03\x04 half a file";
    fs::last_write_time(dir + "/" + name, fs::file_time_type::clock::now() - std::chrono::minutes(minutes_ago));
  };
  save("epoch_2.pt", 2, 20, 30);
  damage("epoch_1.pt", 60);  // older and behind
  EXPECT_EQ(ddp::find_latest_checkpoint(dir), dir + "/epoch_2.pt");
  damage("epoch_3.pt", 90);  // a later epoch, though an older file
  auto msg = ddp::testing::user_error([&] { ddp::find_latest_checkpoint(dir); });
  EXPECT_NE(msg.find(dir + "/epoch_3.pt"), std::string::npos) << msg;
  EXPECT_NE(msg.find(dir + "/epoch_2.pt"), std::string::npos) << msg;
  fs::remove(dir + "/epoch_3.pt");
  damage("preempt.pt", 90);
  EXPECT_NE(ddp::testing::user_error([&] { ddp::find_latest_checkpoint(dir); }).find(dir + "/preempt.pt"), std::string::npos);
  fs::remove(dir + "/preempt.pt");
  // Behind by its number, but written after epoch_2.pt (as a copy without
  // -t may leave it): an epoch_N.pt goes by its N, so it does not block.
  damage("epoch_1.pt", 1);
  EXPECT_EQ(ddp::find_latest_checkpoint(dir), dir + "/epoch_2.pt");
}

// B3: two jobs resuming one run directory at once once both trained, each
// row of metrics.csv twice and both writing epoch_3.pt. Rank 0 of a job holds
// a lock on its run directory: a second job stops at its start in one line
// naming the directory and the holder (pid, host). The lock is the
// kernel's: after the holder is killed (SIGKILL, no clean-up), the next job
// goes on.
TEST(RunDir, ASecondJobInTheSameRunDirectoryStopsAndAKilledHoldersLockDoesNotBlock) {
  DDP_SKIP_UNLESS_GLOO();
  using namespace resume_guard;
  const auto save_path = ddp::testing::temp_dir("run_lock");
  const auto run = one_epoch_run(save_path);
  ASSERT_FALSE(run.empty());
  // A long resume, held at its start of training.
  auto holder = ddp::testing::start_process({DDPTRAIN_EXE, "--resume", run, "--epochs", "400", "--reschedule",
                                             "--save_epoch", "1"});
  ASSERT_TRUE(ddp::testing::wait_for_output(holder, "world:", 120)) << ddp::testing::read_file(holder.log);
  // (More epochs than the holder reaches: a resume with nothing left to do writes nothing, and goes.)
  auto second = run_process({DDPTRAIN_EXE, "--resume", run, "--epochs", "500", "--reschedule"});
  const std::string line_second = refusal(second);
  char host[256] = {};
  ASSERT_EQ(gethostname(host, sizeof host - 1), 0);
  EXPECT_NE(line_second.find(run), std::string::npos) << line_second;
  EXPECT_NE(line_second.find("pid " + std::to_string(holder.pid)), std::string::npos) << line_second;
  EXPECT_NE(line_second.find(host), std::string::npos) << line_second;
  EXPECT_EQ(second.output.find("world:"), std::string::npos) << "the second job went on:\n" << second.output;
  EXPECT_EQ(second.output.find("saved "), std::string::npos) << "the second job wrote:\n" << second.output;

  ASSERT_EQ(::kill(holder.pid, SIGKILL), 0);
  ddp::testing::finish_process(holder, 60);
  // The run.lock it leaves (with its pid) does not stop the next job: one more epoch.
  ASSERT_NE(ddp::testing::read_file(run + "/run.lock").find(std::to_string(holder.pid)), std::string::npos);
  const int64_t reached = ddp::read_checkpoint_meta(ddp::find_latest_checkpoint(run)).state.epoch;
  const std::string next = std::to_string(reached + 1);
  auto after_kill = run_process({DDPTRAIN_EXE, "--resume", run, "--epochs", next, "--reschedule"});
  ASSERT_EQ(after_kill.exit_code, 0) << after_kill.output;
  EXPECT_TRUE(ddp::is_checkpoint(run + "/epoch_" + next + ".pt")) << after_kill.output;
}

// B4: --save_path with --resume RUN_DIR was accepted and ignored (the run
// went on in RUN_DIR; the new path was never made). A resumed run continues
// in its own directory, so a --save_path elsewhere is refused in one line,
// before anything is written; the run's own parent is accepted.
TEST(RunDir, SavePathElsewhereWithResumeOfARunIsRefusedInOneLine) {
  DDP_SKIP_UNLESS_GLOO();
  using namespace resume_guard;
  const auto save_path = ddp::testing::temp_dir("resume_save_path");
  const auto run = one_epoch_run(save_path);
  ASSERT_FALSE(run.empty());
  const auto before = contents(save_path);
  const std::string other = ddp::testing::temp_dir("resume_save_path_other") + "/runs";
  for (const std::string& from : {run, run + "/epoch_1.pt"}) {
    auto refused = run_process({DDPTRAIN_EXE, "--resume", from, "--epochs", "2", "--reschedule", "--save_path", other});
    const std::string line = refusal(refused);
    EXPECT_NE(line.find("--save_path " + other), std::string::npos) << line;
    EXPECT_NE(line.find(run), std::string::npos) << line;
    EXPECT_FALSE(fs::exists(other)) << from;
    EXPECT_EQ(contents(save_path), before) << from;
  }
  auto same = run_process({DDPTRAIN_EXE, "--resume", run, "--epochs", "2", "--reschedule", "--save_path", save_path});
  ASSERT_EQ(same.exit_code, 0) << same.output;
  EXPECT_TRUE(ddp::is_checkpoint(run + "/epoch_2.pt")) << same.output;
  // A --save_path above the run's own (as --resume auto finds runs under
  // it, at any depth), written with a "..": accepted too.
  const std::string above = save_path + "/../" + fs::path(save_path).filename().string() + "/..";
  auto higher = run_process({DDPTRAIN_EXE, "--resume", run, "--epochs", "3", "--reschedule", "--save_path", above});
  ASSERT_EQ(higher.exit_code, 0) << higher.output;
  EXPECT_TRUE(ddp::is_checkpoint(run + "/epoch_3.pt")) << higher.output;
}

// B5: a resume with nothing left to do (a finished 2-rank run, copied, and
// resumed from another directory on one process) exits 0 saying so, and
// once rewrote config.toml (size 0, batch 64, the working directory's
// save_path), the metrics, the curves and the TensorBoard file. Now every
// file of the run stays byte-identical, and nothing is written elsewhere.
TEST(RunDir, ResumeWithNothingToDoLeavesEveryFileOfTheRunByteIdentical) {
  DDP_SKIP_UNLESS_GLOO();
  using namespace resume_guard;
  const auto save_path = ddp::testing::temp_dir("nothing_to_do");
  auto first = run_process({DDPTRAIN_EXE, "--model", "cnn", "--size", "2", "--backend", "gloo", "--save_path", save_path,
                            "--dataset", "synthetic", "--train-samples", "128", "--test-samples", "64", "--batch", "32",
                            "--epochs", "1", "--sanity-val-steps", "0", "--progress", "none", "--timeout", "60"});
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string copy = ddp::testing::temp_dir("nothing_to_do_copy") + "/run";
  fs::copy(only_run_dir(save_path), copy, fs::copy_options::recursive);
  const auto before = contents(copy);
  const auto cwd = ddp::testing::temp_dir("nothing_to_do_cwd");
  auto again = run_process({"/bin/sh", "-c", "cd \"$0\" && exec \"$1\" --resume \"$2\" --progress none", cwd, DDPTRAIN_EXE, copy});
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_EQ(ddp::testing::count(again.output, "nothing to do"), 1u) << again.output;
  EXPECT_EQ(contents(copy), before) << again.output;
  EXPECT_TRUE(fs::is_empty(cwd)) << again.output;
}

// C1: a run of ddptrain resumed by a program of the user's once stopped at
// whatever came first: examples/regression (which makes its own data) at
// "--dataset does not apply to this program", examples/tabular at reading
// the CSV files of ddptrain's --data_root; the template at "trained on other
// data ... pass the --data_root the run trained on". None can help. Now the
// one line says that the run is ddptrain's, and its model.
TEST(RunDir, ResumingAnotherProgramsRunNamesTheModelAndProgramFirst) {
  DDP_SKIP_UNLESS_GLOO();
  using namespace resume_guard;
  const auto save_path = ddp::testing::temp_dir("other_program");
  const auto run = one_epoch_run(save_path);
  ASSERT_FALSE(run.empty());
  const auto before = contents(save_path);
  auto other = run_process({EXAMPLE_regression, "--resume", run, "--epochs", "2", "--reschedule"});
  const std::string line_other = refusal(other);
  EXPECT_NE(line_other.find("model 'cnn/"), std::string::npos) << line_other;
  EXPECT_NE(line_other.find("trained by ddptrain"), std::string::npos) << line_other;
  EXPECT_EQ(line_other.find("--data_root"), std::string::npos) << line_other;
  EXPECT_EQ(line_other.find("--dataset"), std::string::npos) << line_other;
  // A program that reads its data from --data_root (examples/tabular) once
  // stopped at reading the CSV files there: ddptrain's run is said first.
  const auto cwd = ddp::testing::temp_dir("other_program_cwd");
  auto reads_data = run_process({"/bin/sh", "-c", "cd \"$0\" && exec \"$@\"", cwd, EXAMPLE_tabular, "--resume", run});
  const std::string line_reads_data = refusal(reads_data);
  EXPECT_NE(line_reads_data.find("trained by ddptrain"), std::string::npos) << line_reads_data;
  EXPECT_EQ(line_reads_data.find("CSV"), std::string::npos) << line_reads_data;
  EXPECT_EQ(contents(save_path), before);
  EXPECT_TRUE(fs::is_empty(cwd));
  // Two programs of the user's: the model differs, said once it is built.
  ddp::testing::write_sales_csvs(cwd + "/sales", 200, 50);
  auto tabular = run_process({EXAMPLE_tabular, "--data_root", cwd + "/sales", "--save_path", cwd + "/runs", "--size", "1",
                              "--backend", "gloo", "--epochs", "1", "--workers", "0", "--progress", "none"});
  ASSERT_EQ(tabular.exit_code, 0) << tabular.output;
  auto regression = run_process({EXAMPLE_regression, "--resume", only_run_dir(cwd + "/runs")});
  const std::string line_regression = refusal(regression);
  EXPECT_NE(line_regression.find("is for model 'sales-mlp/"), std::string::npos) << line_regression;
  EXPECT_NE(line_regression.find("but this program builds 'area-net'; the run was trained by tabular"), std::string::npos)
      << line_regression;
}
