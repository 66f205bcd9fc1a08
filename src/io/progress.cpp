// Progress bar and plain progress lines.
#include "ddp/io/progress.h"

#include <unistd.h>

#include <cmath>

namespace ddp {

ProgressMode resolve_progress_mode(const std::string& flag) {
  if (flag == "bar") return ProgressMode::kBar;
  if (flag == "plain") return ProgressMode::kPlain;
  if (flag == "none") return ProgressMode::kNone;
  return isatty(fileno(stdout)) ? ProgressMode::kBar : ProgressMode::kPlain;
}

std::string format_duration(double s) {
  if (!std::isfinite(s) || s < 0) s = 0;
  long t = std::lround(s);
  char buf[32];
  if (t >= 3600) std::snprintf(buf, sizeof(buf), "%ld:%02ld:%02ld", t / 3600, (t / 60) % 60, t % 60);
  else std::snprintf(buf, sizeof(buf), "%ld:%02ld", t / 60, t % 60);
  return buf;
}

Progress::Progress(ProgressMode mode, int epoch, int epochs, int64_t steps, std::FILE* out)
    : mode_(mode), epoch_(epoch), epochs_(epochs), steps_(steps), out_(out),
      start_(std::chrono::steady_clock::now()) {}

void Progress::update(int64_t step, double loss, double lr, double sps) {
  if (mode_ == ProgressMode::kNone) return;
  double el = std::chrono::duration<double>(std::chrono::steady_clock::now() - start_).count();
  double eta = step > 0 ? el / static_cast<double>(step) * static_cast<double>(steps_ - step) : 0;
  if (mode_ == ProgressMode::kPlain) {
    std::fprintf(out_, "epoch %d/%d step %lld/%lld loss %.4f lr %.3g %.0f samples/s eta %s\n", epoch_, epochs_,
                 static_cast<long long>(step), static_cast<long long>(steps_), loss, lr, sps,
                 format_duration(eta).c_str());
  } else {
    const int width = 24;
    int filled = steps_ > 0 ? static_cast<int>(width * step / steps_) : width;
    std::string bar(static_cast<size_t>(filled), '#');
    bar.resize(width, '.');
    std::fprintf(out_, "\repoch %d/%d [%s] %lld/%lld loss %.4f lr %.3g %.0f samples/s ETA %s  ", epoch_,
                 epochs_, bar.c_str(), static_cast<long long>(step), static_cast<long long>(steps_), loss, lr,
                 sps, format_duration(eta).c_str());
    drawn_ = true;
  }
  std::fflush(out_);
}

void Progress::close() {
  if (mode_ == ProgressMode::kBar && drawn_) std::fprintf(out_, "\n");
  std::fflush(out_);
}

}  // namespace ddp
