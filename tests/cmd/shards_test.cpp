// `ddptrain shards` from a CSV file and from token files: what it writes
// reads back as the source (every record with the same values, bit for bit;
// the same tokens in the same order), each shard within the size asked for,
// and a run on the written token shard equals the run on its source.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>

#include "ddp/data/csv.h"
#include "ddp/data/shards.h"
#include "ddp/data/tar.h"
#include "ddp/data/tokens.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace shards_cmd_test {

using ddp::testing::run_process;

void write_text(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary);
  f << text;
}

// A sales-like CSV: numbers written in several ways (exponents, signs,
// spaces, quotes), a category column, CRLF lines and a blank line.
std::string sales_csv(int rows) {
  std::string s = "x0,x1,store,sales\r\n";
  for (int i = 0; i < rows; ++i) {
    s += std::to_string(i) + ".125e-1, -" + std::to_string(i % 7) + ".5 ,\"" + std::to_string(i % 4) + "\"," +
         std::to_string(1000 + i * 13) + ".0078125\r\n";
    if (i == 5) s += "\r\n";
  }
  return s;
}

// Every sample of the tar shards `paths`: key -> its fields.
std::map<std::string, std::map<std::string, std::vector<uint8_t>>> read_all(const std::vector<std::string>& paths,
                                                                            std::vector<int64_t>* per_shard) {
  std::map<std::string, std::map<std::string, std::vector<uint8_t>>> out;
  for (const auto& p : paths) {
    ddp::data::ShardReader reader(p);
    ddp::data::ShardSample s;
    int64_t n = 0;
    while (reader.next(&s, ddp::data::ShardRead::kAll)) {
      EXPECT_EQ(out.count(s.key), 0u) << s.key << " written twice";
      out[s.key] = s.fields;
      ++n;
    }
    per_shard->push_back(n);
  }
  return out;
}

std::vector<std::string> shard_paths(const std::string& out, int n, const char* ext) {
  std::vector<std::string> paths;
  for (int i = 0; i < n; ++i) {
    char name[16];
    std::snprintf(name, sizeof name, "-%06d", i);
    paths.push_back(out + name + ext);
  }
  return paths;
}

std::vector<uint16_t> all_tokens(const std::vector<ddp::data::TokenBufferPtr>& files) {
  std::vector<uint16_t> out;
  for (const auto& f : files) out.insert(out.end(), f->data(), f->data() + f->size());
  return out;
}

}  // namespace shards_cmd_test

using namespace shards_cmd_test;

// Each record of a CSV becomes a sample KEY.csv (the header and the record):
// parsed on its own, it gives the record's values bit for bit, every record
// once under its row number, shuffled across the shards, at most
// --shard-samples or --shard-mb per shard.
TEST(ShardsCommand, CsvRecordsReadBackAsTheSourcesValues) {
  if (!ddp::data::have_libarchive()) GTEST_SKIP() << "built without libarchive";
  const auto dir = ddp::testing::temp_dir("shards_csv");
  write_text(dir + "/sales.csv", sales_csv(23));
  const auto source = ddp::data::read_csv(dir + "/sales.csv", ddp::data::CsvOptions().categories({"store"}));
  ASSERT_EQ(source.rows, 23);

  auto r = run_process({DDPTRAIN_EXE, "shards", dir + "/sales.csv", dir + "/rows", "--shard-samples", "5"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote 5 shard(s): " + dir + "/rows-{000000..000004}.tar"), std::string::npos) << r.output;
  std::vector<int64_t> per_shard;
  const auto samples = read_all(shard_paths(dir + "/rows", 5, ".tar"), &per_shard);
  EXPECT_EQ(per_shard, (std::vector<int64_t>{5, 5, 5, 5, 3}));
  ASSERT_EQ(samples.size(), 23u);
  int64_t row = 0;
  for (const auto& [key, fields] : samples) {  // keys sort as row numbers
    char expected[24];
    std::snprintf(expected, sizeof expected, "%09lld", static_cast<long long>(row));
    ASSERT_EQ(key, expected);
    ASSERT_EQ(fields.size(), 1u);
    ASSERT_EQ(fields.begin()->first, "csv");
    const auto& bytes = fields.at("csv");
    const auto one = ddp::data::parse_csv(std::string(bytes.begin(), bytes.end()), key,
                                          ddp::data::CsvOptions().categories({"store"}));
    ASSERT_EQ(one.rows, 1);
    EXPECT_EQ(one.names, source.names);
    for (const auto& name : source.names)
      EXPECT_TRUE(torch::equal(one.column(name)[0], source.column(name)[row])) << key << " " << name;
    ++row;
  }
  // The first shard does not hold rows 0-4 in order: the writer shuffles.
  ddp::data::ShardReader first(dir + "/rows-000000.tar");
  ddp::data::ShardSample s;
  std::string keys;
  while (first.next(&s, ddp::data::ShardRead::kNothing)) keys += s.key + " ";
  EXPECT_NE(keys, "000000000 000000001 000000002 000000003 000000004 ");

  // By size: a record takes 1 KiB of tar (header + a padded block), so
  // 0.003 MiB (3145 bytes) holds 3 of them.
  auto m = run_process({DDPTRAIN_EXE, "shards", dir + "/sales.csv", dir + "/small", "--shard-mb", "0.003"});
  ASSERT_EQ(m.exit_code, 0) << m.output;
  EXPECT_NE(m.output.find("wrote 8 shard(s)"), std::string::npos) << m.output;
  per_shard.clear();
  EXPECT_EQ(read_all(shard_paths(dir + "/small", 8, ".tar"), &per_shard).size(), 23u);
  EXPECT_EQ(per_shard, (std::vector<int64_t>{3, 3, 3, 3, 3, 3, 3, 2}));

  // A CSV training could not read is refused as training would refuse it,
  // and no shard is written.
  write_text(dir + "/bad.csv", "x0,sales\n1,2\n3,oops\n");
  auto bad = run_process({DDPTRAIN_EXE, "shards", dir + "/bad.csv", dir + "/bad"});
  EXPECT_EQ(bad.exit_code, ddp::exit_code::kUsage) << bad.output;
  EXPECT_NE(bad.output.find("bad.csv line 3, column 2 ('sales'): 'oops' is not a number."), std::string::npos)
      << bad.output;
  EXPECT_FALSE(fs::exists(dir + "/bad-000000.tar"));
}

// Token files (nanoGPT's raw uint16 and llm.c's layout, named by a brace
// pattern) become numbered llm.c token files whose tokens, read back as one
// stream by the reader --task lm uses, are the source's in order; each is
// within --shard-samples tokens or --shard-mb bytes.
TEST(ShardsCommand, TokenFilesReadBackAsTheSameStream) {
  const auto dir = ddp::testing::temp_dir("shards_tokens");
  std::vector<uint16_t> a, b;
  for (int i = 0; i < 1000; ++i) a.push_back(static_cast<uint16_t>((i * 7919) % 50257));
  for (int i = 0; i < 1500; ++i) b.push_back(static_cast<uint16_t>((i * 104729 + 3) % 65536));
  {
    std::ofstream f(dir + "/src_0.bin", std::ios::binary);  // raw
    f.write(reinterpret_cast<const char*>(a.data()), static_cast<std::streamsize>(2 * a.size()));
    std::ofstream g(dir + "/src_1.bin", std::ios::binary);  // llm.c
    std::vector<int32_t> header(256, 0);
    header[0] = ddp::data::kLlmcMagic, header[1] = ddp::data::kLlmcVersion, header[2] = static_cast<int32_t>(b.size());
    g.write(reinterpret_cast<const char*>(header.data()), 1024);
    g.write(reinterpret_cast<const char*>(b.data()), static_cast<std::streamsize>(2 * b.size()));
  }
  std::vector<uint16_t> source = a;
  source.insert(source.end(), b.begin(), b.end());

  auto r = run_process({DDPTRAIN_EXE, "shards", dir + "/src_{0,1}.bin", dir + "/tok_train", "--shard-samples", "600"});
  ASSERT_EQ(r.exit_code, 0) << r.output;
  EXPECT_NE(r.output.find("wrote 5 shard(s): " + dir + "/tok_train-{000000..000004}.bin"), std::string::npos)
      << r.output;
  const auto shards = ddp::data::read_token_files(dir + "/tok_train-*.bin");
  ASSERT_EQ(shards.size(), 5u);
  std::vector<int64_t> sizes;
  for (const auto& s : shards) sizes.push_back(s->size());
  EXPECT_EQ(sizes, (std::vector<int64_t>{600, 600, 600, 600, 100}));
  EXPECT_EQ(all_tokens(shards), source);
  for (const auto& p : shard_paths(dir + "/tok_train", 5, ".bin")) {  // llm.c's header
    std::ifstream f(p, std::ios::binary);
    int32_t header[3];
    f.read(reinterpret_cast<char*>(header), sizeof header);
    EXPECT_EQ(header[0], ddp::data::kLlmcMagic);
    EXPECT_EQ(header[1], ddp::data::kLlmcVersion);
  }

  // By size: 0.002 MiB is 2097 bytes, a 1024-byte header and 536 tokens.
  auto m = run_process({DDPTRAIN_EXE, "shards", dir + "/src_{0,1}.bin", dir + "/mb_train", "--shard-mb", "0.002"});
  ASSERT_EQ(m.exit_code, 0) << m.output;
  const auto by_mb = ddp::data::read_token_files(dir + "/mb_train-*.bin");
  ASSERT_EQ(by_mb.size(), 5u);  // ceil(2500 / 536)
  for (const auto& p : shard_paths(dir + "/mb_train", 5, ".bin")) EXPECT_LE(fs::file_size(p), 2097u) << p;
  EXPECT_EQ(all_tokens(by_mb), source);

  // Written again: refused, nothing overwritten.
  const auto before = ddp::testing::read_file(dir + "/tok_train-000000.bin");
  auto again = run_process({DDPTRAIN_EXE, "shards", dir + "/src_{0,1}.bin", dir + "/tok_train"});
  EXPECT_EQ(again.exit_code, ddp::exit_code::kUsage) << again.output;
  EXPECT_NE(again.output.find("tok_train-000000.bin already exists; shards are never overwritten."), std::string::npos)
      << again.output;
  EXPECT_EQ(ddp::testing::read_file(dir + "/tok_train-000000.bin"), before);
  // A source that is not there: said so, nothing written.
  auto missing = run_process({DDPTRAIN_EXE, "shards", dir + "/no_such_folder", dir + "/none"});
  EXPECT_EQ(missing.exit_code, ddp::exit_code::kUsage) << missing.output;
  EXPECT_NE(missing.output.find("ddptrain shards: " + dir + "/no_such_folder does not exist."), std::string::npos)
      << missing.output;
  EXPECT_FALSE(fs::exists(dir + "/none-000000.bin"));
}

// A GPT trained on a token file and on that file written as a token shard
// (train and val alike) sees the same windows: the same losses, digit for
// digit. (Over several shards the tokens are the same, but a window never
// spans two files, so the windows differ near the cuts.)
TEST(ShardsCommand, LmRunOnTheWrittenTokenShardEqualsTheRunOnItsSource) {
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("shards_lm");
  fs::create_directories(dir + "/src");
  fs::create_directories(dir + "/out");
  for (const char* split : {"train", "val"}) {
    std::vector<uint16_t> t;
    for (int i = 0; i < 3000; ++i) t.push_back(static_cast<uint16_t>((i * 31 + (split[0] == 'v')) % 256));
    std::ofstream f(dir + "/src/tok_" + split + ".bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(t.data()), static_cast<std::streamsize>(2 * t.size()));
    f.close();
    auto w = run_process({DDPTRAIN_EXE, "shards", dir + "/src/tok_" + split + ".bin", dir + "/out/tok_" + split});
    ASSERT_EQ(w.exit_code, 0) << w.output;
  }
  std::vector<std::vector<nlohmann::json>> metrics;
  for (const std::string& root : {dir + "/src/tok_train.bin", dir + "/out/tok_train-*.bin"}) {
    const auto save = ddp::testing::temp_dir("shards_lm_run");
    auto r = run_process({DDPTRAIN_EXE, "--task", "lm", "--model", "gpt-nano", "--save_path", save, "--progress",
                          "plain", "--timeout", "60", "--backend", "gloo", "--workers", "0", "--size", "1",
                          "--data_root", root, "--epochs", "2", "--batch", "4", "--train-samples", "16",
                          "--test-samples", "8", "--context", "32"});
    ASSERT_EQ(r.exit_code, 0) << r.output;
    metrics.push_back(ddp::testing::metrics_jsonl(save));
  }
  ASSERT_EQ(metrics[0].size(), 2u);
  ASSERT_EQ(metrics[1].size(), 2u);
  for (size_t e = 0; e < 2; ++e)
    for (const char* key : {"train_loss", "test_loss"})
      EXPECT_EQ(metrics[0][e][key].get<double>(), metrics[1][e][key].get<double>()) << key << " epoch " << e;
}
