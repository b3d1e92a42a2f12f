// GlooCommunicator: the Communicator of CPU-device ranks that are processes, on one host
// or several, over Gloo's TCP transport. Compiled only with STRATA_HAVE_GLOO.
//
// Bootstrap: every process of a joined Rendezvous (engine/core/rendezvous.h, itself
// bootstrapped from RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT) calls create() with
// the same options. Each makes a Gloo TCP device listening on the local address that
// routes to MASTER_ADDR (or options.listen_address), one Gloo pair per peer, and the
// pairs' addresses travel through Rendezvous::all_gather; then every pair connects. No
// second store or port is involved beyond the pairs' own ephemeral ports.
//
// Operations follow communicator.h and run like HostCommunicator's: each is a task on
// the caller's CPU stream, in stream order, and moves data with Gloo's point-to-point
// unbound buffers (one message slot per operation, so operations on different streams
// may be in flight together). Reductions keep the rank-order contract exactly: each rank
// receives every rank's copy of the slice it owns (in the wire dtype: fp32 data with a
// 16-bit wire is rounded before it is sent), reduces them in rank order in fp32 with the
// same code as HostCommunicator (engine/core/rank_order_reduction.h) and rounds once;
// all_reduce then all-gathers the reduced slices. Results are bit-identical to
// HostCommunicator's for every dtype, wire dtype and op — Gloo's own ring algorithms,
// which sum in ring order, are not used.
//
// Failure: every wait of an operation shares one deadline, options.timeout after the
// operation starts running. A peer whose connection closes (the process exited or was
// killed, or it aborted) or that sends nothing before the deadline fails the operation
// with an error naming that rank (Unavailable, or DeadlineExceeded), reported by the
// stream's next synchronize() and by async_error(); the exchanges with the other peers
// still finish first, so that they too see the lost rank rather than this one. A failed
// or aborted communicator then closes its connections, so that peers still waiting on it
// fail at once instead of at their deadline, and refuses every later operation. Gloo's
// exceptions never escape.
#pragma once

#if !defined(STRATA_HAVE_GLOO)
#error "engine/core/gloo_communicator.h needs a build with Gloo (STRATA_HAVE_GLOO; apt-get install libgloo-dev)"
#endif

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>

#include "engine/core/communicator.h"
#include "engine/core/stream_task_communicator.h"
#include "engine/core/rendezvous.h"

namespace strata {

struct GlooCommunicatorOptions {
  // Deadline of connecting the pairs and of each collective once it runs: a peer that has
  // not sent its part by then is reported lost.
  std::chrono::milliseconds timeout{std::chrono::seconds(60)};
  // The address this rank listens on for its peers; empty = the local address the host
  // routes to the rendezvous' master_addr through (so each rank of a multi-node job
  // listens on the interface that reaches the others; 127.0.0.1 on one host).
  std::string listen_address;
};

namespace gloo_communicator_internal {
struct State;
}

class GlooCommunicator final : public StreamTaskCommunicator {
 public:
  // Collective over `rendezvous` (joined): every process calls it with the same options,
  // between the same other rendezvous collectives. `device` must be a CPU device.
  static StatusOr<std::unique_ptr<GlooCommunicator>> create(Rendezvous& rendezvous, Device& device,
                                                            const GlooCommunicatorOptions& options = {});

  // Use create().
  GlooCommunicator(std::shared_ptr<gloo_communicator_internal::State> state, Device& device);
  // Operations already enqueued still run; the connections close once the last has
  // finished, and peers waiting on this rank after that fail at once.
  ~GlooCommunicator() override;
  GlooCommunicator(const GlooCommunicator&) = delete;
  GlooCommunicator& operator=(const GlooCommunicator&) = delete;

  int rank() const override;
  int world_size() const override;
  std::string_view backend_name() const override { return "gloo"; }

  // Fails this rank's pending and later operations with `reason` and closes its
  // connections, so that peers in (or entering) a collective with it fail too.
  void abort(std::string_view reason) override;
  Status async_error() override;

  // The address this rank's pairs listen on.
  const std::string& listen_address() const;

 private:
  Status enqueue(CollectiveCall call, const std::optional<ReduceOptions>& reduce, Stream& stream) override;

  std::shared_ptr<gloo_communicator_internal::State> state_;
  std::atomic<uint64_t> next_sequence_{0};
};

}  // namespace strata
