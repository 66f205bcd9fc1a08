// The flag table: parsing, --help, validation and the printed config.
#include <fstream>
#include <sstream>

#include "ddp/cli.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

ddp::Config parse(std::vector<std::string> args) { return ddp::testing::parse_args(std::move(args)); }

std::string error_of(std::vector<std::string> args) {
  try {
    parse(std::move(args));
  } catch (const ddp::UserError& e) {
    return e.what();
  }
  return "";
}

TEST(Cli, SeedFlagsKeepTheirNames) {
  auto c = parse({"--port", "29501", "--size", "2", "--visible", "0,1", "--address", "10.0.0.1", "--epochs", "7",
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
  auto sgd = parse({"--optimizer", "sgd"});
  EXPECT_DOUBLE_EQ(sgd.lr, 0.1);
  EXPECT_DOUBLE_EQ(sgd.weight_decay, 5e-4);
  auto adamw = parse({});
  EXPECT_EQ(adamw.optimizer, "adamw");
  EXPECT_GT(adamw.lr, 0);
  EXPECT_DOUBLE_EQ(parse({"--lr", "0.5"}).lr, 0.5);
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

TEST(Cli, ImpossibleValuesNameTheFlagAndValue) {
  for (auto [flag, value] : std::vector<std::pair<std::string, std::string>>{
           {"--batch", "0"}, {"--batch", "-4"}, {"--epochs", "0"}, {"--epochs", "-1"}, {"--lr", "0"}, {"--lr", "-0.1"}}) {
    auto e = error_of({flag, value});
    EXPECT_NE(e.find(flag + " must be positive, got " + value + "."), std::string::npos) << e;
    EXPECT_NE(e.find("Hint"), std::string::npos) << e;
  }
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
  auto c = parse({"--epochs", "2"});
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
           {"--optimizer", "sgd", "--visible", "0,1", "--pretrain-skip", "fc.*", "--warmup-epochs", "0.3",
            "--lr", "0.07", "--save_path", "/tmp/my runs/it's here", "--timeout", "1e-3", "--epochs", "9",
            "--node-rank", "1", "--nnodes", "2", "--resume", "auto", "--label-smoothing", "0.1"}}) {
    const auto c = parse(flags);
    const auto toml = ddp::config_to_toml(c);
    const auto again = parse({"--config", write_config("cfg_roundtrip", toml)});
    EXPECT_EQ(ddp::config_to_json(again), ddp::config_to_json(c)) << toml;
    EXPECT_TRUE(again.was_given("epochs"));  // a value from the file counts as given
  }
}

TEST(Cli, CommandLineOverridesTheConfigFile) {
  const auto file = write_config("cfg_override", "# a comment\nepochs = 5\nbatch = 16\noptimizer = 'sgd'\ndata_root = \"/data/x\"\n");
  for (const auto& args : std::vector<std::vector<std::string>>{{"--config", file, "--epochs", "2"},
                                                                {"--epochs", "2", "--config", file}}) {
    const auto c = parse(args);
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
