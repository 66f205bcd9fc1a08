// TFRecord framing, CRC32C and the few protobuf fields of tensorflow.Event.
#include "ddp/io/tensorboard.h"

#include <unistd.h>

#include <array>
#include <cstring>

#include "ddp/error.h"

namespace ddp {
namespace {

// Table for the reflected Castagnoli polynomial 0x82f63b78.
std::array<uint32_t, 256> make_crc_table() {
  std::array<uint32_t, 256> t{};
  for (uint32_t i = 0; i < 256; ++i) {
    uint32_t c = i;
    for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ 0x82f63b78u : c >> 1;
    t[i] = c;
  }
  return t;
}

// Protobuf wire format: a key is (field << 3 | wire type); 0 varint,
// 1 fixed64, 2 length-delimited, 5 fixed32. Numbers are little-endian.
void put_varint(std::string& out, uint64_t v) {
  while (v >= 0x80) {
    out.push_back(static_cast<char>((v & 0x7f) | 0x80));
    v >>= 7;
  }
  out.push_back(static_cast<char>(v));
}

template <typename T>
void put_le(std::string& out, T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));  // x86 and ARM servers are little-endian, like the format
  out.append(reinterpret_cast<const char*>(b), sizeof(T));
}

void put_bytes(std::string& out, int field, const std::string& bytes) {
  put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
  put_varint(out, bytes.size());
  out += bytes;
}

// Event fields 1 (wall_time, double) and 2 (step, int64).
std::string event_head(double wall_time, int64_t step) {
  std::string e;
  put_varint(e, 1 << 3 | 1);
  put_le(e, wall_time);
  if (step != 0) {
    put_varint(e, 2 << 3 | 0);
    put_varint(e, static_cast<uint64_t>(step));
  }
  return e;
}

std::string hostname() {
  char buf[256] = {};
  if (gethostname(buf, sizeof(buf) - 1) != 0 || buf[0] == 0) return "localhost";
  return buf;
}

}  // namespace

uint32_t crc32c(const void* data, size_t size) {
  static const auto table = make_crc_table();
  const auto* p = static_cast<const unsigned char*>(data);
  uint32_t c = 0xffffffffu;
  for (size_t i = 0; i < size; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
  return c ^ 0xffffffffu;
}

uint32_t masked_crc32c(const void* data, size_t size) {
  const uint32_t c = crc32c(data, size);
  return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

std::string tfrecord(const std::string& data) {
  std::string r;
  put_le<uint64_t>(r, data.size());
  put_le<uint32_t>(r, masked_crc32c(r.data(), 8));
  r += data;
  put_le<uint32_t>(r, masked_crc32c(data.data(), data.size()));
  return r;
}

std::string file_version_event(double wall_time) {
  std::string e = event_head(wall_time, 0);
  put_bytes(e, 3, "brain.Event:2");
  return e;
}

std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value) {
  std::string v;  // Summary.Value: tag = 1, simple_value = 2 (float)
  put_bytes(v, 1, tag);
  put_varint(v, 2 << 3 | 5);
  put_le(v, value);
  std::string summary;  // Summary: repeated Value value = 1
  put_bytes(summary, 1, v);
  std::string e = event_head(wall_time, step);
  put_bytes(e, 5, summary);  // Event.summary = 5
  return e;
}

bool is_event_file_name(const std::string& filename) { return filename.find("tfevents") != std::string::npos; }

EventWriter::EventWriter(const std::string& dir, double wall_time) {
  path_ = dir + "/events.out.tfevents." + std::to_string(static_cast<long long>(wall_time)) + "." + hostname();
  out_.open(path_, std::ios::binary | std::ios::trunc);
  check_user(static_cast<bool>(out_), "cannot write " + path_ + ".", "check that --save_path is writable.");
  write(file_version_event(wall_time));
}

void EventWriter::add_scalar(const std::string& tag, double value, int64_t step, double wall_time) {
  write(scalar_event(wall_time, step, tag, static_cast<float>(value)));
}

void EventWriter::write(const std::string& event) {
  out_ << tfrecord(event);
  out_.flush();
}

}  // namespace ddp
