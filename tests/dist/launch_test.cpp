// The launcher with real processes: stopping a job by signal keeps its
// checkpoint, and a job's rendezvous store is its own.
#include <dirent.h>
#include <signal.h>
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <thread>

#include "ddp/dist/launch.h"
#include "ddp/error.h"
#include "ddp/io/checkpoint.h"
#include "ddp/io/torch_pickle.h"
#include "ddp/models/registry.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::run_process;

std::vector<std::string> train_args(const std::string& save_path, std::vector<std::string> extra) {
  std::vector<std::string> a{DDPTRAIN_EXE, "--save_path", save_path, "--progress", "plain", "--timeout", "60",
                             "--backend", "gloo", "--dataset", "synthetic", "--size", "2"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

using ddp::testing::find_file;

// The processes whose parent is `pid` (read from /proc).
std::vector<pid_t> children_of(pid_t pid) {
  std::vector<pid_t> out;
  for (const auto& e : fs::directory_iterator("/proc")) {
    const std::string name = e.path().filename().string();
    if (name.find_first_not_of("0123456789") != std::string::npos) continue;
    std::string stat = ddp::testing::read_file(e.path().string() + "/stat");
    // "pid (comm) state ppid ...": comm may hold spaces, so parse after ')'.
    const auto close = stat.rfind(')');
    if (close == std::string::npos) continue;
    std::istringstream in(stat.substr(close + 1));
    std::string state;
    pid_t ppid = 0;
    in >> state >> ppid;
    if (ppid == pid) out.push_back(static_cast<pid_t>(std::stoi(name)));
  }
  return out;
}

// Rank 1 ends with exit 75 at once, rank 0 is still writing its checkpoint:
// the launcher must not take rank 1's exit for a failure and stop rank 0.
TEST(Launcher, PreemptedRankLetsTheOthersFinish) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("preempt_exit");
  auto r = run_process({DDP_TESTWORKER, "--launch", "2", "preempt", dir}, {}, 60);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kPreempted) << r.output;
  EXPECT_TRUE(fs::exists(dir + "/rank0_done")) << "rank 0 was stopped before it finished\n" << r.output;
  EXPECT_EQ(r.output.find("stopping the other ranks"), std::string::npos) << r.output;
}

// Bad input that only rank 1 meets (a corrupt sample in its shard, say):
// rank 0 fails first, in the collective rank 1 left, while rank 1 holds its
// message back for rank 0's. The user must read rank 1's error, once, and
// nothing of rank 0's failure, a mere consequence; exit 2; no launcher line
// blames rank 0, and no restart runs (it would fail alike; the injected
// failure would not, so a restart shows as exit 0).
TEST(Launcher, BadInputOnOneRankIsTheErrorPrinted) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("rank1_bad_input");
  auto r = run_process(train_args(dir, {"--model", "cnn", "--epochs", "1", "--train-samples", "640", "--test-samples",
                                        "64", "--max-restarts", "1", "--inject-fault", "1:2:user"}),
                       {}, 120);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  const std::string error = "injected bad input (--inject-fault) on rank 1 at step 2";
  const auto at = r.output.find(error);
  EXPECT_NE(at, std::string::npos) << r.output;
  if (at != std::string::npos) {
    EXPECT_EQ(r.output.find(error, at + 1), std::string::npos) << "printed twice:\n" << r.output;
  }
  EXPECT_EQ(r.output.find("rank 0 exited"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("worker failed"), std::string::npos) << r.output;
  EXPECT_EQ(r.output.find("collective"), std::string::npos) << "rank 0's consequence was printed:\n" << r.output;
  EXPECT_EQ(r.output.find("restart 1 of"), std::string::npos) << r.output;
}

// Under torchrun's variables the ranks exist already: ddptrain's launcher
// flags were ignored, saved with the run, and obeyed by a later plain
// --resume (which waited for a node that never came). Refused at once.
TEST(Launcher, OwnLauncherFlagsUnderTorchrunAreRefused) {
  const std::string port = std::to_string(ddp::find_free_port());
  const std::map<std::string, std::string> torchrun{{"RANK", "0"},          {"WORLD_SIZE", "1"},
                                                    {"LOCAL_RANK", "0"},    {"LOCAL_WORLD_SIZE", "1"},
                                                    {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", port}};
  for (const auto& [flags, what] : std::vector<std::pair<std::vector<std::string>, std::string>>{
           {{"--size", "4"}, "--size 4 asks ddptrain to start its own ranks"},
           {{"--nnodes", "2"}, "--nnodes 2 does not apply"},
           {{"--max-restarts", "3"}, "--max-restarts restarts ddptrain's own ranks"}}) {
    auto dir = ddp::testing::temp_dir("torchrun_flags");
    std::vector<std::string> args{DDPTRAIN_EXE, "--save_path", dir, "--dataset", "synthetic", "--epochs", "1",
                                  "--train-samples", "64", "--test-samples", "64", "--backend", "gloo"};
    args.insert(args.end(), flags.begin(), flags.end());
    auto r = run_process(args, torchrun, 60);
    EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
    EXPECT_NE(r.output.find(what), std::string::npos) << r.output;
    EXPECT_NE(r.output.find("torchrun (rank 0 of 1"), std::string::npos) << r.output;
    EXPECT_TRUE(fs::is_empty(dir)) << "a run was started";
  }
}

// Starts a 2-rank job, sends its launcher SIGTERM `seconds` after the job
// printed its start (by then every rank is in its loop: a rank still setting
// up has nothing to save and would end at once), and waits for its end.
ddp::testing::ProcessResult sigterm_while_training(const std::string& dir, std::vector<std::string> flags,
                                                   int seconds) {
  auto child = ddp::testing::start_process(train_args(dir, std::move(flags)));
  if (!ddp::testing::wait_for_output(child, "world: ")) ADD_FAILURE() << "training never started";
  std::this_thread::sleep_for(std::chrono::seconds(seconds));
  kill(child.pid, SIGTERM);
  return ddp::testing::finish_process(child, 240);
}

// A stop near an epoch's end (agreed at its last step, during its
// validation or after its checkpoint): the ranks stop with a checkpoint
// that is complete and loadable, and that a resume finds. Epochs of one
// step make every stop land there.
TEST(Preempt, StopNearAnEpochsEndKeepsACompleteCheckpoint) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("epoch_stop");
  // resnet18 makes rank 0's save take long enough that a peer which does not
  // wait for it exits first.
  auto r = sigterm_while_training(dir, {"--model", "resnet18", "--log-every", "100000", "--epochs", "20", "--batch",
                                        "16", "--train-samples", "32", "--test-samples", "32"},
                                  2);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kPreempted) << r.output;
  EXPECT_NE(r.output.find("stopped by a signal "), std::string::npos) << r.output;
  const auto path = ddp::find_latest_checkpoint(dir);
  ASSERT_FALSE(path.empty()) << r.output;
  // After an epoch's end, that epoch's checkpoint; before, preempt.pt.
  const std::string said = "stopped by a signal after epoch ";
  const auto at = r.output.find(said);
  if (at != std::string::npos)
    EXPECT_EQ(fs::path(path).filename().string(), "epoch_" + std::to_string(std::stoi(r.output.substr(at + said.size()))) + ".pt");
  else
    EXPECT_EQ(fs::path(path).filename().string(), "preempt.pt");
  ddp::models::ModelSpec spec;
  spec.name = "resnet18";
  spec.in_channels = 1;
  spec.input_hw = {28, 28};
  spec.num_classes = 10;
  auto model = ddp::models::make_model(spec);
  EXPECT_NO_THROW(ddp::load_checkpoint(path, *model, nullptr, torch::kCPU, "")) << path;
}

// Before training there is nothing to save, so a stop signal ends the
// process at once: a rank waiting in the rendezvous for a peer that never
// comes once ignored SIGTERM and Ctrl-C until --timeout (here 120 s) passed.
TEST(Preempt, SignalDuringRendezvousStopsAtOnce) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("stop_rendezvous");
  const std::map<std::string, std::string> torchrun{
      {"RANK", "0"}, {"WORLD_SIZE", "2"}, {"LOCAL_RANK", "0"}, {"LOCAL_WORLD_SIZE", "2"},
      {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", std::to_string(ddp::find_free_port())}};
  auto child = ddp::testing::start_process({DDPTRAIN_EXE, "--save_path", dir, "--dataset", "synthetic", "--backend",
                                            "gloo", "--timeout", "120", "--progress", "plain"},
                                           torchrun);
  std::this_thread::sleep_for(std::chrono::seconds(3));  // now waiting for rank 1
  kill(child.pid, SIGTERM);
  auto r = ddp::testing::finish_process(child, 30);  // far below --timeout
  EXPECT_EQ(r.exit_code, 128 + SIGTERM) << r.output;
  EXPECT_TRUE(fs::is_empty(dir)) << r.output;
}

// Between display points a stop still comes within seconds: with
// --log-every far past the epoch's end, SIGTERM once waited for the epoch
// to end (165 s in a review's run; Slurm's KillWait is 30 s). The ranks
// agree on it at checks about 2 s of steps apart, stop mid-epoch, and save.
// (No clock here: stopping mid-epoch is the observable difference.)
TEST(Preempt, StopComesWithinSecondsBetweenDisplayPoints) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("stop_between");
  // resnet18 at batch 16: a few steps a second per rank here, 60 steps an epoch.
  auto r = sigterm_while_training(dir, {"--model", "resnet18", "--log-every", "100000", "--epochs", "1", "--batch",
                                        "16", "--train-samples", "1920", "--test-samples", "32"},
                                  4);
  // Mid-epoch, not at its end (which, the epoch being the run's last, would
  // have finished the run with exit 0).
  EXPECT_EQ(r.exit_code, ddp::exit_code::kPreempted) << r.output;
  EXPECT_NE(r.output.find("stopped by a signal at step"), std::string::npos) << r.output;
  EXPECT_FALSE(find_file(dir, "preempt.pt").empty()) << r.output;
}

// ddp_testworker's slow_validation on 2 ranks: the built-in CNN on 32
// synthetic samples, 2 epochs, and a test split of 320 (20 validation
// batches a rank), whose validation_step sleeps `ms` a batch in the
// validation before training ("sanity") or in the epochs' ("epoch").
std::vector<std::string> slow_validation_args(const std::string& dir, int ms, const std::string& where,
                                              std::vector<std::string> extra = {}) {
  std::vector<std::string> a{DDP_TESTWORKER, "--launch", "2", "slow_validation", dir, std::to_string(ms), where,
                             "--dataset", "synthetic", "--model", "cnn", "--epochs", "2", "--batch", "4",
                             "--train-samples", "32", "--test-samples", "320", "--workers", "0", "--timeout", "60",
                             "--sanity-val-steps", where == "sanity" ? "20" : "0"};
  a.insert(a.end(), extra.begin(), extra.end());
  return a;
}

// Starts `args`, sends its launcher SIGTERM once a slow validation began,
// and measures how long preempt.pt took to appear after the signal (-1:
// never, before the job ended).
std::pair<ddp::testing::ProcessResult, double> sigterm_during_slow_validation(const std::string& dir,
                                                                              const std::vector<std::string>& args) {
  auto child = ddp::testing::start_process(args);
  if (!ddp::testing::wait_for_output(child, "slow validation begins")) ADD_FAILURE() << "validation never began";
  const auto signalled = std::chrono::steady_clock::now();
  kill(child.pid, SIGTERM);
  double seconds = -1;
  while (seconds < 0 && kill(child.pid, 0) == 0 &&
         std::chrono::steady_clock::now() - signalled < std::chrono::seconds(120)) {
    if (!find_file(dir, "preempt.pt").empty())
      seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - signalled).count();
    else
      std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  auto r = ddp::testing::finish_process(child, 120);
  if (seconds < 0 && !find_file(dir, "preempt.pt").empty()) seconds = r.seconds;  // written as the job ended
  return {r, seconds};
}

// The model's tensors of a checkpoint.
std::map<std::string, torch::Tensor> model_of(const std::string& checkpoint) {
  std::map<std::string, torch::Tensor> out;
  for (auto& [name, t] : ddp::read_state_dict(checkpoint, [](const std::string& n) { return n.rfind("model/", 0) == 0; }))
    out[name] = t;
  return out;
}

// A stop signal during validation (20 batches of 1 s a rank here, as a
// large test split on a slow model would be) once waited for all of it, and
// then for a training step: past Slurm's KillWait of 30 s on a real test
// set. The ranks agree on it inside validation, save preempt.pt within
// seconds and exit 75; the resumed run validates that epoch and ends where
// a run without the stop does, bit for bit.
TEST(Preempt, SignalDuringValidationSavesWithinSecondsAndResumesExactly) {
  DDP_SKIP_UNLESS_GLOO();
  auto straight = ddp::testing::temp_dir("val_straight"), stopped = ddp::testing::temp_dir("val_stopped");
  auto s = run_process(slow_validation_args(straight, 0, "epoch"), {}, 180);
  ASSERT_EQ(s.exit_code, 0) << s.output;

  auto [r, seconds] = sigterm_during_slow_validation(stopped, slow_validation_args(stopped, 1000, "epoch"));
  EXPECT_EQ(r.exit_code, ddp::exit_code::kPreempted) << r.output;
  const auto preempt = find_file(stopped, "preempt.pt");
  ASSERT_FALSE(preempt.empty()) << r.output;
  EXPECT_GE(seconds, 0) << r.output;
  EXPECT_LT(seconds, 6) << "preempt.pt came " << seconds << " s after the signal\n" << r.output;
  const auto meta = ddp::read_checkpoint_meta(preempt);
  EXPECT_EQ(meta.state.epoch, 0);  // epoch 1 trained, not yet validated
  EXPECT_GT(meta.state.batch_in_epoch, 0);

  const std::string run_dir = fs::path(preempt).parent_path().string();
  auto resumed = run_process(slow_validation_args(stopped, 0, "epoch", {"--resume", run_dir}), {}, 180);
  ASSERT_EQ(resumed.exit_code, 0) << resumed.output;
  const auto want = model_of(find_file(straight, "epoch_2.pt")), got = model_of(find_file(stopped, "epoch_2.pt"));
  ASSERT_FALSE(want.empty());
  ASSERT_EQ(want.size(), got.size());
  for (const auto& [name, t] : want) {
    ASSERT_TRUE(got.count(name)) << name;
    EXPECT_TRUE(torch::equal(t, got.at(name))) << name << " differs after the resume";
  }
  auto epochs = [](const std::string& dir) {
    std::vector<std::string> out;  // train_loss and test_acc per epoch
    for (const auto& m : ddp::testing::metrics_under(dir))
      out.push_back(m.value("train_loss", nlohmann::json()).dump() + " " + m.value("test_acc", nlohmann::json()).dump());
    return out;
  };
  EXPECT_EQ(epochs(straight), epochs(stopped));
}

// The same for the validation before training (--sanity-val-steps): the
// stop saves the run as it starts, and exits 75.
TEST(Preempt, SignalDuringSanityValidationSavesWithinSeconds) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("sanity_stopped");
  auto [r, seconds] = sigterm_during_slow_validation(dir, slow_validation_args(dir, 1000, "sanity"));
  EXPECT_EQ(r.exit_code, ddp::exit_code::kPreempted) << r.output;
  const auto preempt = find_file(dir, "preempt.pt");
  ASSERT_FALSE(preempt.empty()) << r.output;
  EXPECT_GE(seconds, 0) << r.output;
  EXPECT_LT(seconds, 6) << "preempt.pt came " << seconds << " s after the signal\n" << r.output;
  EXPECT_EQ(ddp::read_checkpoint_meta(preempt).state.step, 0);
}

// `pkill -TERM ddptrain`, `systemctl stop` or Slurm signal the launcher and
// every worker at once; the launcher forwards its copy too. A worker must
// take that as one request: checkpoint and exit 75.
TEST(Preempt, SignalToEveryProcessOfTheJobStillCheckpoints) {
  DDP_SKIP_UNLESS_GLOO();
  auto dir = ddp::testing::temp_dir("signal_all");
  auto child = ddp::testing::start_process(
      train_args(dir, {"--model", "cnn", "--log-every", "5", "--epochs", "2", "--train-samples", "3000",
                       "--test-samples", "500"}));
  ASSERT_TRUE(ddp::testing::wait_for_output(child, "epoch 1/2 step 10/")) << "training never started";
  const auto workers = children_of(child.pid);
  ASSERT_EQ(workers.size(), 2u);
  // Workers first, so that the launcher's forwarded copy is each worker's
  // second signal.
  for (pid_t w : workers) kill(w, SIGTERM);
  kill(child.pid, SIGTERM);
  auto r = ddp::testing::finish_process(child, 120);
  EXPECT_EQ(r.exit_code, ddp::exit_code::kPreempted) << r.output;
  EXPECT_FALSE(find_file(dir, "preempt.pt").empty()) << r.output;
}

// A port that nothing listens on now (the tests own the race).
int unused_port() { return ddp::find_free_port(); }

// A second job on the port of a running one fails at once, in one line that
// names the port; the first job is not disturbed.
TEST(Rendezvous, SecondJobOnABusyPortFailsInOneLine) {
  DDP_SKIP_UNLESS_GLOO();
  const std::string port = std::to_string(unused_port());
  auto dir1 = ddp::testing::temp_dir("job1"), dir2 = ddp::testing::temp_dir("job2");
  auto first = ddp::testing::start_process(train_args(
      dir1, {"--port", port, "--model", "cnn", "--epochs", "2", "--train-samples", "2000", "--test-samples", "200"}));
  ASSERT_TRUE(ddp::testing::wait_for_output(first, "world: ")) << "the first job never started";
  auto second = run_process(train_args(
      dir2, {"--port", port, "--model", "cnn", "--epochs", "1", "--train-samples", "200", "--test-samples", "50"}), {},
      60);
  EXPECT_EQ(second.exit_code, ddp::exit_code::kUsage) << second.output;
  EXPECT_LT(second.seconds, 20) << second.output;
  int lines = 0;
  std::istringstream in(second.output);
  for (std::string line; std::getline(in, line);)
    if (!line.empty()) ++lines;
  EXPECT_EQ(lines, 1) << second.output;
  EXPECT_NE(second.output.find("port " + port), std::string::npos) << second.output;
  auto r1 = ddp::testing::finish_process(first, 240);
  EXPECT_EQ(r1.exit_code, 0) << r1.output;
}

// A process that connects to the job's store and writes the keys the ranks
// read (here the string that rank 0 shares, as it shares the resume path)
// must not reach the ranks: the job's keys live under its secret prefix.
TEST(Rendezvous, ForeignKeysDoNotReachTheRanks) {
  DDP_SKIP_UNLESS_GLOO();
  const int port = unused_port();
  auto dir = ddp::testing::temp_dir("foreign");
  auto job = ddp::testing::start_process({DDP_TESTWORKER, "--launch", "2", "share", dir},
                                         {{"DDP_TEST_PORT", std::to_string(port)}});
  c10d::TCPStoreOptions so;
  so.port = static_cast<uint16_t>(port);
  so.isServer = false;
  so.waitWorkers = false;
  so.timeout = std::chrono::seconds(30);
  auto store = c10::make_intrusive<c10d::TCPStore>("127.0.0.1", so);
  const std::string evil = "/tmp/not-the-job's-checkpoint";
  for (const std::string key : {"ddp/share/resume/0", "ddp/attempt0/ddp/share/resume/0"})
    store->set(key, std::vector<uint8_t>(evil.begin(), evil.end()));
  auto r = ddp::testing::finish_process(job, 60);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  for (int rank = 0; rank < 2; ++rank)
    EXPECT_EQ(ddp::testing::read_file(dir + "/share_rank" + std::to_string(rank) + ".txt"), "from rank 0")
        << "rank " << rank;
}

}  // namespace
