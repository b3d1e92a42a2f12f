// NcclCommunicator: the Communicator of GPU ranks, over NCCL. Compiled only with
// STRATA_HAVE_CUDA.
//
// Two ways to make the ranks:
// - one process driving several GPUs: create_local(devices) — one communicator per
//   device, ranks in the order given (what ncclCommInitAll does, but through grouped
//   ncclCommInitRankConfig so that the communicators get the configuration below);
// - one process per GPU (or per node, with several GPUs each), across nodes:
//   create_from_rendezvous(devices, rendezvous) — rank 0 makes the NCCL unique id and
//   shares it through the TCP rendezvous (engine/core/rendezvous.h), which the launcher
//   variables RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT bootstrap, so the same binary
//   runs on one node or many. NCCL rank = process rank * GPUs per process + index.
//
// Operations enqueue on the stream's native cudaStream_t and return at once. The
// communicators are non-blocking (ncclConfig_t::blocking = 0): an NCCL call that is
// still connecting is awaited with a deadline, never forever. A watchdog thread per
// communicator checks ncclCommGetAsyncError and the age of the oldest unfinished
// operation; past options.timeout it records a DeadlineExceeded error naming the
// operation and aborts the NCCL communicator (ncclCommAbort), which also frees the
// peers stuck in the same collective. Each operation is followed by a host function on
// its stream that returns the recorded error, so the failure surfaces at the stream's
// next synchronize(), as Communicator promises.
//
// Reductions follow communicator.h. fp32 sum with an fp32 wire uses ncclReduceScatter /
// ncclAllReduce (mean: that sum, then divided by N by a kernel). Every other reduction
// (16-bit data, fp32 data with a 16-bit wire, max) takes the exact path: the inputs
// (cast to the wire dtype by a kernel first, when it differs) are exchanged with
// grouped ncclSend/ncclRecv so that each rank receives every rank's copy of the slice
// it owns — the same bytes on the wire as a ring reduce-scatter — and a kernel reduces
// them in rank order in fp32 and rounds once; all_reduce then all-gathers the reduced
// slices the same way. The exact path needs device scratch: N x (elements per rank) in
// the wire dtype, plus the whole input in the wire dtype when it is cast. It is
// allocated from the device (under its budget) on first use and kept, grown as needed;
// reserve_scratch() lets the engine take it up front. scratch_bytes_for() tells how much.
//
// Threads: each communicator may be driven by its own thread (the engine's usual
// shape, as with HostCommunicator), which needs nothing more. A single thread driving
// several communicators must put the calls for all of them between an NcclGroup's
// construction and end() (NCCL's group semantics); inside a group only all_gather,
// broadcast, barrier and fp32 sum reductions with an fp32 wire are allowed, since the
// others need a kernel after NCCL's transfer, which NCCL defers to the end of the group.
#pragma once

#if !defined(STRATA_HAVE_CUDA)
#error "engine/core/nccl_communicator.h needs a build with CUDA (STRATA_HAVE_CUDA)"
#endif

#include <cuda_runtime_api.h>

#include <array>
#include <chrono>
#include <cstddef>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/core/communicator.h"
#include "engine/core/rendezvous.h"

struct ncclComm;  // ncclComm_t is ncclComm*; nccl.h stays out of this header

namespace strata {

struct NcclCommunicatorOptions {
  // Deadline of initialization, of each NCCL call that is still connecting, and of each
  // operation in flight (the watchdog); a slow rank may still be computing, so generous.
  std::chrono::milliseconds timeout{std::chrono::minutes(10)};
  // How often the watchdog looks at the operations in flight.
  std::chrono::milliseconds watchdog_period{100};
  // Passed to NCCL as commName (its logs); empty = "strata".
  std::string name;
};

// The 128 bytes every rank of one NCCL communicator must share (ncclUniqueId).
using NcclUniqueIdBytes = std::array<std::byte, 128>;
StatusOr<NcclUniqueIdBytes> make_nccl_unique_id();

namespace nccl_communicator_internal {
struct State;
}

class NcclCommunicator final : public Communicator {
 public:
  // One process, every rank: devices[i] becomes rank i of devices.size().
  static StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> create_local(
      std::span<Device* const> devices, const NcclCommunicatorOptions& options = {});
  // This process's devices become ranks first_rank .. first_rank + devices.size() - 1
  // of world_size, in a communicator named by `id` (every process calls this, each
  // with its own devices and first_rank, and the same id).
  static StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> create_ranks(
      std::span<Device* const> devices, int first_rank, int world_size, const NcclUniqueIdBytes& id,
      const NcclCommunicatorOptions& options = {});
  // Every process of `rendezvous` (joined) contributes `devices` (the same number on
  // each; checked): rank 0 makes the id, the rendezvous shares it, then create_ranks
  // with first_rank = rendezvous.rank() * devices.size().
  static StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> create_from_rendezvous(
      std::span<Device* const> devices, Rendezvous& rendezvous, const NcclCommunicatorOptions& options = {});
  // The usual case: one GPU per process.
  static StatusOr<std::unique_ptr<NcclCommunicator>> create_from_rendezvous(Device& device, Rendezvous& rendezvous,
                                                                             const NcclCommunicatorOptions& options = {});

  // Shuts a set of communicators down together: waits for their operations, finalizes
  // all of them (NCCL finalization waits for the peers), then destroys them. A process
  // driving several GPUs from one thread should end this way; a communicator destroyed
  // on its own waits at most 5 s for its peers' finalization and otherwise aborts.
  // Returns the first failure any of them had.
  static Status destroy_all(std::vector<std::unique_ptr<NcclCommunicator>> communicators);

  // Use the create functions.
  NcclCommunicator(std::shared_ptr<nccl_communicator_internal::State> state, Device& device, int rank, int world_size);
  // Waits (up to the timeout) for this rank's operations in flight, then finalizes and
  // destroys the NCCL communicator; aborts it instead after a failure, or when the peers
  // do not finalize within 5 s (see destroy_all).
  ~NcclCommunicator() override;
  NcclCommunicator(const NcclCommunicator&) = delete;
  NcclCommunicator& operator=(const NcclCommunicator&) = delete;

  int rank() const override { return rank_; }
  int world_size() const override { return world_size_; }
  Device& device() override { return device_; }
  std::string_view backend_name() const override { return "nccl"; }

  Status all_gather(const void* send, void* recv, size_t send_count, DType dtype, Stream& stream) override;
  Status reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, const ReduceOptions& options,
                        Stream& stream) override;
  Status all_reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options,
                    Stream& stream) override;
  Status broadcast(const void* send, void* recv, size_t count, DType dtype, int root, Stream& stream) override;
  Status barrier(Stream& stream) override;

  // Aborts the NCCL communicator (ncclCommAbort); every later operation fails.
  void abort(std::string_view reason) override;
  Status async_error() override;

  // Device scratch the exact path needs for reduce_scatter(recv_count) or
  // all_reduce(count = recv_count * world_size) of `dtype` with `options`; 0 for the
  // native path.
  size_t scratch_bytes_for(size_t recv_count, DType dtype, const ReduceOptions& options) const;
  // Allocates (at least) `bytes` of scratch now, from the device budget.
  Status reserve_scratch(size_t bytes);

 private:
  friend class NcclGroup;
  struct Slices;  // which elements each rank reduces
  Status exact_reduce(const void* send, void* recv, const Slices& slices, DType dtype, DType wire, ReduceOp op,
                      bool gather_result, Stream& stream, const std::string& what);
  // The exact path's point-to-point calls, posted inside an NCCL group with the state's
  // mutex held: the exchange of slices, and all_reduce's gather of the reduced slices.
  Status post_slice_exchange(const std::byte* wire_send, std::byte* contributions, const Slices& slices, DType wire,
                             cudaStream_t native);
  Status post_reduced_gather(const std::byte* reduced, void* recv, const Slices& slices, DType dtype,
                             cudaStream_t native);
  // Checks the stream and the communicator's health; returns the cudaStream_t.
  StatusOr<cudaStream_t> begin(Stream& stream, const std::string& what);
  // Tracks the operation just enqueued (watchdog) and surfaces errors in stream order.
  Status finish(Stream& stream, std::string what);

  std::shared_ptr<nccl_communicator_internal::State> state_;
  Device& device_;
  const int rank_;
  const int world_size_;
  uint64_t issued_ = 0;  // operations enqueued so far (numbers them in messages)
};

// Groups the calls of one thread that drives several communicators (ncclGroupStart /
// ncclGroupEnd). end() waits, up to each communicator's timeout, until NCCL has taken
// the calls of all of them. Destroying an un-ended group ends it (errors are logged).
class NcclGroup {
 public:
  static StatusOr<NcclGroup> start(std::span<NcclCommunicator* const> communicators);
  NcclGroup(NcclGroup&& other) noexcept;
  NcclGroup& operator=(NcclGroup&&) = delete;
  NcclGroup(const NcclGroup&) = delete;
  NcclGroup& operator=(const NcclGroup&) = delete;
  ~NcclGroup();
  Status end();

 private:
  explicit NcclGroup(std::vector<std::shared_ptr<nccl_communicator_internal::State>> states);
  std::vector<std::shared_ptr<nccl_communicator_internal::State>> states_;
  bool active_ = false;
};

// The kernels the exact path uses (engine/core/nccl_communicator_kernels.cu). Element
// functions match engine/core/dtype.h bit for bit.
namespace nccl_communicator_internal {
// dst[i] = round(src[i]) to `wire` (kBFloat16 or kFloat16).
Status launch_cast_to_wire(const float* src, void* dst, DType wire, size_t count, cudaStream_t stream);
// out[i] = reduce over r < ranks of w(contributions[r * count + i]) (contributions are in
// `wire`), rounded once to `out_dtype`, as communicator.h defines.
Status launch_reduce_contributions(const void* contributions, int ranks, size_t count, DType wire, ReduceOp op,
                                   void* out, DType out_dtype, cudaStream_t stream);
// dst[i] = fp32(round(src[i]) to `wire`): a reduction of one rank (SelfCommunicator); src may be dst.
Status launch_round_through_wire(const float* src, float* dst, DType wire, size_t count, cudaStream_t stream);
// data[i] = data[i] / divisor.
Status launch_divide(float* data, size_t count, float divisor, cudaStream_t stream);
}  // namespace nccl_communicator_internal

}  // namespace strata
