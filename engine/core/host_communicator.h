// HostCommunicator: collectives for CPU-device ranks that are threads of one process.
//
// A HostCommunicatorGroup is created once for N ranks and hands out one
// HostCommunicator per rank. Each rank's thread enqueues operations on a stream of
// its own (CPU) device; there an operation is a task that waits until every rank has
// reached the same operation (matched by sequence number: the n-th collective a rank
// issues meets the n-th of every other rank), then moves the data with every rank's
// buffers in view, and completes once every rank has finished reading the others'
// buffers. Reductions are split by rank: each rank reduces its own slice (fanned out
// through its device's executor), always rank 0 + rank 1 + ... in fp32, so the
// results do not depend on timing and are bit-identical from run to run.
//
// Failure: a rank that waits longer than options.timeout for the others fails that
// operation with DeadlineExceeded naming the operation and the ranks that did not
// arrive, and aborts the group; an aborted group fails every pending and later
// operation of every rank with the reason; so does a rank whose communicator was
// destroyed before reaching an operation the others are waiting in. Mismatched
// operations (different kinds, counts, dtypes, options or roots at the same sequence
// number) abort the group with an error naming both.
#pragma once

#include <atomic>
#include <chrono>
#include <cstdint>
#include <memory>
#include <optional>
#include <string_view>

#include "engine/core/communicator.h"
#include "engine/core/stream_task_communicator.h"

namespace strata {

namespace host_communicator_internal {
struct GroupState;
}

struct HostCommunicatorOptions {
  int world_size = 1;  // number of ranks (threads)
  // How long a rank waits for the others at one operation before giving up (and
  // aborting the group). Generous by default: a slow rank may still be computing.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
};

class HostCommunicator;

class HostCommunicatorGroup {
 public:
  static StatusOr<HostCommunicatorGroup> create(const HostCommunicatorOptions& options);

  // Hands out rank `rank`'s communicator, bound to `device` (a CPU device; several ranks
  // may share one). Each rank can be taken once. The communicators keep the shared
  // state alive: the group object may be destroyed before them.
  StatusOr<std::unique_ptr<HostCommunicator>> communicator(int rank, Device& device);

  // Fails every pending and later operation of every rank with `reason` (Cancelled).
  void abort(std::string_view reason);
  int world_size() const;

 private:
  explicit HostCommunicatorGroup(std::shared_ptr<host_communicator_internal::GroupState> state);
  std::shared_ptr<host_communicator_internal::GroupState> state_;
};

class HostCommunicator final : public StreamTaskCommunicator {
 public:
  // Use HostCommunicatorGroup::communicator().
  HostCommunicator(std::shared_ptr<host_communicator_internal::GroupState> state, int rank, Device& device);
  // Operations already enqueued still run; the other ranks' operations past them fail
  // instead of waiting for this rank.
  ~HostCommunicator() override;
  HostCommunicator(const HostCommunicator&) = delete;
  HostCommunicator& operator=(const HostCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override;
  std::string_view backend_name() const override { return "host"; }

  // Aborts the whole group (see HostCommunicatorGroup::abort).
  void abort(std::string_view reason) override;
  Status async_error() override;

  // Collectives this rank has issued so far (the next one's sequence number).
  uint64_t issued() const { return next_sequence_.load(std::memory_order_relaxed); }

 private:
  Status enqueue(CollectiveCall call, const std::optional<ReduceOptions>& reduce, Stream& stream) override;

  std::shared_ptr<host_communicator_internal::GroupState> state_;
  const int rank_;
  std::atomic<uint64_t> next_sequence_{0};
};

}  // namespace strata
