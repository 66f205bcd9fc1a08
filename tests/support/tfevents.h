// A reader for TensorBoard event files, written apart from the writer in
// src/io/tensorboard.cpp so that the tests check the format, not the code
// against itself: TFRecord framing with both CRCs verified, then a generic
// protobuf walk of tensorflow.Event.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace ddp::testing {

struct ScalarEvent {
  double wall_time = 0;
  int64_t step = 0;
  std::string tag;
  float value = 0;
};

struct EventFile {
  std::string first_file_version;  // file_version of the first record ("" if it has none)
  size_t records = 0;
  std::vector<ScalarEvent> scalars;
};

/// Reads every record; throws std::runtime_error on a bad CRC or framing.
EventFile read_event_file(const std::string& path);

/// The event files (names containing "tfevents") in `dir`.
std::vector<std::string> event_files(const std::string& dir);

}  // namespace ddp::testing
