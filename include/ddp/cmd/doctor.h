// `ddptrain doctor`: a self-check for a new machine or cluster.
//
// Prints library and CUDA versions and the visible GPUs, then, on every
// rank of the job: an all-reduce checked against its closed form, the
// all-reduce bus bandwidth, and a small data-parallel equivalence check
// (gradients synchronised over N ranks against one process's gradient on
// the whole batch). Ends with a pass/fail summary and exit status.
#pragma once

#include "ddp/dist/world.h"

namespace ddp {

/// Runs the checks as one rank of `world`; returns 0 if all passed.
int run_doctor(World& world);

}  // namespace ddp
