// What the communicators that run each collective as a task on the caller's CPU-device
// stream share (HostCommunicator: ranks as threads of one process; GlooCommunicator: ranks
// as processes): the Communicator calls as one CollectiveCall, the checks made when a call
// is enqueued, and the guard that aborts the group when a stream drops a collective unrun.
//
// Why the guard: a CPU stream skips its later tasks after an error until the error is
// reported, and a collective skipped that way would leave the other ranks waiting for it.
#pragma once

#include <cstddef>
#include <functional>
#include <optional>

#include "engine/core/communicator.h"
#include "engine/core/device.h"
#include "engine/core/status.h"

namespace strata {

// One collective as one rank issues it.
struct CollectiveCall {
  CollectiveKind kind = CollectiveKind::kBarrier;
  DType dtype = DType::kFloat32;
  DType wire = DType::kFloat32;  // reductions only (resolved from ReduceOptions)
  ReduceOp op = ReduceOp::kSum;  // reductions only
  size_t count = 0;              // all_gather: per rank sent; reduce_scatter: per rank received; others: total
  int root = 0;                  // broadcast only
  const std::byte* send = nullptr;
  std::byte* recv = nullptr;
};

class StreamTaskCommunicator : public Communicator {
 public:
  explicit StreamTaskCommunicator(Device& device) : device_(device) {}

  Device& device() final { return device_; }
  Status all_gather(const void* send, void* recv, size_t send_count, DType dtype, Stream& stream) final;
  Status reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, const ReduceOptions& options,
                        Stream& stream) final;
  Status all_reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options,
                    Stream& stream) final;
  Status broadcast(const void* send, void* recv, size_t count, DType dtype, int root, Stream& stream) final;
  Status barrier(Stream& stream) final;

 protected:
  // Issues one call (`reduce` set for reductions). Every refusal must also fail the group:
  // the other ranks would otherwise wait for a collective this rank never issues.
  virtual Status enqueue(CollectiveCall call, const std::optional<ReduceOptions>& reduce, Stream& stream) = 0;

  // The checks every backend makes before issuing: the stream is on this rank's device, the
  // wire dtype (resolved into `call`), the broadcast root, the count, the buffers.
  Status check_call(CollectiveCall& call, const std::optional<ReduceOptions>& reduce, Stream& stream) const;

  // Launches `body` on `stream`. When the stream destroys the task without running it,
  // `dropped` runs instead (it aborts the group). A launch that fails returns its error and
  // does not call `dropped`: the caller reports it.
  static Status launch_guarded(Stream& stream, std::function<void()> dropped, std::function<Status(const LaunchContext&)> body);

  Device& device_;
};

}  // namespace strata
