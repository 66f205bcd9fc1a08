// The CSV reader and the dataset of named tensors: values by header name,
// errors that name the file, line and column, and hostile input (mutated and
// random files) that either loads or gives a UserError, never a crash,
// another exception or an allocation far beyond the file's size.
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <functional>
#include <random>

#include "ddp/data/csv.h"
#include "ddp/data/tensor_dataset.h"
#include "ddp/error.h"
#include "support/capped_child.h"
#include "support/testing.h"

namespace {

using ddp::data::CsvOptions;
using ddp::data::parse_csv;
using ddp::testing::user_error;

TEST(Csv, ReadsNumbersAndCategoriesByName) {
  const std::string text =
      "\xEF\xBB\xBFx0, x1 ,store,\"sales\"\r\n"
      "1.5,-2,3,10\r\n"
      "\n"
      "+0.25,1e-3, 0 ,\"2.5\"\r\n";
  const auto t = parse_csv(text, "sales.csv", CsvOptions().categories({"store"}));
  EXPECT_EQ(t.rows, 2);
  EXPECT_EQ(t.names, (std::vector<std::string>{"x0", "x1", "store", "sales"}));
  EXPECT_TRUE(torch::equal(t.column("store"), torch::tensor({3, 0}, torch::kLong)));
  EXPECT_TRUE(torch::equal(t.floats({"x0", "x1"}), torch::tensor({{1.5f, -2.0f}, {0.25f, 1e-3f}})));
  EXPECT_TRUE(torch::equal(t.column("sales"), torch::tensor({10.0f, 2.5f})));
  // Only the columns asked for are parsed: a bad value elsewhere is no error.
  const auto only = parse_csv("a,b\n1,oops\n", "f.csv", CsvOptions().columns({"a"}));
  EXPECT_EQ(only.names, std::vector<std::string>{"a"});
  // Quotes keep a delimiter and a doubled quote.
  const auto quoted = parse_csv("\"a,1\",\"b\"\"\"\n3,4\n", "q.csv");
  EXPECT_EQ(quoted.names, (std::vector<std::string>{"a,1", "b\""}));
}

TEST(Csv, ErrorsNameTheFileLineAndColumn) {
  const auto opts = CsvOptions().categories({"store"});
  for (const auto& [input, expected] : std::vector<std::pair<std::string, std::string>>{
           {"x,store\n1,2\n3,abc\n", "f.csv line 3, column 2 ('store'): 'abc' is not a category"},
           {"x,store\n1,2\n1.5.2,3\n", "f.csv line 3, column 1 ('x'): '1.5.2' is not a number"},
           {"x,store\n,2\n", "f.csv line 2, column 1 ('x'): an empty value"},
           {"x,store\nnan,2\n", "f.csv line 2, column 1 ('x'): 'nan' is not a finite float32 number"},
           {"x,store\n1e39,2\n", "'1e39' is not a finite float32 number"},
           {"x,store\n1,-1\n", "line 2, column 2 ('store'): '-1' is not a category (an integer from 0)"},
           {"x,store\n1,2.0\n", "'2.0' is not a category"},
           {"x,store\n1,2,3\n", "f.csv line 2 has 3 field(s); the header has 2"},
           {"x,store\n\"1,2\n", "f.csv line 2, column 1: a quote that does not close on its line"},
           {"x,store\n\"1\"x,2\n", "f.csv line 2, column 1: text after a closing quote"},
           {"x,x,store\n", "f.csv line 1, column 2: the header names 'x' twice"},
           {"x,,store\n", "f.csv line 1, column 2: a column without a name"},
           {"\n\n", "f.csv is empty: no header line"},
           {"x,y\n1,2\n", "f.csv: no column 'store'; the header has x, y"},
       }) {
    const std::string& text = input;  // a lambda captures no structured binding in C++17
    const auto message = user_error([&] { parse_csv(text, "f.csv", opts); });
    EXPECT_NE(message.find(expected), std::string::npos) << "for:\n" << text << "got: " << message;
    EXPECT_NE(message.find("Hint: "), std::string::npos) << message;
  }
  EXPECT_NE(user_error([] { ddp::data::read_csv("/nonexistent/sales.csv"); }).find("/nonexistent/sales.csv"),
            std::string::npos);
  const auto t = parse_csv("x,store\n1,2\n", "f.csv", opts);
  EXPECT_NE(user_error([&] { t.floats({"store"}); }).find("column 'store' holds categories"), std::string::npos);
  EXPECT_NE(user_error([&] { t.column("y"); }).find("no column 'y' was read; there are x, store"), std::string::npos);
}

TEST(NamedTensorDataset, GivesRowsByNameAndBatchesByIndex) {
  auto x = torch::arange(12, torch::kFloat).view({6, 2});
  auto id = torch::arange(6, torch::kLong) * 10;
  const ddp::data::NamedTensorDataset d({{"input", x}, {"store", id}}, "table");
  EXPECT_EQ(d.size(), 6);
  EXPECT_EQ(d.input_shape(), std::vector<int64_t>{2});
  EXPECT_TRUE(torch::equal(d.get(4).at("store"), torch::tensor(40, torch::kLong)));
  const auto b = d.get_batch({5, 0, 5});
  EXPECT_TRUE(torch::equal(b.input(), torch::stack({x[5], x[0], x[5]})));
  EXPECT_TRUE(torch::equal(b.at("store"), torch::tensor({50, 0, 50}, torch::kLong)));
  const auto message = user_error([] {
    ddp::data::NamedTensorDataset({{"input", torch::zeros({3, 2})}, {"target", torch::zeros({4})}}, "t");
  });
  EXPECT_NE(message.find("different numbers of rows (input 3, target 4)"), std::string::npos) << message;
}

// ------------------------------------------------ hostile input

constexpr size_t kCap = 256u << 20;  // what parsing a few-KB text may add to the address space

// Runs `body` in a child under kCap (support/capped_child.h).
std::string in_capped_child(const std::function<std::string()>& body) {
  return ddp::testing::in_capped_child(body, kCap);
}

// "" if `text` parsed (and its columns hold as many rows as it says) or
// gave a UserError that names the source; else what happened.
std::string parse_outcome(const std::string& text) {
  try {
    const auto t = parse_csv(text, "fuzz.csv", CsvOptions().categories({"store"}));
    for (const auto& [name, column] : t.columns)
      if (column.size(0) != t.rows) return "column " + name + " has " + std::to_string(column.size(0)) + " rows";
    return "";
  } catch (const ddp::UserError& e) {
    const std::string m = e.what();
    return m.find("fuzz.csv") == std::string::npos ? "an error that names no file: " + m : "";
  } catch (const std::exception& e) {
    return std::string("not a UserError: ") + e.what();
  }
}

// A valid file, mutated byte by byte (replaced, inserted, deleted, and
// spliced with the bytes that matter to a CSV), 3000 times, in children
// that each run 100 cases under the cap.
TEST(CsvFuzz, MutatedFilesLoadOrGiveAUserError) {
  std::string valid = "x0,x1,store,sales\n";
  for (int r = 0; r < 20; ++r)
    valid += std::to_string(r * 0.5) + "," + std::to_string(-r) + "," + std::to_string(r % 4) + ",\"" +
             std::to_string(r * 1.25) + "\"\n";
  ASSERT_EQ(parse_outcome(valid), "");
  const std::string special = ",\"\r\n \t+-.eE0123456789\xEF\xBB\xBF\0";
  for (int child = 0; child < 30; ++child) {
    const auto out = in_capped_child([&] {
      std::mt19937_64 random(static_cast<uint64_t>(child));
      for (int k = 0; k < 100; ++k) {
        std::string text = valid;
        const int edits = 1 + static_cast<int>(random() % 8);
        for (int e = 0; e < edits && !text.empty(); ++e) {
          const size_t at = random() % text.size();
          const char c = random() % 2 ? special[random() % special.size()] : static_cast<char>(random() % 256);
          switch (random() % 3) {
            case 0: text[at] = c; break;
            case 1: text.insert(text.begin() + static_cast<std::ptrdiff_t>(at), c); break;
            default: text.erase(at, 1 + random() % 4);
          }
        }
        const auto outcome = parse_outcome(text);
        if (!outcome.empty()) return outcome + "\nfor:\n" + text;
      }
      return std::string();
    });
    ASSERT_EQ(out, "") << "child " << child;
  }
}

// Random bytes, and long lines of delimiters and quotes.
TEST(CsvFuzz, RandomAndDegenerateTextLoadsOrGivesAUserError) {
  const auto out = in_capped_child([] {
    std::mt19937_64 random(7);
    for (int k = 0; k < 300; ++k) {
      std::string text(1 + random() % 2000, '\0');
      for (char& c : text) c = static_cast<char>(random() % 256);
      if (auto o = parse_outcome(text); !o.empty()) return o;
    }
    for (const std::string& text : {std::string(100000, ','), "a\n" + std::string(100000, '"'),
                                    "store\n" + std::string(50000, '\n') + "99999999999999999999999\n",
                                    std::string("a,b\n") + std::string(3000, '1') + ",2\n"})
      if (auto o = parse_outcome(text); !o.empty()) return o.substr(0, 200);
    return std::string();
  });
  EXPECT_EQ(out, "");
}

}  // namespace
