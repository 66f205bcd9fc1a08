#include "ddp/train/resume.h"

#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <system_error>

#include "ddp/error.h"
#include "ddp/io/checkpoint.h"

namespace ddp {

namespace fs = std::filesystem;

std::string job_id() {
  if (const char* id = std::getenv("DDPTRAIN_JOB_ID"); id && *id) return id;
  if (const char* id = std::getenv("TORCHELASTIC_RUN_ID"); id && *id && std::string(id) != "none")
    return std::string("torchelastic-") + id;
  return "";
}

int restart_attempt() {
  const char* attempt = std::getenv("TORCHELASTIC_RESTART_COUNT");
  return attempt ? std::atoi(attempt) : 0;
}

JobRecord read_job_record(const fs::path& dir) {
  JobRecord r;
  std::ifstream f(dir / "job_id");
  if (f && std::getline(f, r.id)) std::getline(f, r.checkpoint);
  return r;
}

void write_job_record(const std::string& dir, const JobRecord& r) {
  write_file_atomic(dir + "/job_id", r.id + "\n" + (r.checkpoint.empty() ? "" : r.checkpoint + "\n"));
}

std::string job_run_dir(const std::string& save_path, const std::string& resume, const std::string& id) {
  auto is_jobs = [&](const fs::path& dir) { return read_job_record(dir).id == id; };
  std::error_code ec;
  if (id.empty()) return "";
  if (!resume.empty() && resume != "auto") {
    const fs::path dir = fs::is_directory(resume, ec) ? fs::path(resume) : fs::path(run_dir_of(resume));
    if (is_jobs(dir)) return dir.string();
  }
  if (!fs::is_directory(save_path, ec)) return "";
  for (const auto& e : fs::directory_iterator(save_path, ec))
    if (is_jobs(e.path())) return e.path().string();
  return "";
}

std::string choose_resume_checkpoint(const Config& c, bool speak) {
  if (restart_attempt() > 0) {
    const std::string id = job_id();
    if (const std::string dir = job_run_dir(c.save_path, c.resume, id); !dir.empty()) {
      const std::string saved = read_job_record(dir).checkpoint;
      if (!saved.empty() && is_checkpoint(dir + "/" + saved)) return dir + "/" + saved;
      // None saved yet: as the first attempt began (--resume's file, or
      // afresh in `dir`: Trainer::find_resume_checkpoint).
    } else if (id.empty() && c.resume.empty()) {
      if (speak)
        std::fprintf(stderr,
                     "%s: warning: restart %d cannot tell this job's checkpoints from other runs' (no "
                     "DDPTRAIN_JOB_ID or TORCHELASTIC_RUN_ID); resuming the newest under %s. Hint: give torchrun "
                     "--rdzv-id, or a --save_path of the job's own.\n",
                     c.program.name.c_str(), restart_attempt(), c.save_path.c_str());
      return find_latest_checkpoint(c.save_path);
    }
  }
  const std::string path = resume_checkpoint(c.resume, c.save_path);
  if (speak && c.resume == "auto" && path.empty())
    std::printf("resume: no checkpoint under %s; starting fresh\n", c.save_path.c_str());
  return path;
}

void check_save_path_fits_resume(const Config& c, const std::string& checkpoint) {
  if (checkpoint.empty() || c.resume.empty() || c.resume == "auto" || !c.was_given("save_path")) return;
  // The run's own --save_path, or one above it (what a job script repeats),
  // compared as written and with links followed.
  const auto under = [](const fs::path& run, const fs::path& given) {
    const auto r = run.lexically_normal(), g = given.lexically_normal();
    const auto rel = r.lexically_relative(g);
    return !rel.empty() && *rel.begin() != ".." && rel != ".";
  };
  std::error_code ec;
  const fs::path run_as_written = fs::absolute(run_dir_of(checkpoint));
  const fs::path run = fs::weakly_canonical(run_as_written, ec);
  if (under(run_as_written, fs::absolute(c.save_path)) || under(run, fs::weakly_canonical(fs::absolute(c.save_path), ec)))
    return;
  throw UserError("--save_path " + c.save_path + " does not apply to --resume " + c.resume +
                      ": a resumed run goes on in its own run directory, " + run.string() + ".",
                  "drop --save_path; to go on elsewhere, copy the run directory there and resume the copy "
                  "(--resume NEW_DIR), or start a new run there from its weights with --pretrain " + checkpoint + ".");
}

}  // namespace ddp
