// The flag table: parsing, --help, validation and the printed config.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <tuple>
#include <map>
#include <regex>
#include <set>
#include <sstream>

#include "ddp/cli.h"
#include "ddp/train/task.h"
#include "ddp/compat.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

using ddp::testing::parse_args;

std::string error_of(std::vector<std::string> args) {
  try {
    parse_args(std::move(args));
  } catch (const ddp::UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Cli, SeedFlagsKeepTheirNames) {
  auto c = parse_args({"--port", "29501", "--size", "2", "--visible", "0,1", "--address", "10.0.0.1", "--epochs", "7",
                  "--batch", "16", "--pretrain", "w.pt", "--save_path", "/tmp/x", "--save_epoch", "2",
                  "--data_root", "/data/fm"});
  EXPECT_EQ(c.port, 29501);
  EXPECT_EQ(c.size, 2);
  EXPECT_EQ(c.visible, "0,1");
  EXPECT_EQ(c.address, "10.0.0.1");
  EXPECT_EQ(c.epochs, 7);
  EXPECT_EQ(c.batch, 16);
  EXPECT_EQ(c.pretrain, "w.pt");
  EXPECT_EQ(c.save_path, "/tmp/x");
  EXPECT_EQ(c.save_epoch, 2);
  EXPECT_EQ(c.data_root, "/data/fm");  // a path, not an int as in the seed
  EXPECT_TRUE(c.was_given("data_root"));
  EXPECT_FALSE(c.was_given("lr"));
}

TEST(Cli, OptimizerDefaultsAreResolved) {
  auto sgd = parse_args({"--optimizer", "sgd"});
  EXPECT_DOUBLE_EQ(sgd.lr, 0.1);
  EXPECT_DOUBLE_EQ(sgd.weight_decay, 5e-4);
  auto adamw = parse_args({});
  EXPECT_EQ(adamw.optimizer, "adamw");
  EXPECT_GT(adamw.lr, 0);
  EXPECT_DOUBLE_EQ(parse_args({"--lr", "0.5"}).lr, 0.5);
}

TEST(Cli, UnknownFlagAndWrongTypeAreClearErrors) {
  auto e = error_of({"--bogus", "1"});
  EXPECT_NE(e.find("--bogus"), std::string::npos) << e;
  EXPECT_NE(e.find("--help"), std::string::npos) << e;
  e = error_of({"--epochs", "three"});
  EXPECT_NE(e.find("three"), std::string::npos) << e;
  e = error_of({"--optimizer", "lbfgs"});
  EXPECT_NE(e.find("lbfgs"), std::string::npos) << e;
}

// --ce-kernel: --task lm's fused cross-entropy (auto, the default: one pass
// in training), its two-pass form, or LibTorch's (native), for A/B timing.
TEST(Cli, CeKernelIsAutoTwoPassOrNative) {
  EXPECT_EQ(ddp::testing::parse_args({}).ce_kernel, "auto");
  EXPECT_EQ(ddp::testing::parse_args({"--ce-kernel", "native"}).ce_kernel, "native");
  EXPECT_EQ(ddp::testing::parse_args({"--ce-kernel", "two-pass"}).ce_kernel, "two-pass");
  auto e = error_of({"--ce-kernel", "fused"});
  EXPECT_NE(e.find("fused"), std::string::npos) << e;
}

// The fused residual add + LayerNorm is on unless --ln-kernel native: on the
// H200 it gave config (e) the same validation loss, 3.2 ms a step sooner.
TEST(Cli, LnKernelIsAutoOrNative) {
  EXPECT_EQ(ddp::testing::parse_args({}).ln_kernel, "auto");
  EXPECT_EQ(ddp::testing::parse_args({"--ln-kernel", "native"}).ln_kernel, "native");
  auto e = error_of({"--ln-kernel", "fused"});
  EXPECT_NE(e.find("fused"), std::string::npos) << e;
}

// The fused bias gradients are on unless --linear-kernel native: on the H200
// they gave config (e) the same validation loss (2.636 against 2.633), 1 ms
// a step sooner.
TEST(Cli, LinearKernelIsAutoOrNative) {
  EXPECT_EQ(ddp::testing::parse_args({}).linear_kernel, "auto");
  EXPECT_EQ(ddp::testing::parse_args({"--linear-kernel", "auto"}).linear_kernel, "auto");
  auto e = error_of({"--linear-kernel", "fused"});
  EXPECT_NE(e.find("fused"), std::string::npos) << e;
}

// The side stream is auto unless asked: on for ddptrain's GPT on one GPU
// (SideStream.AutoIsOnForDdptrainsGptAlone_CUDA tests what each value does).
TEST(Cli, SideStreamIsAutoOnOrOff) {
  EXPECT_EQ(ddp::testing::parse_args({}).side_stream, "auto");
  EXPECT_EQ(ddp::testing::parse_args({"--side-stream", "off"}).side_stream, "off");
  EXPECT_EQ(ddp::testing::parse_args({"--side-stream", "on"}).side_stream, "on");
  auto e = error_of({"--side-stream", "yes"});
  EXPECT_NE(e.find("yes"), std::string::npos) << e;
}

// --cpu-decode-share is a share: outside [0, 1] it is an error naming the value.
TEST(Cli, CpuDecodeShareIsAShare) {
  EXPECT_EQ(ddp::testing::parse_args({}).cpu_decode_share, 1.0);  // the loader's threads decode every crop
  EXPECT_EQ(ddp::testing::parse_args({"--cpu-decode-share", "0.3"}).cpu_decode_share, 0.3);
  for (const char* bad : {"1.5", "-0.1"}) {
    auto e = error_of({"--cpu-decode-share", bad});
    EXPECT_NE(e.find("--cpu-decode-share must be in [0, 1]"), std::string::npos) << e;
  }
}

TEST(Cli, ImpossibleValuesNameTheFlagAndValue) {
  for (auto [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--batch", "0"}, {"--batch", "-4"}, {"--epochs", "0"}, {"--epochs", "-1"}, {"--lr", "0"}, {"--lr", "-0.1"}}) {
    auto e = error_of({flag, value});
    EXPECT_NE(e.find(flag + " must be positive, got " + value + "."), std::string::npos) << e;
    EXPECT_NE(e.find("Hint"), std::string::npos) << e;
  }
}

// --inject-fault (for tests of restarts) takes RANK:STEP[:segv|user|term]
// and nothing else: a typo must not run a job without its fault.
TEST(Cli, InjectFaultIsRankStepAndAKind) {
  for (const char* good : {"0:5", "3:12:segv", "1:2:user", "0:20:term"})
    EXPECT_EQ(parse_args({"--inject-fault", good}).inject_fault, good);
  for (const char* bad : {"5", "a:b", "-1:3", "0:-2", "0:3:kill", "0:3:term:x", "0:3x"}) {
    auto e = error_of({"--inject-fault", bad});
    EXPECT_NE(e.find(std::string("--inject-fault '") + bad + "' is not RANK:STEP"), std::string::npos) << e;
  }
}

// Values that pass a sign check but cannot be meant: infinities (--lr inf
// trained NaN weights into best.pt), a timeout no collective layer takes,
// and negative weight decay or momentum (accepted silently before).
TEST(Cli, InfiniteAndNegativeValuesAreRefused) {
  for (auto [flag, value, what] : std::vector<std::tuple<std::string, std::string, std::string>>{
           {"--lr", "inf", "--lr must be finite, got inf."},
           {"--timeout", "inf", "--timeout must be finite, got inf."},
           {"--timeout", "1e300", "--timeout must be at most"},
           {"--clip-grad-norm", "inf", "--clip-grad-norm must be finite"},
           {"--weight-decay", "-5", "--weight-decay must be 0 or positive, got -5"},
           {"--weight-decay", "-1", "--weight-decay must be 0 or positive, got -1"},
           {"--weight-decay", "inf", "--weight-decay must be finite"}}) {
    auto e = error_of({flag, value});
    EXPECT_NE(e.find(what), std::string::npos) << flag << " " << value << ": " << e;
  }
  auto e = error_of({"--optimizer", "sgd", "--momentum", "-3"});
  EXPECT_NE(e.find("--momentum must be in [0, 1), got -3"), std::string::npos) << e;
  e = error_of({"--optimizer", "sgd", "--momentum", "1"});
  EXPECT_NE(e.find("--momentum must be in [0, 1), got 1"), std::string::npos) << e;
  EXPECT_EQ(ddp::testing::parse_args({"--weight-decay", "0"}).weight_decay, 0.0);
  EXPECT_EQ(ddp::testing::parse_args({"--optimizer", "sgd", "--momentum", "0"}).momentum, 0.0);
}

TEST(Cli, HelpListsEveryFlagOfTheTable) {
  auto r = ddp::testing::run_process({DDPTRAIN_EXE, "--help"});
  EXPECT_EQ(r.exit_code, 0);
  ddp::Config c;
  for (const auto& f : ddp::flag_table(c)) {
    const std::string first = f.names.substr(0, f.names.find(','));
    EXPECT_NE(r.output.find(first), std::string::npos) << first << " missing from --help";
  }
}

TEST(Cli, PrintedConfigHasEveryKey) {
  auto c = parse_args({"--epochs", "2"});
  std::ostringstream os;
  ddp::print_config(c, os);
  auto j = ddp::config_to_json(c);
  for (const auto& f : ddp::flag_table(c)) {
    EXPECT_NE(os.str().find(f.key()), std::string::npos) << f.key();
    EXPECT_TRUE(j.contains(f.key())) << f.key();
  }
  EXPECT_EQ(j["epochs"], 2);
}

std::string write_config(const std::string& tag, const std::string& text) {
  const auto path = ddp::testing::temp_dir(tag) + "/run.toml";
  std::ofstream(path) << text;
  return path;
}

TEST(Cli, ConfigFileRepeatsTheResolvedConfig) {
  // Strings with commas, globs, spaces and quotes; doubles that print long.
  for (const auto& flags : std::vector<std::vector<std::string>>{
           {},
           {"--optimizer", "sgd", "--visible", "0,1", "--pretrain", "/tmp/w.pt", "--pretrain-skip", "fc.*", "--warmup-epochs", "0.3",
            "--lr", "0.07", "--save_path", "/tmp/my runs/it's here", "--timeout", "1e-3", "--epochs", "9",
            "--node-rank", "1", "--nnodes", "2", "--resume", "auto", "--label-smoothing", "0.1"}}) {
    const auto c = parse_args(flags);
    const auto toml = ddp::config_to_toml(c);
    const auto again = parse_args({"--config", write_config("cfg_roundtrip", toml)});
    EXPECT_EQ(ddp::config_to_json(again), ddp::config_to_json(c)) << toml;
    // A value from the file counts as given where it is not the default:
    // a run's config.toml lists every flag, and the defaults in it must not
    // read as the user's (a task that ignores --label-smoothing would refuse
    // its own config.toml otherwise).
    EXPECT_EQ(again.was_given("epochs"), c.epochs != 3);
    EXPECT_EQ(again.was_given("label-smoothing"), c.label_smoothing != 0);
    EXPECT_FALSE(again.was_given("seed"));
  }
}

TEST(Cli, CommandLineOverridesTheConfigFile) {
  const auto file = write_config("cfg_override", "# a comment\nepochs = 5\nbatch = 16\noptimizer = 'sgd'\ndata_root = \"/data/x\"\n");
  for (const auto& args : std::vector<std::vector<std::string>>{{"--config", file, "--epochs", "2"},
                                                                {"--epochs", "2", "--config", file}}) {
    const auto c = parse_args(args);
    EXPECT_EQ(c.epochs, 2);             // the command line wins
    EXPECT_EQ(c.batch, 16);             // the file fills in the rest
    EXPECT_EQ(c.data_root, "/data/x");
    EXPECT_DOUBLE_EQ(c.lr, 0.1);        // defaults follow the file's optimizer
    EXPECT_EQ(c.seed, 0);               // and untouched flags keep theirs
    EXPECT_TRUE(c.was_given("batch"));
    EXPECT_FALSE(c.was_given("seed"));
  }
}

TEST(Cli, UnknownOrBadConfigKeysAreOneLineErrors) {
  const auto file = write_config("cfg_unknown", "epochs = 2\nlearning_rate = 0.1\n");
  auto e = error_of({"--config", file});
  EXPECT_NE(e.find("unknown key 'learning_rate'"), std::string::npos) << e;
  EXPECT_NE(e.find(file), std::string::npos) << e;
  EXPECT_NE(e.find("Hint"), std::string::npos) << e;
  EXPECT_EQ(e.find('\n'), std::string::npos) << e;
  e = error_of({"--config", write_config("cfg_bad_value", "optimizer = 'lbfgs'\n")});
  EXPECT_NE(e.find("lbfgs"), std::string::npos) << e;
  e = error_of({"--config", write_config("cfg_bad_number", "epochs = -1\n")});
  EXPECT_NE(e.find("--epochs must be positive, got -1."), std::string::npos) << e;
}

TEST(Cli, MissingConfigFileIsAnError) {
  const auto missing = ddp::testing::temp_dir("cfg_missing") + "/nope.toml";
  const auto e = error_of({"--config", missing});
  EXPECT_NE(e.find("'" + missing + "'"), std::string::npos) << e;
  EXPECT_NE(e.find("Hint"), std::string::npos) << e;
  // And from the real binary: one line, usage exit code.
  const auto r = ddp::testing::run_process({DDPTRAIN_EXE, "--config", missing});
  EXPECT_EQ(r.exit_code, 2) << r.output;
  EXPECT_EQ(std::count(r.output.begin(), r.output.end(), '\n'), 1) << r.output;
}

}  // namespace

namespace {

bool contains(const std::string& text, const std::string& what) { return text.find(what) != std::string::npos; }

TEST(Cli, MistypedFlagSuggestsTheNearest) {
  auto e = error_of({"--epoch", "1"});
  EXPECT_TRUE(contains(e, "unknown flag '--epoch'.")) << e;
  EXPECT_TRUE(contains(e, "did you mean --epochs?")) << e;
  e = error_of({"--lerning-rate=0.1"});
  EXPECT_TRUE(contains(e, "unknown flag '--lerning-rate'")) << e;
  e = error_of({"--optimiser", "sgd"});
  EXPECT_TRUE(contains(e, "did you mean --optimizer?")) << e;
  e = error_of({"--warmup_epoch", "1"});
  EXPECT_TRUE(contains(e, "did you mean --warmup-epochs?")) << e;
  // Nothing close: no suggestion, still the way to the list.
  e = error_of({"--frobnicate", "1"});
  EXPECT_FALSE(contains(e, "did you mean")) << e;
  EXPECT_TRUE(contains(e, "ddptrain --help")) << e;
}

// The names Lightning, torchrun and timm users type point to ddptrain's
// (suggested, not accepted); a program's own task is not offered the flags
// it does not read (--loss-scal: not --loss, which it would refuse).
TEST(Cli, KinNamesOfOtherToolsSuggestDdptrainsFlag) {
  for (const auto& [kin, ours] : std::vector<std::pair<std::string, std::string>>{
           {"--max-epochs", "--epochs"}, {"--max_epochs", "--epochs"}, {"--precision", "--amp"},
           {"--gradient-clip-val", "--clip-grad-norm"}, {"--accumulate-grad-batches", "--accum-steps"},
           {"--nproc-per-node", "--size"}, {"--lr-schedule", "--schedule"}, {"--grad-checkpointing", "--recompute"}}) {
    const auto e = error_of({kin, "1"});
    EXPECT_TRUE(contains(e, "unknown flag '" + kin + "'.")) << e;
    EXPECT_TRUE(contains(e, "did you mean " + ours + "?")) << kin << ": " << e;
  }
  ddp::Config own;
  own.program.name = "train";
  own.program.unread_flags = {"task", "loss", "label-smoothing", "model", "stem"};
  own.add_flag("--loss-scale", "the program's own flag", 1.0);
  auto error_of_own = [&](std::vector<std::string> args) {
    std::vector<const char*> argv{"train"};
    for (const auto& a : args) argv.push_back(a.c_str());
    try {
      ddp::parse_cli(static_cast<int>(argv.size()), argv.data(), own);
    } catch (const ddp::UserError& e) {
      return std::string(e.what());
    }
    return std::string();
  };
  auto e = error_of_own({"--loss-scal", "2"});
  EXPECT_TRUE(contains(e, "did you mean --loss-scale?")) << e;
  e = error_of_own({"--mdoel", "x"});
  EXPECT_FALSE(contains(e, "--model?")) << e;
  e = error_of({"--mdoel", "x"});
  EXPECT_TRUE(contains(e, "did you mean --model?")) << "ddptrain reads --model: " << e;
}

TEST(Cli, MistypedConfigKeySuggestsTheNearest) {
  const auto e = error_of({"--config", write_config("cfg_typo", "epoch = 2\n")});
  EXPECT_TRUE(contains(e, "unknown key 'epoch'")) << e;
  EXPECT_TRUE(contains(e, "did you mean epochs?")) << e;
}

// The table's values as command-line words: the resolved defaults, so that
// validation passes; "x" for empty strings.
std::vector<std::pair<ddp::Flag, std::string>> flags_with_a_value() {
  static ddp::Config defaults = parse_args({});
  const auto j = ddp::config_to_json(defaults);
  std::vector<std::pair<ddp::Flag, std::string>> out;
  for (const auto& f : ddp::flag_table(defaults)) {
    const auto& v = j[f.key()];
    std::string word = v.is_string() ? v.get<std::string>() : v.dump();
    if (word.empty())
      word = f.key() == "stop-at"        ? "test_acc=0.9"
             : f.key() == "inject-fault" ? "0:1"
             : f.key() == "monitor"      ? "test_loss:min"
                                         : "x";
    out.push_back({f, word});
  }
  return out;
}

TEST(Cli, UnderscoresAndDashesAreAlikeInEveryFlagAndKey) {
  // Flags that mean nothing without another one come with it.
  const std::map<std::string, std::pair<std::string, std::string>> companion = {
      {"pretrain-skip", {"pretrain", "x.pt"}}, {"reschedule", {"resume", "auto"}}, {"momentum", {"optimizer", "sgd"}}};
  for (const auto& [f, word] : flags_with_a_value()) {
    for (char from : {'-', '_'}) {
      std::string name = f.names.substr(2, f.names.find(',') - 2);
      std::replace(name.begin(), name.end(), from, from == '-' ? '_' : '-');
      const bool is_bool = std::holds_alternative<bool*>(f.target);
      auto flag_args = is_bool ? std::vector<std::string>{"--" + name} : std::vector<std::string>{"--" + name, word};
      std::string extra_key;
      if (auto it = companion.find(f.key()); it != companion.end()) {
        flag_args.insert(flag_args.end(), {"--" + it->second.first, it->second.second});
        extra_key = it->second.first + " = '" + it->second.second + "'\n";
      }
      EXPECT_EQ(error_of(flag_args), "") << "--" << name;
      const auto file = write_config("cfg_spelling", name + " = " + (is_bool ? std::string("true") : "'" + word + "'") + "\n" + extra_key);
      EXPECT_EQ(error_of({"--config", file}), "") << "config key " << name;
    }
  }
  EXPECT_EQ(parse_args({"--train_samples", "12"}).train_samples, 12);
  EXPECT_EQ(parse_args({"--config", write_config("cfg_us", "train_samples = 34\n")}).train_samples, 34);
  EXPECT_TRUE(parse_args({"--train_samples", "12"}).was_given("train-samples"));
}

TEST(Cli, TomlSectionsOfFlagGroupsWork) {
  const auto c = parse_args({"--config", write_config("cfg_sections", "epochs = 4\n[train]\nbatch = 16\n[data]\ntrain_samples = 100\n"
                                                                  "[optimisation]\nlr = 0.5\n[distributed]\nnnodes = 1\n")});
  EXPECT_EQ(c.epochs, 4);
  EXPECT_EQ(c.batch, 16);
  EXPECT_EQ(c.train_samples, 100);
  EXPECT_DOUBLE_EQ(c.lr, 0.5);
  const auto e = error_of({"--config", write_config("cfg_bad_section", "[trian]\nepochs = 2\n")});
  EXPECT_TRUE(contains(e, "section [trian]")) << e;
  EXPECT_TRUE(contains(e, "[data]")) << e;
  EXPECT_FALSE(contains(e, "++")) << e;
}

TEST(Cli, HelpIsGroupedAndListsSubcommandsAndSchedules) {
  const auto r = ddp::testing::run_process({DDPTRAIN_EXE, "--help"});
  EXPECT_EQ(r.exit_code, 0);
  size_t last = 0;
  for (const char* group : {"\ndata:", "\nmodel:", "\noptimisation:", "\ndistributed:", "\noutput:"}) {
    const size_t at = r.output.find(group);
    ASSERT_NE(at, std::string::npos) << group << " missing:\n" << r.output;
    EXPECT_GT(at, last) << group << " out of order";
    last = at;
  }
  for (const char* sub : {"ddptrain report RUN_DIR", "ddptrain export CHECKPOINT", "ddptrain doctor", "ddptrain bench"})
    EXPECT_TRUE(contains(r.output, sub)) << sub;
  for (const char* formula : {"constant ", "step ", "cosine ", "onecycle ", "OneCycleLR", "peak/25/1e4", "(1 + cos(pi"})
    EXPECT_TRUE(contains(r.output, formula)) << formula;
  // A task's own flags are listed with the task, and the plain help says how.
  EXPECT_TRUE(contains(r.output, "ddptrain --task lm --help")) << r.output;
  EXPECT_FALSE(contains(r.output, "--layers"));
  const auto lm = ddp::testing::run_process({DDPTRAIN_EXE, "--task", "lm", "--help"});
  EXPECT_EQ(lm.exit_code, 0);
  EXPECT_TRUE(contains(lm.output, "--layers")) << lm.output;
}

TEST(Cli, VersionNamesDdptrainLibTorchCudaAndNccl) {
  const auto r = ddp::testing::run_process({DDPTRAIN_EXE, "--version"});
  EXPECT_EQ(r.exit_code, 0) << r.output;
  EXPECT_TRUE(contains(r.output, "ddptrain 0.")) << r.output;
  EXPECT_TRUE(contains(r.output, "LibTorch " + ddp::compat::torch_version())) << r.output;
  if (torch::cuda::is_available()) {
    EXPECT_TRUE(contains(r.output, "CUDA ")) << r.output;
    EXPECT_TRUE(contains(r.output, "NCCL ")) << r.output;
  } else {
    EXPECT_TRUE(contains(r.output, "CUDA") || contains(r.output, "CPU only")) << r.output;
  }
}

// Every "--flag value" that ddptrain's messages and help suggest is one the
// parser takes: read the string literals of the sources, find each flag
// followed by something that looks like a value (a number, a path, or a word
// that is a value of some flag, such as false or gloo), and parse it.
TEST(Cli, EveryHintNamesAValueTheParserAccepts) {
  namespace fs = std::filesystem;
  const std::regex literal(R"re("((?:[^"\\\n]|\\.)*)")re");
  // A value runs to a space, comma, colon, ... but a colon inside it joins
  // its parts (--inject-fault 1:30).
  const std::regex flag_value(R"re(--([a-z][a-z0-9_-]+)(=|\s)?([^\s,;:)'"\]\\]*(?::[^\s,;:)'"\]\\]+)*))re");
  const std::regex number(R"re(-?[0-9.][0-9.eE+-]*(,[0-9]+)*)re");
  // Flags of other programs that messages mention (apt-get, torchrun, ctest, cmake).
  const std::set<std::string> others = {"reinstall", "nproc-per-node", "nproc_per_node", "rdzv-id", "no-python", "test-dir",
                                        "no_python", "redirects", "tee",  // torchrun's, in the resume command it prints
                                        "output-on-failure", "build", "target", "tests",
                                        "logdir",       // tensorboard's
                                        "aux-weight",   // the example task flag in cli.h's comments
                                        "prompt", "tokens", "temperature", "top-k", "logits-out",  // generate's
                                        "shard-mb", "shard-samples"};  // the shards subcommand's
  // The built-in tasks' own flags (--task lm's --context, ...) count as flags.
  ddp::Config c = ddp::builtin_task_flags();
  std::map<std::string, ddp::Flag> flags;
  std::set<std::string> value_words = {"true", "false", "yes", "no"};
  for (const auto& f : ddp::flag_table(c)) {
    std::stringstream names(f.names);
    std::string name;
    while (std::getline(names, name, ',')) flags.emplace(name.substr(2), f);
    value_words.insert(f.choices.begin(), f.choices.end());
  }
  int checked = 0;
  for (const char* dir : {"/src", "/include", "/apps"})
    for (const auto& e : fs::recursive_directory_iterator(std::string(DDP_SOURCE_DIR) + dir)) {
      if (!e.is_regular_file()) continue;
      const std::string text = ddp::testing::read_file(e.path().string());
      for (std::sregex_iterator l(text.begin(), text.end(), literal), end; l != end; ++l) {
        const std::string s = (*l)[1];
        for (std::sregex_iterator m(s.begin(), s.end(), flag_value); m != end; ++m) {
          const std::string name = (*m)[1], sep = (*m)[2];
          std::string value = (*m)[3];
          while (!value.empty() && value.back() == '.') value.pop_back();
          const std::string where = e.path().filename().string() + ": \"" + s + "\"";
          if (name == "config" || name == "help" || name == "version" || others.count(name)) continue;
          const auto f = flags.find(name);
          if (f == flags.end()) {
            ADD_FAILURE() << "--" << name << " is no flag, in " << where;
            continue;
          }
          const bool is_bool = std::holds_alternative<bool*>(f->second.target);
          const bool numeric = std::holds_alternative<int*>(f->second.target) ||
                               std::holds_alternative<double*>(f->second.target);
          const bool looks_like_value =
              std::regex_match(value, number) ||
              (!numeric && (value_words.count(value) || value.find(':') != std::string::npos ||
                           (!value.empty() && (value[0] == '/' || value[0] == '.'))));
          if (sep.empty() || !looks_like_value || (is_bool && sep != "=")) continue;
          ++checked;
          auto args = sep == "=" ? std::vector<std::string>{"--" + name + "=" + value}
                                       : std::vector<std::string>{"--" + name, value};
          args.insert(args.begin(), "ddptrain");
          std::vector<const char*> argv;
          for (auto& a : args) argv.push_back(a.c_str());
          std::string error;
          try {
            ddp::parse_cli(static_cast<int>(argv.size()), argv.data(), ddp::builtin_task_flags());
          } catch (const ddp::UserError& e) {
            error = e.what();
          }
          EXPECT_EQ(error, "") << "the hint '--" << name << sep << value << "' does not parse, in " << where;
        }
      }
    }
  EXPECT_GE(checked, 10);  // the scan finds the hints
}

}  // namespace

// --resume restores the run's saved flags; flags that leave the job the
// same may be given, the others are refused all at once.
namespace resume {

nlohmann::json saved_run() {
  auto c = parse_args({"--epochs", "2", "--train-samples", "12000", "--lr", "0.01", "--optimizer", "sgd", "--seed", "4",
                  "--save_epoch", "1", "--batch", "32", "--size", "2"});
  return ddp::config_to_json(c);
}

TEST(CliResume, RestoresTheSavedFlags) {
  auto c = ddp::resumed_config(parse_args({"--resume", "auto"}), saved_run(), "run/epoch_1.pt");
  EXPECT_EQ(c.epochs, 2);
  EXPECT_EQ(c.train_samples, 12000);
  EXPECT_EQ(c.optimizer, "sgd");
  EXPECT_DOUBLE_EQ(c.lr, 0.01);
  EXPECT_EQ(c.seed, 4);
  EXPECT_EQ(c.save_epoch, 1);
  EXPECT_EQ(c.batch, 32);
  EXPECT_EQ(c.resume, "auto");
  // The run's own values count as given (they were), except --batch, which
  // the trainer derives from the global batch.
  EXPECT_TRUE(c.was_given("train-samples"));
  EXPECT_TRUE(c.was_given("seed"));
  EXPECT_FALSE(c.was_given("batch"));
  EXPECT_FALSE(c.was_given("model"));  // the default, in the run too
}

// Placement and output paths are never restored from a checkpoint: a
// header is data, and one from elsewhere must not make the job connect
// out, start ranks or write a file (OnResume::kNotRestored). On main a
// header's --nnodes 2 --address made a plain `--resume` join a job there.
TEST(CliResume, PlacementAndOutputPathsAreNeverRestored) {
  auto hostile = ddp::config_to_json(parse_args(
      {"--port", "29611", "--nnodes", "2", "--node-rank", "1", "--address", "10.0.0.1", "--size", "3", "--visible",
       "5", "--backend", "nccl", "--timeout", "7", "--max-restarts", "4", "--profile-trace", "/etc/passwd",
       "--save_path", "/somewhere/else", "--epochs", "2"}));
  auto c = ddp::resumed_config(parse_args({"--resume", "auto"}), hostile, "run/epoch_1.pt");
  const ddp::Config plain;
  EXPECT_EQ(c.port, plain.port);
  EXPECT_EQ(c.nnodes, 1);
  EXPECT_EQ(c.node_rank, 0);
  EXPECT_EQ(c.address, plain.address);
  EXPECT_EQ(c.size, plain.size);
  EXPECT_EQ(c.visible, "");
  EXPECT_EQ(c.backend, "auto");
  EXPECT_EQ(c.timeout, plain.timeout);
  EXPECT_EQ(c.max_restarts, 0);
  EXPECT_EQ(c.profile_trace, "");
  EXPECT_EQ(c.save_path, plain.save_path);
  for (const char* key : {"port", "nnodes", "node-rank", "address", "size", "visible", "backend", "timeout",
                          "max-restarts", "profile-trace", "save_path"})
    EXPECT_FALSE(c.was_given(key)) << key;
  EXPECT_EQ(c.epochs, 2);  // the rest of the run's flags are its own
  // Given now, they are this job's.
  c = ddp::resumed_config(parse_args({"--resume", "auto", "--nnodes", "2", "--node-rank", "1", "--port", "29700",
                                      "--address", "10.0.0.9"}),
                          hostile, "run/epoch_1.pt");
  EXPECT_EQ(c.port, 29700);
  EXPECT_EQ(c.address, "10.0.0.9");
}

// The merged flags are validated as parsed ones are: a header's value that
// the command line refuses is one line naming the checkpoint (on main,
// --save_epoch 0 in a header reached the trainer and divided by zero).
TEST(CliResume, AHeaderValueTheCommandLineRefusesIsAnError) {
  for (const auto& [key, value, expect] : std::vector<std::tuple<std::string, nlohmann::json, std::string>>{
           {"save_epoch", 0, "--save_epoch must be positive, got 0."},
           {"batch", -3, "--batch must be positive, got -3."},
           {"accum-steps", 0, "--accum-steps must be positive, got 0."}}) {
    auto saved = ddp::config_to_json(parse_args({}));  // as a run saves it: defaults resolved
    saved[key] = value;
    std::string what;
    try {
      ddp::resumed_config(parse_args({"--resume", "auto"}), saved, "run/epoch_1.pt");
    } catch (const ddp::UserError& e) {
      what = e.what();
    }
    EXPECT_NE(what.find("checkpoint run/epoch_1.pt holds flags that ddptrain refuses: " + expect), std::string::npos)
        << key << ": " << what;
  }
  // A value given now replaces the header's (--save_epoch may change).
  auto saved = ddp::config_to_json(parse_args({}));
  saved["save_epoch"] = 0;
  EXPECT_EQ(ddp::resumed_config(parse_args({"--resume", "auto", "--save_epoch", "2"}), saved, "c.pt").save_epoch, 2);
}

TEST(CliResume, FlagsThatKeepTheJobMayBeGiven) {
  auto c = ddp::resumed_config(
      parse_args({"--resume", "auto", "--save_epoch", "5", "--progress", "none", "--size", "1", "--keep-last", "1",
             "--epochs", "4", "--workers", "0", "--lr", "0.01"}),  // --lr as the run had it
      saved_run(), "run/epoch_1.pt");
  EXPECT_EQ(c.save_epoch, 5);
  EXPECT_EQ(c.progress, "none");
  EXPECT_EQ(c.size, 1);
  EXPECT_EQ(c.keep_last, 1);
  EXPECT_EQ(c.epochs, 4);  // the trainer checks the schedule
  EXPECT_EQ(c.workers, 0);
  EXPECT_EQ(c.train_samples, 12000);
}

TEST(CliResume, FlagsThatChangeTheJobAreRefusedTogether) {
  std::string what;
  try {
    ddp::resumed_config(parse_args({"--resume", "auto", "--lr", "0.1", "--model", "resnet18", "--seed", "4", "--save_epoch", "3"}),
                        saved_run(), "run/epoch_1.pt");
  } catch (const ddp::UserError& e) {
    what = e.what();
  }
  EXPECT_NE(what.find("--lr 0.1 (the run's: 0.01)"), std::string::npos) << what;
  EXPECT_NE(what.find("--model resnet18 (the run's: cnn)"), std::string::npos) << what;
  EXPECT_EQ(what.find("--seed"), std::string::npos) << "same value as the run: " << what;
  EXPECT_EQ(what.find("--save_epoch"), std::string::npos) << "may change: " << what;
  EXPECT_NE(what.find("run/epoch_1.pt"), std::string::npos) << what;
  EXPECT_EQ(std::count(what.begin(), what.end(), '\n'), 0) << "one line: " << what;
}

TEST(CliResume, EveryJobFlagIsRefusedAndEveryOtherIsTaken) {
  // Row by row: a new value for each flag of the table either raises the
  // error (OnResume::kSame) or replaces the saved one (kMayChange).
  ddp::Config probe;
  const auto saved = ddp::config_to_json(parse_args({}));  // as a run saves it: defaults resolved
  for (const auto& f : ddp::flag_table(probe)) {
    if (f.key() == "resume") continue;
    std::string value = std::visit(
        [&](auto* p) -> std::string {
          using T = std::decay_t<decltype(*p)>;
          if constexpr (std::is_same_v<T, bool>) return *p ? "false" : "true";
          else if constexpr (std::is_same_v<T, std::string>) return f.choices.empty() ? "x" + *p : "";
          else return std::to_string(*p + 3);
        },
        f.target);
    if (value.empty())  // a choice other than the default
      for (const auto& choice : f.choices)
        if (choice != saved[f.key()].get<std::string>()) value = choice;
    if (f.key() == "node-rank") value = "0";  // any other is outside --nnodes
    if (f.key() == "stop-at") value = "test_acc=0.5";
    if (f.key() == "stop-at-acc") value = "0.5";
    if (f.key() == "inject-fault") value = "0:1";
    if (f.key() == "val-split") value = "0.25";
    if (f.key() == "label-smoothing") value = "0.25";
    if (f.key() == "cpu-decode-share") value = "0.5";  // a share: the default, 1, plus 3 is out of range
    if (f.key() == "recompute") value = "blocks";
    if (f.key() == "nnodes" || f.key() == "node-rank" || value == std::string(saved[f.key()].dump())) continue;
    bool refused = false;
    try {
      std::vector<std::string> args{"--resume", "auto", "--" + f.key() + "=" + value};
      if (f.key() == "pretrain-skip") args.push_back("--pretrain=w.pt");  // it means nothing alone
      ddp::resumed_config(parse_args(args), saved, "c.pt");
    } catch (const ddp::UserError&) {
      refused = true;
    }
    EXPECT_EQ(refused, f.on_resume == ddp::OnResume::kSame) << "--" << f.key() << " " << value;
  }
}

// A run can move: its data folders may be given anew on resume (the
// trainer checks that the data is the same, data/identity.h), and one not
// given comes from the checkpoint. A new folder keeps the run's trailing
// '/', which an image folder's validation carve hashes with the paths.
TEST(CliResume, DataFoldersMayMoveAndKeepTheRunsTrailingSlash) {
  const auto saved = ddp::config_to_json(
      parse_args({"--dataset", "imagefolder", "--data_root", "/old/imgs/", "--val-root", "/old/val"}));
  auto moved = ddp::resumed_config(parse_args({"--resume", "auto", "--data_root", "/new/imgs", "--val-root", "/new/val/"}),
                                   saved, "run/epoch_1.pt");
  EXPECT_EQ(moved.data_root, "/new/imgs/");
  EXPECT_EQ(moved.val_root, "/new/val");
  auto kept = ddp::resumed_config(parse_args({"--resume", "auto"}), saved, "run/epoch_1.pt");
  EXPECT_EQ(kept.data_root, "/old/imgs/");
  EXPECT_EQ(kept.val_root, "/old/val");
  EXPECT_TRUE(kept.was_given("data_root"));
}

// What a run saves names its files absolutely, so that it resumes (or
// repeats with --config) from any working directory; a folder's trailing
// '/' stays, as above.
TEST(CliResume, SavedPathsAreAbsoluteAndNormalised) {
  const std::string cwd = std::filesystem::current_path().string();
  auto c = ddp::with_absolute_paths(parse_args({"--data_root", "data/./fm/../fm", "--val-root", "val/", "--save_path",
                                                "runs", "--pretrain", "/w/./a.pt", "--split", "test"}));
  EXPECT_EQ(c.data_root, cwd + "/data/fm");
  EXPECT_EQ(c.val_root, cwd + "/val/");
  EXPECT_EQ(c.save_path, cwd + "/runs");
  EXPECT_EQ(c.pretrain, "/w/a.pt");
  EXPECT_EQ(c.split, "test");       // a word here, not a path
  EXPECT_EQ(c.profile_trace, "");   // not given: nothing to resolve
  EXPECT_EQ(ddp::with_absolute_paths(parse_args({"--data_root", "."})).data_root, cwd);
}

}  // namespace resume
