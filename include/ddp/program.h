// The program's name as its own lines give it: "ddptrain", or the name that
// a program built from the template passes to ddp::main (ProgramOptions).
// ddp::main sets it once, before any rank, thread or signal handler starts;
// the library reads it where no Config reaches: the crash handler, the
// CUDA-graph notes, the loader's and decoders' warnings.
#pragma once

#include <string>

namespace ddp {

/// The name; safe to read from a signal handler.
const char* program_name();

/// Sets it (truncated to 63 bytes). ddp::main only.
void set_program_name(const std::string& name);

}  // namespace ddp
