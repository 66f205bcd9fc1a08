// TFRecord + protobuf reader for the tests (see tfevents.h).
#include "support/tfevents.h"

#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <stdexcept>

#include "ddp/io/tensorboard.h"

namespace ddp::testing {
namespace {

template <typename T>
T get_le(const std::string& s, size_t at) {
  if (at + sizeof(T) > s.size()) throw std::runtime_error("truncated record");
  T v;
  std::memcpy(&v, s.data() + at, sizeof(T));
  return v;
}

uint64_t get_varint(const std::string& s, size_t& at) {
  uint64_t v = 0;
  for (int shift = 0; shift < 64; shift += 7) {
    if (at >= s.size()) throw std::runtime_error("truncated varint");
    const auto b = static_cast<unsigned char>(s[at++]);
    v |= static_cast<uint64_t>(b & 0x7f) << shift;
    if (!(b & 0x80)) return v;
  }
  throw std::runtime_error("varint too long");
}

// Calls on_field(number, wire_type, payload_begin, payload_end) per field.
template <typename F>
void for_each_field(const std::string& msg, F on_field) {
  size_t at = 0;
  while (at < msg.size()) {
    const uint64_t key = get_varint(msg, at);
    const int field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
    size_t begin = at;
    switch (wire) {
      case 0: get_varint(msg, at); break;
      case 1: at += 8; break;
      case 5: at += 4; break;
      case 2: {
        const uint64_t n = get_varint(msg, at);
        begin = at;
        at += n;
        break;
      }
      default: throw std::runtime_error("unknown wire type " + std::to_string(wire));
    }
    if (at > msg.size()) throw std::runtime_error("field runs past its message");
    on_field(field, wire, begin, at);
  }
}

}  // namespace

EventFile read_event_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  const std::string bytes = ss.str();
  EventFile out;
  size_t at = 0;
  while (at < bytes.size()) {
    const auto length = get_le<uint64_t>(bytes, at);
    if (get_le<uint32_t>(bytes, at + 8) != masked_crc32c(bytes.data() + at, 8))
      throw std::runtime_error("bad length CRC in record " + std::to_string(out.records));
    if (at + 12 + length + 4 > bytes.size()) throw std::runtime_error("truncated record");
    const std::string data = bytes.substr(at + 12, length);
    if (get_le<uint32_t>(bytes, at + 12 + length) != masked_crc32c(data.data(), data.size()))
      throw std::runtime_error("bad data CRC in record " + std::to_string(out.records));
    at += 12 + length + 4;

    double wall_time = 0;
    int64_t step = 0;
    std::string file_version;
    std::vector<std::pair<std::string, float>> values;
    for_each_field(data, [&](int field, int wire, size_t b, size_t e) {
      if (field == 1 && wire == 1) wall_time = get_le<double>(data, b);
      if (field == 2 && wire == 0) step = static_cast<int64_t>(get_varint(data, b));
      if (field == 3 && wire == 2) file_version = data.substr(b, e - b);
      if (field == 5 && wire == 2) {
        const std::string summary = data.substr(b, e - b);
        for_each_field(summary, [&](int sf, int sw, size_t vb, size_t ve) {
          if (sf != 1 || sw != 2) return;
          const std::string value = summary.substr(vb, ve - vb);
          std::pair<std::string, float> v;
          for_each_field(value, [&](int f, int w, size_t b2, size_t e2) {
            if (f == 1 && w == 2) v.first = value.substr(b2, e2 - b2);
            if (f == 2 && w == 5) v.second = get_le<float>(value, b2);
          });
          values.push_back(v);
        });
      }
    });
    if (out.records == 0) out.first_file_version = file_version;
    for (const auto& [tag, value] : values) out.scalars.push_back({wall_time, step, tag, value});
    ++out.records;
  }
  return out;
}

std::vector<std::string> event_files(const std::string& dir) {
  std::vector<std::string> out;
  for (const auto& e : std::filesystem::directory_iterator(dir))
    if (e.path().filename().string().find("tfevents") != std::string::npos) out.push_back(e.path().string());
  return out;
}

}  // namespace ddp::testing
