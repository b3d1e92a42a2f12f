// strata-launch's command line and what each local process is given: torchrun's
// variables (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR,
// MASTER_PORT), so that programs read them through rendezvous_options_from_env exactly
// as under torchrun.
#pragma once

#include <chrono>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

#include "engine/core/status.h"

namespace strata::launch {

struct LaunchPlan {
  int nproc_per_node = 1;           // processes started on this node
  int nnodes = 1;                   // nodes in the job, each running one strata-launch
  int node_rank = 0;                // this node's index, 0 <= node_rank < nnodes
  std::string master_addr = "127.0.0.1";  // rank 0's host (on node 0)
  uint16_t master_port = 0;         // rank 0's rendezvous port; 0 = pick a free one (one node only)
  std::chrono::milliseconds grace_period{std::chrono::seconds(10)};  // SIGTERM to SIGKILL when stopping
  std::vector<std::string> command;  // the program and its arguments
  bool help = false;                // --help: print the usage and exit 0

  int world_size() const { return nnodes * nproc_per_node; }
  int global_rank(int local_rank) const { return node_rank * nproc_per_node + local_rank; }
};

// strata-launch's usage text.
std::string_view launch_usage();

// Parses `args` (without the program name): the flags, then `--` (optional when the
// program does not start with "--") and the command. With --nnodes > 1, --node-rank and
// --master-addr are required (every node must agree on them) and the port defaults to
// kDefaultMasterPort; with one node and no --master-port, master_port stays 0
// (resolve_master_port picks one). Errors name the flag and the value.
StatusOr<LaunchPlan> parse_launch_args(std::span<const std::string> args);

// A free TCP port for a one-node launch without --master-port: the kernel's pick for a
// socket bound to port 0, released again for rank 0 to take (another process could take
// it first; rank 0's bind then fails naming the port, and a rerun picks another).
StatusOr<uint16_t> pick_free_port();

// The environment of local process `local_rank`: `inherited` ("NAME=value" entries)
// without any of the variables set here, then torchrun's variables for this rank.
std::vector<std::string> child_environment(const LaunchPlan& plan, int local_rank,
                                           std::span<const std::string> inherited);

}  // namespace strata::launch
