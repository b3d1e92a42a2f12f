// Starts a LaunchPlan's local processes and supervises them: their output, prefixed
// with the rank, goes to the launcher's stdout and stderr line by line; SIGINT, SIGTERM
// and SIGHUP sent to the launcher are passed on to them; the first one that fails (exits
// non-zero or is killed) stops the others — SIGTERM, then SIGKILL after the grace period
// — and its code becomes the launcher's.
//
// Each child runs in its own process group, so a terminal's Ctrl-C reaches it once,
// through the launcher, and stopping a child reaches what it started; and each gets
// PR_SET_PDEATHSIG(SIGKILL), so a launcher that is itself SIGKILLed leaves no child
// behind. The supervisor is one poll loop (signals through a signalfd): no threads.
// For a program's main() only: it changes the process's signal mask while it runs.
#pragma once

#include <string>
#include <sys/types.h>

#include "engine/core/status.h"
#include "examples/strata_launch/launch_plan.h"
#include "examples/strata_launch/line_prefixer.h"

namespace strata::launch {

// Where the children's prefixed lines and the launcher's own notices go.
struct LaunchOutput {
  LineSink out;  // the children's stdout
  LineSink err;  // the children's stderr and the launcher's notices ("strata-launch: ...")
};

struct LaunchResult {
  int exit_code = 0;     // the first failed rank's exit code, 128+signal if it was killed; 0 when none failed
  int failed_rank = -1;  // that rank (global), -1 when every rank exited 0
  std::string failure;   // how it failed: "exited with code 3", "was killed by signal 9 (SIGKILL)"
};

// How a wait(2) status reads in a message, and the exit code a shell would give it.
std::string describe_wait_status(int wait_status);
int exit_code_of_wait_status(int wait_status);

// Runs the plan's nproc_per_node processes of plan.command with child_environment's
// variables (plan.master_port must be set) until all have exited. Errors are the
// launcher's own (a pipe, fork or signalfd that failed); a child that cannot execute
// the program exits 127 after saying why on its stderr.
StatusOr<LaunchResult> run_local_ranks(const LaunchPlan& plan, const LaunchOutput& output);

}  // namespace strata::launch
