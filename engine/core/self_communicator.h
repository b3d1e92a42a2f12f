// SelfCommunicator: the collectives of a world of one rank, with no communication library.
//
// A world of one needs no NCCL: creating an NCCL communicator costs start-up time, device
// memory and a proxy thread, and its collectives are launches that move nothing. Here
// every collective is what the definitions of communicator.h give for N = 1, in stream
// order on the caller's stream: all_gather, broadcast and the reductions copy send to
// recv (nothing when they are the same buffer), except that fp32 data reduced over a
// 16-bit wire is rounded through the wire dtype, as the other communicators do, so one
// rank gives the same bits whichever communicator it has. barrier has nothing to wait for.
// Works on any device (CUDA: a copy or one rounding kernel; CPU: a stream task).
#pragma once

#include <mutex>
#include <string>
#include <string_view>

#include "engine/core/communicator.h"

namespace strata {

class SelfCommunicator final : public Communicator {
 public:
  explicit SelfCommunicator(Device& device) : device_(device) {}
  SelfCommunicator(const SelfCommunicator&) = delete;
  SelfCommunicator& operator=(const SelfCommunicator&) = delete;

  int rank() const override { return 0; }
  int world_size() const override { return 1; }
  Device& device() override { return device_; }
  std::string_view backend_name() const override { return "self"; }

  Status all_gather(const void* send, void* recv, size_t send_count, DType dtype, Stream& stream) override;
  Status reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, const ReduceOptions& options,
                        Stream& stream) override;
  Status all_reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options,
                    Stream& stream) override;
  Status broadcast(const void* send, void* recv, size_t count, DType dtype, int root, Stream& stream) override;
  Status barrier(Stream& stream) override;
  // Later operations fail with the reason (there are no peers to release).
  void abort(std::string_view reason) override;
  Status async_error() override;

 private:
  Status check_usable(std::string_view what, Stream& stream);
  Status copy(const void* send, void* recv, size_t bytes, Stream& stream);
  Status reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options, Stream& stream,
                std::string_view what);

  Device& device_;
  std::mutex mutex_;
  std::string aborted_;  // the abort reason; empty while usable
};

}  // namespace strata
