// TensorBoard event files, written without TensorFlow.
//
// An event file (events.out.tfevents.<secs>.<host>) is a TFRecord stream:
// each record is [uint64 length][masked CRC32C of length][data][masked CRC32C
// of data], all little-endian, and each data block is one serialized
// tensorflow.Event protobuf. The first event carries file_version
// "brain.Event:2"; the others carry a Summary with one simple_value scalar.
//
// Why by hand: libprotobuf would need protoc plus TensorFlow's .proto files
// at build time, and the CUDA machine has no CRC32C library; the handful of
// fields used here (Event.wall_time/step/file_version/summary,
// Summary.value, Summary.Value.tag/simple_value) take a few lines of
// protobuf wire format, and CRC32C is a table of 256 words.
#pragma once

#include <cstdint>
#include <fstream>
#include <string>

namespace ddp {

/// CRC-32C (Castagnoli), as used by TFRecord.
uint32_t crc32c(const void* data, size_t size);
/// TFRecord's masked form: rotate right by 15 bits, add 0xa282ead8.
uint32_t masked_crc32c(const void* data, size_t size);

/// One TFRecord: length, its masked CRC, the data, the data's masked CRC.
std::string tfrecord(const std::string& data);
/// A serialized Event with file_version "brain.Event:2".
std::string file_version_event(double wall_time);
/// A serialized Event holding one scalar (Summary.Value.simple_value).
std::string scalar_event(double wall_time, int64_t step, const std::string& tag, float value);

/// Appends scalars to a new event file in `dir`; each call is flushed, so a
/// running TensorBoard sees it at once and a crash loses nothing written.
class EventWriter {
 public:
  EventWriter(const std::string& dir, double wall_time);
  void add_scalar(const std::string& tag, double value, int64_t step, double wall_time);
  const std::string& path() const { return path_; }

 private:
  void write(const std::string& event);
  std::string path_;
  std::ofstream out_;
};

/// True for names TensorBoard reads as event files ("*tfevents*").
bool is_event_file_name(const std::string& filename);

}  // namespace ddp
