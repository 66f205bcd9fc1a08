// The flag table: parsing, --help, validation and the printed config.
#include <sstream>

#include "ddp/cli.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace {

ddp::Config parse(std::vector<std::string> args) {
  args.insert(args.begin(), "ddptrain");
  std::vector<const char*> argv;
  for (auto& a : args) argv.push_back(a.c_str());
  return ddp::parse_cli(static_cast<int>(argv.size()), argv.data());
}

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

}  // namespace
