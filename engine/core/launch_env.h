// The launchers' variables (torchrun, strata-launch, Open MPI's mpirun, Slurm's srun) read
// into the options of a rendezvous (engine/core/rendezvous.h): which rank this process is,
// how many there are, where rank 0 listens, and how long to wait. docs/distributed.md
// lists the variables.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <string_view>

#include "engine/core/status.h"

namespace strata {

// Which launcher's variables rendezvous_options_from_env read.
enum class LaunchEnvironment {
  kNone,      // none set: a world of one
  kTorchrun,  // RANK, WORLD_SIZE, ... (torchrun, strata-launch, or set by hand)
  kOpenMpi,   // OMPI_COMM_WORLD_* (mpirun)
  kSlurm,     // SLURM_PROCID, SLURM_NTASKS, ... (srun)
};
std::string_view launch_environment_name(LaunchEnvironment environment);  // "none", "torchrun", "openmpi", "slurm"

// MASTER_PORT when an Open MPI or Slurm launch does not set it (torchrun's default too).
// Under Slurm it is offset by SLURM_JOB_ID % 1000, so that two jobs sharing a node do not
// both listen on it.
inline constexpr uint16_t kDefaultMasterPort = 29500;

struct RendezvousOptions {
  int rank = 0;                  // this process's rank, 0 <= rank < world_size
  int world_size = 1;            // number of processes; 1 needs no sockets at all
  int local_rank = 0;            // index on this node (which GPU to use), 0 <= local_rank < local_world_size
  int local_world_size = 1;      // processes on this node
  int node_rank = 0;             // index of this node among the job's nodes
  std::string master_addr = "127.0.0.1";  // host name or address of rank 0
  uint16_t master_port = 0;      // rank 0's port; 0 on rank 0 = pick a free one (see Rendezvous::port())
  std::string listen_address;    // where rank 0 binds; empty = master_addr ("0.0.0.0" = every interface)
  std::chrono::milliseconds timeout{std::chrono::minutes(5)};  // deadline of join()
  // How long a collective (the rendezvous's own and the communicators': Gloo, NCCL) may
  // wait for a peer before the run fails naming it: the bound on a hang after a process
  // dies or stops.
  std::chrono::milliseconds collective_timeout{std::chrono::seconds(60)};
  LaunchEnvironment launched_by = LaunchEnvironment::kNone;  // whose variables these came from
};

// Looks up an environment variable; nullopt when unset. The default reads the process
// environment; tests pass a map instead of calling setenv.
using EnvLookup = std::function<std::optional<std::string>(const char* name)>;
std::optional<std::string> process_env_lookup(const char* name);

// Builds options from the first launcher whose variables are set, in this order of
// preference (a launcher started by another inherits the outer one's variables, e.g.
// torchrun inside an sbatch script sees SLURM_PROCID=0: the innermost, most specific
// launcher wins, and the other launchers' variables are not read at all):
//
//   torchrun  RANK or WORLD_SIZE set: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE,
//             GROUP_RANK (the node rank), MASTER_ADDR, MASTER_PORT (all three required
//             when WORLD_SIZE > 1). With TORCHELASTIC_USE_AGENT_STORE=True torchrun's
//             agent serves its own store on MASTER_PORT, so rank 0 listens on MASTER_PORT + 1.
//   Open MPI  OMPI_COMM_WORLD_RANK set: OMPI_COMM_WORLD_RANK, _SIZE, _LOCAL_RANK,
//             _LOCAL_SIZE; node rank = rank / local size (mpirun's default by-slot
//             mapping); MASTER_ADDR (default 127.0.0.1 when every rank is on one node,
//             required otherwise), MASTER_PORT (default kDefaultMasterPort).
//   Slurm     SLURM_PROCID set: SLURM_PROCID, SLURM_NTASKS, SLURM_LOCALID, SLURM_NODEID,
//             this node's process count from SLURM_NTASKS_PER_NODE or else
//             SLURM_TASKS_PER_NODE ("2(x3),1"); MASTER_ADDR or else the first host of
//             SLURM_STEP_NODELIST / SLURM_JOB_NODELIST ("node[01-04],gpu7" -> node01);
//             MASTER_PORT or else kDefaultMasterPort + SLURM_JOB_ID % 1000.
//
// Defaults when a launcher leaves them out: local_rank = rank, local_world_size =
// world_size (one node), node_rank = rank / local_world_size. STRATA_MASTER_PORT, when set,
// is the port whatever the launcher. With none of the launchers' variables set the result
// is a world of one. Every launcher also reads
// STRATA_RENDEZVOUS_TIMEOUT_S (seconds, default 300: join()) and
// STRATA_COLLECTIVE_TIMEOUT_S (seconds, default 60: collective_timeout, every collective).
// Errors (InvalidArgument) name the variable and its value: a value that is not a
// number, RANK outside [0, WORLD_SIZE), a port outside [0, 65535], ...
StatusOr<RendezvousOptions> rendezvous_options_from_env(const EnvLookup& lookup = process_env_lookup);

}  // namespace strata
