// Tar shards: the pattern, the reader, the epoch's stream order (determinism,
// every sample once across ranks and loader workers, the same global batch on
// any world size dividing the streams), exact mid-epoch resume, bad shards,
// and the shards subcommand feeding a real 2-rank run that resumes bit-exactly.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>

#include <ATen/CPUGeneratorImpl.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <numeric>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <regex>
#include <set>
#include <thread>

#include "ddp/data/image_codec.h"
#include "ddp/data/image_folder.h"
#include "ddp/data/loader.h"
#include "ddp/data/shards.h"
#include "ddp/error.h"
#include "ddp/io/torch_pickle.h"
#include "support/testing.h"

namespace fs = std::filesystem;
using ddp::data::ShardDataset;
using ddp::data::ShardDatasetOptions;
using ddp::data::ShardRead;
using ddp::data::ShardReader;
using ddp::data::ShardSample;
using ddp::data::StreamOrderOptions;
using ddp::data::TarWriter;
using ddp::testing::user_error;

#define DDP_SKIP_UNLESS_LIBARCHIVE() \
  do { if (!ddp::data::have_libarchive()) GTEST_SKIP() << "built without libarchive"; } while (0)

namespace {

std::vector<uint8_t> file_bytes(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

// A small PNG of pixels drawn from `seed`, as bytes (written through one
// file of the process: the suite makes thousands; called from one thread).
std::vector<uint8_t> png_bytes(int64_t seed, int64_t side = 12) {
  static const std::string file = ddp::testing::temp_dir("png") + "/x.png";
  auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(seed) + 1);
  auto image = torch::randint(0, 256, {side, side, 3}, gen, torch::kLong).to(torch::kUInt8);
  ddp::data::write_png(file, image);
  return file_bytes(file);
}

// `sizes[i]` samples in shard i, written as DIR/s-i.tar; sample n (counting
// across shards) has key "k<n>" and class n % classes (or n itself when
// classes is 0). Returns the pattern.
std::string write_shards(const std::string& dir, const std::vector<int64_t>& sizes, int64_t classes = 0) {
  int64_t n = 0;
  for (size_t i = 0; i < sizes.size(); ++i) {
    TarWriter w(dir + "/s-" + std::to_string(i) + ".tar");
    for (int64_t k = 0; k < sizes[i]; ++k, ++n) {
      const auto png = png_bytes(n);
      const std::string key = "k" + std::to_string(n), cls = std::to_string(classes ? n % classes : n);
      w.add(key + ".png", png.data(), png.size());
      w.add(key + ".cls", cls.data(), cls.size());
    }
    w.close();
  }
  return dir + "/s-{0.." + std::to_string(sizes.size() - 1) + "}.tar";
}

std::shared_ptr<ShardDataset> open_shards(const std::string& pattern, bool train = false) {
  auto index = ddp::data::scan_image_shards(ddp::data::expand_shard_pattern(pattern));
  return std::make_shared<ShardDataset>(
      std::move(index), ShardDatasetOptions().transform(ddp::data::ImageTransformOptions().size(8).train(train)),
      "test shards");
}

int64_t total(const std::vector<int64_t>& sizes) {
  int64_t n = 0;
  for (auto s : sizes) n += s;
  return n;
}

}  // namespace

TEST(ShardPattern, ExpandsRangesListsAndCommas) {
  using ddp::data::expand_shard_pattern;
  EXPECT_EQ(expand_shard_pattern("t-{0000..0002}.tar"),
            (std::vector<std::string>{"t-0000.tar", "t-0001.tar", "t-0002.tar"}));
  EXPECT_EQ(expand_shard_pattern("{a,b}-{8..10}.tar"),
            (std::vector<std::string>{"a-8.tar", "a-9.tar", "a-10.tar", "b-8.tar", "b-9.tar", "b-10.tar"}));
  EXPECT_EQ(expand_shard_pattern("x.tar,y-{08..09}.tar"), (std::vector<std::string>{"x.tar", "y-08.tar", "y-09.tar"}));
  EXPECT_EQ(expand_shard_pattern("/d/one.tar"), (std::vector<std::string>{"/d/one.tar"}));
  EXPECT_NE(user_error([] { expand_shard_pattern("t-{3..1}.tar"); }).find("runs backwards"), std::string::npos);
  EXPECT_NE(user_error([] { expand_shard_pattern("t-{1..2.tar"); }).find("unclosed brace"), std::string::npos);
  EXPECT_NE(user_error([] { expand_shard_pattern("t-{{1..2}}.tar"); }).find("nested"), std::string::npos);
  EXPECT_NE(user_error([] { expand_shard_pattern("t-{a..2}.tar"); }).find("not a range"), std::string::npos);
}

TEST(ShardMember, KeyIsThePathUpToTheFirstDotOfTheFileName) {
  using ddp::data::split_member_name;
  EXPECT_EQ(split_member_name("n01/img_3.jpg"), (std::pair<std::string, std::string>{"n01/img_3", "jpg"}));
  EXPECT_EQ(split_member_name("dir.v1/a.seg.png"), (std::pair<std::string, std::string>{"dir.v1/a", "seg.png"}));
  EXPECT_EQ(split_member_name("plain"), (std::pair<std::string, std::string>{"plain", ""}));
}

TEST(ShardReader, GroupsConsecutiveMembersByKeyAndReadsOnlyWhatIsAsked) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_reader");
  {
    TarWriter w(dir + "/a.tar");
    for (const auto& [name, text] : std::vector<std::pair<std::string, std::string>>{
             {"x/a.jpg", "AAAA"}, {"x/a.cls", "1"}, {"x/b.png", "BB"}, {"x/b.cls", "2"}, {"x/b.meta.json", "{}"},
             {"c.cls", "3"}})
      w.add(name, text.data(), text.size());
    EXPECT_FALSE(fs::exists(dir + "/a.tar")) << "visible before close()";
    w.close();
  }
  ShardReader r(dir + "/a.tar");
  ShardSample s;
  ASSERT_TRUE(r.next(&s, ShardRead::kAll));
  EXPECT_EQ(s.key, "x/a");
  ASSERT_EQ(s.fields.size(), 2u);
  EXPECT_EQ(std::string(s.fields["jpg"].begin(), s.fields["jpg"].end()), "AAAA");
  ASSERT_TRUE(r.next(&s, ShardRead::kLabel));
  EXPECT_EQ(s.key, "x/b");
  ASSERT_EQ(s.fields.size(), 3u);
  EXPECT_TRUE(s.fields["png"].empty());
  EXPECT_EQ(std::string(s.fields["cls"].begin(), s.fields["cls"].end()), "2");
  EXPECT_TRUE(s.fields.count("meta.json"));
  ASSERT_TRUE(r.next(&s, ShardRead::kNothing));
  EXPECT_EQ(s.key, "c");
  EXPECT_TRUE(s.fields["cls"].empty());
  EXPECT_FALSE(r.next(&s, ShardRead::kAll));
}

TEST(StreamOrder, AFunctionOfSeedEpochAndStreams) {
  const std::vector<int64_t> sizes{7, 3, 5, 9, 1};
  auto o = StreamOrderOptions().seed(3).epoch(1).streams(2).shuffle_buffer(4);
  const auto a = ddp::data::plan_stream_order(sizes, o).ids;
  EXPECT_EQ(a, ddp::data::plan_stream_order(sizes, o).ids);
  EXPECT_NE(a, ddp::data::plan_stream_order(sizes, StreamOrderOptions(o).epoch(2)).ids);
  EXPECT_NE(a, ddp::data::plan_stream_order(sizes, StreamOrderOptions(o).seed(4)).ids);
  EXPECT_NE(a, ddp::data::plan_stream_order(sizes, StreamOrderOptions(o).streams(1)).ids);
  // Unshuffled: the shards in their order, one stream.
  const auto plain = ddp::data::plan_stream_order(sizes, StreamOrderOptions().streams(1).shuffle(false)).ids;
  std::vector<int64_t> in_order(25);
  std::iota(in_order.begin(), in_order.end(), 0);
  EXPECT_EQ(plain, in_order);
}

TEST(StreamOrder, ShuffleBufferMovesASampleAtMostItsSizeEarlier) {
  const std::vector<int64_t> sizes{40, 40, 40};
  for (int64_t buffer : {1, 2, 8, 500}) {
    const auto plan = ddp::data::plan_stream_order(sizes, StreamOrderOptions().seed(1).streams(1).shuffle_buffer(buffer));
    std::vector<int64_t> sorted = plan.raw;
    std::sort(sorted.begin(), sorted.end());
    for (size_t k = 0; k < sorted.size(); ++k) ASSERT_EQ(sorted[k], static_cast<int64_t>(k));
    for (size_t k = 0; k < plan.raw.size(); ++k)
      EXPECT_LE(plan.raw[k], static_cast<int64_t>(k) + std::max<int64_t>(buffer, 1) - 1) << "buffer " << buffer;
    if (buffer == 1) {
      EXPECT_TRUE(std::is_sorted(plan.raw.begin(), plan.raw.end()));
    }
  }
}

// Shard counts and sizes that do and do not divide among 4 streams: each
// rank gets the same number of samples, every sample comes once, and only
// the streams' padding (streams x Q - N, wrapped from the epoch's start)
// comes twice.
TEST(StreamOrder, EverySampleOncePerEpochAcrossRanks) {
  for (const auto& sizes : std::vector<std::vector<int64_t>>{{5, 5, 5, 5}, {7, 3, 5, 9, 1}, {2, 2, 2}, {30}, {1, 1}}) {
    const int64_t N = total(sizes), S = 4, Q = (N + S - 1) / S;
    for (int64_t world : {1, 2, 4}) {
      std::map<int64_t, int> seen;
      std::vector<int64_t> sequence;
      for (int64_t r = 0; r < world; ++r) {
        const auto plan = ddp::data::plan_stream_order(
            sizes, StreamOrderOptions().seed(9).epoch(2).streams(S).shuffle_buffer(3).rank(r).world(world));
        EXPECT_EQ(static_cast<int64_t>(plan.ids.size()), S * Q / world);
        EXPECT_EQ(static_cast<int64_t>(plan.ids.size()), ddp::data::stream_epoch_samples(N, S, world));
        for (auto id : plan.ids) ++seen[id];
        sequence = plan.sequence;
      }
      ASSERT_EQ(static_cast<int64_t>(seen.size()), N) << "N " << N << " world " << world;
      int64_t twice = 0;
      for (const auto& [id, times] : seen) {
        // The streams cover positions 0 .. S*Q-1 of the sequence, modulo N.
        const int64_t at = std::find(sequence.begin(), sequence.end(), id) - sequence.begin();
        const int64_t expected = (S * Q - 1 - at) / N + 1;
        EXPECT_EQ(times, expected) << "id " << id << " N " << N;
        twice += times - 1;
      }
      EXPECT_EQ(twice, S * Q - N);
    }
  }
}

// Rank r of W takes global positions r, r + W, ...: the same samples in the
// same global batches on 1, 2 or 4 ranks of a run with 4 streams.
TEST(StreamOrder, SameGlobalOrderOnEveryWorldSizeThatDividesTheStreams) {
  const std::vector<int64_t> sizes{7, 3, 5, 9, 1, 11};
  const auto one = ddp::data::plan_stream_order(sizes, StreamOrderOptions().seed(5).streams(4).shuffle_buffer(6)).ids;
  for (int64_t world : {2, 4}) {
    for (int64_t r = 0; r < world; ++r) {
      const auto mine = ddp::data::plan_stream_order(
          sizes, StreamOrderOptions().seed(5).streams(4).shuffle_buffer(6).rank(r).world(world));
      for (size_t p = 0; p < mine.ids.size(); ++p)
        ASSERT_EQ(mine.ids[p], one[p * static_cast<size_t>(world) + static_cast<size_t>(r)]) << world << " " << r;
      // And its samples come from its own streams only.
      for (auto s : mine.stream) EXPECT_EQ(s % world, r);
    }
  }
  EXPECT_NE(user_error([&] { ddp::data::plan_stream_order(sizes, StreamOrderOptions().streams(4).world(3)); })
                .find("--shard-streams 4 is not a multiple of the world size 3"),
            std::string::npos);
}

// Through the real Loader: 0 or 3 worker threads give the planned samples
// (labels are the sample ids) in the planned order, on both ranks, and the
// two ranks together hold every sample.
TEST(ShardDataset, LoaderWorkersGiveThePlannedSamplesInOrder) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_loader");
  const std::vector<int64_t> sizes{6, 2, 5, 3, 4};
  const auto data = open_shards(write_shards(dir, sizes));
  std::set<int64_t> all;
  for (int64_t rank = 0; rank < 2; ++rank) {
    std::vector<int64_t> first_run;
    for (int64_t workers : {0, 3}) {
      const auto o = StreamOrderOptions().seed(1).epoch(0).streams(2).shuffle_buffer(4).rank(rank).world(2);
      const auto ids = data->epoch_order(o, 0);
      ddp::data::Loader loader(data, ids, ddp::data::LoaderOptions(3).workers(workers).seed(1).epoch(0).rank(rank));
      std::vector<int64_t> got;
      while (auto b = loader.next())
        for (int64_t j = 0; j < b->target().size(0); ++j) got.push_back(b->target()[j].item<int64_t>());
      EXPECT_EQ(got, ids) << "workers " << workers;
      all.insert(got.begin(), got.end());
    }
  }
  EXPECT_EQ(static_cast<int64_t>(all.size()), total(sizes));
}

// Mid-epoch resume: the stream replayed from position 9 gives bit for bit
// the batches of the uninterrupted epoch (augmentation on).
TEST(ShardDataset, ResumedMidEpochGivesTheSameBatchesBitForBit) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_resume");
  const auto data = open_shards(write_shards(dir, {6, 2, 5, 3, 4}), /*train=*/true);
  const auto o = StreamOrderOptions().seed(2).epoch(1).streams(2).shuffle_buffer(5).rank(1).world(2);
  const ddp::data::DrawKey key{2, 1, 1};
  const auto ids = data->epoch_order(o, 0);
  std::vector<ddp::data::Batch> straight;
  for (size_t first = 0; first < ids.size(); first += 3) {
    std::vector<int64_t> chunk(ids.begin() + first, ids.begin() + std::min(first + 3, ids.size()));
    straight.push_back(data->get_keyed_batch(chunk, key, static_cast<int64_t>(first)));
  }
  EXPECT_EQ(data->epoch_order(o, 9), ids);
  for (size_t first = 9; first < ids.size(); first += 3) {
    std::vector<int64_t> chunk(ids.begin() + first, ids.begin() + std::min(first + 3, ids.size()));
    auto b = data->get_keyed_batch(chunk, key, static_cast<int64_t>(first));
    EXPECT_TRUE(torch::equal(b.input(), straight[first / 3].input())) << "batch at " << first;
    EXPECT_TRUE(torch::equal(b.target(), straight[first / 3].target()));
  }
  // Indexed access (evaluation) reads the same pixels as the stream.
  const auto eval = open_shards(dir + "/s-{0..4}.tar");
  eval->epoch_order(StreamOrderOptions().streams(1).shuffle(false), 0);
  std::vector<int64_t> some{3, 17, 4, 0};
  auto indexed = eval->get_batch(some);
  auto streamed = eval->get_keyed_batch({0, 1, 2, 3}, ddp::data::DrawKey{}, 0);
  EXPECT_TRUE(torch::equal(indexed.input()[3], streamed.input()[0]));
  EXPECT_TRUE(torch::equal(indexed.input()[0], streamed.input()[3]));
  EXPECT_EQ(indexed.target()[1].item<int64_t>(), 17);
}

TEST(BadShard, TruncatedTarNamesTheShardAndTheLastMember) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("bad_truncated");
  write_shards(dir, {4, 4});
  const auto path = dir + "/s-1.tar";
  fs::resize_file(path, fs::file_size(path) / 2 + 100);
  const auto msg = user_error([&] { ddp::data::scan_image_shards(ddp::data::expand_shard_pattern(dir + "/s-{0..1}.tar")); });
  EXPECT_NE(msg.find("shard " + path + " is damaged"), std::string::npos) << msg;
  EXPECT_NE(msg.find(" member k"), std::string::npos) << msg;
  EXPECT_EQ(msg.find('\n'), std::string::npos) << msg;
}

TEST(BadShard, SampleMissingAFieldNamesTheShardAndTheKey) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("bad_field");
  {
    TarWriter w(dir + "/a.tar");
    const auto png = png_bytes(0);
    w.add("good.png", png.data(), png.size());
    w.add("good.cls", "1", 1);
    w.add("nolabel.png", png.data(), png.size());
    w.close();
    TarWriter v(dir + "/b.tar");
    v.add("noimage.cls", "1", 1);
    v.add("noimage.txt", "hi", 2);
    v.close();
  }
  auto msg = user_error([&] { ddp::data::scan_image_shards({dir + "/a.tar"}); });
  EXPECT_NE(msg.find("shard " + dir + "/a.tar: sample nolabel has no class (.cls); its files: .png."), std::string::npos)
      << msg;
  msg = user_error([&] { ddp::data::scan_image_shards({dir + "/b.tar"}); });
  EXPECT_NE(msg.find("shard " + dir + "/b.tar: sample noimage has no image"), std::string::npos) << msg;
  // A corrupt image stops the batch that meets it, naming the sample.
  {
    TarWriter w(dir + "/c.tar");
    w.add("broken.jpg", "not a jpeg", 10);
    w.add("broken.cls", "0", 1);
    w.close();
  }
  const auto data = open_shards(dir + "/c.tar");
  msg = user_error([&] { data->get_batch({0}); });
  EXPECT_NE(msg.find("shard " + dir + "/c.tar: sample broken's image does not decode"), std::string::npos) << msg;
}

TEST(BadShard, ShardVanishingMidEpochNamesTheShardAndTheNextSample) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("bad_vanish");
  const auto data = open_shards(write_shards(dir, {3, 3, 3}));
  const auto o = StreamOrderOptions().streams(1).shuffle(false);
  const auto ids = data->epoch_order(o, 0);
  EXPECT_NO_THROW(data->get_keyed_batch({ids[0], ids[1]}, ddp::data::DrawKey{}, 0));
  fs::remove(dir + "/s-1.tar");
  const auto msg = user_error([&] { data->get_keyed_batch({ids[2], ids[3]}, ddp::data::DrawKey{}, 2); });
  EXPECT_NE(msg.find("shard " + dir + "/s-1.tar vanished during the epoch, before its sample k3."), std::string::npos)
      << msg;
}

// ---- the streams' reader threads ----

namespace {

// The batches of `positions` of `ids`, 3 samples each, asked of `data` by
// `threads` threads at once: thread t takes batch b for b % threads == t,
// odd threads from their last batch down, so some ask far ahead of the
// readers' bound.
std::vector<ddp::data::Batch> batches_from_threads(const ShardDataset& data, const std::vector<int64_t>& ids,
                                                   const ddp::data::DrawKey& key, int64_t threads) {
  const int64_t n = (static_cast<int64_t>(ids.size()) + 2) / 3;
  std::vector<ddp::data::Batch> out(static_cast<size_t>(n));
  std::vector<std::thread> pool;
  for (int64_t t = 0; t < threads; ++t)
    pool.emplace_back([&, t] {
      std::vector<int64_t> mine;
      for (int64_t b = t; b < n; b += threads) mine.push_back(b);
      if (t % 2) std::reverse(mine.begin(), mine.end());
      for (int64_t b : mine) {
        const auto first = static_cast<size_t>(3 * b);
        std::vector<int64_t> chunk(ids.begin() + first, ids.begin() + std::min(first + 3, ids.size()));
        out[static_cast<size_t>(b)] = data.get_keyed_batch(chunk, key, static_cast<int64_t>(first));
      }
    });
  for (auto& th : pool) th.join();
  return out;
}

}  // namespace

// 8 worker threads taking batches of one rank's two streams at once, in
// scrambled order, get exactly the planned samples, bit for bit as read by
// index (augmentation on), epoch after epoch (the readers re-armed).
TEST(ShardDataset, EightWorkerThreadsTakingTheStreamsAtOnceGetThePlannedSamples) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_threads");
  const auto pattern = write_shards(dir, {7, 5, 9, 4, 6, 8});
  const auto data = open_shards(pattern, /*train=*/true), by_index = open_shards(pattern, /*train=*/true);
  for (int64_t epoch = 0; epoch < 3; ++epoch) {
    const auto o = StreamOrderOptions().seed(5).epoch(epoch).streams(2).shuffle_buffer(2).rank(0).world(1);
    const ddp::data::DrawKey key{5, epoch, 0};
    const auto ids = data->epoch_order(o, 0);
    ASSERT_EQ(ids.size(), 40u);  // 2 streams x 20 (one sample seen twice)
    const auto got = batches_from_threads(*data, ids, key, 8);
    for (size_t b = 0; b < got.size(); ++b) {
      const auto first = 3 * b;
      std::vector<int64_t> chunk(ids.begin() + first, ids.begin() + std::min(first + 3, ids.size()));
      const auto want = by_index->get_keyed_batch(chunk, key, static_cast<int64_t>(first));  // never armed: by index
      ASSERT_TRUE(got[b].target().defined()) << "epoch " << epoch << " batch " << b;
      EXPECT_TRUE(torch::equal(got[b].target(), torch::tensor(chunk))) << "epoch " << epoch << " batch " << b;
      EXPECT_TRUE(torch::equal(got[b].input(), want.input())) << "epoch " << epoch << " batch " << b;
    }
  }
  EXPECT_EQ(data->samples_read_by_index(), 0) << "batches read by index, not from the streams";
  EXPECT_GT(by_index->samples_read_by_index(), 0);
}

// The point of the readers: a worker whose samples are read gets them while
// another worker waits on a shard the stream is still reading (here a pipe
// that has no data yet), rather than waiting behind it.
TEST(ShardDataset, AWorkerGetsReadSamplesWhileAnotherWaitsOnAShardStillBeingRead) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_pipe");
  const auto data = open_shards(write_shards(dir, {4, 3}));  // scanned while s-1 is a file
  const std::string pipe = dir + "/s-1.tar";
  const auto bytes = file_bytes(pipe);
  fs::remove(pipe);
  ASSERT_EQ(mkfifo(pipe.c_str(), 0600), 0);
  const auto ids = data->epoch_order(StreamOrderOptions().streams(1).shuffle(false), 0);
  auto label = [&](int64_t p) {
    return data->get_keyed_batch({ids[static_cast<size_t>(p)]}, ddp::data::DrawKey{}, p).target()[0].item<int64_t>();
  };
  auto in_pipe = std::async(std::launch::async, label, 4);  // k4: the pipe's first sample
  // A writer can open the pipe once the stream has it open to read: from
  // then on the stream is inside the shard still being read.
  int fd = -1;
  for (int tries = 0; fd < 0 && tries < 1000; ++tries) {
    fd = open(pipe.c_str(), O_WRONLY | O_NONBLOCK);
    if (fd < 0) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  }
  // Whatever fails below, the pipe ends (the reader sees a short shard), so
  // the futures' destructors do not wait forever.
  struct EndPipe {
    int& fd;
    ~EndPipe() {
      if (fd >= 0) close(fd);
    }
  } end_pipe{fd};
  ASSERT_GE(fd, 0) << "nothing opened the pipe to read it";
  auto read_first = std::async(std::launch::async, label, 0);
  EXPECT_EQ(read_first.wait_for(std::chrono::seconds(5)), std::future_status::ready)
      << "a worker waited behind the one whose shard is still being read";
  fcntl(fd, F_SETFL, 0);
  for (size_t off = 0; off < bytes.size();) {
    const ssize_t n = write(fd, bytes.data() + off, bytes.size() - off);
    ASSERT_GT(n, 0);
    off += static_cast<size_t>(n);
  }
  close(fd);
  fd = -1;
  EXPECT_EQ(read_first.get(), 0);
  EXPECT_EQ(in_pipe.get(), 4);
  EXPECT_EQ(data->samples_read_by_index(), 0);
}

// A shard gone before the reader reaches it (or cut short in its first
// sample) fails, with the one-line error of the sample, every worker asking
// for a sample from it on, while those asking earlier samples get them;
// nothing hangs.
TEST(BadShard, ShardGoneBeforeTheReaderReachesItFailsTheWorkersAskingFromItOn) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  for (const bool truncate : {false, true}) {
    const auto dir = ddp::testing::temp_dir("bad_reader");
    const auto data = open_shards(write_shards(dir, {30, 3, 3}));
    const std::string gone = dir + "/s-1.tar";
    if (truncate) fs::resize_file(gone, 600);  // inside k30's first member
    else fs::remove(gone);
    const auto ids = data->epoch_order(StreamOrderOptions().streams(1).shuffle(false), 0);
    ASSERT_EQ(ids.size(), 36u);
    std::vector<std::string> errors(ids.size());
    std::vector<int64_t> labels(ids.size(), -1);
    std::vector<std::thread> pool;
    for (int64_t t = 0; t < 8; ++t)
      pool.emplace_back([&, t] {
        for (int64_t p = 35 - t; p >= 0; p -= 8)  // the furthest first: they wait on the reader
          try {
            labels[static_cast<size_t>(p)] =
                data->get_keyed_batch({ids[static_cast<size_t>(p)]}, ddp::data::DrawKey{}, p).target()[0].item<int64_t>();
          } catch (const ddp::UserError& e) {
            errors[static_cast<size_t>(p)] = e.what();
          }
      });
    for (auto& th : pool) th.join();
    for (size_t p = 0; p < ids.size(); ++p) {
      if (p < 30) {
        EXPECT_EQ(errors[p], "") << p;
        EXPECT_EQ(labels[p], static_cast<int64_t>(p));
      } else if (!truncate) {
        EXPECT_NE(errors[p].find("shard " + gone + " vanished during the epoch, before its sample k30."),
                  std::string::npos) << p << ": " << errors[p];
      } else {
        EXPECT_NE(errors[p].find("shard " + gone + " is damaged"), std::string::npos) << p << ": " << errors[p];
      }
      EXPECT_EQ(errors[p].find('\n'), std::string::npos) << errors[p];
    }
  }
}

// Destroying the dataset, or arming another epoch, with readers running
// (one waiting for room, after a batch; one stopped with its loader after
// a batch) returns at once, and a worker of the old epoch still gets its
// samples (by index).
TEST(ShardDataset, ReadersStopPromptlyWhenReArmedOrDestroyedMidEpoch) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_stop");
  const auto pattern = write_shards(dir, {40, 40});
  const auto by_index = open_shards(pattern, /*train=*/true);
  auto data = open_shards(pattern, /*train=*/true);
  const auto o = StreamOrderOptions().seed(3).epoch(0).streams(2).shuffle_buffer(3);
  const ddp::data::DrawKey key{3, 0, 0};
  const auto ids = data->epoch_order(o, 0);
  {
    ddp::data::Loader loader(data, ids, ddp::data::LoaderOptions(4).workers(2).seed(3).epoch(0).rank(0));
    ASSERT_TRUE(loader.next().has_value());
  }  // stopped mid-epoch
  const std::vector<int64_t> later(ids.begin() + 40, ids.begin() + 44);
  const auto want = by_index->get_keyed_batch(later, key, 40);
  data->epoch_order(StreamOrderOptions(o).epoch(1), 0);  // re-armed while the old readers wait for room
  const auto old = data->get_keyed_batch(later, key, 40);
  EXPECT_TRUE(torch::equal(old.input(), want.input()));
  EXPECT_TRUE(torch::equal(old.target(), want.target()));
  data->get_keyed_batch({data->epoch_order(StreamOrderOptions(o).epoch(1), 0)[0]}, ddp::data::DrawKey{3, 1, 0}, 0);
  const auto start = std::chrono::steady_clock::now();
  data.reset();  // its readers wait for room
  EXPECT_LT(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(), 2.0);
}

namespace {

// Whether this process has `path` open (a stream's reader reading it).
bool have_open(const std::string& path) {
  const auto want = fs::canonical(path);
  for (const auto& e : fs::directory_iterator("/proc/self/fd")) {
    std::error_code ec;
    if (fs::read_symlink(e.path(), ec) == want) return true;
  }
  return false;
}

// The shard that epoch `o`'s first stream reads first.
std::string first_shard(const ShardDataset& data, const StreamOrderOptions& o) {
  const auto plan = ddp::data::plan_stream_order(data.index().shard_sizes(), o);
  return data.index().paths[static_cast<size_t>(data.index().shard_of(plan.sequence[0]))];
}

// Epoch `o`'s batches of 5, taken in order from its streams.
std::vector<ddp::data::Batch> take_epoch(const ShardDataset& data, const StreamOrderOptions& o) {
  const auto ids = data.epoch_order(o, 0);
  const ddp::data::DrawKey key{o.seed(), o.epoch(), o.rank()};
  std::vector<ddp::data::Batch> out;
  for (size_t p = 0; p < ids.size(); p += 5) {
    std::vector<int64_t> chunk(ids.begin() + static_cast<std::ptrdiff_t>(p),
                               ids.begin() + static_cast<std::ptrdiff_t>(std::min(p + 5, ids.size())));
    out.push_back(data.get_keyed_batch(chunk, key, static_cast<int64_t>(p)));
  }
  return out;
}

}  // namespace

// Once an epoch's samples are all read and another epoch follows, that
// epoch's streams start filling their shuffle buffers (the trainer's next
// epoch used to wait for them); it changes no sample: its batches are the
// ones a dataset that read nothing ahead gives, bit for bit.
TEST(ShardDataset, TheNextEpochStartsReadingOnceThisOnesSamplesAreRead) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_next");
  const auto pattern = write_shards(dir, {30, 30, 30});
  const auto data = open_shards(pattern, /*train=*/true), fresh = open_shards(pattern, /*train=*/true);
  const auto o = StreamOrderOptions().seed(9).streams(1).shuffle_buffer(6);
  const auto next = StreamOrderOptions(o).epoch(1);
  take_epoch(*data, StreamOrderOptions(o).next_epoch_follows(true));
  // Epoch 1's reader fills its buffer of 6 from its first shard and waits
  // there, with the shard open.
  bool opened = false;
  for (int tries = 0; !opened && tries < 500; ++tries) {
    opened = have_open(first_shard(*data, next));
    if (!opened) std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  EXPECT_TRUE(opened) << "epoch 1 read nothing ahead: " << first_shard(*data, next) << " is not open";
  const auto got = take_epoch(*data, next), want = take_epoch(*fresh, next);
  ASSERT_EQ(got.size(), want.size());
  for (size_t b = 0; b < got.size(); ++b) {
    EXPECT_TRUE(torch::equal(got[b].input(), want[b].input())) << "batch " << b;
    EXPECT_TRUE(torch::equal(got[b].target(), want[b].target())) << "batch " << b;
  }
  EXPECT_EQ(data->samples_read_by_index(), 0);
}

// The last epoch (no next_epoch_follows) reads nothing beyond itself.
TEST(ShardDataset, TheLastEpochReadsNothingAhead) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_last");
  const auto data = open_shards(write_shards(dir, {30, 30, 30}), /*train=*/true);
  const auto o = StreamOrderOptions().seed(9).streams(1).shuffle_buffer(6);
  take_epoch(*data, o);
  std::this_thread::sleep_for(std::chrono::milliseconds(300));
  for (const auto& path : data->index().paths) EXPECT_FALSE(have_open(path)) << path;
}

// ---- fields beyond the image, and bad samples skipped ----

namespace {

// Shard DIR/f.tar of `n` samples k<i>: a PNG, .cls i % 3, and the fields a
// task asks for: .cls2 (i * 10, text), .f32 (three raw floats i, i + 0.5,
// -i) and .txt ("i, 2i").
std::string write_field_shard(const std::string& dir, int64_t n) {
  TarWriter w(dir + "/f.tar");
  for (int64_t i = 0; i < n; ++i) {
    const auto png = png_bytes(i);
    const std::string key = "k" + std::to_string(i), cls = std::to_string(i % 3), cls2 = std::to_string(i * 10);
    const float f32[3] = {static_cast<float>(i), static_cast<float>(i) + 0.5f, -static_cast<float>(i)};
    const std::string txt = std::to_string(i) + ", " + std::to_string(2 * i) + "\n";
    w.add(key + ".png", png.data(), png.size());
    w.add(key + ".cls", cls.data(), cls.size());
    w.add(key + ".cls2", cls2.data(), cls2.size());
    w.add(key + ".f32", f32, sizeof f32);
    w.add(key + ".txt", txt.data(), txt.size());
  }
  w.close();
  return dir + "/f.tar";
}

std::vector<ddp::data::ShardField> test_fields() {
  return {{"cls2", ddp::data::integer_field("label2")},
          {"f32", ddp::data::float32_field("embedding")},
          {"txt", ddp::data::numbers_field("numbers")}};
}

}  // namespace

// A task's own fields reach the batch as named tensors beside "input" and
// "target", stacked in the batch's order, streamed or by index.
TEST(ShardFields, OtherExtensionsBecomeNamedTensorsOfTheBatch) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_fields");
  const auto path = write_field_shard(dir, 7);
  auto index = ddp::data::scan_shards({path}, ddp::data::ShardScanOptions().fields({"cls2", "f32", "txt"}));
  const auto data = std::make_shared<ShardDataset>(
      std::move(index),
      ShardDatasetOptions().transform(ddp::data::ImageTransformOptions().size(8).train(false)).fields(test_fields()),
      "fields");
  const auto ids = data->epoch_order(StreamOrderOptions().seed(3).streams(1).shuffle_buffer(4), 0);
  ddp::data::Loader loader(data, ids, ddp::data::LoaderOptions(3).workers(2).seed(3));
  std::vector<int64_t> seen;
  while (auto b = loader.next()) {
    EXPECT_EQ(b->names(), (std::vector<std::string>{"embedding", "input", "label2", "numbers", "target"}));
    for (int64_t j = 0; j < b->target().size(0); ++j) {
      const int64_t i = ids[seen.size()];  // key k<i> is sample id i
      EXPECT_EQ(b->target()[j].item<int64_t>(), i % 3);
      EXPECT_EQ(b->at("label2")[j].item<int64_t>(), 10 * i);
      EXPECT_TRUE(torch::equal(b->at("embedding")[j], torch::tensor({1.0f * i, i + 0.5f, -1.0f * i})));
      EXPECT_TRUE(torch::equal(b->at("numbers")[j], torch::tensor({1.0f * i, 2.0f * i})));
      seen.push_back(i);
    }
  }
  EXPECT_EQ(seen, ids);
  const auto indexed = data->get_batch({4, 1});
  EXPECT_EQ(indexed.at("label2")[0].item<int64_t>(), 40);
  EXPECT_EQ(indexed.at("embedding").sizes(), (std::vector<int64_t>{2, 3}));
  // Without an image: the fields alone.
  auto plain = std::make_shared<ShardDataset>(
      ddp::data::scan_shards({path}, ddp::data::ShardScanOptions().image(false).fields({"cls2"})),
      ShardDatasetOptions().image(false).fields({{"cls2", ddp::data::integer_field("target")}}), "no image");
  EXPECT_EQ(plain->get_batch({2, 5}).names(), (std::vector<std::string>{"target"}));
  EXPECT_TRUE(plain->input_shape().empty());
  // A field every sample needs, missing: the scan names it.
  auto msg = user_error([&] { ddp::data::scan_shards({path}, ddp::data::ShardScanOptions().fields({"json"})); });
  EXPECT_NE(msg.find("shard " + path + ": sample k0 has no .json; its files: .cls, .cls2, .f32, .png, .txt."),
            std::string::npos) << msg;
}

// A field that does not decode, or decodes to another shape than the rest
// of its batch, stops the batch naming the shard, sample and field.
TEST(ShardFields, AFieldThatDoesNotDecodeNamesTheSample) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_fields_bad");
  {
    TarWriter w(dir + "/b.tar");
    const std::pair<const char*, const char*> samples[] = {{"a", "1 2"}, {"b", "3 4 5"}, {"c", "6 x"}};
    for (const auto& [key, txt] : samples) w.add(std::string(key) + ".txt", txt, std::strlen(txt));
    w.close();
  }
  auto data = std::make_shared<ShardDataset>(
      ddp::data::scan_shards({dir + "/b.tar"}, ddp::data::ShardScanOptions().image(false).fields({"txt"})),
      ShardDatasetOptions().image(false).fields({{"txt", ddp::data::numbers_field("v")}}), "bad fields");
  auto msg = user_error([&] { data->get_batch({0, 1}); });
  EXPECT_NE(msg.find("sample b's 'v' is not shaped as sample a's [2]."), std::string::npos) << msg;
  msg = user_error([&] { data->get_batch({2}); });
  EXPECT_NE(msg.find("shard " + dir + "/b.tar: sample c's .txt"), std::string::npos) << msg;
  EXPECT_NE(msg.find("'x' is not a number"), std::string::npos) << msg;
}

// --skip-bad-samples: a sample missing a field is left out at the scan
// (listed); one whose image does not decode is replaced, in its place, by
// the next sample of its shard that decodes (image, label and fields), the
// same for any worker count, and counted for its epoch. Without the flag
// both stop the run, naming shard and key.
TEST(BadShard, SkipBadSamplesLeavesOutIncompleteAndReplacesUndecodable) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("bad_skip");
  {
    TarWriter w(dir + "/s.tar");
    for (int64_t i = 0; i < 8; ++i) {
      const auto png = png_bytes(i);
      const std::string key = "k" + std::to_string(i), cls = std::to_string(i);
      if (i == 5) w.add(key + ".png", "not a png", 9);  // corrupt
      else w.add(key + ".png", png.data(), png.size());
      if (i != 2) w.add(key + ".cls", cls.data(), cls.size());  // k2: no class
    }
    w.close();
  }
  const std::string path = dir + "/s.tar";
  auto msg = user_error([&] { ddp::data::scan_image_shards({path}); });
  EXPECT_NE(msg.find("shard " + path + ": sample k2 has no class (.cls)"), std::string::npos) << msg;
  auto index = ddp::data::scan_shards({path}, ddp::data::ShardScanOptions().skip_incomplete(true));
  EXPECT_EQ(index.left_out, (std::vector<std::string>{path + ": k2 (no class (.cls))"}));
  ASSERT_EQ(index.size(), 7);  // k0 k1 k3 k4 k5 k6 k7: id 4 is k5
  EXPECT_EQ(index.keys[4], "k5");
  auto make = [&](bool skip) {
    return std::make_shared<ShardDataset>(
        index, ShardDatasetOptions().transform(ddp::data::ImageTransformOptions().size(8).train(true)).skip_bad(skip),
        "skip");
  };
  msg = user_error([&] { make(false)->get_batch({4}); });
  EXPECT_NE(msg.find("shard " + path + ": sample k5's image does not decode"), std::string::npos) << msg;

  const auto data = make(true), good = make(false);
  const auto o = StreamOrderOptions().seed(4).epoch(2).streams(1).shuffle_buffer(3);
  const ddp::data::DrawKey key{4, 2, 0};
  std::vector<ddp::data::Batch> by_workers;
  for (int64_t workers : {0, 2}) {
    const auto ids = data->epoch_order(o, 0);
    ASSERT_EQ(ids.size(), 7u);
    ddp::data::Loader loader(data, ids, ddp::data::LoaderOptions(7).workers(workers).seed(4).epoch(2).rank(0));
    by_workers.push_back(*loader.next());
    const auto& b = by_workers.back();
    const auto at = static_cast<int64_t>(std::find(ids.begin(), ids.end(), 4) - ids.begin());
    // k5's place holds k6 (id 5): its label, and its image as drawn for k5's position.
    EXPECT_EQ(b.target()[at].item<int64_t>(), 6);
    const auto k6 = good->get_keyed_batch({5}, key, at);
    EXPECT_TRUE(torch::equal(b.input()[at], k6.input()[0]));
    for (int64_t j = 0; j < 7; ++j) {
      if (j != at) {
        EXPECT_TRUE(torch::equal(b.input()[j], good->get_keyed_batch({ids[static_cast<size_t>(j)]}, key, j).input()[0]));
      }
    }
  }
  EXPECT_TRUE(torch::equal(by_workers[0].input(), by_workers[1].input()));
  EXPECT_EQ(data->skipped(2), 2);  // once per pass
  EXPECT_EQ(data->skipped(1), 0);
}

// ---- the program ----

namespace {

// DIR/<class>/<i>.png: `per_class` images for each of `classes` classes.
void write_image_folder(const std::string& dir, int classes, int per_class) {
  for (int c = 0; c < classes; ++c) {
    fs::create_directories(dir + "/c" + std::to_string(c));
    for (int i = 0; i < per_class; ++i) {
      const auto png = png_bytes(c * 1000 + i, 10 + (i % 3) * 4);
      std::ofstream f(dir + "/c" + std::to_string(c) + "/" + std::to_string(i) + ".png", std::ios::binary);
      f.write(reinterpret_cast<const char*>(png.data()), static_cast<std::streamsize>(png.size()));
    }
  }
}

std::vector<std::string> shard_run_args(const std::string& save, const std::string& train, const std::string& val) {
  return {DDPTRAIN_EXE, "--dataset", "shards", "--data_root", train, "--val-root", val, "--image-size", "16",
          "--model", "cnn", "--batch", "4", "--epochs", "2", "--size", "2", "--backend", "gloo", "--timeout", "60",
          "--save_path", save, "--progress", "plain", "--log-every", "1", "--shuffle-buffer", "8", "--workers", "2"};
}

// PATH: `n` samples KEY<i> (a PNG from seed + i, class i % 3), of which
// those in `undecodable` hold garbage for an image and `no_class` has no
// .cls.
void write_bad_shard(const std::string& path, const std::string& key_prefix, int64_t n, int64_t seed,
                     const std::set<int64_t>& undecodable, int64_t no_class) {
  TarWriter w(path);
  for (int64_t i = 0; i < n; ++i) {
    const auto png = png_bytes(seed + i);
    const std::string key = key_prefix + std::to_string(i), cls = std::to_string(i % 3);
    if (undecodable.count(i)) w.add(key + ".png", "garbage", 7);
    else w.add(key + ".png", png.data(), png.size());
    if (i != no_class) w.add(key + ".cls", cls.data(), cls.size());
  }
  w.close();
}

// Five shards of 160 samples (20 steps an epoch of shard_run_args) under
// DIR, and one validation shard under DIR/v: {train, val} patterns.
std::pair<std::string, std::string> five_shards_and_val(const std::string& dir) {
  const auto train = write_shards(dir, {36, 28, 44, 20, 32}, 3);
  fs::create_directories(dir + "/v");
  return {train, write_shards(dir + "/v", {6}, 3)};
}

// The step a resumed run says it starts after ("resume: FILE (epoch E, step S)").
int64_t resumed_step(const std::string& output) {
  std::smatch m;
  if (!std::regex_search(output, m, std::regex(R"(resume: \S+ \(epoch \d+, step (\d+)\))"))) return -1;
  return std::stoll(m[1]);
}

}  // namespace

// The documented commands: write shards from a folder, then train on them.
// Every image of the folder is in the shards with its class, and a 2-rank
// run trains on them for the epoch's full length.
TEST(ShardsCommand, WritesAFolderAsShardsThatTrainingReads) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("shards_cmd");
  write_image_folder(dir + "/train", 3, 12);
  write_image_folder(dir + "/val", 3, 2);
  fs::create_directories(dir + "/shards");
  auto w = ddp::testing::run_process({DDPTRAIN_EXE, "shards", dir + "/train", dir + "/shards/train", "--shard-samples", "5"});
  ASSERT_EQ(w.exit_code, 0) << w.output;
  EXPECT_NE(w.output.find("wrote 8 shard(s): " + dir + "/shards/train-{000000..000007}.tar"), std::string::npos)
      << w.output;
  auto v = ddp::testing::run_process({DDPTRAIN_EXE, "shards", dir + "/val", dir + "/shards/val"});
  ASSERT_EQ(v.exit_code, 0) << v.output;
  // Written again: refused, the shards untouched.
  const auto before = file_bytes(dir + "/shards/val-000000.tar");
  auto again = ddp::testing::run_process({DDPTRAIN_EXE, "shards", dir + "/val", dir + "/shards/val"});
  EXPECT_EQ(again.exit_code, ddp::exit_code::kUsage);
  EXPECT_NE(again.output.find("val-000000.tar already exists; shards are never overwritten."), std::string::npos)
      << again.output;
  EXPECT_EQ(file_bytes(dir + "/shards/val-000000.tar"), before);

  const auto index = ddp::data::scan_image_shards(
      ddp::data::expand_shard_pattern(dir + "/shards/train-{000000..000007}.tar"));
  ASSERT_EQ(index.size(), 36);
  std::map<int64_t, int> per_class;
  for (auto l : index.labels) ++per_class[l];
  EXPECT_EQ(per_class, (std::map<int64_t, int>{{0, 12}, {1, 12}, {2, 12}}));
  EXPECT_NE(index.labels[0] == index.labels[1] && index.labels[1] == index.labels[2] &&
                index.labels[2] == index.labels[3] && index.labels[3] == index.labels[4],
            true)
      << "the writer shuffles: a shard of one class would defeat the stream's buffer";
  EXPECT_EQ(ddp::testing::read_file(dir + "/shards/train-classes.txt"), "c0\nc1\nc2\n");

  const auto save = ddp::testing::temp_dir("shards_train");
  auto t = ddp::testing::run_process(
      shard_run_args(save, dir + "/shards/train-{000000..000007}.tar", dir + "/shards/val-000000.tar"));
  ASSERT_EQ(t.exit_code, 0) << t.output;
  // 36 samples in 2 streams of 18, one per rank: 5 batches of 4, 4, 4, 4, 2.
  EXPECT_NE(t.output.find("epoch 2/2 step 5/5"), std::string::npos) << t.output;
  EXPECT_EQ(ddp::testing::metrics_jsonl(save).size(), 2u);
}

// --skip-bad-samples in a 2-rank run: a shard with a sample without a class
// (left out at the start) and one whose image does not decode (replaced in
// each epoch); the epoch line counts both, once per epoch over both ranks;
// the ranks keep equal epochs. Without the flag the run stops at the scan, naming shard and key.
TEST(ShardsCommand, SkipBadSamplesTrainsOnAndCountsThemInTheEpochLine) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("shards_skip");
  write_shards(dir, {6, 6, 6}, 3);
  write_bad_shard(dir + "/s-3.tar", "b", 7, 100, {4}, 2);  // b2 has no class, b4's image does not decode
  const auto train = dir + "/s-{0..3}.tar", val = dir + "/s-0.tar";
  const auto save = ddp::testing::temp_dir("shards_skip_run");
  auto stop = ddp::testing::run_process(shard_run_args(save, train, val));
  EXPECT_EQ(stop.exit_code, ddp::exit_code::kUsage) << stop.output;
  EXPECT_NE(stop.output.find("shard " + dir + "/s-3.tar: sample b2 has no class (.cls)"), std::string::npos)
      << stop.output;
  auto args = shard_run_args(save, train, val);
  args.push_back("--skip-bad-samples");
  auto t = ddp::testing::run_process(args);
  ASSERT_EQ(t.exit_code, 0) << t.output;
  EXPECT_NE(t.output.find("1 incomplete sample(s) left out (--skip-bad-samples), the first: " + dir + "/s-3.tar: b2"),
            std::string::npos) << t.output;
  // 24 samples in 2 streams of 12, one per rank: 3 batches of 4 each epoch.
  EXPECT_NE(t.output.find("epoch 2/2 step 3/3"), std::string::npos) << t.output;
  std::regex line(R"(epoch [12]/2 .* skipped 2 bad sample\(s\) \(1 incomplete\))");  // b2 and b4
  EXPECT_EQ(std::distance(std::sregex_iterator(t.output.begin(), t.output.end(), line), std::sregex_iterator()), 2)
      << t.output;
  EXPECT_NE(t.output.find("sample b4's image does not decode"), std::string::npos) << t.output;
}

// A 2-rank run on shards stopped mid-epoch (a preemption in epoch 2 of 2)
// and resumed from its checkpoint ends with the same weights, bit for bit,
// as the run that was never stopped.
namespace {

// A 2-rank run on `train` (`steps` steps an epoch) stopped by SIGTERM
// after step steps + 5 and resumed from its checkpoint ends epoch 2 with
// the weights and validation loss of the run never stopped, bit for bit.
// *straight_output gets that run's output.
void expect_preempted_resume_is_straight(const std::string& train, const std::string& val, int64_t steps,
                                         const std::vector<std::string>& extra, std::string* straight_output) {
  auto straight = ddp::testing::temp_dir("shards_straight"), split = ddp::testing::temp_dir("shards_split");
  auto args = shard_run_args(straight, train, val);
  args.insert(args.end(), extra.begin(), extra.end());
  auto a = ddp::testing::run_process(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;
  *straight_output = a.output;

  args = shard_run_args(split, train, val);
  args.insert(args.end(), extra.begin(), extra.end());
  // SIGTERM after epoch 2's fifth step; the ranks agree to stop a step or
  // a few later, still inside epoch 2 (resumed_step checks).
  args.insert(args.end(), {"--inject-fault", "1:" + std::to_string(steps + 5) + ":term"});
  auto b1 = ddp::testing::run_process(args);
  ASSERT_EQ(b1.exit_code, ddp::exit_code::kPreempted) << b1.output;
  const auto preempt = ddp::testing::find_file(split, "preempt.pt");
  ASSERT_FALSE(preempt.empty()) << b1.output;
  auto b2 = ddp::testing::run_process({DDPTRAIN_EXE, "--resume", preempt, "--size", "2", "--backend", "gloo",
                                       "--progress", "plain", "--log-every", "1"});
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  const int64_t step = resumed_step(b2.output);
  EXPECT_TRUE(step > steps && step < 2 * steps) << "not stopped inside epoch 2: " << b2.output;

  const auto wa = ddp::read_state_dict(ddp::testing::find_file(straight, "epoch_2.pt"));
  const auto wb = ddp::read_state_dict(ddp::testing::find_file(split, "epoch_2.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  int compared = 0;
  for (size_t i = 0; i < wa.size(); ++i) {
    ASSERT_EQ(wa[i].first, wb[i].first);
    if (wa[i].first.rfind("model/", 0) != 0 && wa[i].first.rfind("optimizer/", 0) != 0) continue;
    EXPECT_TRUE(torch::equal(wa[i].second, wb[i].second)) << wa[i].first;
    ++compared;
  }
  EXPECT_GT(compared, 4);
  auto ma = ddp::testing::metrics_jsonl(straight), mb = ddp::testing::metrics_jsonl(split);
  ASSERT_EQ(ma.size(), 2u);
  ASSERT_EQ(mb.size(), 2u);
  EXPECT_EQ(ma[1]["val_loss"], mb[1]["val_loss"]);
}

}  // namespace

TEST(ShardsResume, PreemptedMidEpochAndResumedEqualsStraight_BitExact) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  DDP_SKIP_UNLESS_GLOO();
  const auto [train, val] = five_shards_and_val(ddp::testing::temp_dir("shards_resume"));
  std::string output;
  expect_preempted_resume_is_straight(train, val, 20, {}, &output);
  EXPECT_EQ(output.find("skipped"), std::string::npos) << "no count without the flag";
}

// --skip-bad-samples moves no position: with samples left out and samples
// replaced, a run preempted mid-epoch and resumed is still the straight run.
TEST(ShardsResume, WithSkippedBadSamplesResumedEqualsStraight_BitExact) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("shards_resume_skip");
  const auto val = five_shards_and_val(dir).second;
  write_bad_shard(dir + "/s-5.tar", "c", 8, 200, {1, 6}, 3);  // c3 has no class, c1 and c6 do not decode
  // 167 samples in 2 streams of 84: 21 steps an epoch.
  std::string output;
  expect_preempted_resume_is_straight(dir + "/s-{0..5}.tar", val, 21, {"--skip-bad-samples"}, &output);
  // c3 left out, c1 and c6 replaced: each counted once per epoch
  std::regex line(R"(epoch [12]/2 .* skipped 3 bad sample\(s\) \(1 incomplete\))");
  EXPECT_EQ(std::distance(std::sregex_iterator(output.begin(), output.end(), line), std::sregex_iterator()), 2)
      << output;
}

// The global batch at each step is the same samples on any world size that
// divides the run's streams: a 2-rank run preempted mid-epoch and resumed
// on 1 rank (batch 8 for 2 x 4) ends where the straight 2-rank run ends, to
// fp32 rounding (plain SGD, no augmentation), as map-style data does
// (Resume.OnAnotherNumberOfRanksEqualsTheStraightRun). A 1-rank run has one
// stream, which 2 ranks cannot share: that resume is refused in one line.
TEST(ShardsResume, MidEpochOnAnotherNumberOfRanksEqualsTheStraightRun) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  DDP_SKIP_UNLESS_GLOO();
  const auto [train, val] = five_shards_and_val(ddp::testing::temp_dir("shards_ranks"));
  const std::vector<std::string> sgd{"--optimizer", "sgd", "--lr", "0.01", "--momentum", "0", "--augment", "none",
                                     "--seed", "3"};
  auto straight = ddp::testing::temp_dir("shards_ranks_straight"), split = ddp::testing::temp_dir("shards_ranks_split");
  auto args = shard_run_args(straight, train, val);
  args.insert(args.end(), sgd.begin(), sgd.end());
  auto a = ddp::testing::run_process(args);
  ASSERT_EQ(a.exit_code, 0) << a.output;

  args = shard_run_args(split, train, val);
  args.insert(args.end(), sgd.begin(), sgd.end());
  args.insert(args.end(), {"--inject-fault", "1:25:term"});
  auto b1 = ddp::testing::run_process(args);
  ASSERT_EQ(b1.exit_code, ddp::exit_code::kPreempted) << b1.output;
  auto b2 = ddp::testing::run_process({DDPTRAIN_EXE, "--resume", ddp::testing::find_file(split, "preempt.pt"), "--size",
                                       "1", "--backend", "gloo", "--progress", "plain", "--log-every", "1"});
  ASSERT_EQ(b2.exit_code, 0) << b2.output;
  const int64_t step = resumed_step(b2.output);
  EXPECT_TRUE(step > 20 && step < 40) << "not stopped inside epoch 2: " << b2.output;
  EXPECT_NE(b2.output.find("resume: 1 rank(s) instead of 2; --batch 8 per rank keeps the global batch 8"),
            std::string::npos) << b2.output;
  EXPECT_NE(b2.output.find("epoch 2/2 step 20/20"), std::string::npos) << b2.output;
  auto want = ddp::testing::metrics_jsonl(straight), got = ddp::testing::metrics_jsonl(split);
  ASSERT_EQ(want.size(), 2u);
  ASSERT_EQ(got.size(), 2u);
  // (train_loss is left out: the trainer averages per-rank batch means, so
  // an epoch split over 2 ranks and then 1 weights its steps otherwise.)
  for (const char* key : {"val_loss", "val_acc"})
    EXPECT_NEAR(got[1][key].get<double>(), want[1][key].get<double>(), 1e-4) << key;
  EXPECT_EQ(got[1]["lr"], want[1]["lr"]);
  const auto wa = ddp::read_state_dict(ddp::testing::find_file(straight, "epoch_2.pt"));
  const auto wb = ddp::read_state_dict(ddp::testing::find_file(split, "epoch_2.pt"));
  ASSERT_EQ(wa.size(), wb.size());
  int compared = 0;
  for (size_t i = 0; i < wa.size(); ++i) {
    if (wa[i].first.rfind("model/", 0) != 0 || !wa[i].second.is_floating_point()) continue;
    EXPECT_TRUE(torch::allclose(wa[i].second, wb[i].second, 1e-4, 1e-5)) << wa[i].first;
    ++compared;
  }
  EXPECT_GT(compared, 4);

  // A 1-rank run (one stream) resumed on 2 ranks.
  auto one = ddp::testing::temp_dir("shards_ranks_one");
  args = shard_run_args(one, train, val);
  args[std::find(args.begin(), args.end(), "--size") - args.begin() + 1] = "1";
  args[std::find(args.begin(), args.end(), "--epochs") - args.begin() + 1] = "1";
  auto c = ddp::testing::run_process(args);
  ASSERT_EQ(c.exit_code, 0) << c.output;
  auto d = ddp::testing::run_process({DDPTRAIN_EXE, "--resume", ddp::testing::find_file(one, "epoch_1.pt"), "--size",
                                      "2", "--backend", "gloo", "--epochs", "2"});
  EXPECT_EQ(d.exit_code, ddp::exit_code::kUsage) << d.output;
  EXPECT_NE(d.output.find("--shard-streams 1 is not a multiple of the world size 2."), std::string::npos) << d.output;
}

// A build without libarchive (the GPU machine's, when libarchive-dev is
// absent) refuses shards in one line that says how to get it; where
// libarchive is present this has nothing to check.
TEST(ShardsWithoutLibarchive, RefusedInOneLineSayingHowToGetIt) {
  if (ddp::data::have_libarchive()) GTEST_SKIP() << "this build has libarchive";
  DDP_SKIP_UNLESS_GLOO();
  const auto dir = ddp::testing::temp_dir("no_libarchive");
  auto r = ddp::testing::run_process({DDPTRAIN_EXE, "--dataset", "shards", "--data_root", dir + "/t-{0..1}.tar",
                                      "--val-root", dir + "/v.tar", "--size", "1", "--backend", "gloo",
                                      "--save_path", dir});
  EXPECT_EQ(r.exit_code, ddp::exit_code::kUsage) << r.output;
  EXPECT_NE(r.output.find("--dataset shards reads and writes tar shards, but this build has no libarchive. Hint: "
                          "install libarchive-dev"),
            std::string::npos)
      << r.output;
  auto w = ddp::testing::run_process({DDPTRAIN_EXE, "shards", dir, dir + "/out"});
  EXPECT_EQ(w.exit_code, ddp::exit_code::kUsage) << w.output;
  EXPECT_NE(w.output.find("ddptrain shards reads and writes tar shards, but this build has no libarchive."),
            std::string::npos)
      << w.output;
}

// --image-decode gpu on shards: training batches carry each JPEG's bytes as
// the shard holds them, with the CPU path's window for its position, and
// the CPU share (and any file nvJPEG does not take, PNG here) travels as
// the decoded crop.
TEST(ShardDataset, GpuDecodeBatchesCarryTheShardsJpegsAndTheCpuPathsWindows) {
  DDP_SKIP_UNLESS_LIBARCHIVE();
  const auto dir = ddp::testing::temp_dir("shard_gpu");
  std::vector<std::vector<uint8_t>> files;
  {
    TarWriter w(dir + "/g.tar");
    for (int i = 0; i < 6; ++i) {
      auto gen = at::detail::createCPUGenerator(static_cast<uint64_t>(i) + 11);
      auto image = torch::randint(0, 256, {40 + 4 * i, 50, 3}, gen, torch::kLong).to(torch::kUInt8);
      const std::string file = dir + "/" + std::to_string(i) + (i == 5 ? ".png" : ".jpg");
      if (i == 5) ddp::data::write_png(file, image); else ddp::data::write_jpeg(file, image, 90);
      files.push_back(file_bytes(file));
      const std::string key = "s" + std::to_string(i), cls = std::to_string(i % 2);
      w.add(key + (i == 5 ? ".png" : ".jpg"), files.back().data(), files.back().size());
      w.add(key + ".cls", cls.data(), cls.size());
      const std::string cls2 = std::to_string(10 * i);
      w.add(key + ".cls2", cls2.data(), cls2.size());
    }
    w.close();
  }
  const auto transform = ddp::data::ImageTransformOptions().size(16);
  auto data = std::make_shared<ShardDataset>(
      ddp::data::scan_shards({dir + "/g.tar"}, ddp::data::ShardScanOptions().fields({"cls2"})),
      ShardDatasetOptions().transform(transform).gpu_decode(true).cpu_decode_share(0.5).fields(
          {{"cls2", ddp::data::integer_field("second")}}),
      "gpu shards");
  const ddp::data::DrawKey key{4, 1, 0};
  const auto ids = data->epoch_order(StreamOrderOptions().seed(4).epoch(1).shuffle_buffer(3), 0);
  auto batch = data->get_keyed_batch(ids, key, 0);
  ASSERT_TRUE(batch.contains(ddp::data::kEncodedImages)) << "an encoded batch";
  const auto rows = batch.at(ddp::data::kEncodedImages);
  const auto bytes = batch.at(ddp::data::kEncodedBytes);
  int jpegs = 0, decoded = 0;
  for (int64_t j = 0; j < rows.size(0); ++j) {
    const auto id = ids[static_cast<size_t>(j)];
    const auto r = rows[j];
    EXPECT_EQ(r[ddp::data::kEcIndex].item<int64_t>(), id);
    EXPECT_EQ(batch.target()[j].item<int64_t>(), id % 2);
    EXPECT_EQ(batch.at("second")[j].item<int64_t>(), 10 * id) << "a task's field rides with the encoded batch";
    const bool cpu = ddp::data::uses_cpu_decode(j, 0.5) || id == 5;
    EXPECT_EQ(r[ddp::data::kEcKind].item<int64_t>(), cpu ? ddp::data::kEncodedRgb : ddp::data::kEncodedJpeg) << j;
    if (cpu) {
      ++decoded;
      continue;
    }
    ++jpegs;
    const auto off = r[ddp::data::kEcByteOffset].item<int64_t>(), len = r[ddp::data::kEcByteLength].item<int64_t>();
    const auto& file = files[static_cast<size_t>(id)];
    ASSERT_EQ(len, static_cast<int64_t>(file.size()));
    EXPECT_TRUE(std::equal(file.begin(), file.end(), bytes.data_ptr<uint8_t>() + off)) << "sample " << id;
    const auto window = ddp::data::transform_window(40 + 4 * id, 50, transform, key, j);
    EXPECT_EQ(r[ddp::data::kEcTop].item<int64_t>(), window.source.top);
    EXPECT_EQ(r[ddp::data::kEcWindowWidth].item<int64_t>(), window.source.width);
    EXPECT_EQ(r[ddp::data::kEcFlip].item<int64_t>(), window.flip ? 1 : 0);
  }
  EXPECT_GT(jpegs, 0);
  EXPECT_GT(decoded, 0);
  // Indexed access (evaluation, predict) still gives tensors.
  EXPECT_EQ(data->get_batch({0, 1}).input().sizes(), (std::vector<int64_t>{2, 3, 16, 16}));
  if (!ddp::data::gpu_jpeg_available()) {
    EXPECT_NE(user_error([&] { data->device_stage(); }).find("nvJPEG"), std::string::npos);
  }
}

// The device stage on a GPU gives the CPU path's batch, to nvJPEG's decode
// differences (the bounds of GpuImages.StageMatchesTheCpuPath_CUDA for
// its synthetic hard-edged JPEGs).
TEST(ShardDataset, GpuDecodeMatchesTheCpuPath_CUDA) {
  DDP_SKIP_UNLESS_CUDA();
  DDP_SKIP_UNLESS_LIBARCHIVE();
  if (!ddp::data::gpu_jpeg_available()) GTEST_SKIP() << "no nvJPEG in this build";
  const auto dir = ddp::testing::temp_dir("shard_gpu_cuda");
  {
    TarWriter w(dir + "/g.tar");
    for (int i = 0; i < 8; ++i) {
      auto y = torch::arange(120 + 9 * i, torch::kFloat).view({-1, 1, 1});
      auto x = torch::arange(160, torch::kFloat).view({1, -1, 1});
      auto c = torch::arange(3, torch::kFloat).view({1, 1, 3});
      auto image = (torch::sin(y * 0.11 + x * 0.07 * (c + 1) + i) * 90 + 128 + x * 0.2).clamp(0, 255).to(torch::kByte).contiguous();
      ddp::data::write_jpeg(dir + "/x.jpg", image, 90);
      const auto jpeg = file_bytes(dir + "/x.jpg");
      const std::string key = "p" + std::to_string(i), cls = "0";
      w.add(key + ".jpg", jpeg.data(), jpeg.size());
      w.add(key + ".cls", cls.data(), cls.size());
    }
    w.close();
  }
  for (bool train : {true, false}) {
    const auto transform = ddp::data::ImageTransformOptions().size(64).train(train);
    // .cls read again as a field of the task's: it must survive the stage.
    auto gpu = std::make_shared<ShardDataset>(
        ddp::data::scan_image_shards({dir + "/g.tar"}),
        ShardDatasetOptions().transform(transform).gpu_decode(true).cpu_decode_share(0).fields(
            {{"cls", ddp::data::integer_field("again")}}),
        "gpu");
    auto cpu = std::make_shared<ShardDataset>(ddp::data::scan_image_shards({dir + "/g.tar"}),
                                              ShardDatasetOptions().transform(transform).scaled_jpeg_decode(false), "cpu");
    const ddp::data::DrawKey key{5, 2, 0};
    const auto order = StreamOrderOptions().seed(5).epoch(2).shuffle_buffer(4);
    const auto ids = gpu->epoch_order(order, 0);
    EXPECT_EQ(cpu->epoch_order(order, 0), ids);
    auto batch = gpu->get_keyed_batch(ids, key, 0);
    const auto want = cpu->get_keyed_batch(ids, key, 0);
    gpu->device_stage()->run(batch, torch::Device(torch::kCUDA, 0));
    const auto got = batch.input().cpu();
    ASSERT_EQ(got.sizes(), want.input().sizes());
    EXPECT_EQ(batch.names(), (std::vector<std::string>{"again", "input", "target"}));
    EXPECT_TRUE(torch::equal(batch.at("again"), want.target())) << "a task's field rides through the stage";
    const double level = 1.0 / (255.0 * 0.229);
    for (int64_t i = 0; i < got.size(0); ++i) {
      const auto diff = (got[i] - want.input()[i]).abs();
      // These synthetic 4:2:0 files have sharp colour waves: the bounds of
      // the hard-edged files there (measured on an H100, 2026-12-07: mean up
      // to 2.76 levels, above the photo-like bound of 2.5).
      EXPECT_LT(diff.mean().item<double>() / level, 6.5) << i << " train=" << train;
      EXPECT_LT(diff.max().item<double>() / level, 58.0) << i << " train=" << train;
    }
  }
}
