// What rank 0 shows while training.
//
// On a terminal: one progress bar, redrawn in place, with epoch, step/total,
// mean loss, learning rate, samples/s and ETA. Elsewhere (CI, log files): a
// plain line every N steps. Other ranks show nothing; the values passed in
// are already averaged across ranks by the caller.
#pragma once

#include <chrono>
#include <cstdio>
#include <string>

namespace ddp {

enum class ProgressMode { kBar, kPlain, kNone };

/// "auto" becomes bar when stdout is a terminal, plain otherwise.
ProgressMode resolve_progress_mode(const std::string& flag);

class Progress {
 public:
  Progress(ProgressMode mode, int epoch, int epochs, int64_t steps, std::FILE* out = stdout);
  /// Called with cross-rank means; draws according to the mode.
  void update(int64_t step, double mean_loss, double lr, double samples_per_second);
  /// Ends the bar's line (no-op for plain).
  void close();

 private:
  ProgressMode mode_;
  int epoch_, epochs_;
  int64_t steps_;
  std::FILE* out_;
  std::chrono::steady_clock::time_point start_;
  bool drawn_ = false;
};

/// "1:05", "12:00:03".
std::string format_duration(double seconds);

}  // namespace ddp
