// strata-launch: starts this node's processes of a multi-process run with torchrun's
// variables and supervises them (examples/strata_launch/process_group.h). See
// docs/distributed.md and `strata-launch --help`.
#include <unistd.h>

#include <cstdio>
#include <string>
#include <vector>

#include "examples/strata_launch/launch_plan.h"
#include "examples/strata_launch/process_group.h"

namespace {

int fail(const strata::Status& status) {
  std::fprintf(stderr, "strata-launch: %s\n", status.to_string().c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  const std::vector<std::string> args(argv + 1, argv + argc);
  strata::StatusOr<strata::launch::LaunchPlan> plan = strata::launch::parse_launch_args(args);
  if (!plan.ok()) return fail(plan.status());
  if (plan->help) {
    std::fputs(std::string(strata::launch::launch_usage()).c_str(), stdout);
    return 0;
  }
  if (plan->master_port == 0) {
    strata::StatusOr<uint16_t> port = strata::launch::pick_free_port();
    if (!port.ok()) return fail(port.status());
    plan->master_port = *port;
  }
  const strata::launch::LaunchOutput output{strata::launch::fd_line_sink(STDOUT_FILENO, "stdout"),
                                            strata::launch::fd_line_sink(STDERR_FILENO, "stderr")};
  strata::StatusOr<strata::launch::LaunchResult> result = strata::launch::run_local_ranks(*plan, output);
  if (!result.ok()) return fail(result.status());
  if (result->failed_rank >= 0) {
    std::fprintf(stderr, "strata-launch: rank %d failed: it %s; exiting with code %d\n", result->failed_rank,
                 result->failure.c_str(), result->exit_code);
  }
  return result->exit_code;
}
