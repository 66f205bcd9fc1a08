// Process and filesystem helpers for tests.
#include "support/testing.h"

#include "ddp/dist/world.h"
#include "ddp/error.h"

#include <nlohmann/json.hpp>

#include <fcntl.h>
#include <zlib.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdio>
#include <random>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <sstream>
#include <thread>

namespace ddp::testing {

ProcessResult run_process(const std::vector<std::string>& argv,
                          const std::map<std::string, std::string>& env, double timeout_seconds) {
  ProcessResult r;
  auto t0 = std::chrono::steady_clock::now();
  char tmpl[] = "/tmp/ddp_test_outXXXXXX";
  int fd = mkstemp(tmpl);
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(fd, 1);
    dup2(fd, 2);
    for (const auto& [k, v] : env) {
      if (v.empty()) unsetenv(k.c_str());
      else setenv(k.c_str(), v.c_str(), 1);
    }
    std::vector<char*> a;
    for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execvp(a[0], a.data());
    _exit(127);
  }
  int st = 0;
  bool done = false;
  while (!done) {
    pid_t w = waitpid(pid, &st, WNOHANG);
    if (w == pid) { done = true; break; }
    double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (el > timeout_seconds) {
      kill(-pid, SIGKILL);
      waitpid(pid, &st, 0);
      done = true;
      r.output = "[test harness: killed after timeout]\n";
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  // Whatever the process group left behind goes too.
  kill(-pid, SIGKILL);
  r.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  close(fd);
  r.output += read_file(tmpl);
  unlink(tmpl);
  return r;
}

Child start_process(const std::vector<std::string>& argv, const std::map<std::string, std::string>& env) {
  Child c;
  char tmpl[] = "/tmp/ddp_test_childXXXXXX";
  int fd = mkstemp(tmpl);
  c.log = tmpl;
  pid_t pid = fork();
  if (pid == 0) {
    setpgid(0, 0);
    dup2(fd, 1);
    dup2(fd, 2);
    for (const auto& [k, v] : env) setenv(k.c_str(), v.c_str(), 1);
    std::vector<char*> a;
    for (const auto& s : argv) a.push_back(const_cast<char*>(s.c_str()));
    a.push_back(nullptr);
    execvp(a[0], a.data());
    _exit(127);
  }
  close(fd);
  c.pid = pid;
  return c;
}

ProcessResult finish_process(Child& c, double timeout_seconds) {
  ProcessResult r;
  auto t0 = std::chrono::steady_clock::now();
  int st = 0;
  while (true) {
    if (waitpid(c.pid, &st, WNOHANG) == c.pid) break;
    if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_seconds) {
      kill(-c.pid, SIGKILL);
      waitpid(c.pid, &st, 0);
      r.output = "[test harness: killed after timeout]\n";
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  kill(-c.pid, SIGKILL);
  r.exit_code = WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st);
  r.output += read_file(c.log);
  unlink(c.log.c_str());
  return r;
}

bool wait_for_output(const Child& c, const std::string& text, double timeout_seconds) {
  auto t0 = std::chrono::steady_clock::now();
  while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_seconds) {
    if (read_file(c.log).find(text) != std::string::npos) return true;
    if (kill(c.pid, 0) != 0) return false;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

namespace {
// Every temp_dir() of this test process. After the last test, gtest tears
// this environment down: the directories go when every test passed, and
// stay, each named on stderr, when one failed (its files are the evidence).
class TempDirs : public ::testing::Environment {
 public:
  void add(const std::string& dir) {
    std::lock_guard<std::mutex> lock(mutex_);
    dirs_.push_back(dir);
  }
  void TearDown() override {
    std::lock_guard<std::mutex> lock(mutex_);
    const bool passed = ::testing::UnitTest::GetInstance()->Passed();
    for (const auto& d : dirs_) {
      if (passed) {
        std::error_code ec;
        std::filesystem::remove_all(d, ec);
      } else {
        std::fprintf(stderr, "[test harness: kept %s]\n", d.c_str());
      }
    }
    dirs_.clear();
  }

 private:
  std::mutex mutex_;
  std::vector<std::string> dirs_;
};
// gtest owns it; registered before main() so that it is torn down after
// the tests, whichever of them made directories.
TempDirs* const g_temp_dirs = static_cast<TempDirs*>(::testing::AddGlobalTestEnvironment(new TempDirs));
}  // namespace

std::string temp_dir(const std::string& tag) {
  auto base = std::filesystem::temp_directory_path() /
              ("ddp_" + tag + "_" + std::to_string(getpid()) + "_" +
               std::to_string(std::chrono::steady_clock::now().time_since_epoch().count()));
  std::filesystem::create_directories(base);
  g_temp_dirs->add(base.string());
  return base.string();
}

std::string fashion_mnist_root() {
  const char* over = std::getenv("DDP_FASHION_MNIST");
  std::string root = over ? over : "/usr/share/datasets/fashion-mnist";
  return std::filesystem::exists(root + "/train-images-idx3-ubyte.gz") ||
                 std::filesystem::exists(root + "/train-images-idx3-ubyte")
             ? root
             : "";
}

std::string read_file(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) return "";
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string find_file(const std::string& dir, const std::string& name) {
  for (const auto& e : std::filesystem::recursive_directory_iterator(dir))
    if (e.path().filename() == name) return e.path().string();
  return "";
}

std::vector<nlohmann::json> metrics_jsonl(const std::string& dir) {
  std::vector<nlohmann::json> out;
  std::ifstream f(find_file(dir, "metrics.jsonl"));
  for (std::string line; std::getline(f, line);)
    if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  return out;
}

std::vector<nlohmann::json> metrics_under(const std::string& save_path) {
  std::vector<nlohmann::json> out;
  if (!std::filesystem::exists(save_path)) return out;
  for (const auto& e : std::filesystem::recursive_directory_iterator(save_path)) {
    if (e.path().filename() != "metrics.jsonl") continue;
    std::ifstream f(e.path());
    for (std::string line; std::getline(f, line);)
      if (!line.empty()) out.push_back(nlohmann::json::parse(line));
  }
  return out;
}

std::string only_run_dir(const std::string& save_path) {
  std::vector<std::string> dirs;
  for (const auto& e : std::filesystem::directory_iterator(save_path))
    if (e.is_directory()) dirs.push_back(e.path().string());
  EXPECT_EQ(dirs.size(), 1u) << "run directories under " << save_path;
  return dirs.size() == 1 ? dirs[0] : "";
}

const ddp::data::ImageTensorDataset& as_images(const ddp::data::DatasetPtr& d) {
  const auto* p = dynamic_cast<const ddp::data::ImageTensorDataset*>(d.get());
  EXPECT_NE(p, nullptr) << "not an in-memory image dataset";
  if (!p) throw std::runtime_error("as_images: not an ImageTensorDataset");
  return *p;
}

size_t count(const std::string& text, const std::string& what) {
  size_t n = 0;
  for (size_t p = text.find(what); p != std::string::npos; p = text.find(what, p + 1)) ++n;
  return n;
}

std::unique_ptr<ddp::World> one_rank_world(bool cuda) {
  ddp::Placement p;
  ddp::WorldOptions o;
  o.use_cuda = cuda;
  if (cuda) o.backend = "nccl";
  return std::make_unique<ddp::World>(p, o);
}

std::string user_error(const std::function<void()>& f) {
  try {
    f();
  } catch (const ddp::UserError& e) {
    return e.what();
  } catch (const std::exception& e) {
    ADD_FAILURE() << "expected a UserError, got: " << e.what();
    return "";
  }
  ADD_FAILURE() << "expected a UserError, nothing was thrown";
  return "";
}

ddp::Config parse_args(std::vector<std::string> args) {
  args.insert(args.begin(), "ddptrain");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return ddp::parse_cli(static_cast<int>(argv.size()), argv.data());
}

void write_sales_csvs(const std::string& dir, int train_rows, int test_rows) {
  std::filesystem::create_directories(dir);
  std::mt19937_64 random(12345);
  auto uniform = [&] { return static_cast<double>(random() >> 11) * 0x1.0p-53; };
  auto normal = [&] { return std::sqrt(-2.0 * std::log(1.0 - uniform())) * std::cos(6.283185307179586 * uniform()); };
  for (const auto& [name, rows] : {std::pair<std::string, int>{"train.csv", train_rows}, {"test.csv", test_rows}}) {
    std::FILE* f = std::fopen((dir + "/" + name).c_str(), "w");
    if (!f) throw std::runtime_error("cannot write " + dir + "/" + name);
    std::fprintf(f, "x0,x1,x2,x3,x4,x5,x6,x7,store,sales\n");
    for (int r = 0; r < rows; ++r) {
      double x[8];
      for (double& v : x) v = normal();
      const int store = static_cast<int>(random() % 12);
      const double sales = 2 + 1.5 * x[0] - x[1] + 0.5 * x[2] * x[3] + std::sin(2 * x[4]) + 0.3 * x[5] +
                           0.8 * (store % 4 - 1.5) + 0.1 * normal();
      for (double v : x) std::fprintf(f, "%.6g,", v);
      std::fprintf(f, "%d,%.6g\n", store, sales);
    }
    std::fclose(f);
  }
}

void write_mnist_like(const std::string& dir, int n_train, int n_test, unsigned seed, bool gz) {
  std::filesystem::create_directories(dir);
  auto put = [&](const std::string& name, const std::string& bytes) {
    const std::string path = dir + "/" + name + (gz ? ".gz" : "");
    if (!gz) {
      std::ofstream(path, std::ios::binary) << bytes;
      return;
    }
    gzFile f = gzopen(path.c_str(), "wb");
    if (!f || gzwrite(f, bytes.data(), static_cast<unsigned>(bytes.size())) != static_cast<int>(bytes.size()))
      throw std::runtime_error("cannot write " + path);
    gzclose(f);
  };
  auto be32 = [](uint32_t v) { return std::string{char(v >> 24), char(v >> 16), char(v >> 8), char(v)}; };
  for (const auto& [prefix, n] : {std::pair<std::string, int>{"train", n_train}, {"t10k", n_test}}) {
    // A stream per split: the same seed gives the same test split beside
    // training sets of any size.
    std::seed_seq seeds{seed, prefix == "train" ? 0u : 1u};
    std::mt19937 random(seeds);
    std::string images = be32(2051) + be32(n) + be32(28) + be32(28), labels = be32(2049) + be32(n);
    for (int i = 0; i < n * 784; ++i) images += static_cast<char>(random() & 0xff);
    for (int i = 0; i < n; ++i) labels += static_cast<char>(random() % 10);
    put(prefix + "-images-idx3-ubyte", images);
    put(prefix + "-labels-idx1-ubyte", labels);
  }
}

}  // namespace ddp::testing
