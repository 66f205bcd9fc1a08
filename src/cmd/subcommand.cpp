// parse_subcommand: one CLI11 parse for the subcommands (see subcommand.h).
#include "ddp/cmd/subcommand.h"

#include <CLI/CLI.hpp>

#include <iostream>

#include "ddp/error.h"

namespace ddp {

bool parse_subcommand(CLI::App& app, const std::vector<std::string>& args, const std::string& usage,
                      const std::function<void(const std::vector<std::string>&)>& on_extras) {
  std::vector<std::string> reversed(args.rbegin(), args.rend());  // CLI11 takes a vector last argument first
  try {
    app.parse(reversed);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    return false;
  } catch (const CLI::ExtrasError& e) {
    // CLI11 2.1's own message lists the extras last first; remaining() has
    // them as they were given.
    if (on_extras) on_extras(app.remaining());
    throw UserError(std::string(e.what()) + ".", usage);
  } catch (const CLI::ParseError& e) {
    throw UserError(std::string(e.what()) + ".", usage);
  }
  return true;
}

}  // namespace ddp
