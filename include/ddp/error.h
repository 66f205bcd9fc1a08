// Errors that tell the user what to do.
//
// A UserError is a mistake in flags, files or environment: it carries a plain
// sentence and a hint and is printed as one line, without a stack trace. Any
// other exception is an internal fault and keeps its file:line (TORCH_CHECK).
#pragma once

#include <c10/util/Exception.h>

#include <stdexcept>
#include <string>

namespace ddp {

class UserError : public std::runtime_error {
 public:
  UserError(const std::string& what, const std::string& hint = "")
      : std::runtime_error(hint.empty() ? what : what + " Hint: " + hint) {}
};

/// A collective failed or timed out; names the rank and the collective.
class CollectiveError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// The loss became NaN or Inf: training stops, earlier checkpoints stay.
class NonFiniteLoss : public std::runtime_error {
 public:
  NonFiniteLoss(long long epoch, long long step, double value, const std::string& run_dir)
      : std::runtime_error("the training loss became " + std::to_string(value) + " at epoch " +
                           std::to_string(epoch) + ", step " + std::to_string(step) +
                           "; stopped without saving, earlier checkpoints in " + run_dir +
                           " are intact. Hint: lower --lr, set --clip-grad-norm, or check the data.") {}
};

/// SIGTERM/SIGINT: the run saved a checkpoint and stops (exit kPreempted).
class Preempted : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

/// Throws UserError(what, hint) unless cond holds. Use for user input only.
inline void check_user(bool cond, const std::string& what, const std::string& hint = "") {
  if (!cond) throw UserError(what, hint);
}

/// The first line of an exception's message, without LibTorch's backtrace:
/// for errors that quote a lower layer's failure in one line.
inline std::string first_line(const std::exception& e) {
  const auto* torch_error = dynamic_cast<const c10::Error*>(&e);
  const std::string msg = torch_error ? torch_error->what_without_backtrace() : e.what();
  return msg.substr(0, msg.find('\n'));
}

/// Exit codes shared by the launcher, the workers and the tests.
namespace exit_code {
constexpr int kOk = 0;
constexpr int kFailure = 1;     // internal fault or collective failure
constexpr int kUsage = 2;       // bad flag or bad input (UserError)
constexpr int kPreempted = 75;  // stopped by SIGTERM/SIGINT after saving (EX_TEMPFAIL)
constexpr int kNonFinite = 3;   // loss became NaN or Inf
constexpr int kPeerFailed = 4;  // a collective failed, usually because another rank died
}  // namespace exit_code

}  // namespace ddp
