// A TCP rendezvous for multi-process runs: the ranks of a job find each other, then
// agree on small blobs (the 128-byte NCCL unique id, a plan, a checksum).
//
// It is bootstrapped from the variables of the usual launchers (torchrun, strata-launch,
// Open MPI's mpirun, Slurm's srun; see engine/core/launch_env.h and docs/distributed.md)
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
#include "engine/core/launch_env.h"
#include "engine/core/status.h"

namespace strata {

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
  struct Gather;  // one all_gather or barrier in progress
  explicit Rendezvous(const RendezvousOptions& options);
  Status join_as_root();
  void reject_all(std::vector<Peer>& pending, const Status& why);  // rank 0: the group cannot form
  StatusOr<bool> read_hello(Peer& peer, std::vector<Peer>& pending, int& present);  // rank 0: true = still pending
  Status accept_connections(std::vector<Peer>& pending);  // rank 0: new connections onto `pending`
  Status join_as_peer();
  // all_gather and barrier: every blob to rank 0, the concatenation back. `kind_code`
  // is the wire message kind, so that a barrier never matches an all_gather.
  StatusOr<std::vector<std::vector<std::byte>>> gather_all(std::span<const std::byte> blob, uint16_t kind_code);
  StatusOr<std::vector<std::vector<std::byte>>> gather_through_root(std::span<const std::byte> blob, Gather& gather);
  StatusOr<std::vector<std::vector<std::byte>>> gather_at_root(Gather& gather);
  Status collect_at_root(Gather& gather);
  StatusOr<std::vector<int>> take_arrived_blobs(Gather& gather, std::vector<bool>& received);
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
