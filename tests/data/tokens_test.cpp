// Token data (src/data/tokens.cpp): nanoGPT's and llm.c's token files, the
// errors for bad ones, the byte-level text corpus, and the windows whose
// draws make 2 ranks x B equal 1 rank x 2B and resumes exact.
#include <unistd.h>

#include <filesystem>
#include <fstream>
#include <set>

#include "ddp/data/sampler.h"
#include "ddp/data/tokens.h"
#include "ddp/error.h"
#include "support/testing.h"

namespace fs = std::filesystem;

namespace ddp::data {
namespace {

void write_bytes(const std::string& path, const void* data, size_t n) {
  std::ofstream f(path, std::ios::binary);
  f.write(static_cast<const char*>(data), static_cast<std::streamsize>(n));
}

std::vector<uint16_t> ramp(int n, int modulo = 65536) {
  std::vector<uint16_t> v;
  for (int i = 0; i < n; ++i) v.push_back(static_cast<uint16_t>(i % modulo));
  return v;
}

void write_llmc(const std::string& path, const std::vector<uint16_t>& tokens, int32_t version, int32_t count) {
  std::vector<int32_t> header(256, 0);
  header[0] = kLlmcMagic;
  header[1] = version;
  header[2] = count;
  std::ofstream f(path, std::ios::binary);
  f.write(reinterpret_cast<const char*>(header.data()), 1024);
  f.write(reinterpret_cast<const char*>(tokens.data()), static_cast<std::streamsize>(2 * tokens.size()));
}

TEST(Tokens, ReadsNanoGptsRawUint16File) {
  const auto dir = testing::temp_dir("tok_raw");
  const auto tokens = ramp(5000, 50257);
  write_bytes(dir + "/train.bin", tokens.data(), 2 * tokens.size());
  auto t = read_token_file(dir + "/train.bin");
  ASSERT_EQ(t->size(), 5000);
  EXPECT_EQ(t->data()[0], 0);
  EXPECT_EQ(t->data()[4999], 4999);
}

TEST(Tokens, ReadsLlmcsHeaderedFile) {
  const auto dir = testing::temp_dir("tok_llmc");
  const auto tokens = ramp(3000, 50257);
  write_llmc(dir + "/val.bin", tokens, kLlmcVersion, 3000);
  auto t = read_token_file(dir + "/val.bin");
  ASSERT_EQ(t->size(), 3000);
  EXPECT_EQ(t->data()[0], 0);
  EXPECT_EQ(t->data()[2999], 2999);
}

TEST(Tokens, BadFilesAreErrorsThatNameThePathAndTheFix) {
  const auto dir = testing::temp_dir("tok_bad");
  auto error_for = [&](const std::string& name) { return testing::user_error([&] { read_token_file(dir + "/" + name); }); };
  auto missing = error_for("train.bin");
  EXPECT_NE(missing.find(dir + "/train.bin does not exist"), std::string::npos) << missing;
  EXPECT_NE(missing.find("Hint: --data_root needs train.bin and val.bin"), std::string::npos) << missing;
  fs::create_directory(dir + "/folder.bin");  // there, but not a file: not "does not exist"
  const auto folder = error_for("folder.bin");
  EXPECT_NE(folder.find(dir + "/folder.bin is a directory, not a token file"), std::string::npos) << folder;

  const char odd[3] = {1, 2, 3};
  write_bytes(dir + "/odd.bin", odd, 3);
  EXPECT_NE(error_for("odd.bin").find("has 3 bytes, not a whole number of uint16 tokens"), std::string::npos);
  write_bytes(dir + "/empty.bin", odd, 0);
  EXPECT_NE(error_for("empty.bin").find("has 0 bytes, no tokens"), std::string::npos);

  write_llmc(dir + "/v2.bin", ramp(10), 2, 10);
  EXPECT_NE(error_for("v2.bin").find("version 2; ddptrain reads version 1"), std::string::npos);
  write_llmc(dir + "/short.bin", ramp(10), kLlmcVersion, 20);
  const auto truncated = error_for("short.bin");
  EXPECT_NE(truncated.find("header for 20 tokens, but 20 bytes of tokens follow it (expected 40)"), std::string::npos)
      << truncated;
  EXPECT_NE(truncated.find(dir + "/short.bin"), std::string::npos);
}

TEST(Tokens, WindowsAreTheTokensAndTheNextOnes) {
  auto buf = std::make_shared<TokenBuffer>(ramp(1000, 200), "ramp");
  TokenWindows w(buf, TokenWindowsOptions().context(16).vocab_size(200).windows(50));
  EXPECT_EQ(w.size(), 50);
  EXPECT_EQ(w.num_classes(), 200);
  auto b = w.get_keyed_batch({0, 1, 2}, DrawKey{5, 2, 0}, 0);
  ASSERT_EQ(b.input().sizes(), (std::vector<int64_t>{3, 16}));
  EXPECT_EQ(b.input().scalar_type(), torch::kLong);
  for (int64_t i = 0; i < 3; ++i) {
    const int64_t start = w.start_of(i, 5, 2);
    EXPECT_GE(start, 0);
    EXPECT_LE(start + 16, 999);
    EXPECT_EQ(b.input()[i][0].item<int64_t>(), start % 200);
    EXPECT_TRUE(torch::equal(b.input()[i].slice(0, 1), b.target()[i].slice(0, 0, 15)));
  }
  // The default size is one pass in expectation: tokens / context.
  EXPECT_EQ(TokenWindows(buf, TokenWindowsOptions().context(16).vocab_size(200)).size(), 1000 / 16);
}

// Every token is checked when the windows are made, not only those a batch
// happens to draw: one bad id deep in the file once failed a run epochs in
// (or never, with few samples).
TEST(Tokens, TokenBeyondTheVocabularyIsAnErrorBeforeTraining) {
  auto tokens = ramp(10000, 100);
  tokens[9000] = 65000;
  auto buf = std::make_shared<TokenBuffer>(std::move(tokens), "ramp file");
  for (const bool random : {true, false}) {
    const auto msg = testing::user_error(
        [&] { TokenWindows(buf, TokenWindowsOptions().context(16).vocab_size(256).windows(2).random(random)); });
    EXPECT_NE(msg.find("ramp file holds token id 65000"), std::string::npos) << msg;
    EXPECT_NE(msg.find("beyond the model's vocabulary of 256"), std::string::npos) << msg;
    EXPECT_NE(msg.find("--vocab-size 65001"), std::string::npos) << msg;
  }
  EXPECT_EQ(buf->largest(), 65000);
  EXPECT_NO_THROW(TokenWindows(buf, TokenWindowsOptions().context(16).vocab_size(65001)));
}

// A file laid out as llm.c's (version and count agree with its size) whose
// magic is not llm.c's is damaged or another format: refused, not trained on
// with its header read as 512 tokens.
TEST(Tokens, LlmcLayoutWithAnotherMagicIsAnError) {
  const auto dir = testing::temp_dir("tok_magic");
  std::vector<int32_t> header(256, 0);
  header[0] = kLlmcMagic + 1;
  header[1] = kLlmcVersion;
  header[2] = 100;
  const auto tokens = ramp(100, 50257);
  {
    std::ofstream f(dir + "/train.bin", std::ios::binary);
    f.write(reinterpret_cast<const char*>(header.data()), 1024);
    f.write(reinterpret_cast<const char*>(tokens.data()), 200);
  }
  const auto msg = testing::user_error([&] { read_token_file(dir + "/train.bin"); });
  EXPECT_NE(msg.find(dir + "/train.bin"), std::string::npos) << msg;
  EXPECT_NE(msg.find("magic " + std::to_string(kLlmcMagic + 1)), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

// A window depends on (seed, epoch, sample index) only: not on the rank,
// the batch it lands in or the other samples beside it.
TEST(Tokens, TrainingWindowsDependOnSeedEpochAndIndexOnly) {
  auto buf = std::make_shared<TokenBuffer>(ramp(100000, 256), "ramp");
  TokenWindows w(buf, TokenWindowsOptions().context(32).windows(64));
  auto both = w.get_keyed_batch({3, 9}, DrawKey{1, 4, 0}, 0);
  auto nine = w.get_keyed_batch({9}, DrawKey{1, 4, 1}, 17);
  EXPECT_TRUE(torch::equal(both.input()[1], nine.input()[0]));
  EXPECT_NE(w.start_of(3, 1, 4), w.start_of(3, 1, 5)) << "a new epoch draws new windows";
  EXPECT_NE(w.start_of(3, 1, 4), w.start_of(3, 2, 4)) << "another seed draws other windows";
  std::set<int64_t> starts;
  for (int64_t i = 0; i < 64; ++i) starts.insert(w.start_of(i, 1, 4));
  EXPECT_GE(starts.size(), 60u);
}

// bench/gpt_torch.py's train mode replays these draws in Python for the
// quality check beside PyTorch; its ddptrain_window_start() gave these.
TEST(Tokens, WindowStartsEqualThePythonReplicaOfTheBenchScript) {
  auto big = std::make_shared<TokenBuffer>(ramp(100000, 256), "ramp");
  TokenWindows w(big, TokenWindowsOptions().context(32).windows(64));
  EXPECT_EQ(w.start_of(0, 1, 4), 67997);
  EXPECT_EQ(w.start_of(3, 1, 4), 94409);
  EXPECT_EQ(w.start_of(63, 1, 4), 78601);
  auto small = std::make_shared<TokenBuffer>(ramp(1064, 256), "ramp");
  EXPECT_EQ(TokenWindows(small, TokenWindowsOptions().context(64)).start_of(0, 0, 0), 864);
}

// What the trainer does with these: rank r of 2 with batch B takes every
// other index of the sampler's order; together they hold 1 rank's batch of 2B.
TEST(Tokens, TwoRanksOfBatchBSeeOneRanksBatchOf2B) {
  auto buf = std::make_shared<TokenBuffer>(ramp(50000, 256), "ramp");
  auto w = std::make_shared<TokenWindows>(buf, TokenWindowsOptions().context(8).windows(40));
  const int64_t b = 4;
  DistributedSampler one({w->size(), 1, 0, true, 9, false});
  one.set_epoch(2);
  const auto all = one.indices();
  for (int64_t k = 0; k < 40 / (2 * b); ++k) {
    std::multiset<int64_t> global, split;
    for (int64_t j = 0; j < 2 * b; ++j) global.insert(w->start_of(all[static_cast<size_t>(k * 2 * b + j)], 9, 2));
    for (int r = 0; r < 2; ++r) {
      DistributedSampler s({w->size(), 2, r, true, 9, false});
      s.set_epoch(2);
      const auto mine = s.indices();
      for (int64_t j = 0; j < b; ++j) split.insert(w->start_of(mine[static_cast<size_t>(k * b + j)], 9, 2));
    }
    EXPECT_EQ(global, split) << "batch " << k;
  }
}

TEST(Tokens, ValidationWindowsTileTheTokensInOrder) {
  auto buf = std::make_shared<TokenBuffer>(ramp(1001, 256), "ramp");
  TokenWindows all(buf, TokenWindowsOptions().context(100).random(false));
  EXPECT_EQ(all.size(), 10);
  auto b = all.get_batch({0, 9});
  EXPECT_EQ(b.input()[1][0].item<int64_t>(), 900 % 256);
  EXPECT_EQ(b.target()[1][99].item<int64_t>(), 1000 % 256);
  EXPECT_EQ(TokenWindows(buf, TokenWindowsOptions().context(100).random(false).windows(4)).size(), 4);
  EXPECT_NE(testing::user_error([&] { TokenWindows(buf, TokenWindowsOptions().context(1001)); })
                .find("too few for one window of 1002"),
            std::string::npos);
}

TEST(Tokens, TextCorpusIsBytesWithTheLastTenthOfEachFileHeldOut) {
  const auto dir = testing::temp_dir("corpus");
  std::string a(1000, 'a'), b(500, 'b');
  write_bytes(dir + "/a", a.data(), a.size());
  write_bytes(dir + "/b", b.data(), b.size());
  write_bytes(dir + "/a.dat", "\x01\x02", 2);      // fortune's index files
  fs::create_symlink(dir + "/a", dir + "/a.u8");   // fortune's aliases
  auto corpus = read_text_corpus(dir);
  EXPECT_EQ(corpus.files, 2);
  ASSERT_EQ(corpus.train->size(), 900 + 450);
  ASSERT_EQ(corpus.val->size(), 100 + 50);
  EXPECT_EQ(corpus.train->data()[0], 'a');
  EXPECT_EQ(corpus.train->data()[900], 'b');
  EXPECT_EQ(corpus.val->data()[0], 'a');
  EXPECT_EQ(corpus.val->data()[100], 'b');
  const auto msg = testing::user_error([&] { read_text_corpus(dir + "/none"); });
  EXPECT_NE(msg.find("no text corpus at " + dir + "/none"), std::string::npos) << msg;
}

// A corpus too small to hold back a validation part is said to be small, not
// empty; an empty one is empty.
TEST(Tokens, TinyTextCorpusIsNamedTooSmallNotEmpty) {
  const auto dir = testing::temp_dir("corpus_tiny");
  write_bytes(dir + "/three", "abc", 3);
  const auto tiny = testing::user_error([&] { read_text_corpus(dir + "/three"); });
  EXPECT_NE(tiny.find("the text corpus " + dir + "/three holds only 3 bytes"), std::string::npos) << tiny;
  EXPECT_EQ(tiny.find("is empty"), std::string::npos) << tiny;
  write_bytes(dir + "/none", "", 0);
  const auto empty = testing::user_error([&] { read_text_corpus(dir + "/none"); });
  EXPECT_NE(empty.find("the text corpus " + dir + "/none is empty"), std::string::npos) << empty;
}

// A folder read as text must hold text: a binary file (NUL bytes; e.g. the
// Fashion-MNIST folder given to --task lm) is named, not trained on as bytes.
TEST(Tokens, BinaryFileInATextCorpusIsAnError) {
  const auto dir = testing::temp_dir("corpus_binary");
  std::string text(1000, 'a');
  const char binary[] = {'\x1f', '\x8b', '\x08', '\0', '\0', 'x'};
  write_bytes(dir + "/a.txt", text.data(), text.size());
  write_bytes(dir + "/images.gz", binary, sizeof(binary));
  const auto msg = testing::user_error([&] { read_text_corpus(dir); });
  EXPECT_NE(msg.find(dir + "/images.gz is not text"), std::string::npos) << msg;
  EXPECT_NE(msg.find("train.bin"), std::string::npos) << msg;
}

TEST(Tokens, FortunesCorpusHasMegabytesOfText) {
  if (!fs::exists(kFortunesDir)) GTEST_SKIP() << "apt-get install fortunes (./setup.sh does)";
  auto corpus = read_text_corpus(kFortunesDir);
  EXPECT_GE(corpus.files, 40);
  EXPECT_GE(corpus.train->size(), 2000000);
  EXPECT_GE(corpus.val->size(), 200000);
}


// Several token files (llm.c's FineWeb shards, in both layouts) are one
// stream: a glob or a brace pattern names them in order, training windows
// come from every file and never span two, validation tiles file after file.
TEST(TokenFiles, SeveralFilesAreOneStreamOfWindowsThatNeverSpanTwo) {
  const auto dir = testing::temp_dir("tok_files");
  // File f holds f * 20000 + 0, 1, 2, ...: a window's file is its first
  // token / 20000, and within a file tokens count up by one.
  const std::vector<int> sizes{1000, 1500, 800};
  for (int f = 0; f < 3; ++f) {
    std::vector<uint16_t> t;
    for (int i = 0; i < sizes[static_cast<size_t>(f)]; ++i) t.push_back(static_cast<uint16_t>(f * 20000 + i));
    const auto path = dir + "/x_train_" + std::to_string(f) + ".bin";
    if (f == 1) write_llmc(path, t, kLlmcVersion, static_cast<int32_t>(t.size()));
    else write_bytes(path, t.data(), 2 * t.size());
  }
  const auto by_glob = read_token_files(dir + "/x_train_*.bin");
  const auto by_braces = read_token_files(dir + "/x_train_{0..2}.bin");
  ASSERT_EQ(by_glob.size(), 3u);
  ASSERT_EQ(by_braces.size(), 3u);
  for (size_t f = 0; f < 3; ++f) {
    EXPECT_EQ(by_glob[f]->size(), sizes[f]);
    EXPECT_EQ(by_glob[f]->data()[0], by_braces[f]->data()[0]);
  }
  TokenWindows train(by_glob, TokenWindowsOptions().context(16).vocab_size(65536).windows(3000));
  std::vector<int> per_file(3, 0);
  for (int64_t i = 0; i < train.size(); ++i) {
    auto b = train.get_keyed_batch({i}, DrawKey{7, 1, 0}, 0);
    const auto x = b.input()[0], y = b.target()[0];
    const int64_t first = x[0].item<int64_t>(), f = first / 20000;
    ASSERT_EQ(y[15].item<int64_t>(), first + 16) << "window " << i << " spans two files";
    ++per_file[static_cast<size_t>(f)];
  }
  // Starts per file: 984, 1484, 784 of 3252.
  EXPECT_NEAR(per_file[0], 3000 * 984 / 3252, 120);
  EXPECT_NEAR(per_file[1], 3000 * 1484 / 3252, 120);
  EXPECT_NEAR(per_file[2], 3000 * 784 / 3252, 120);
  TokenWindows val(by_glob, TokenWindowsOptions().context(16).vocab_size(65536).random(false));
  EXPECT_EQ(val.size(), 999 / 16 + 1499 / 16 + 799 / 16);
  for (int64_t i = 0; i < val.size(); ++i) {
    auto b = val.get_batch({i});
    ASSERT_EQ(b.target()[0][15].item<int64_t>(), b.input()[0][0].item<int64_t>() + 16) << "tile " << i;
  }
  EXPECT_EQ(val.get_batch({62}).input()[0][0].item<int64_t>(), 20000) << "file 1's first tile follows file 0's last";
  EXPECT_NE(testing::user_error([&] { read_token_files(dir + "/x_train_*.bin," + dir + "/y_*.bin"); })
                .find("no token file matches " + dir + "/y_*.bin"),
            std::string::npos);
}

}  // namespace
}  // namespace ddp::data
