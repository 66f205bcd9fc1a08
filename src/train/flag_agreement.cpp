// Comparing every rank's flags with rank 0's (see the header for why).
//
// The common case costs one store read and one small all-reduce: a count
// of differing ranks per flag. Only when a flag differs do the ranks learn
// who holds which value (a second all-reduce, and the values of a few
// differing ranks through the store), so that every rank throws the same
// line and whichever prints first says it all.
#include "ddp/train/flag_agreement.h"

#include <map>
#include <set>

#include <nlohmann/json.hpp>
#include <torch/torch.h>

#include "ddp/error.h"

namespace ddp {

namespace {

// At most this many differing ranks' values are fetched and named; the
// rest are counted. A job where more differ has the same fix.
constexpr int kRanksNamed = 8;

// "ranks 0-3, 8" for sorted ranks.
std::string rank_list(const std::vector<int>& ranks) {
  std::string out;
  for (size_t i = 0; i < ranks.size();) {
    size_t j = i;
    while (j + 1 < ranks.size() && ranks[j + 1] == ranks[j] + 1) ++j;
    out += (out.empty() ? "" : ", ") + std::to_string(ranks[i]) + (j > i ? "-" + std::to_string(ranks[j]) : "");
    i = j + 1;
  }
  return out;
}

// "rank 1 (node 1)", "ranks 2-3 (node 1)", "ranks 0-1, 4-5 (nodes 0, 2)".
std::string who(const std::vector<int>& ranks, int ranks_per_node) {
  std::vector<int> nodes;
  for (int r : ranks) {
    const int n = r / ranks_per_node;
    if (nodes.empty() || nodes.back() != n) nodes.push_back(n);
  }
  return (ranks.size() == 1 ? "rank " : "ranks ") + rank_list(ranks) + (nodes.size() == 1 ? " (node " : " (nodes ") +
         rank_list(nodes) + ")";
}

// A value as the command line spells it; an empty string as ''.
std::string spelled(const nlohmann::json& v) {
  if (!v.is_string()) return v.dump();
  const std::string s = v.get<std::string>();
  return s.empty() || s.find(' ') != std::string::npos || s.find_first_of("<>=") != std::string::npos ? "'" + s + "'"
                                                                                                      : s;
}

}  // namespace

void check_flags_agree(const Config& config, World& world) {
  if (world.size() == 1) return;
  Config copy = config;
  const nlohmann::json all = config_to_json(config);
  std::vector<std::string> keys;
  nlohmann::json mine = nlohmann::json::object();
  for (const auto& f : flag_table(copy)) {
    if (f.across_ranks != AcrossRanks::kMustAgree) continue;
    keys.push_back(f.key());
    mine[f.key()] = all[f.key()];
  }
  const auto root = nlohmann::json::parse(world.share_string("job_flags", world.is_main() ? mine.dump() : ""));
  const auto n_keys = static_cast<int64_t>(keys.size());
  auto mismatch = torch::zeros({n_keys}, torch::kDouble);
  for (int64_t i = 0; i < n_keys; ++i)
    mismatch[i] = root.contains(keys[i]) && root[keys[i]] == mine[keys[i]] ? 0.0 : 1.0;
  auto counts = mismatch.to(world.device());
  world.all_reduce(counts, "comparing every rank's flags with rank 0's");
  counts = counts.cpu();
  std::vector<int64_t> differing;
  for (int64_t i = 0; i < n_keys; ++i)
    if (counts[i].item<double>() > 0) differing.push_back(i);
  if (differing.empty()) return;

  // Which ranks differ in which flag: one row per rank, each fills its own.
  const auto n_diff = static_cast<int64_t>(differing.size());
  auto table = torch::zeros({world.size(), n_diff}, torch::kDouble);
  for (int64_t j = 0; j < n_diff; ++j) table[world.rank()][j] = mismatch[differing[j]];
  table = table.to(world.device());
  world.all_reduce(table, "finding the ranks whose flags differ from rank 0's");
  table = table.cpu();
  auto t = table.accessor<double, 2>();
  std::vector<int> odd_ranks;  // ranks with any differing flag, in order
  for (int r = 0; r < world.size(); ++r)
    for (int64_t j = 0; j < n_diff; ++j)
      if (t[r][j] > 0) {
        odd_ranks.push_back(r);
        break;
      }
  // The values of the first few such ranks, from each through the store.
  nlohmann::json my_differing = nlohmann::json::object();
  for (int64_t j = 0; j < n_diff; ++j) my_differing[keys[differing[j]]] = mine[keys[differing[j]]];
  std::map<int, nlohmann::json> values;
  for (size_t k = 0; k < odd_ranks.size() && k < kRanksNamed; ++k) {
    const int r = odd_ranks[k];
    values[r] = nlohmann::json::parse(
        world.share_string("differing_flags", world.rank() == r ? my_differing.dump() : "", r));
  }

  const int per_node = std::max(1, world.placement().local_world_size);
  std::string line, flags;
  for (int64_t j = 0; j < n_diff; ++j) {
    const std::string& key = keys[differing[j]];
    // Ranks grouped by value, rank 0's value first; ranks beyond those read
    // are counted, not named.
    std::vector<std::pair<nlohmann::json, std::vector<int>>> groups{{root[key], {}}};
    int unnamed = 0;
    for (int r = 0; r < world.size(); ++r) {
      if (t[r][j] == 0) {
        groups[0].second.push_back(r);
        continue;
      }
      const auto v = values.find(r);
      if (v == values.end()) {
        ++unnamed;
        continue;
      }
      const nlohmann::json& value = v->second[key];
      auto g = std::find_if(groups.begin(), groups.end(), [&](const auto& x) { return x.first == value; });
      if (g == groups.end()) groups.push_back({value, {r}});
      else g->second.push_back(r);
    }
    std::string part = "--" + key + " differs between ranks: ";
    for (size_t g = 0; g < groups.size(); ++g)
      part += (g ? ", " : "") + who(groups[g].second, per_node) + (groups[g].second.size() == 1 ? " has " : " have ") +
              spelled(groups[g].first);
    if (unnamed > 0) part += ", and " + std::to_string(unnamed) + " more rank(s) another value";
    line += (line.empty() ? "" : "; ") + part;
    flags += (flags.empty() ? "--" : j + 1 == n_diff ? " and --" : ", --") + key;
  }
  throw UserError(line + ".", "give every node the same " + flags +
                                  "; only the flags that --help marks [per node] may differ between nodes.");
}

}  // namespace ddp
