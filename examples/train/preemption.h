// Graceful preemption for a training program: clusters send SIGTERM (and users press
// Ctrl-C, SIGINT) before they end a job, and expect the current step to finish and a
// checkpoint to be written.
//
// install_preemption_handlers() is for a program's main() only; the libraries keep no
// signal state. The handler is async-signal-safe: the first SIGTERM or SIGINT records its
// number in an atomic, writes one line to stderr and restores the default action of both
// signals, so a second one ends the process at once. The trainer polls
// preemption_requested() between steps (TrainerOptions::stop_requested), its ranks agree
// on the step to stop after, and the program exits with 128 + the signal's number.
#pragma once

#include <string_view>

#include "engine/core/status.h"

namespace strata::train {

// Installs the SIGTERM and SIGINT handlers; `program` starts the line the handler writes.
Status install_preemption_handlers(std::string_view program);

// The first SIGTERM or SIGINT received since install_preemption_handlers(), 0 while none.
int preemption_requested();

}  // namespace strata::train
