// DistributedSampler against index lists produced by PyTorch (Python)'s
// torch.utils.data.DistributedSampler (tools/gen_testdata.py).
#include <fstream>

#include <nlohmann/json.hpp>

#include "ddp/error.h"
#include "ddp/data/sampler.h"
#include "support/testing.h"

namespace {

nlohmann::json load_vectors() {
  std::ifstream f(std::string(DDP_TEST_DATA_DIR) + "/sampler_vectors.json");
  if (!f) return {};
  return nlohmann::json::parse(f);
}

TEST(DistributedSampler, MatchesPyTorchVectors) {
  auto j = load_vectors();
  ASSERT_FALSE(j.is_null()) << "tests/testdata/sampler_vectors.json is missing";
  size_t checked = 0;
  for (const auto& c : j["cases"]) {
    ddp::SamplerOptions o;
    o.size = c["n"];
    o.num_replicas = c["replicas"];
    o.rank = c["rank"];
    o.seed = c["seed"];
    o.shuffle = c["shuffle"];
    o.drop_last = c["drop_last"];
    ddp::DistributedSampler s(o);
    s.set_epoch(c["epoch"]);
    auto expected = c["indices"].get<std::vector<int64_t>>();
    ASSERT_EQ(s.indices(), expected) << c.dump().substr(0, 200);
    ASSERT_EQ(s.num_samples(), static_cast<int64_t>(expected.size()));
    ++checked;
  }
  EXPECT_GT(checked, 100u);
}

TEST(DistributedSampler, EpochChangesOrderAndRanksPartition) {
  ddp::SamplerOptions o;
  o.size = 1000;
  o.num_replicas = 2;
  ddp::DistributedSampler a(o);
  o.rank = 1;
  ddp::DistributedSampler b(o);
  auto e0 = a.indices();
  a.set_epoch(1);
  EXPECT_NE(a.indices(), e0) << "set_epoch must reshuffle";
  std::vector<int64_t> all = a.indices();
  b.set_epoch(1);
  auto bi = b.indices();
  all.insert(all.end(), bi.begin(), bi.end());
  std::sort(all.begin(), all.end());
  for (int64_t i = 0; i < 1000; ++i) ASSERT_EQ(all[i], i);
}

TEST(DistributedSampler, EvalShardCountsEachSampleOnce) {
  std::vector<int> seen(10001, 0);
  for (int r = 0; r < 3; ++r)
    for (auto i : ddp::shard_without_padding(10001, r, 3)) seen[i]++;
  for (int v : seen) ASSERT_EQ(v, 1);
}

TEST(DistributedSampler, RejectsBadRank) {
  ddp::SamplerOptions o;
  o.size = 10;
  o.num_replicas = 2;
  o.rank = 2;
  EXPECT_THROW(ddp::DistributedSampler s(o), ddp::UserError);
}

}  // namespace
