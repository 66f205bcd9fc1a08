// Where a run starts from. `--resume` (a checkpoint, a run directory, or
// auto) and a restart's own checkpoint are resolved to one file once per
// process, in ddp::main, before the ranks meet: the same file then gives the
// run's flags (resumed_config) and its weights (Trainer), and a launcher
// hands the file, not the words, to the ranks it starts.
#pragma once

#include <filesystem>
#include <string>

#include "ddp/cli.h"

namespace ddp {

/// This job's id, the same across restarts: ddptrain's launcher's, or the
/// rendezvous id torchrun gives (--standalone makes a fresh one); "" when
/// neither says.
std::string job_id();

/// 0 for a job's first attempt, then 1, 2, ... for each restart
/// (--max-restarts, or torchrun's).
int restart_attempt();

/// A run directory's job_id file: the id of the job that trains in it, then
/// the file name of the newest checkpoint that job saved there (none yet:
/// the directory may still hold checkpoints of the run it resumed, later
/// ones included, which are not this job's).
struct JobRecord {
  std::string id, checkpoint;
};
JobRecord read_job_record(const std::filesystem::path& dir);
void write_job_record(const std::string& dir, const JobRecord& record);

/// The run directory whose job_id file names `id`, or "": the one `resume`
/// names (a run resumed where it was moved to, out of --save_path), else one
/// under `save_path`.
std::string job_run_dir(const std::string& save_path, const std::string& resume, const std::string& id);

/// The checkpoint this process starts from, "" for none. A first attempt:
/// --resume's (a run directory or auto: its newest checkpoint). A restart:
/// this job's own newest, found by its id, never another run's under the
/// same --save_path; before the job saved one, what the first attempt
/// started from. `speak` prints the notes (rank 0, or a launcher).
std::string choose_resume_checkpoint(const Config& config, bool speak);

/// A run resumed from a run directory or a file (not auto) goes on writing
/// in that run's directory: a --save_path given beside it that is not that
/// directory's parent would do nothing, so it is a UserError, before
/// anything is written. `checkpoint`: choose_resume_checkpoint's file.
void check_save_path_fits_resume(const Config& config, const std::string& checkpoint);

}  // namespace ddp
