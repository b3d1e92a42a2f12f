// A TCP rendezvous for multi-process runs: the ranks of a job find each other, then
// agree on small blobs (the 128-byte NCCL unique id, a plan, a checksum).
//
// It is bootstrapped from the variables of the usual launchers (torchrun, strata-launch,
// Open MPI's mpirun, Slurm's srun; see rendezvous_options_from_env and docs/distributed.md)
// or from explicit options.
//
// Rank 0 listens on MASTER_ADDR:MASTER_PORT (port 0 picks a free port, which port()
// reports; the launcher must hand it to the other ranks), every other rank connects
// to it, retrying until the deadline, and says hello with its rank and world size.
// join() returns on every rank once all WORLD_SIZE ranks are present. The collectives
// (broadcast, all_gather, barrier) then run over the sockets as a star through rank 0;
// every rank must call the same collectives in the same order (a mismatch is an error
// naming both calls, not a hang). Every wait has a deadline: join() waits at most
// options.timeout (ranks start at different times), each collective at most
// options.collective_timeout (the ranks of a running job call it within moments of each
// other; a peer that is alive but stuck must not hold the others for the join's minutes).
// A rank that does not arrive gives a DeadlineExceeded error naming the missing ranks.
//
// Not for bulk data: payloads are meant to be bytes to megabytes. Not thread-safe: one
// thread per process drives a Rendezvous.
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/file.h"
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

// Slurm's compressed host lists, in order: "node[01-04],gpu7" -> node01 node02 node03
// node04 gpu7 (zero padding kept; several brackets in one name expand left to right,
// "r[1-2]n[1-2]" -> r1n1 r1n2 r2n1 r2n2). An error names the text and what is wrong.
StatusOr<std::vector<std::string>> expand_slurm_nodelist(std::string_view nodelist);
// Slurm's tasks-per-node lists: "2(x3),1" -> 2 2 2 1.
StatusOr<std::vector<int>> expand_slurm_tasks_per_node(std::string_view tasks_per_node);

class Rendezvous {
 public:
  // Checks the options and, on rank 0, binds and listens (so that port() is known before
  // the others connect). Other ranks do nothing yet. A non-zero rank with port 0 is an
  // error: only rank 0 may ask for a free port.
  static StatusOr<Rendezvous> start(const RendezvousOptions& options);
  // start() then join().
  static StatusOr<Rendezvous> create(const RendezvousOptions& options);

  Rendezvous(Rendezvous&&) noexcept;
  Rendezvous& operator=(Rendezvous&&) noexcept;
  Rendezvous(const Rendezvous&) = delete;
  Rendezvous& operator=(const Rendezvous&) = delete;
  ~Rendezvous();

  // Rank 0: accepts connections until every rank has said hello, then welcomes them all.
  // Other ranks: connect to rank 0 (retrying refused connections until the deadline),
  // say hello, and wait for the welcome. A rank with another WORLD_SIZE, a rank out of
  // range or a rank claimed twice fails the join on rank 0 and on the offending rank,
  // with the same message. On timeout rank 0 names the ranks that never arrived, and
  // passes that message to the ranks that did.
  Status join();
  bool joined() const { return joined_; }

  int rank() const { return options_.rank; }
  int world_size() const { return options_.world_size; }
  int local_rank() const { return options_.local_rank; }
  // The port rank 0 listens on (the one picked when master_port was 0); master_port on
  // other ranks.
  uint16_t port() const { return port_; }
  const RendezvousOptions& options() const { return options_; }

  // Every rank gets `root`'s blob (`blob` is ignored on the other ranks).
  StatusOr<std::vector<std::byte>> broadcast(std::span<const std::byte> blob, int root = 0);
  // Every rank gets every rank's blob, indexed by rank. Blobs may differ in size.
  StatusOr<std::vector<std::vector<std::byte>>> all_gather(std::span<const std::byte> blob);
  // Returns once every rank has called barrier().
  Status barrier();

  // String conveniences over broadcast / all_gather.
  StatusOr<std::string> broadcast_string(std::string_view text, int root = 0);
  StatusOr<std::vector<std::string>> all_gather_strings(std::string_view text);

 private:
  struct Peer;  // a connection and its partly received bytes
  explicit Rendezvous(const RendezvousOptions& options);
  Status join_as_root();
  Status join_as_peer();
  // all_gather and barrier: every blob to rank 0, the concatenation back. `kind_code`
  // is the wire message kind, so that a barrier never matches an all_gather.
  StatusOr<std::vector<std::vector<std::byte>>> gather_all(std::span<const std::byte> blob, uint16_t kind_code);
  Status fail(Status status);  // keeps the first failure; later calls return it

  RendezvousOptions options_;
  uint16_t port_ = 0;
  File listener_;               // rank 0 only
  std::vector<Peer> peers_;     // rank 0: one per rank (index 0 unused); others: [0] = rank 0
  uint64_t next_sequence_ = 0;  // collectives issued so far
  bool joined_ = false;
  Status failure_;              // first failure; the rendezvous is unusable after one
};

}  // namespace strata
