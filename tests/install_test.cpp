// The installed package: `cmake --install` into a fresh prefix, then the
// template, copied out of the source tree, is configured and built against
// that prefix alone (find_package(ddptrain) + ddp::ddp) and trains.
#include <algorithm>
#include <cctype>
#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "support/testing.h"

namespace fs = std::filesystem;

namespace {

using ddp::testing::read_file;
using ddp::testing::run_process;

// Text files under `dir` (CMake files, headers, build files) that mention `needle`.
// True if `text` names the directory `dir` itself or a path below it: an
// occurrence not followed by more of a file name. (A plain substring search
// took the compiler's temporary files, /tmp/ccXXXXXX.s in CMake's logs, for
// mentions of a tree checked out at /tmp/cc.)
bool mentions_dir(const std::string& text, const std::string& dir) {
  for (size_t p = text.find(dir); p != std::string::npos; p = text.find(dir, p + 1)) {
    const size_t end = p + dir.size();
    if (end == text.size()) return true;
    const char c = text[end];
    if (!(std::isalnum(static_cast<unsigned char>(c)) || c == '_' || c == '-' || c == '.')) return true;
  }
  return false;
}

std::vector<std::string> files_mentioning(const std::string& dir, const std::string& needle) {
  std::vector<std::string> out;
  for (const auto& e : fs::recursive_directory_iterator(dir)) {
    if (!e.is_regular_file()) continue;
    const std::string text = read_file(e.path().string());
    if (text.find('\0') != std::string::npos) continue;  // libraries, binaries, object files
    if (mentions_dir(text, needle)) out.push_back(e.path().string());
  }
  return out;
}

TEST(Install, MentionsDirMatchesWholePathsOnly) {
  EXPECT_TRUE(mentions_dir("-I/tmp/cc/include -O2", "/tmp/cc"));
  EXPECT_TRUE(mentions_dir("source: /tmp/cc", "/tmp/cc"));
  EXPECT_TRUE(mentions_dir("\"/tmp/cc\"", "/tmp/cc"));
  EXPECT_FALSE(mentions_dir("as -o /tmp/ccq3Xz1.o /tmp/ccq3Xz1.s", "/tmp/cc"));
  EXPECT_FALSE(mentions_dir("/tmp/cc.d /tmp/cc-old /tmp/cc_x", "/tmp/cc"));
}

std::string joined(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += "  " + x + "\n";
  return s;
}

TEST(Install, InstalledPackageBuildsAndTrainsTheTemplateAndTheExamples) {
  DDP_SKIP_UNLESS_GLOO();
  const std::string root = ddp::testing::temp_dir("install");
  const std::string prefix = root + "/prefix", src = root + "/my_training", build = root + "/build";

  auto inst = run_process({"cmake", "--install", DDP_BINARY_DIR, "--prefix", prefix}, {}, 300);
  ASSERT_EQ(inst.exit_code, 0) << inst.output;
  const std::string cmake_dir = prefix + "/lib/cmake/ddptrain";
  for (const std::string f : {"/include/ddp/app.h", "/include/ddp/dist/world.h", "/include/ddp/data/dataset.h",
                              "/include/ddp/models/net.h", "/lib/libddp.a", "/bin/ddptrain",
                              "/lib/cmake/ddptrain/ddptrainConfig.cmake",
                              "/lib/cmake/ddptrain/ddptrainConfigVersion.cmake",
                              "/lib/cmake/ddptrain/ddptrainTargets.cmake"})
    EXPECT_TRUE(fs::exists(prefix + f)) << f << " not installed\n" << inst.output;

  // The config finds what libddp links, and nothing installed points back
  // into the source or build tree.
  const std::string config = read_file(cmake_dir + "/ddptrainConfig.cmake");
  for (const std::string dep : {"Torch", "Threads", "ZLIB"})
    EXPECT_NE(config.find(dep), std::string::npos) << dep << " missing from\n" << config;
  EXPECT_NE(config.find("find_dependency"), std::string::npos) << config;
  EXPECT_EQ(files_mentioning(prefix, DDP_SOURCE_DIR), std::vector<std::string>{})
      << "installed files mention the source tree " << DDP_SOURCE_DIR << ":\n"
      << joined(files_mentioning(prefix, DDP_SOURCE_DIR));
  EXPECT_EQ(files_mentioning(prefix, DDP_BINARY_DIR), std::vector<std::string>{})
      << "installed files mention the build tree " << DDP_BINARY_DIR;

  auto help = run_process({prefix + "/bin/ddptrain", "--help"}, {}, 60);
  EXPECT_EQ(help.exit_code, 0) << help.output;
  EXPECT_NE(help.output.find("--nnodes"), std::string::npos) << help.output;

  // The template as a user would have it: a copy, outside ddptrain's tree.
  fs::copy(std::string(DDP_SOURCE_DIR) + "/template", src, fs::copy_options::recursive);
  // No build type given: the template builds optimised on its own.
  std::vector<std::string> configure{"cmake", "-S", src, "-B", build, "-Dddptrain_DIR=" + cmake_dir,
                                     std::string("-DTorch_DIR=") + DDP_TORCH_DIR};
  if (run_process({"ninja", "--version"}, {}, 30).exit_code == 0) configure.insert(configure.end(), {"-G", "Ninja"});
  // ccache hits across runs although the temp dir changes: paths below the
  // base dir are hashed relative to it.
  const bool ccache = run_process({"ccache", "--version"}, {}, 30).exit_code == 0;
  if (ccache) configure.push_back("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache");
  auto cfg = run_process(configure, {}, 300);
  ASSERT_EQ(cfg.exit_code, 0) << cfg.output;
  const std::string cache = read_file(build + "/CMakeCache.txt");
  const size_t entry = cache.find("\nddptrain_DIR:");
  ASSERT_NE(entry, std::string::npos);
  EXPECT_EQ(cache.substr(cache.find('=', entry) + 1, cmake_dir.size() + 1), cmake_dir + "\n");
  EXPECT_NE(cache.find("\nCMAKE_BUILD_TYPE:STRING=Release\n"), std::string::npos) << "the template builds Release";
  auto make = run_process({"cmake", "--build", build, "-j", "2"}, {{"CCACHE_BASEDIR", root}}, 600);
  ASSERT_EQ(make.exit_code, 0) << make.output;
  // Headers and library came from the prefix: the build files never name
  // ddptrain's source or build tree.
  EXPECT_EQ(files_mentioning(build, DDP_SOURCE_DIR), std::vector<std::string>{});
  EXPECT_EQ(files_mentioning(build, DDP_BINARY_DIR), std::vector<std::string>{});

  const std::string out = root + "/runs";
  auto r = run_process({build + "/train", "--size", "1", "--backend", "gloo", "--epochs", "1", "--train-samples",
                        "2000", "--test-samples", "500", "--val-split", "0.2", "--save_path", out, "--progress", "plain",
                        "--ema", "0.9"},
                       {}, 300);
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("data: my-dataset"), std::string::npos) << r.output;
  // The program is the user's: its name and description open its --help.
  auto own_help = run_process({build + "/train", "--help"}, {}, 60);
  EXPECT_EQ(own_help.output.rfind("train: ", 0), 0u) << own_help.output;
  EXPECT_EQ(own_help.output.find("\n  --model "), std::string::npos) << own_help.output;
  std::vector<nlohmann::json> metrics;
  for (const auto& e : fs::recursive_directory_iterator(out))
    if (e.path().filename() == "metrics.jsonl") {
      std::ifstream f(e.path());
      std::string line;
      while (std::getline(f, line))
        if (!line.empty()) metrics.push_back(nlohmann::json::parse(line));
    }
  ASSERT_EQ(metrics.size(), 1u) << r.output;
  // --val-split: validation (400 of the 2000) chooses; test is evaluated on best.pt at the end.
  EXPECT_GT(metrics[0]["val_acc"].get<double>(), 0.5) << r.output;  // MyDataset is learnable; chance is 0.1
  EXPECT_EQ(metrics[0]["monitor"], "val_acc") << r.output;
  const auto test = nlohmann::json::parse(ddp::testing::read_file(ddp::testing::find_file(out, "test.json")));
  EXPECT_GT(test["test_acc"].get<double>(), 0.5) << r.output;
  // predict through the template's own predict_step, on 2 ranks, with the
  // weights' average (--ema): every test sample once, the columns named.
  std::string best;
  for (const auto& e : fs::recursive_directory_iterator(out))
    if (e.path().filename() == "best.pt") best = e.path().string();
  auto pr = run_process({build + "/train", "predict", "--checkpoint", best, "--out", root + "/preds.csv", "--size", "2",
                         "--backend", "gloo"},
                        {}, 300);
  ASSERT_EQ(pr.exit_code, 0) << pr.output;
  const std::string preds = read_file(root + "/preds.csv");
  EXPECT_EQ(preds.substr(0, preds.find('\n')),
            "class,prob_0,prob_1,prob_2,prob_3,prob_4,prob_5,prob_6,prob_7,prob_8,prob_9");
  EXPECT_EQ(std::count(preds.begin(), preds.end(), '\n'), 501) << "a header and the 500 test samples";
  // The examples, built against the same prefix, each train one short epoch.
  const std::string ex_build = root + "/examples_build";
  std::vector<std::string> ex_configure{"cmake", "-S", std::string(DDP_SOURCE_DIR) + "/examples", "-B", ex_build,
                                        "-DCMAKE_BUILD_TYPE=Release", "-Dddptrain_DIR=" + cmake_dir,
                                        std::string("-DTorch_DIR=") + DDP_TORCH_DIR};
  if (ccache) ex_configure.push_back("-DCMAKE_CXX_COMPILER_LAUNCHER=ccache");
  auto ex_cfg = run_process(ex_configure, {}, 300);
  ASSERT_EQ(ex_cfg.exit_code, 0) << ex_cfg.output;
  auto ex_make = run_process({"cmake", "--build", ex_build, "-j", "2"}, {{"CCACHE_BASEDIR", DDP_SOURCE_DIR}}, 900);
  ASSERT_EQ(ex_make.exit_code, 0) << ex_make.output;
  EXPECT_EQ(files_mentioning(ex_build, DDP_BINARY_DIR), std::vector<std::string>{});
  for (const std::string example : {"regression", "two_inputs"}) {
    auto run = run_process({ex_build + "/" + example, "--size", "1", "--backend", "gloo", "--epochs", "1",
                            "--train-samples", "512", "--test-samples", "128", "--save_path", root + "/ex_" + example,
                            "--progress", "none"},
                           {}, 300);
    EXPECT_EQ(run.exit_code, 0) << example << "\n" << run.output;
  }
  // examples/tabular on its CSV, with a validation split: test on best.pt at the end.
  ddp::testing::write_sales_csvs(root + "/sales", 600, 150);
  auto tabular = run_process({ex_build + "/tabular", "--size", "1", "--backend", "gloo", "--epochs", "1", "--data_root",
                              root + "/sales", "--val-split", "0.2", "--save_path", root + "/ex_tabular", "--progress",
                              "none"},
                             {}, 300);
  EXPECT_EQ(tabular.exit_code, 0) << tabular.output;
  EXPECT_NE(tabular.output.find("test on best.pt (epoch 1):  test_mae"), std::string::npos) << tabular.output;
  auto own = run_process({ex_build + "/own_loop", root}, {}, 600);
  EXPECT_EQ(own.exit_code, 0) << own.output;
  EXPECT_NE(own.output.find("epoch 2  test_acc"), std::string::npos) << own.output;
  EXPECT_TRUE(fs::exists(root + "/own_loop_last.pt"));

  std::printf("install %.1f s, configure %.1f s, build %.1f s (ccache %s), train %.1f s, val_acc %.3f, test_acc %.3f\n",
              inst.seconds, cfg.seconds, make.seconds, ccache ? "on" : "off", r.seconds,
              metrics[0]["val_acc"].get<double>(), test["test_acc"].get<double>());
}

// The unity build's switches (CMakeLists.txt; the README's build paragraph
// names -DDDP_UNITY_BUILD=OFF): off, the library's files compile one at a
// time; on, in batches of DDP_UNITY_BATCH; DDP_UNITY_BATCH=0, in one batch.
// CMake writes the batches' sources when it configures, so configuring is
// enough to see them: the library's files each batch includes.
std::vector<std::vector<std::string>> unity_batches(const std::string& tag, const std::string& flag) {
  const std::string build = ddp::testing::temp_dir(tag);
  const auto cfg = run_process({"cmake", "-S", DDP_SOURCE_DIR, "-B", build, "-DDDP_BUILD_TESTS=OFF",
                                std::string("-DTorch_DIR=") + DDP_TORCH_DIR, flag},
                               {}, 300);
  EXPECT_EQ(cfg.exit_code, 0) << cfg.output;
  std::vector<std::vector<std::string>> batches;
  const auto dir = build + "/CMakeFiles/ddp.dir/Unity";
  if (!fs::exists(dir)) return batches;
  for (const auto& e : fs::directory_iterator(dir)) {
    std::vector<std::string> files;
    std::istringstream lines(read_file(e.path().string()));
    for (std::string line; std::getline(lines, line);)
      if (line.rfind("#include \"", 0) == 0) files.push_back(line.substr(10, line.size() - 11));
    batches.push_back(files);
  }
  return batches;
}

TEST(Build, UnityBatchesFollowTheirOptions) {
  EXPECT_TRUE(unity_batches("unity_off", "-DDDP_UNITY_BUILD=OFF").empty());
  const auto eights = unity_batches("unity_on", "-DDDP_UNITY_BATCH=8");
  const auto one = unity_batches("unity_one", "-DDDP_UNITY_BATCH=0");
  ASSERT_GE(eights.size(), 2u);
  std::set<std::string> all;
  for (const auto& batch : eights) {
    EXPECT_LE(batch.size(), 8u);
    all.insert(batch.begin(), batch.end());
  }
  EXPECT_GE(all.size(), 40u);  // the library's .cpp files, less any with flags of their own
  ASSERT_EQ(one.size(), 1u);
  EXPECT_EQ(std::set<std::string>(one[0].begin(), one[0].end()), all);
}

}  // namespace
