// The CSV reader (see csv.h for why it is written here).
#include "ddp/data/csv.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <fstream>
#include <limits>
#include <sstream>

#include "ddp/error.h"

namespace ddp::data {

namespace {

// Where a value sits, for errors: "FILE line 7, column 3 ('store')".
std::string where(const std::string& source, int64_t line, size_t column, const std::string& name) {
  return source + " line " + std::to_string(line) + ", column " + std::to_string(column + 1) +
         (name.empty() ? "" : " ('" + name + "')");
}

std::string shown(const std::string& value) {
  constexpr size_t kMax = 40;
  std::string v = value.size() > kMax ? value.substr(0, kMax) + "..." : value;
  for (char& c : v)
    if (static_cast<unsigned char>(c) < 0x20) c = '?';
  return "'" + v + "'";
}

std::string trimmed(const std::string& s) {
  const auto b = s.find_first_not_of(" \t");
  if (b == std::string::npos) return "";
  return s.substr(b, s.find_last_not_of(" \t") - b + 1);
}

// One line's fields. Quotes may enclose a field (the delimiter inside is
// text, "" a quote); a record never spans lines.
std::vector<std::string> split_fields(const std::string& line, char delimiter, const std::string& source, int64_t line_no) {
  std::vector<std::string> fields;
  std::string field;
  bool quoted = false, was_quoted = false;
  for (size_t i = 0; i < line.size(); ++i) {
    const char c = line[i];
    if (quoted) {
      if (c != '"') field += c;
      else if (i + 1 < line.size() && line[i + 1] == '"') field += '"', ++i;
      else quoted = false;
    } else if (c == '"' && trimmed(field).empty() && !was_quoted) {
      quoted = was_quoted = true;
      field.clear();
    } else if (c == delimiter) {
      fields.push_back(was_quoted ? field : trimmed(field));
      field.clear();
      was_quoted = false;
    } else if (was_quoted && c != ' ' && c != '\t') {
      throw UserError(where(source, line_no, fields.size(), "") + ": text after a closing quote.",
                      "quote the whole field, and write a quote inside it as \"\".");
    } else if (!was_quoted) {
      field += c;
    }
  }
  check_user(!quoted, where(source, line_no, fields.size(), "") + ": a quote that does not close on its line.",
             "close the quote; a record of this reader never spans lines.");
  fields.push_back(was_quoted ? field : trimmed(field));
  return fields;
}

float parse_number(const std::string& value, const std::string& at) {
  check_user(!value.empty(), at + ": an empty value.", "fill it in, or drop the record.");
  const char* first = value.data() + (value[0] == '+' ? 1 : 0);
  const char* last = value.data() + value.size();
  double v = 0;
  const auto [end, error] = std::from_chars(first, last, v);
  check_user(error == std::errc() && end == last && first != last,
             at + ": " + shown(value) + " is not a number.",
             "write plain decimal numbers (e.g. 3.25 or -1e-3), or name the column in CsvOptions::categories if it "
             "holds integer categories.");
  check_user(std::isfinite(v) && std::abs(v) <= std::numeric_limits<float>::max(),
             at + ": " + shown(value) + " is not a finite float32 number.",
             "replace NaN and infinite values (and values beyond 3.4e38) before training.");
  return static_cast<float>(v);
}

int64_t parse_category(const std::string& value, const std::string& at) {
  check_user(!value.empty(), at + ": an empty category.", "fill it in, or drop the record.");
  int64_t v = -1;
  const char* last = value.data() + value.size();
  const auto [end, error] = std::from_chars(value.data(), last, v);
  check_user(error == std::errc() && end == last && v >= 0,
             at + ": " + shown(value) + " is not a category (an integer from 0).",
             "number the categories 0, 1, 2, ..., or leave the column out of CsvOptions::categories to read it as a "
             "number.");
  return v;
}

}  // namespace

CsvTable parse_csv(const std::string& text, const std::string& source, const CsvOptions& options) {
  std::istringstream in(text);
  std::string line;
  int64_t line_no = 0;
  auto next_line = [&]() -> bool {
    while (std::getline(in, line)) {
      ++line_no;
      if (!line.empty() && line.back() == '\r') line.pop_back();
      if (line_no == 1 && line.compare(0, 3, "\xEF\xBB\xBF") == 0) line.erase(0, 3);  // a spreadsheet's BOM
      if (!trimmed(line).empty()) return true;  // blank lines separate nothing
    }
    return false;
  };
  check_user(next_line(), source + " is empty: no header line.",
             "write the column names on the first line, e.g. x0,x1,store,sales.");
  CsvTable table;
  table.source = source;
  const std::vector<std::string> header = split_fields(line, options.delimiter(), source, line_no);
  for (size_t c = 0; c < header.size(); ++c) {
    check_user(!header[c].empty(), where(source, line_no, c, "") + ": a column without a name in the header.",
               "name every column on the first line.");
    check_user(std::count(header.begin(), header.begin() + static_cast<std::ptrdiff_t>(c), header[c]) == 0,
               where(source, line_no, c, "") + ": the header names '" + header[c] + "' twice.",
               "give each column its own name.");
  }
  auto in_header = [&](const std::string& name) { return std::find(header.begin(), header.end(), name) != header.end(); };
  std::string names;
  for (const auto& h : header) names += (names.empty() ? "" : ", ") + h;
  for (const auto* list : {&options.categories(), &options.columns()})
    for (const auto& name : *list)
      check_user(in_header(name), source + ": no column '" + name + "'; the header has " + names + ".",
                 "use one of those names, or fix the header.");
  auto wanted = [&](const std::string& name) {
    const auto& only = options.columns();
    return only.empty() || std::find(only.begin(), only.end(), name) != only.end();
  };
  auto is_category = [&](const std::string& name) {
    return std::find(options.categories().begin(), options.categories().end(), name) != options.categories().end();
  };
  std::vector<std::vector<float>> numbers(header.size());
  std::vector<std::vector<int64_t>> categories(header.size());
  while (next_line()) {
    const auto fields = split_fields(line, options.delimiter(), source, line_no);
    check_user(fields.size() == header.size(),
               source + " line " + std::to_string(line_no) + " has " + std::to_string(fields.size()) +
                   " field(s); the header has " + std::to_string(header.size()) + ".",
               "give every record one value per column (a delimiter inside a value needs quotes).");
    for (size_t c = 0; c < header.size(); ++c) {
      if (!wanted(header[c])) continue;
      const std::string at = where(source, line_no, c, header[c]);
      if (is_category(header[c])) categories[c].push_back(parse_category(fields[c], at));
      else numbers[c].push_back(parse_number(fields[c], at));
    }
    ++table.rows;
  }
  for (size_t c = 0; c < header.size(); ++c) {
    if (!wanted(header[c])) continue;
    table.names.push_back(header[c]);
    table.columns[header[c]] = is_category(header[c]) ? torch::tensor(categories[c], torch::kLong)
                                                      : torch::tensor(numbers[c], torch::kFloat);
  }
  return table;
}

CsvTable read_csv(const std::string& path, const CsvOptions& options) {
  std::ifstream f(path, std::ios::binary);
  check_user(static_cast<bool>(f), "cannot read the CSV file " + path + ".", "check the path and its permissions.");
  std::ostringstream text;
  text << f.rdbuf();
  return parse_csv(text.str(), path, options);
}

const torch::Tensor& CsvTable::column(const std::string& name) const {
  std::string all;
  for (const auto& n : names) all += (all.empty() ? "" : ", ") + n;
  check_user(columns.contains(name), source + ": no column '" + name + "' was read; there are " + all + ".",
             "use one of those names (CsvOptions::columns limits what is read).");
  return columns.at(name);
}

torch::Tensor CsvTable::floats(const std::vector<std::string>& wanted) const {
  std::vector<torch::Tensor> parts;
  for (const auto& name : wanted) {
    const auto& t = column(name);
    check_user(t.scalar_type() == torch::kFloat, source + ": column '" + name + "' holds categories, not numbers.",
               "read it with column(\"" + name + "\") (int64), e.g. for an embedding.");
    parts.push_back(t);
  }
  check_user(!parts.empty(), source + ": floats() of no columns.", "name the feature columns to stack.");
  return torch::stack(parts, 1);
}

}  // namespace ddp::data
