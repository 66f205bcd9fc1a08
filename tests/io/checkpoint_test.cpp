// Checkpoints, resume, preemption, restarts and bad input, with the real
// binary and real processes.
#include <signal.h>
#include <sys/socket.h>
#include <netinet/in.h>
#include <unistd.h>

#include <chrono>
#include <thread>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <sstream>

#include <nlohmann/json.hpp>

#include "ddp/io/checkpoint.h"
#include "ddp/io/torch_pickle.h"
#include "ddp/error.h"
#include "ddp/dist/launch.h"
#include "ddp/models/registry.h"
#include "ddp/dist/sync_batchnorm.h"
#include "support/checkpoint_weights.h"
#include "support/testing.h"
#include "support/tfevents.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::run_process;

std::vector<std::string> run_args(const std::string& save_path, std::vector<std::string> extra) {
  std::vector<std::string> a{DDPTRAIN_EXE, "--model", "cnn", "--save_path", save_path, "--progress", "plain",
                             "--log-every", "5", "--timeout", "60", "--backend", "gloo"};
  const auto root = ddp::testing::fashion_mnist_root();
  if (root.empty()) a.insert(a.end(), {"--dataset", "synthetic"});
  else a.insert(a.end(), {"--data_root", root});
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// `args` with --inject-fault `fault` (RANK:STEP[:how]) added.
std::vector<std::string> with_fault(std::vector<std::string> args, const std::string& fault) {
  args.insert(args.end(), {"--inject-fault", fault});
  return args;
}

using ddp::testing::find_file;
using ddp::testing::metrics_jsonl;

// metrics.csv's step rows as (step, train loss).
std::vector<std::pair<int64_t, double>> step_rows(const std::string& dir) {
  std::vector<std::pair<int64_t, double>> out;
  std::ifstream f(find_file(dir, "metrics.csv"));
  std::string line;
  while (std::getline(f, line)) {
    if (line.rfind("step,", 0) != 0) continue;
    std::vector<std::string> c;
    std::stringstream ss(line);
    for (std::string cell; std::getline(ss, cell, ',');) c.push_back(cell);
    out.emplace_back(std::stoll(c.at(2)), std::stod(c.at(4)));
  }
  return out;
}

using ddp::testing::expect_bit_equal;

const std::vector<std::string> kSmall{"--size", "2", "--epochs", "2", "--train-samples", "3000", "--test-samples", "500"};

// The words of the command a run printed after `marker` (to the line's end).
std::vector<std::string> printed_command(const std::string& output, const std::string& marker) {
  const auto at = output.find(marker);
  if (at == std::string::npos) return {};
  std::istringstream line(output.substr(at + marker.size(), output.find('\n', at) - at - marker.size()));
  std::vector<std::string> words;
  for (std::string w; line >> w;) words.push_back(w);
  if (!words.empty() && words.back().back() == '.') words.back().pop_back();
  return words;
}

// SIGTERM mid-epoch: every rank stops at the same step, a checkpoint is
// written, the exit status says so, and the printed resume command finishes the run with
// weights bit-identical to an uninterrupted run (augmentation on).
TEST(Resume, InterruptedAndResumedEqualsStraight_BitExact) {
  DDP_SKIP_UNLESS_GLOO();
  auto straight = ddp::testing::temp_dir("straight"), split = ddp::testing::temp_dir("split");
  auto a = run_process(run_args(straight, kSmall));
  ASSERT_EQ(a.exit_code, 0) << a.output;

  auto child = ddp::testing::start_process(run_args(split, kSmall));
  ASSERT_TRUE(ddp::testing::wait_for_output(child, "epoch 1/2 step 10/")) << "training never started";
  kill(child.pid, SIGTERM);
  auto b1 = ddp::testing::finish_process(child, 60);
  ASSERT_EQ(b1.exit_code, ddp::exit_code::kPreempted) << b1.output;
  EXPECT_NE(b1.output.find("stopped by a signal"), std::string::npos) << b1.output;
  ASSERT_FALSE(find_file(split, "preempt.pt").empty());

  // The command the run printed, as printed: it restores every flag of the
  // run (3000 samples, the model, ...) but its placement, which a
  // checkpoint never restores and the command repeats (--size 2).
  const auto resume = printed_command(b1.output, "Resume: ");
  ASSERT_EQ(resume.size(), 5u) << b1.output;
  EXPECT_EQ(resume[1], "--resume");
  EXPECT_EQ(resume[3], "--size");
  EXPECT_EQ(resume[4], "2");
  auto b2 = run_process(resume);
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  EXPECT_NE(b2.output.find("resume: "), std::string::npos);
  expect_bit_equal(find_file(straight, "epoch_2.pt"), find_file(split, "epoch_2.pt"));
  auto ma = metrics_jsonl(straight), mb = metrics_jsonl(split);
  ASSERT_EQ(ma.size(), 2u);
  ASSERT_EQ(mb.size(), 2u);
  for (size_t e = 0; e < 2; ++e) {
    EXPECT_NEAR(ma[e]["train_loss"].get<double>(), mb[e]["train_loss"].get<double>(), 1e-12);
    EXPECT_EQ(ma[e]["test_loss"], mb[e]["test_loss"]);
    EXPECT_EQ(ma[e]["test_acc"], mb[e]["test_acc"]);
    EXPECT_EQ(ma[e]["lr"], mb[e]["lr"]);
  }
  // metrics.csv and the event file go on where the run stopped: the same
  // log points as the straight run, each once.
  auto sa = step_rows(straight), sb = step_rows(split);
  ASSERT_EQ(sa.size(), sb.size());
  for (size_t i = 0; i < sa.size(); ++i) {
    EXPECT_EQ(sa[i].first, sb[i].first) << "row " << i;
    EXPECT_NEAR(sa[i].second, sb[i].second, 1e-8 * sa[i].second) << "row " << i;
  }
  const auto events = ddp::testing::event_files(fs::path(find_file(split, "metrics.csv")).parent_path().string());
  ASSERT_EQ(events.size(), 1u);
  std::vector<int64_t> logged;
  for (const auto& e : ddp::testing::read_event_file(events[0]).scalars)
    if (e.tag == "train/loss") logged.push_back(e.step);
  ASSERT_EQ(logged.size(), sb.size());
  for (size_t i = 0; i < sb.size(); ++i) EXPECT_EQ(logged[i], sb[i].first) << "event " << i;
}

// Rewrites the JSON header of checkpoint `path` in place, as whoever hands
// out a checkpoint could; its tensors stay as they were.
void edit_header(const std::string& path, const std::function<void(nlohmann::json&)>& edit) {
  auto tensors = ddp::read_state_dict(path);
  for (auto& [name, t] : tensors) {
    if (name != "ddptrain") continue;
    auto header = nlohmann::json::parse(ddp::tensor_string(t));
    edit(header);
    t = ddp::string_tensor(header.dump());
  }
  ddp::write_state_dict(path, tensors);
}

// A one-epoch run's epoch_1.pt under `dir` ("" if the run failed, which
// the test then reports), for the tests that rewrite its header.
std::string one_epoch_checkpoint(const std::string& dir) {
  auto first = run_process(run_args(dir, {"--size", "1", "--epochs", "1", "--train-samples", "128",
                                          "--test-samples", "64", "--workers", "0", "--sanity-val-steps", "0"}));
  EXPECT_EQ(first.exit_code, 0) << first.output;
  return first.exit_code == 0 ? find_file(dir, "epoch_1.pt") : "";
}

// A checkpoint whose header was rewritten to place the job (join, as node 1
// of 2, a job hosted elsewhere; start ranks; pick GPUs and a backend) and to
// name files to write (--profile-trace, --save_path) resumes where this
// command line places it, writing only in its own run directory: a header
// is data, never instructions. Each value here failed the run on main
// (it tried to join 198.51.100.1, or refused the trace path on a CPU build).
TEST(Resume, AHeaderCannotPlaceTheJobOrNameAFileToWrite) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("hostile_header");
  const std::string checkpoint = one_epoch_checkpoint(dir);
  ASSERT_FALSE(checkpoint.empty());
  const std::string victim = dir + "/victim.txt", elsewhere = dir + "/elsewhere";
  edit_header(checkpoint, [&](nlohmann::json& h) {
    auto& c = h["config"];
    c["nnodes"] = 2;
    c["node-rank"] = 1;
    c["address"] = "198.51.100.1";  // TEST-NET-2 (RFC 5737): nobody there
    c["port"] = 29555;
    c["size"] = 3;
    c["visible"] = "7";
    c["backend"] = "nccl";
    c["timeout"] = 5;
    c["max-restarts"] = 4;
    c["profile-trace"] = victim;
    c["save_path"] = elsewhere;
  });
  auto resumed = run_process({DDPTRAIN_EXE, "--resume", checkpoint, "--epochs", "2", "--reschedule", "--progress",
                              "plain", "--workers", "0"},
                             {}, 120);
  EXPECT_EQ(resumed.exit_code, 0) << resumed.output;
  EXPECT_EQ(resumed.output.find("joining"), std::string::npos) << resumed.output;
  EXPECT_EQ(resumed.output.find("198.51.100.1"), std::string::npos) << resumed.output;
  EXPECT_NE(resumed.output.find("rank 0 of 1 (no launcher), backend gloo"), std::string::npos) << resumed.output;
  EXPECT_FALSE(fs::exists(victim));
  EXPECT_FALSE(fs::exists(elsewhere));
  EXPECT_EQ(metrics_jsonl(dir).size(), 2u) << resumed.output;
  // What the run goes on to save describes this job, not the header's.
  const auto saved = ddp::read_checkpoint_meta(find_file(dir, "epoch_2.pt")).config;
  EXPECT_EQ(saved["nnodes"], 1);
  EXPECT_EQ(saved["address"], "127.0.0.1");
  EXPECT_EQ(saved["profile-trace"], "");
}

// A header's value that the command line would refuse is refused, in one
// line naming the checkpoint and the value: the merged flags are validated
// as parsed ones are. --save_epoch 0 crashed resume with SIGFPE on main.
TEST(Resume, AHeaderValueTheCommandLineRefusesIsOneLineNamingTheCheckpoint) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("bad_header_value");
  const std::string checkpoint = one_epoch_checkpoint(dir);
  ASSERT_FALSE(checkpoint.empty());
  const std::vector<std::pair<nlohmann::json, std::string>> cases{
      {{{"save_epoch", 0}}, "--save_epoch must be positive, got 0."},
      {{{"batch", -3}}, "--batch must be positive, got -3."},
      {{{"accum-steps", 0}}, "--accum-steps must be positive, got 0."},
  };
  for (const auto& [values, expect] : cases) {
    const std::string copy = dir + "/bad.pt";
    fs::copy_file(checkpoint, copy, fs::copy_options::overwrite_existing);
    edit_header(copy, [&](nlohmann::json& h) { h["config"].update(values); });
    auto r = run_process({DDPTRAIN_EXE, "--resume", copy, "--epochs", "2", "--reschedule", "--progress", "none"}, {}, 60);
    EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << values.dump() << "\n" << r.output;
    EXPECT_NE(r.output.find("checkpoint " + copy + " holds flags that ddptrain refuses: " + expect), std::string::npos)
        << r.output;
    EXPECT_NE(r.output.find("Hint:"), std::string::npos) << r.output;
    EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
  }
}

// --resume refuses flags that change the job, all in one line, and a longer
// run of a length-dependent schedule unless --reschedule; flags that leave
// the job the same are taken.
TEST(Resume, ChangedJobIsRefusedAndLongerScheduleNeedsReschedule) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("refuse");
  const std::vector<std::string> run{"--size", "1", "--epochs", "1", "--train-samples", "512", "--test-samples", "128",
                                     "--seed", "5", "--schedule", "cosine"};
  auto first = run_process(run_args(dir, run));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const auto resume = printed_command(first.output, "resume:   ");
  ASSERT_EQ(resume.size(), 3u) << first.output;

  auto with = [&](std::vector<std::string> extra) {
    auto a = resume;
    a.insert(a.end(), extra.begin(), extra.end());
    return run_process(a);
  };
  auto changed = with({"--lr", "0.5", "--seed", "6"});
  EXPECT_EQ(changed.exit_code, ddp::exit_code::kUsage) << changed.output;
  EXPECT_NE(changed.output.find("--lr 0.5 (the run's: 0.002), --seed 6 (the run's: 5) change what it learns"),
            std::string::npos) << changed.output;
  EXPECT_EQ(std::count(changed.output.begin(), changed.output.end(), '\n'), 1) << changed.output;

  auto longer = with({"--epochs", "2"});
  EXPECT_EQ(longer.exit_code, ddp::exit_code::kUsage) << longer.output;
  EXPECT_NE(longer.output.find("--epochs 2 changes the length of the run's cosine schedule (1 epochs): the learning "
                               "rate at the resume point (step 8) would jump from 0 to 0.001"),
            std::string::npos) << longer.output;
  EXPECT_NE(longer.output.find("add --reschedule"), std::string::npos);

  auto rescheduled = with({"--epochs", "2", "--reschedule", "--progress", "none"});
  ASSERT_EQ(rescheduled.exit_code, 0) << rescheduled.output;
  auto m = metrics_jsonl(dir);
  ASSERT_EQ(m.size(), 2u);
  // The last step (15) of a cosine over 2 epochs of 8 steps.
  EXPECT_NEAR(m[1]["lr"].get<double>(), 0.002 * (1 + std::cos(M_PI * 15 / 16)) / 2, 1e-12);
  // The run's files describe the job as it goes on, without this run's --resume.
  const auto toml = ddp::testing::read_file(fs::path(find_file(dir, "config.toml")).string());
  EXPECT_NE(toml.find("epochs = 2\n"), std::string::npos) << toml;
  EXPECT_NE(toml.find("resume = ''"), std::string::npos) << toml;
  EXPECT_NE(toml.find("reschedule = false"), std::string::npos) << toml;
}

// PyTorch's sampler deals one permutation round-robin, so the global batch
// at each step is the same samples on any number of ranks: a run resumed on
// another --size keeps the global batch and ends where the straight run
// ends, to fp32 rounding (plain SGD, a stable regime: see
// Trainer.OneRankBatch64EqualsTwoRanksBatch32).
TEST(Resume, OnAnotherNumberOfRanksEqualsTheStraightRun) {
  DDP_SKIP_UNLESS_GLOO();
  const std::vector<std::string> run{"--epochs", "2", "--train-samples", "2048", "--test-samples", "500",
                                     "--optimizer", "sgd", "--lr", "0.01", "--momentum", "0", "--schedule", "cosine",
                                     "--augment", "none", "--seed", "3", "--save_epoch", "1"};
  auto with = [&](std::vector<std::string> extra) {
    auto a = run;
    a.insert(a.end(), extra.begin(), extra.end());
    return a;
  };
  auto straight = ddp::testing::temp_dir("ranks_straight");
  auto s = run_process(run_args(straight, with({"--size", "2", "--batch", "32"})));
  ASSERT_EQ(s.exit_code, 0) << s.output;
  const auto want = metrics_jsonl(straight);
  ASSERT_EQ(want.size(), 2u);
  // 2048 samples / global batch 64 = 32 steps per epoch: fail in epoch 2,
  // after epoch_1.pt, then resume on the other number of ranks.
  for (auto [from, to] : {std::pair<const char*, const char*>{"2", "1"}, {"1", "2"}}) {
    auto dir = ddp::testing::temp_dir(std::string("ranks_") + from + to);
    auto first = run_process(
        with_fault(run_args(dir, with({"--size", from, "--batch", from == std::string("2") ? "32" : "64"})), "0:33"));
    ASSERT_NE(first.exit_code, 0) << first.output;
    ASSERT_FALSE(find_file(dir, "epoch_1.pt").empty()) << first.output;
    auto second = run_process({DDPTRAIN_EXE, "--resume", find_file(dir, "epoch_1.pt"), "--size", to});
    ASSERT_EQ(second.exit_code, 0) << second.output;
    EXPECT_NE(second.output.find(std::string("resume: ") + to + " rank(s) instead of " + from + "; --batch " +
                                 (to == std::string("2") ? "32" : "64") + " per rank keeps the global batch 64"),
              std::string::npos) << second.output;
    auto got = metrics_jsonl(dir);
    ASSERT_EQ(got.size(), 2u) << from << " -> " << to;
    for (const char* key : {"train_loss", "test_loss", "test_acc"})
      EXPECT_NEAR(got[1][key].get<double>(), want[1][key].get<double>(), 1e-4) << key << ", " << from << " -> " << to;
    EXPECT_EQ(got[1]["lr"], want[1]["lr"]);
  }
  // A global batch that does not split over the ranks is refused.
  auto odd = ddp::testing::temp_dir("ranks_odd");
  auto o = run_process(run_args(odd, {"--size", "1", "--batch", "33", "--epochs", "1", "--train-samples", "66",
                                      "--test-samples", "32"}));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  auto r = run_process({DDPTRAIN_EXE, "--resume", find_file(odd, "epoch_1.pt"), "--size", "2", "--epochs", "1"});
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_NE(r.output.find("the run's global batch 33 (--batch 33 x 1 rank(s)) does not split over 2 ranks"),
            std::string::npos) << r.output;
}

// A worker that crashes prints where, and the launcher names the rank and
// the signal and stops the other rank.
TEST(Launcher, CrashedWorkerPrintsItsStackAndIsNamed) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("segv");
  auto r = run_process(with_fault(run_args(dir, kSmall), "1:3:segv"));
  EXPECT_NE(r.exit_code, 0) << r.output;
  EXPECT_LT(r.seconds, 60);
  EXPECT_NE(r.output.find("ddptrain: worker crashed; native stack:"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("  pc 0x"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("rank 1 was killed by signal 11 (SIGSEGV)"), std::string::npos) << r.output;
}

// Workers ignore SIGPIPE (as Python does), so a write to the socket of a
// peer that died fails as a lost peer, which the launcher does not blame:
// under load, MultiNode.MaxRestartsRestartsEveryNode saw rank 0 killed by
// SIGPIPE after rank 3's injected failure, and node 0 named rank 0.
TEST(Launcher, WorkersIgnoreSigpipe) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("sigpipe");
  auto child = ddp::testing::start_process(
      run_args(dir, {"--size", "2", "--epochs", "50", "--train-samples", "3000", "--test-samples", "500"}));
  ASSERT_TRUE(ddp::testing::wait_for_output(child, "world: 2 rank(s)", 90)) << ddp::testing::read_file(child.log);
  int workers = 0;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string stat = ddp::testing::read_file(e.path().string() + "/stat");
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream rest(stat.substr(close + 2));
    std::string state;
    int ppid = 0;
    rest >> state >> ppid;
    if (ppid != child.pid) continue;
    const std::string status = ddp::testing::read_file(e.path().string() + "/status");
    const auto at = status.find("SigIgn:");
    ASSERT_NE(at, std::string::npos);
    const unsigned long long ignored = std::stoull(status.substr(at + 7), nullptr, 16);
    EXPECT_TRUE(ignored & (1ULL << (SIGPIPE - 1))) << "worker " << e.path().filename() << " does not ignore SIGPIPE";
    ++workers;
  }
  EXPECT_EQ(workers, 2);
  ::kill(child.pid, SIGKILL);  // the workers die with the launcher (PR_SET_PDEATHSIG)
  ddp::testing::finish_process(child, 30);
}

// A worker that fails is restarted with the group, from the last checkpoint.
TEST(Resume, MaxRestartsResumesFromLastCheckpoint) {
  DDP_SKIP_UNLESS_GLOO();
  auto straight = ddp::testing::temp_dir("straight2"), restarted = ddp::testing::temp_dir("restarted");
  auto a = run_process(run_args(straight, kSmall));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  // 3000 samples / 2 ranks / batch 64 = 24 steps per epoch: fail in epoch 2.
  auto args = kSmall;
  args.insert(args.end(), {"--save_epoch", "1", "--max-restarts", "1"});
  auto r = run_process(with_fault(run_args(restarted, args), "1:30"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("rank 1 exited with code 1; restart 1 of 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("injected failure"), std::string::npos);
  expect_bit_equal(find_file(straight, "epoch_2.pt"), find_file(restarted, "epoch_2.pt"));
  EXPECT_EQ(metrics_jsonl(restarted).size(), 2u);
}

// A restart resumes this job's own checkpoints, never another run's under
// the same --save_path (both use ./checkpoint by default): run A saves epoch
// 1; job B fails in its first epoch, before it has saved anything, and
// restarts. B starts again in its own run directory; A's files are as A
// left them.
TEST(Resume, RestartNeverResumesAnotherRunsCheckpoint) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("restart_other");
  const std::vector<std::string> one_epoch{"--size", "2", "--epochs", "1", "--train-samples", "640", "--test-samples", "128"};
  auto a = run_process(run_args(dir, one_epoch));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::string a_config = find_file(dir, "config.json"), a_dir = fs::path(a_config).parent_path().string();
  const std::string a_config_text = ddp::testing::read_file(a_config);
  auto args = one_epoch;
  args.insert(args.end(), {"--lr", "0.05", "--max-restarts", "1"});
  // 640 samples / 2 ranks / batch 64 = 5 steps an epoch: fail at step 2.
  auto b = run_process(with_fault(run_args(dir, args), "1:2"));
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("restart 1 of 1"), std::string::npos) << b.output;
  EXPECT_EQ(b.output.find("resume: " + a_dir), std::string::npos) << b.output;
  EXPECT_EQ(ddp::testing::read_file(a_config), a_config_text) << "the restart rewrote run A's config";
  std::vector<std::string> runs;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.is_directory()) runs.push_back(e.path().string());
  ASSERT_EQ(runs.size(), 2u) << "B's two attempts should share one run directory";
  const std::string b_dir = runs[0] == a_dir ? runs[1] : runs[0];
  EXPECT_TRUE(fs::exists(b_dir + "/epoch_1.pt"));
  EXPECT_EQ(metrics_jsonl(b_dir).size(), 1u);
  EXPECT_EQ(metrics_jsonl(a_dir).size(), 1u);
}

// A run resumed from a checkpoint in a run directory moved out of
// --save_path, that fails and restarts, goes on from the newest checkpoint
// the failed attempt wrote there, not from the file --resume named: that
// would train the epochs since then again.
TEST(Resume, RestartOfAMovedRunGoesOnFromItsNewestCheckpoint) {
  DDP_SKIP_UNLESS_GLOO();
  const auto first = ddp::testing::temp_dir("restart_moved_a"), moved = ddp::testing::temp_dir("restart_moved_b");
  const std::vector<std::string> small{"--size", "1", "--train-samples", "512", "--test-samples", "128", "--save_epoch", "1"};
  auto args = small;
  args.insert(args.end(), {"--epochs", "1"});
  auto a = run_process(run_args(first, args));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::string run = fs::path(find_file(first, "epoch_1.pt")).parent_path().string();
  const std::string to = moved + "/run";
  fs::rename(run, to);
  // 512 samples / batch 64 = 8 steps an epoch: fail at step 20, in epoch 3,
  // after this attempt saved epoch_2.pt in the moved directory.
  args = small;
  args.insert(args.end(), {"--epochs", "3", "--reschedule", "--resume", to + "/epoch_1.pt", "--max-restarts", "1"});
  // No --save_path: the resumed run writes in its own directory, and a
  // --save_path elsewhere is refused (RunDir.SavePathElsewhereWith...).
  auto resumed = run_args(first, args);
  const auto flag = std::find(resumed.begin(), resumed.end(), "--save_path");
  resumed.erase(flag, flag + 2);
  auto b = run_process(with_fault(resumed, "0:20"));
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("restart 1 of 1"), std::string::npos) << b.output;
  EXPECT_NE(b.output.find("resume: " + to + "/epoch_2.pt"), std::string::npos) << b.output;
  EXPECT_EQ(metrics_jsonl(to).size(), 3u);
}

// A job that resumed a run from an earlier checkpoint (epoch 1 of 3) and
// fails before saving one of its own restarts from that checkpoint again,
// not from the later ones the run directory still holds from before
// (epoch_3.pt here): they are another trajectory, and resuming the last
// one would skip epochs 2 and 3. Once the job has saved epoch 2 itself, a
// second failure restarts from that.
TEST(Resume, RestartOfARunResumedFromAnEarlierCheckpointIgnoresTheLaterOnes) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("restart_earlier");
  const std::vector<std::string> small{"--size", "1", "--train-samples", "512", "--test-samples", "128",
                                       "--save_epoch", "1", "--epochs", "3"};
  auto a = run_process(run_args(dir, small));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::string run = fs::path(find_file(dir, "epoch_3.pt")).parent_path().string();
  // 512 samples / batch 64 = 8 steps an epoch: fail at step 12, in epoch 2,
  // before this job has saved anything.
  auto args = small;
  args.insert(args.end(), {"--resume", run + "/epoch_1.pt", "--max-restarts", "1"});
  auto b = run_process(with_fault(run_args(dir, args), "0:12"));
  ASSERT_EQ(b.exit_code, 0) << b.output;
  EXPECT_NE(b.output.find("restart 1 of 1"), std::string::npos) << b.output;
  EXPECT_EQ(b.output.find("resume: " + run + "/epoch_3.pt"), std::string::npos) << b.output;
  EXPECT_EQ(b.output.find("already trained"), std::string::npos) << b.output;
  const std::string from_1 = "resume: " + run + "/epoch_1.pt";
  const auto first_resume = b.output.find(from_1);
  ASSERT_NE(first_resume, std::string::npos) << b.output;
  EXPECT_NE(b.output.find(from_1, first_resume + 1), std::string::npos) << "the restart did not resume epoch 1\n"
                                                                        << b.output;
  EXPECT_EQ(metrics_jsonl(run).size(), 3u) << b.output;

  // Fail again, in epoch 3 (step 20), after this job saved epoch_2.pt.
  auto c = run_process(with_fault(run_args(dir, args), "0:20"));
  ASSERT_EQ(c.exit_code, 0) << c.output;
  EXPECT_NE(c.output.find("restart 1 of 1"), std::string::npos) << c.output;
  EXPECT_NE(c.output.find("resume: " + run + "/epoch_2.pt"), std::string::npos) << c.output;
  EXPECT_EQ(metrics_jsonl(run).size(), 3u) << c.output;
}

// --resume auto is resolved once, by the process that reads the flags, and
// the file itself is handed to the ranks and their restarts: a restart goes
// on from the file the job began with (here run A's epoch 2) even when
// another run's checkpoint has become the newest under --save_path since.
// (Each process resolved "auto" again: the restart resumed run O, its
// flags and its weights.)
TEST(Resume, ResumeAutoIsResolvedOnceAndARestartKeepsTheFile) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("resume_once");
  // 2048 samples / batch 64 = 32 steps an epoch.
  const std::vector<std::string> small{"--size", "1", "--train-samples", "2048", "--test-samples", "128",
                                       "--save_epoch", "1", "--workers", "0"};
  auto with = [&](std::vector<std::string> extra) {
    auto args = small;
    args.insert(args.end(), extra.begin(), extra.end());
    return run_args(dir, args);
  };
  auto o = run_process(with({"--epochs", "1", "--lr", "0.07"}));
  ASSERT_EQ(o.exit_code, 0) << o.output;
  const std::string o_ckpt = find_file(dir, "epoch_1.pt"), o_dir = fs::path(o_ckpt).parent_path().string();
  std::this_thread::sleep_for(std::chrono::milliseconds(1100));  // a later file time for A's checkpoints
  auto a = run_process(with({"--epochs", "2", "--lr", "0.02"}));
  ASSERT_EQ(a.exit_code, 0) << a.output;
  const std::string a_dir = fs::path(find_file(dir, "epoch_2.pt")).parent_path().string();
  ASSERT_NE(a_dir, o_dir);
  // Job J resumes A's epoch 2 (step 64) and fails at step 90, in epoch 3,
  // before it saves anything; meanwhile O's checkpoint becomes the newest.
  auto child = ddp::testing::start_process(
      with({"--resume", "auto", "--epochs", "3", "--reschedule", "--max-restarts", "1", "--inject-fault", "0:90"}));
  ASSERT_TRUE(ddp::testing::wait_for_output(child, "resume: " + a_dir + "/epoch_2.pt", 120))
      << ddp::testing::read_file(child.log);
  fs::last_write_time(o_ckpt, fs::file_time_type::clock::now() + std::chrono::seconds(5));
  auto j = ddp::testing::finish_process(child, 240);
  ASSERT_EQ(j.exit_code, 0) << j.output;
  EXPECT_NE(j.output.find("restart 1 of 1"), std::string::npos) << j.output;
  EXPECT_EQ(j.output.find("resume: " + o_dir), std::string::npos) << j.output;
  const std::string from_a = "resume: " + a_dir + "/epoch_2.pt";
  EXPECT_NE(j.output.find(from_a, j.output.find(from_a) + 1), std::string::npos)
      << "the restart did not go on from A's epoch 2\n" << j.output;
  EXPECT_EQ(metrics_jsonl(a_dir).size(), 3u) << j.output;
  EXPECT_EQ(metrics_jsonl(o_dir).size(), 1u) << j.output;
  EXPECT_NE(ddp::testing::read_file(a_dir + "/config.json").find("0.02"), std::string::npos);
}

// --max-restarts restarts a single process too (restarts live in the
// launcher, which a one-process run once skipped: the flag did nothing).
TEST(Resume, MaxRestartsRestartsASingleProcess) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("restart_single");
  auto r = run_process(with_fault(run_args(dir, {"--size", "1", "--epochs", "1", "--train-samples", "512", "--test-samples", "128",
                                      "--max-restarts", "1"}), "0:2"));
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("injected failure"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("restart 1 of 1"), std::string::npos) << r.output;
  EXPECT_NE(r.output.find("epoch 1/1"), std::string::npos) << r.output;
}

// Resuming a run that already trained all its epochs (a requeued job script
// that always resumes, say) says so in one line and ends with 0: no
// "done: 0 epoch(s) ... nan" summary, no metrics row, the checkpoints as
// they were.
TEST(Resume, FinishedRunSaysSoAndTrainsNothing) {
  const auto dir = ddp::testing::temp_dir("resume_finished");
  auto first = run_process(run_args(dir, {"--size", "1", "--epochs", "1", "--train-samples", "256", "--test-samples", "64"}));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string run_dir = fs::path(find_file(dir, "epoch_1.pt")).parent_path().string();
  const auto before = ddp::testing::read_file(run_dir + "/metrics.jsonl");
  auto again = run_process({DDPTRAIN_EXE, "--resume", run_dir, "--progress", "plain"});
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("already trained all its 1 epoch(s)"), std::string::npos) << again.output;
  EXPECT_NE(again.output.find("--epochs"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("done:"), std::string::npos) << again.output;
  EXPECT_EQ(again.output.find("nan"), std::string::npos) << again.output;
  EXPECT_EQ(ddp::testing::read_file(run_dir + "/metrics.jsonl"), before);
}

// --pretrain with a resume: the checkpoint's weights are the run's (they
// went on from the pretrained ones), so the pretrained file is not loaded
// (it was, and then overwritten: a silent no-op), and the run says so. The
// resumed run ends as the straight run does. (--resume auto with no
// checkpoint yet, a job's first start, loads it: Pretrain.* tests.)
TEST(Resume, PretrainIsNotLoadedOverAResumedRun) {
  const auto dir = ddp::testing::temp_dir("resume_pretrain");
  const std::vector<std::string> run{"--size", "1", "--epochs", "2", "--train-samples", "256", "--test-samples", "64",
                                     "--save_epoch", "1", "--augment", "none"};
  auto first = run_process(run_args(dir, run));
  ASSERT_EQ(first.exit_code, 0) << first.output;
  const std::string run_dir = fs::path(find_file(dir, "epoch_2.pt")).parent_path().string();
  const auto straight = metrics_jsonl(run_dir);
  ASSERT_EQ(straight.size(), 2u);
  auto export_run = run_process({DDPTRAIN_EXE, "export", run_dir + "/epoch_2.pt", dir + "/w.pt"});
  ASSERT_EQ(export_run.exit_code, 0) << export_run.output;
  auto again = run_process({DDPTRAIN_EXE, "--resume", run_dir + "/epoch_1.pt", "--pretrain", dir + "/w.pt",
                            "--progress", "plain"});
  ASSERT_EQ(again.exit_code, 0) << again.output;
  EXPECT_NE(again.output.find("pretrain: " + dir + "/w.pt not loaded: the run resumes from"), std::string::npos)
      << again.output;
  EXPECT_EQ(again.output.find("tensors loaded"), std::string::npos) << again.output;
  const auto resumed = metrics_jsonl(run_dir);
  ASSERT_EQ(resumed.size(), 2u);
  EXPECT_EQ(resumed[1].at("test_loss"), straight[1].at("test_loss"));
}

// On one GPU: a run stopped after epoch 1 and resumed continues in its own
// run directory (the CUDA wheel's libtorch.so once crashed this path through
// its broken std::filesystem::remove_all) with every epoch in metrics.jsonl.
TEST(Resume, ResumeOnOneGpuContinuesTheRun_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  auto dir = ddp::testing::temp_dir("gpu_resume");
  std::vector<std::string> a{DDPTRAIN_EXE, "--model", "resnet18", "--stem", "small", "--size", "1", "--backend", "nccl",
                             "--dataset", "synthetic", "--train-samples", "2048", "--test-samples", "512",
                             "--amp", "bf16", "--cuda-graph", "--save_path", dir, "--progress", "plain"};
  auto first = a;
  first.insert(first.end(), {"--epochs", "1"});
  auto r1 = run_process(first);
  ASSERT_EQ(r1.exit_code, 0) << r1.output;
  auto second = a;
  second.insert(second.end(), {"--epochs", "2", "--reschedule", "--resume", "auto"});
  auto r2 = run_process(second);
  ASSERT_EQ(r2.exit_code, 0) << r2.output;
  EXPECT_NE(r2.output.find("resume: "), std::string::npos) << r2.output;
  EXPECT_NE(r2.output.find("epoch 2/2"), std::string::npos) << r2.output;
  EXPECT_EQ(std::distance(fs::directory_iterator(dir), fs::directory_iterator()), 1) << "resume made a new run dir";
  auto m = metrics_jsonl(dir);
  ASSERT_EQ(m.size(), 2u);
  EXPECT_EQ(m[1]["epoch"].get<int>(), 2);
}

// kill -9 at any moment leaves every checkpoint under its final name loadable.
// The kill is aimed: the test watches the run directory and kills as soon
// as (or a little after) a checkpoint's temporary file appears, so that it
// lands while a write is in progress.
bool writing_checkpoint(const std::string& dir) {
  std::error_code ec;
  for (fs::recursive_directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec))
    if (it->path().filename().string().find(".pt.tmp.") != std::string::npos) return true;
  return false;
}

TEST(Checkpoint, KillDuringWriteLeavesPreviousIntact) {
  DDP_SKIP_UNLESS_GLOO();
  int landed = 0;
  for (int attempt = 0; attempt < 6; ++attempt) {
    auto dir = ddp::testing::temp_dir("kill9");
    // ResNet-18 checkpoints (~130 MB with Adam state) take a while to write.
    auto child = ddp::testing::start_process(
        {DDPTRAIN_EXE, "--model", "resnet18", "--size", "1", "--backend", "gloo", "--epochs", "100", "--save_epoch", "1",
         "--train-samples", "32", "--test-samples", "32", "--batch", "32", "--keep-last", "0", "--save_path", dir,
         "--progress", "none", "--dataset", "synthetic"});
    // Let one checkpoint complete, so that there is a previous one to keep.
    ASSERT_TRUE(ddp::testing::wait_for_output(child, "saved ", 120));
    auto t0 = std::chrono::steady_clock::now();
    while (!writing_checkpoint(dir) && std::chrono::steady_clock::now() - t0 < std::chrono::seconds(60)) usleep(200);
    usleep(static_cast<useconds_t>(15000 * (attempt % 3)));  // early, and further into the write
    const bool mid_write = writing_checkpoint(dir);
    kill(-child.pid, SIGKILL);
    ddp::testing::finish_process(child, 10);
    if (mid_write && writing_checkpoint(dir)) ++landed;  // the temporary outlived the writer
    int finals = 0;
    for (const auto& e : fs::recursive_directory_iterator(dir)) {
      if (e.path().extension() != ".pt") continue;
      ++finals;
      EXPECT_TRUE(ddp::is_checkpoint(e.path().string())) << e.path() << " is broken";
    }
    EXPECT_GE(finals, 1);
    if (landed >= 2) break;  // two kills mid-write, at different points of it, are proof enough
  }
  EXPECT_GE(landed, 1) << "no kill landed during a write; the test proved nothing";
}

// Loading a checkpoint puts the random generators back where they were when
// it was written: the same draws follow, on the CPU and on the model's GPU.
void expect_rng_restored(const torch::Device& device) {
  auto dir = ddp::testing::temp_dir("rng");
  ddp::models::ModelSpec spec;
  auto model = ddp::models::make_model(spec);
  model->to(device);
  torch::manual_seed(11);
  ddp::save_checkpoint(dir + "/a.pt", *model, nullptr, ddp::CheckpointMeta{});
  auto cpu_before = torch::rand({8}), dev_before = torch::rand({8}, device);
  torch::rand({100}, device);  // move both generators on
  torch::rand({100});
  ddp::load_checkpoint(dir + "/a.pt", *model, nullptr, device, "");
  EXPECT_TRUE(torch::equal(torch::rand({8}), cpu_before));
  EXPECT_TRUE(torch::equal(torch::rand({8}, device), dev_before)) << device;
}

TEST(Checkpoint, RngStatesRoundTrip) { expect_rng_restored(torch::kCPU); }

TEST(Checkpoint, RngStatesRoundTripOnGpu_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  expect_rng_restored(torch::Device(torch::kCUDA, 0));
}

TEST(Checkpoint, VersionAndArchitectureMismatchAreClearErrors) {
  auto dir = ddp::testing::temp_dir("ckpt");
  ddp::models::ModelSpec spec;
  auto model = ddp::models::make_model(spec);
  ddp::CheckpointMeta meta;
  meta.arch = "cnn/auto/1x28x28/10";
  ddp::save_checkpoint(dir + "/a.pt", *model, nullptr, meta);
  EXPECT_NO_THROW(ddp::load_checkpoint(dir + "/a.pt", *model, nullptr, torch::kCPU, meta.arch));
  try {
    ddp::load_checkpoint(dir + "/a.pt", *model, nullptr, torch::kCPU, "resnet18/small/1x28x28/10");
    FAIL();
  } catch (const ddp::UserError& e) {
    EXPECT_NE(std::string(e.what()).find("is for model 'cnn/auto/1x28x28/10'"), std::string::npos) << e.what();
  }
  std::ofstream(dir + "/junk.pt") << "not a checkpoint";
  EXPECT_THROW(ddp::load_checkpoint(dir + "/junk.pt", *model, nullptr, torch::kCPU, ""), ddp::UserError);
  EXPECT_FALSE(ddp::is_checkpoint(dir + "/junk.pt"));
  EXPECT_EQ(ddp::find_latest_checkpoint(dir), "");  // neither name matches epoch_N.pt
}

// A state_dict written by PyTorch (Python) with DDP's "module." prefix loads
// into the same architecture built in C++ and gives the same outputs.
struct TinyImpl : ddp::Net {
  TinyImpl()
      : conv(register_module("conv", torch::nn::Conv2d(torch::nn::Conv2dOptions(3, 4, 3).padding(1)))),
        bn(register_module("bn", ddp::BatchNorm2d(4))),
        fc(register_module("fc", torch::nn::Linear(64, 3))) {}
  torch::Tensor forward(torch::Tensor x) override {
    x = torch::relu(bn(conv(x)));
    return fc(torch::avg_pool2d(x, 2).flatten(1));
  }
  torch::nn::Conv2d conv;
  ddp::BatchNorm bn;
  torch::nn::Linear fc;
};
TORCH_MODULE(Tiny);

TEST(Pretrain, PyTorchStateDictLoadsAndMatchesPythonOutputs) {
  const std::string data = DDP_TEST_DATA_DIR;
  Tiny model;
  auto report = ddp::load_pretrained(data + "/tiny_state_dict.pt", *model, torch::kCPU);
  EXPECT_EQ(report.loaded.size(), 9u) << report.summary();  // 6 parameters + 3 BN buffers
  model->eval();
  auto x = torch::arange(2 * 3 * 8 * 8, torch::kFloat).reshape({2, 3, 8, 8}) / 100.0;
  auto y = model->forward(x).flatten();
  std::ifstream f(data + "/tiny_state_dict_expected.json");
  auto expected = nlohmann::json::parse(f)["output"].get<std::vector<double>>();
  ASSERT_EQ(y.numel(), static_cast<int64_t>(expected.size()));
  for (size_t i = 0; i < expected.size(); ++i) EXPECT_NEAR(y[i].item<double>(), expected[i], 1e-5) << i;
  EXPECT_EQ(model->bn->num_batches_tracked.item<int64_t>(), 7);
}

TEST(Pretrain, SkipKeepsANewHeadAndStrictNamesTheRest) {
  const std::string path = std::string(DDP_TEST_DATA_DIR) + "/tiny_state_dict.pt";
  Tiny model;
  auto before = model->fc->weight.clone();
  auto report = ddp::load_pretrained(path, *model, torch::kCPU, "fc.*");
  EXPECT_EQ(report.skipped.size(), 2u);
  EXPECT_TRUE(torch::equal(before, model->fc->weight));
  ddp::models::ModelSpec spec;  // the CNN: nothing fits
  auto cnn = ddp::models::make_model(spec);
  try {
    ddp::load_pretrained(path, *cnn, torch::kCPU);
    FAIL();
  } catch (const ddp::UserError& e) {
    std::string m = e.what();
    EXPECT_NE(m.find("missing: "), std::string::npos) << m;
    EXPECT_NE(m.find("unexpected: "), std::string::npos) << m;
    EXPECT_NE(m.find("--pretrain-skip"), std::string::npos) << m;
  }
}

// ---- bad input: one line naming the value and the fix, exit 2, fast ----

struct BadCase {
  std::string name;
  std::vector<std::string> args;
  std::string expect;
  int code = ddp::exit_code::kUsage;
};

class BadInput : public ::testing::TestWithParam<BadCase> {};

// A case's argument "bad idx: KIND" stands for write_bad_dataset(KIND).
constexpr const char* kBadIdx = "bad idx: ";

std::string write_bad_dataset(const std::string& kind) {
  auto dir = ddp::testing::temp_dir("bad_" + kind);
  auto put = [&](const std::string& name, std::vector<uint8_t> bytes) {
    std::ofstream f(dir + "/" + name, std::ios::binary);
    f.write(reinterpret_cast<const char*>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
  };
  auto be32 = [](uint32_t v) { return std::vector<uint8_t>{uint8_t(v >> 24), uint8_t(v >> 16), uint8_t(v >> 8), uint8_t(v)}; };
  auto images = [&](uint32_t magic, uint32_t n, size_t pixels) {
    std::vector<uint8_t> b = be32(magic);
    for (uint32_t v : {n, 28u, 28u}) { auto x = be32(v); b.insert(b.end(), x.begin(), x.end()); }
    b.resize(b.size() + pixels, 7);
    return b;
  };
  auto labels = [&](uint32_t n, uint8_t value) {
    std::vector<uint8_t> b = be32(2049);
    auto x = be32(n);
    b.insert(b.end(), x.begin(), x.end());
    b.resize(b.size() + n, value);
    return b;
  };
  const bool wrong_magic = kind == "magic", truncated = kind == "truncated", bad_label = kind == "label";
  put("train-images-idx3-ubyte", images(wrong_magic ? 1234 : 2051, 10, truncated ? 100 : 10 * 784));
  put("train-labels-idx1-ubyte", labels(10, bad_label ? 12 : 1));
  put("t10k-images-idx3-ubyte", images(2051, 10, 10 * 784));
  put("t10k-labels-idx1-ubyte", labels(kind == "count" ? 9 : 10, 1));
  return dir;
}

TEST_P(BadInput, OneLineErrorAndExitCode) {
  DDP_SKIP_UNLESS_GLOO();
  const auto& c = GetParam();
  auto dir = ddp::testing::temp_dir("bad");
  std::vector<std::string> argv{DDPTRAIN_EXE, "--size", "1", "--backend", "gloo", "--epochs", "1",
                                "--train-samples", "64", "--test-samples", "64", "--save_path", dir, "--progress", "none"};
  for (const auto& a : c.args)  // the broken data sets are written here, not when the cases are listed
    argv.push_back(a.rfind(kBadIdx, 0) == 0 ? write_bad_dataset(a.substr(std::strlen(kBadIdx))) : a);
  auto r = run_process(argv, {}, 30);
  EXPECT_EQ(r.exit_code, c.code) << r.output;
  EXPECT_LT(r.seconds, 10);
  EXPECT_NE(r.output.find(c.expect), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("terminate called"), std::string::npos);
  EXPECT_EQ(r.output.find("Exception raised from"), std::string::npos) << "a stack trace leaked";
  EXPECT_EQ(r.output.find("Logging before InitGoogleLogging"), std::string::npos) << "c10's log lines leaked";
}

std::string busy_port_holder() {
  // A listening socket kept open for the whole test binary's life.
  static int fd = -1;
  static int port = 0;
  if (fd < 0) {
    fd = ::socket(AF_INET, SOCK_STREAM, 0);
    sockaddr_in a{};
    a.sin_family = AF_INET;
    a.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
    ::bind(fd, reinterpret_cast<sockaddr*>(&a), sizeof(a));
    ::listen(fd, 1);
    socklen_t len = sizeof(a);
    ::getsockname(fd, reinterpret_cast<sockaddr*>(&a), &len);
    port = ntohs(a.sin_port);
  }
  return std::to_string(port);
}

INSTANTIATE_TEST_SUITE_P(
    Cases, BadInput,
    ::testing::Values(
        BadCase{"MissingDataset", {"--dataset", "fashion-mnist", "--data_root", "/nonexistent/fm"}, "apt-get install dataset-fashion-mnist"},
        BadCase{"WrongMagic", {"--dataset", "mnist", "--data_root", kBadIdx + std::string("magic")}, "magic number 1234"},
        BadCase{"TruncatedImages", {"--dataset", "mnist", "--data_root", kBadIdx + std::string("truncated")}, "truncated"},
        BadCase{"CountsDisagree", {"--dataset", "mnist", "--data_root", kBadIdx + std::string("count")}, "t10k-labels-idx1-ubyte"},
        BadCase{"LabelOutOfRange", {"--dataset", "mnist", "--data_root", kBadIdx + std::string("label")}, "label 12"},
        BadCase{"InputTooSmallForModel", {"--dataset", "synthetic", "--model", "resnet18", "--stem", "imagenet"}, "--stem small"},
        BadCase{"ShapesDoNotMatch", {"--dataset", "synthetic", "--loss", "l1"}, "would broadcast output [64, 10] and target [64]"},
        BadCase{"NonFiniteLoss", {"--dataset", "synthetic", "--optimizer", "sgd", "--lr", "1e30", "--schedule", "constant", "--warmup-epochs", "0", "--train-samples", "640"}, "the training loss became", ddp::exit_code::kNonFinite},
        BadCase{"PortInUse", {"--dataset", "synthetic", "--port", busy_port_holder()}, "is already in use on this machine"},
        BadCase{"UnwritableSavePath", {"--dataset", "synthetic", "--save_path", "/proc/ddp_forbidden"}, "pass a writable --save_path"},
        BadCase{"CorruptCheckpoint", {"--dataset", "synthetic", "--resume", "/etc/hostname"}, "corrupt or not a ddptrain"},
        BadCase{"MissingResume", {"--dataset", "synthetic", "--resume", "/nonexistent/epoch_3.pt"}, "--resume /nonexistent/epoch_3.pt does not exist."},
        BadCase{"CorruptPretrain", {"--dataset", "synthetic", "--pretrain", "/etc/hostname"}, "--pretrain /etc/hostname is neither a ddptrain checkpoint nor a PyTorch"},
        BadCase{"MismatchedPretrain", {"--dataset", "synthetic", "--pretrain", std::string(DDP_TEST_DATA_DIR) + "/tiny_state_dict.pt"}, "does not fit the model"},
        BadCase{"MnistWithoutDataRoot", {"--dataset", "mnist"}, "--dataset mnist needs --data_root"},
        BadCase{"SubsetOfImageFolder", {"--dataset", "imagefolder", "--data_root", "/nonexistent/images"},
                "--train-samples and --test-samples do not apply to --dataset imagefolder"},
        BadCase{"ValRootWithoutImageFolder", {"--dataset", "synthetic", "--val-root", "/nonexistent/val"},
                "--image-size and --val-root apply to --dataset imagefolder and shards only"},
        BadCase{"ValSplitLeavesNoTraining", {"--dataset", "synthetic", "--train-samples", "10", "--val-split", "0.99"},
                "--val-split 0.99 of the 10 samples of synthetic (train) leaves no training sample."},
        BadCase{"ShardStreamsWithoutShards", {"--dataset", "synthetic", "--shard-streams", "4"},
                "--shard-streams, --shuffle-buffer and --skip-bad-samples apply to --dataset shards only"},
        BadCase{"LargestBatchInTraining", {"--dataset", "synthetic", "--largest-batch"},
                "--largest-batch searches the batch size for `ddptrain bench`"},
        BadCase{"SkipBadSamplesWithoutShards", {"--dataset", "synthetic", "--skip-bad-samples"},
                "--shard-streams, --shuffle-buffer and --skip-bad-samples apply to --dataset shards only"},
        BadCase{"CpuDecodeShareWithoutImageFolder", {"--dataset", "synthetic", "--cpu-decode-share", "0.3"},
                "--cpu-decode-share apply to --dataset imagefolder and shards only"},
        BadCase{"CpuDecodeShareWithCpuDecoding",
                {"--dataset", "imagefolder", "--image-decode", "cpu", "--cpu-decode-share", "0.3"},
                "--cpu-decode-share splits the decoding between the CPU and nvJPEG"},
        BadCase{"MomentumWithAdamw", {"--dataset", "synthetic", "--optimizer", "adamw", "--momentum", "0.5"},
                "--momentum applies to --optimizer sgd only"},
        BadCase{"PretrainSkipWithoutPretrain", {"--dataset", "synthetic", "--pretrain-skip", "fc.*"},
                "--pretrain-skip needs --pretrain"},
        BadCase{"RescheduleWithoutResume", {"--dataset", "synthetic", "--reschedule"}, "--reschedule needs --resume"},
        BadCase{"TwoStopRules", {"--dataset", "synthetic", "--stop-at", "test_acc=0.5", "--stop-at-acc", "0.5"},
                "--stop-at and --stop-at-acc"},
        BadCase{"SyntheticWithDataRoot", {"--dataset", "synthetic", "--data_root", "/tmp"}, "--dataset synthetic makes its own data"},
        BadCase{"WarmupLongerThanRun", {"--dataset", "synthetic", "--warmup-epochs", "5"},
                "--warmup-epochs 5 is longer than the run"},
        BadCase{"StopAtWithoutDirection", {"--dataset", "synthetic", "--stop-at", "test_loss=0.1"},
                "--stop-at test_loss<=0.1 or --stop-at test_loss>=0.1"},
        BadCase{"ZeroBatch", {"--batch", "0"}, "--batch must be positive, got 0."},
        BadCase{"NegativeEpochs", {"--epochs", "-2"}, "--epochs must be positive, got -2."},
        BadCase{"ZeroLr", {"--lr", "0"}, "--lr must be positive, got 0."}),
    [](const auto& info) { return info.param.name; });

}  // namespace
