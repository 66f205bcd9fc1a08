// Parsing a subcommand's own arguments (`generate`, `shards`) with CLI11,
// and naming the nearest command to a mistyped one.
#pragma once

#include <functional>
#include <string>
#include <vector>

namespace CLI {
class App;
}

namespace ddp {

/// Parses `args` into `app`'s options. Returns false when --help was asked
/// for (the help is printed). A parse error is a UserError with `usage` as
/// its hint; arguments left over go first to `on_extras`, where given (it
/// may throw a message of its own).
bool parse_subcommand(CLI::App& app, const std::vector<std::string>& args, const std::string& usage,
                      const std::function<void(const std::vector<std::string>&)>& on_extras = {});

/// "did you mean WORD? " for the word of `words` nearest to `wrong` (a
/// mistyped command), or "" when none is near.
std::string nearest_word(const std::string& wrong, const std::vector<std::string>& words);

}  // namespace ddp
