// The job's flags, the same on every rank.
//
// Each node of a job parses its own command line. A flag that decides what
// is learnt, which collectives run or how a buffer is laid out
// (AcrossRanks::kMustAgree in the flag table) must then have one value on
// every rank: --log-every on one node only made its ranks all-reduce at
// other steps (Gloo aborts, NCCL hangs), and --channels-last summed gradient
// buckets of two memory layouts as raw memory. The check runs before the
// first collective of training and stops the job in one line that names
// each differing flag, its values and the ranks (and nodes) that hold them.
#pragma once

#include "ddp/cli.h"
#include "ddp/dist/world.h"

namespace ddp {

/// UserError, on every rank alike, if a kMustAgree flag (a task's flags
/// included) differs between ranks. Collective: every rank calls it.
void check_flags_agree(const Config& config, World& world);

}  // namespace ddp
