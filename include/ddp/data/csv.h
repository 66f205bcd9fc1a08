// A CSV reader for tabular training data: numeric columns as float32 and
// integer category columns (a store id, a weekday) as int64, by header name.
//
// Written here, small, because the packages this project builds on offer
// none that fits: Debian 12 has no well-kept C++ CSV library among them
// (the candidates are unpackaged single headers, or pull in Arrow), and a
// training program needs only a header, numbers and integers, with errors
// that name the file, line and column. It reads RFC 4180's common subset:
// one record per line (\n or \r\n), fields separated by the delimiter,
// optionally in double quotes ("" inside is a quote), a header first.
// Numbers are read locale-independently (std::from_chars). Fuzzed in
// tests/data/csv_test.cpp like the pickle reader.
#pragma once

#include <string>
#include <vector>

#include <torch/arg.h>
#include <torch/torch.h>

#include "ddp/data/dataset.h"

namespace ddp::data {

struct CsvOptions {
  /// Columns read as integer categories (int64, each >= 0, ready for an
  /// embedding); every other column is read as a float32 number.
  TORCH_ARG(std::vector<std::string>, categories);
  /// Only these columns (empty: all); the others are not parsed.
  TORCH_ARG(std::vector<std::string>, columns);
  TORCH_ARG(char, delimiter) = ',';
};

/// A CSV file's columns by header name: float32 (numbers) or int64
/// (categories), one row per record.
struct CsvTable {
  std::string source;              // the file, for errors
  std::vector<std::string> names;  // the columns read, in the header's order
  TensorDict columns;
  int64_t rows = 0;
  /// The named numeric columns side by side: float32 rows x names.size().
  /// A UserError for a name that is not a numeric column, listing those there are.
  torch::Tensor floats(const std::vector<std::string>& names) const;
  /// One column (float32 or int64); a UserError listing the names if absent.
  const torch::Tensor& column(const std::string& name) const;
};

/// Reads `path`. UserError naming the file, line and column for anything it
/// cannot read: a missing or unreadable file, a record with another number
/// of fields than the header, an empty, non-numeric or non-finite value, a
/// category that is not a non-negative integer, a column asked for that the
/// header lacks.
CsvTable read_csv(const std::string& path, const CsvOptions& options = {});

/// The same for text already in memory; `source` names it in errors.
CsvTable parse_csv(const std::string& text, const std::string& source, const CsvOptions& options = {});

}  // namespace ddp::data
