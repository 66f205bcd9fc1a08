// The data identity record of checkpoints, and fingerprints (see identity.h).
#include "ddp/data/identity.h"

#include <algorithm>
#include <cstdio>

#include "ddp/data/counter_rng.h"

namespace ddp::data {

Fingerprint& Fingerprint::add(const void* bytes, size_t count) {
  const auto* p = static_cast<const unsigned char*>(bytes);
  for (size_t i = 0; i < count; ++i) h_ = (h_ ^ p[i]) * 0x100000001b3ull;
  return *this;
}

Fingerprint& Fingerprint::add(int64_t value) {
  // Little-endian bytes whatever the machine's order, so that a record
  // compares across machines.
  unsigned char b[8];
  for (int i = 0; i < 8; ++i) b[i] = static_cast<unsigned char>(static_cast<uint64_t>(value) >> (8 * i));
  return add(b, sizeof(b));
}

Fingerprint& Fingerprint::add(const std::string& text) {
  add(static_cast<int64_t>(text.size()));
  return add(text.data(), text.size());
}

Fingerprint& Fingerprint::add_rows(const void* data, int64_t rows, int64_t row_bytes) {
  add(rows).add(row_bytes);
  if (rows <= 0 || row_bytes <= 0) return *this;
  const auto* base = static_cast<const unsigned char*>(data);
  const int64_t picked = std::min(rows, kSampledRows);
  for (int64_t k = 0; k < picked; ++k) {
    // Row k * (rows - 1) / (picked - 1): the first and the last always, so
    // that data cut or extended at either end differs.
    const int64_t row = picked == 1 ? 0 : k * (rows - 1) / (picked - 1);
    add(base + row * row_bytes, static_cast<size_t>(row_bytes));
  }
  return *this;
}

Fingerprint& Fingerprint::add(const torch::Tensor& t) {
  if (!t.defined()) return add(std::string("undefined"));
  add(std::string(c10::toString(t.scalar_type())));
  for (int64_t s : t.sizes()) add(s);
  if (t.dim() == 0 || t.numel() == 0) return *this;
  const torch::Tensor c = t.cpu().contiguous();
  const int64_t rows = c.size(0);
  return add_rows(c.data_ptr(), rows, static_cast<int64_t>(c.numel() / rows * c.element_size()));
}

std::string Fingerprint::hex() const {
  char out[17];
  std::snprintf(out, sizeof(out), "%016llx", static_cast<unsigned long long>(mix64(h_)));
  return out;
}

nlohmann::json data_identity(const Splits& splits, const std::vector<std::string>& locations) {
  nlohmann::json out = nlohmann::json::object();
  nlohmann::json where = nlohmann::json::array();
  for (const auto& l : locations)
    if (!l.empty()) where.push_back(l);
  out["locations"] = where;
  auto put = [&](const char* split, const DatasetPtr& d) {
    if (d) out[split] = {{"name", d->name()}, {"size", d->size()}, {"fingerprint", d->fingerprint()}};
  };
  put("train", splits.train);
  put("val", splits.val);
  put("test", splits.test);
  return out;
}

namespace {

// `name` with each of `locations` (the longest first: a --val-root inside
// --data_root) replaced by one mark, so that names that say where their
// data lies compare by what they say besides.
std::string without_locations(std::string name, const nlohmann::json& locations) {
  std::vector<std::string> where;
  if (locations.is_array())
    for (const auto& l : locations)
      if (l.is_string() && !l.get<std::string>().empty()) where.push_back(l.get<std::string>());
  std::sort(where.begin(), where.end(), [](const auto& a, const auto& b) { return a.size() > b.size(); });
  for (const auto& l : where)
    for (size_t at = name.find(l); at != std::string::npos; at = name.find(l, at + 1)) name.replace(at, l.size(), "\x01");
  return name;
}

// A field of a record, or the default when it is absent or of another type:
// a header is data from a file, and a damaged one must not stop the run with
// an internal error where it would merely not compare.
std::string text(const nlohmann::json& record, const char* key) {
  return record.is_object() && record.contains(key) && record[key].is_string() ? record[key].get<std::string>() : "";
}
int64_t count(const nlohmann::json& record, const char* key) {
  return record.is_object() && record.contains(key) && record[key].is_number_integer() ? record[key].get<int64_t>() : -1;
}

}  // namespace

std::string data_difference(const nlohmann::json& saved, const nlohmann::json& now) {
  if (!saved.is_object()) return "";
  std::string out;
  auto say = [&](const std::string& clause) { out += (out.empty() ? "" : "; ") + clause; };
  for (const char* split : {"train", "val", "test"}) {
    const bool had = saved.contains(split), has = now.contains(split);
    const std::string the = std::string("the ") + split + " split";
    if (had != has) {
      say(has ? "this data has a " + std::string(split) + " split and the run had none"
              : "the run had a " + std::string(split) + " split and this data has none");
      continue;
    }
    if (!had) continue;
    const auto &s = saved[split], &n = now[split];
    const std::string s_name = text(s, "name"), n_name = text(n, "name");
    const std::string s_print = text(s, "fingerprint"), n_print = text(n, "fingerprint");
    const nlohmann::json none;
    if (s_name != n_name && without_locations(s_name, saved.contains("locations") ? saved["locations"] : none) !=
                                without_locations(n_name, now.contains("locations") ? now["locations"] : none))
      say(the + " is '" + n_name + "', the run's was '" + s_name + "'");
    else if (count(s, "size") != count(n, "size"))
      say(the + " '" + n_name + "' has " + std::to_string(count(n, "size")) + " samples, the run's had " +
          std::to_string(count(s, "size")));
    else if (!s_print.empty() && !n_print.empty() && s_print != n_print)
      say(the + " '" + n_name + "' holds other samples (fingerprint " + n_print + ", the run's " + s_print + ")");
  }
  return out;
}

}  // namespace ddp::data
