#include "ddp/program.h"

#include <cstring>

namespace ddp {
namespace {
// A fixed buffer, not a std::string: the crash handler reads it, and a
// signal handler may not allocate.
char g_name[64] = "ddptrain";
}  // namespace

const char* program_name() { return g_name; }

void set_program_name(const std::string& name) {
  if (name.empty()) return;
  std::strncpy(g_name, name.c_str(), sizeof(g_name) - 1);
  g_name[sizeof(g_name) - 1] = '\0';
}

}  // namespace ddp
