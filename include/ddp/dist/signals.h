// What a worker process does with signals: stop cleanly, and report crashes.
//
// install_stop_handlers(): the first SIGTERM or SIGINT asks the training
// loop to stop at the next step boundary that every rank agrees on
// (stop_requested() turns true; the loop checkpoints and exits 75, as
// torchrun and Slurm expect of a preempted job); a second one, at least a
// second later and not the launcher's forwarded copy, exits at once.
// install_crash_handler(): a crash (SIGSEGV, SIGBUS, SIGFPE, SIGILL) prints
// where it happened and the native stack, on its own signal stack, then
// dies with the same signal, so the launcher's "rank N died" comes with a
// place to look. ddptrain's workers install both; a loop of your own can too
// (examples/own_loop).
#pragma once

namespace ddp {

/// `launcher_pid`: the process that forwards signals to this one (0: none).
void install_stop_handlers(int launcher_pid = 0);
void install_crash_handler();

/// True once a stop was asked for (by a signal or by request_stop()).
bool stop_requested();
/// Asks the training loop to checkpoint and stop at the next agreed step.
void request_stop();
/// Whether a first stop signal waits for the loop to checkpoint (true, the
/// default) or ends the process at once with 128 + the signal (false).
/// ddptrain's workers say false until their training loop runs: set-up and a
/// rendezvous that waits for a rank that never comes hold nothing to save,
/// and there Ctrl-C once did nothing until --timeout passed.
void set_stop_can_checkpoint(bool can);

}  // namespace ddp
