// The NCCL communicator's collectives (all-gather, broadcast, barrier, the reductions on
// their native and exact paths) and NCCL groups; creation and the watchdog are in
// nccl_communicator.cpp.
#include "engine/core/nccl_communicator.h"

#include <algorithm>
#include <cstring>
#include <optional>
#include <set>
#include <utility>

#include "engine/core/nccl_communicator_internal.h"

namespace strata {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

using nccl_communicator_internal::CurrentDevice;
using nccl_communicator_internal::nccl_type;
using nccl_communicator_internal::State;
using nccl_communicator_internal::t_group_depth;

// Operations
// ---------------------------------------------------------------------------

struct NcclCommunicator::Slices {
  std::vector<size_t> begin;  // per rank, first element of the slice it reduces
  std::vector<size_t> count;  // per rank, elements in it
};

StatusOr<cudaStream_t> NcclCommunicator::begin(Stream& stream, const std::string& what) {
  if (&stream.device() != &device_)
    return InvalidArgumentError(state_->who + ": " + what + " on stream '" + stream.name() + "' of " +
                                stream.device().description() + ", not of this rank's device " + device_.description());
  auto* native = static_cast<cudaStream_t>(stream.native_handle());
  if (native == nullptr)
    return InvalidArgumentError(state_->who + ": stream '" + stream.name() + "' has no CUDA stream");
  if (Status failure = state_->current_failure(); !failure.ok())
    return Status(failure.code(), state_->who + ": " + what + " refused: the communicator failed earlier: " +
                                      failure.message());
  return native;
}

Status NcclCommunicator::finish(Stream& stream, std::string what) {
  if (t_group_depth > 0) return Status::Ok();  // NCCL has not enqueued anything yet (see NcclGroup)
  State& state = *state_;
  cudaEvent_t event = nullptr;
  {
    std::lock_guard<std::mutex> lock(state.watch_mutex);
    if (!state.spare_events.empty()) {
      event = state.spare_events.back();
      state.spare_events.pop_back();
    }
  }
  if (event == nullptr) STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
  if (const cudaError_t error = cudaEventRecord(event, static_cast<cudaStream_t>(stream.native_handle()));
      error != cudaSuccess) {
    (void)cudaEventDestroy(event);
    STRATA_RETURN_IF_CUDA_ERROR(error);
  }
  {
    std::lock_guard<std::mutex> lock(state.watch_mutex);
    state.in_flight.push_back({event, Clock::now(), what});
  }
  // In stream order after the operation: a failure recorded by then (a timeout, an
  // abort, an NCCL error) becomes the stream's error.
  return stream.enqueue_host([state = state_, what = std::move(what)]() -> Status {
    Status failure = state->current_failure();
    if (failure.ok()) return failure;
    return Status(failure.code(), state->who + ": " + what + " did not complete: " + failure.message());
  });
}

Status NcclCommunicator::all_gather(const void* send, void* recv, size_t send_count, DType dtype, Stream& stream) {
  const std::string what = "all_gather #" + std::to_string(issued_++);
  STRATA_ASSIGN_OR_RETURN(cudaStream_t native, begin(stream, what));
  STRATA_NCCL_ENTER_DEVICE(state_->ordinal);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->comm == nullptr) return FailedPreconditionError(state_->who + ": the communicator was aborted");
    STRATA_NCCL_SETTLE(*state_, ncclAllGather(send, recv, send_count, nccl_type(dtype), state_->comm, native));
  }
  return finish(stream, what);
}

Status NcclCommunicator::broadcast(const void* send, void* recv, size_t count, DType dtype, int root, Stream& stream) {
  const std::string what = "broadcast #" + std::to_string(issued_++);
  if (root < 0 || root >= world_size_)
    return InvalidArgumentError(state_->who + ": broadcast root " + std::to_string(root) + " is outside [0, " +
                                std::to_string(world_size_ - 1) + "]");
  STRATA_ASSIGN_OR_RETURN(cudaStream_t native, begin(stream, what));
  STRATA_NCCL_ENTER_DEVICE(state_->ordinal);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->comm == nullptr) return FailedPreconditionError(state_->who + ": the communicator was aborted");
    STRATA_NCCL_SETTLE(*state_, ncclBroadcast(rank_ == root ? send : recv, recv, count, nccl_type(dtype), root,
                                              state_->comm, native));
  }
  return finish(stream, what);
}

Status NcclCommunicator::barrier(Stream& stream) {
  const std::string what = "barrier #" + std::to_string(issued_++);
  STRATA_ASSIGN_OR_RETURN(cudaStream_t native, begin(stream, what));
  STRATA_NCCL_ENTER_DEVICE(state_->ordinal);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->comm == nullptr) return FailedPreconditionError(state_->who + ": the communicator was aborted");
    void* word = state_->barrier_word.data();
    STRATA_NCCL_SETTLE(*state_, ncclAllReduce(word, word, 1, ncclFloat32, ncclSum, state_->comm, native));
  }
  return finish(stream, what);
}

namespace {
// NCCL's own fp32 sum (`issue` makes the call on the communicator, under the state's
// mutex), then the division for a mean.
template <typename Issue>
Status native_sum(nccl_communicator_internal::State& state, const char* statement, Issue issue, float* recv, size_t count, ReduceOp op,
                  int world_size, cudaStream_t native) {
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.comm == nullptr) return FailedPreconditionError(state.who + ": the communicator was aborted");
    STRATA_RETURN_IF_ERROR(state.settle(issue(state.comm), statement, __FILE__, __LINE__));
  }
  if (op != ReduceOp::kMean) return Status::Ok();
  return nccl_communicator_internal::launch_divide(recv, count, static_cast<float>(world_size), native);
}

bool takes_native_path(DType dtype, DType wire, ReduceOp op) {
  return dtype == DType::kFloat32 && wire == DType::kFloat32 && op != ReduceOp::kMax;
}

// A reduction that needs a kernel after its transfer (not NCCL's own sum, or a mean) cannot
// run inside an NcclGroup, where NCCL defers the transfer to the group's end.
Status check_outside_group_if_kernel(const std::string& who, const std::string& what, DType dtype, DType wire, ReduceOp op) {
  if ((takes_native_path(dtype, wire, op) && op != ReduceOp::kMean) || t_group_depth == 0) return Status::Ok();
  return FailedPreconditionError(who + ": " + what + " (" + std::string(dtype_name(dtype)) + ", " + std::string(reduce_op_name(op)) +
                                 ", wire " + std::string(dtype_name(wire)) + ") needs a kernel after the transfer and cannot run inside an NcclGroup");
}

}  // namespace

Status NcclCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                        const ReduceOptions& options, Stream& stream) {
  const std::string what = "reduce_scatter #" + std::to_string(issued_++);
  STRATA_ASSIGN_OR_RETURN(const DType wire, resolve_wire_dtype(dtype, options));
  STRATA_ASSIGN_OR_RETURN(cudaStream_t native, begin(stream, what));
  STRATA_NCCL_ENTER_DEVICE(state_->ordinal);
  STRATA_RETURN_IF_ERROR(check_outside_group_if_kernel(state_->who, what, dtype, wire, options.op));
  if (takes_native_path(dtype, wire, options.op)) {
    auto issue = [&](ncclComm_t comm) { return ncclReduceScatter(send, recv, recv_count, ncclFloat32, ncclSum, comm, native); };
    STRATA_RETURN_IF_ERROR(native_sum(*state_, "ncclReduceScatter", issue, static_cast<float*>(recv), recv_count, options.op, world_size_, native));
    return finish(stream, what);
  }
  Slices slices;
  for (int rank = 0; rank < world_size_; ++rank) {
    slices.begin.push_back(static_cast<size_t>(rank) * recv_count);
    slices.count.push_back(recv_count);
  }
  STRATA_RETURN_IF_ERROR(exact_reduce(send, recv, slices, dtype, wire, options.op, /*gather_result=*/false, stream, what));
  return finish(stream, what);
}

Status NcclCommunicator::all_reduce(const void* send, void* recv, size_t count, DType dtype,
                                    const ReduceOptions& options, Stream& stream) {
  const std::string what = "all_reduce #" + std::to_string(issued_++);
  STRATA_ASSIGN_OR_RETURN(const DType wire, resolve_wire_dtype(dtype, options));
  STRATA_ASSIGN_OR_RETURN(cudaStream_t native, begin(stream, what));
  STRATA_NCCL_ENTER_DEVICE(state_->ordinal);
  STRATA_RETURN_IF_ERROR(check_outside_group_if_kernel(state_->who, what, dtype, wire, options.op));
  if (takes_native_path(dtype, wire, options.op)) {
    auto issue = [&](ncclComm_t comm) { return ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, comm, native); };
    STRATA_RETURN_IF_ERROR(native_sum(*state_, "ncclAllReduce", issue, static_cast<float*>(recv), count, options.op, world_size_, native));
    return finish(stream, what);
  }
  // The same split as HostCommunicator: ceil(count / N) elements per rank, the last ones shorter.
  Slices slices;
  const size_t per_rank = (count + static_cast<size_t>(world_size_) - 1) / static_cast<size_t>(world_size_);
  for (int rank = 0; rank < world_size_; ++rank) {
    const size_t begin = std::min(count, per_rank * static_cast<size_t>(rank));
    slices.begin.push_back(begin);
    slices.count.push_back(std::min(count, begin + per_rank) - begin);
  }
  STRATA_RETURN_IF_ERROR(exact_reduce(send, recv, slices, dtype, wire, options.op, /*gather_result=*/true, stream, what));
  return finish(stream, what);
}

size_t NcclCommunicator::scratch_bytes_for(size_t recv_count, DType dtype, const ReduceOptions& options) const {
  const StatusOr<DType> wire = resolve_wire_dtype(dtype, options);
  if (!wire.ok() || takes_native_path(dtype, *wire, options.op)) return 0;
  const size_t total = recv_count * static_cast<size_t>(world_size_);
  return (*wire != dtype ? total * dtype_size(*wire) : 0) + total * dtype_size(*wire);
}

Status NcclCommunicator::reserve_scratch(size_t bytes) {
  STRATA_NCCL_ENTER_DEVICE(state_->ordinal);
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->scratch.size() >= bytes) return Status::Ok();
  // The old scratch may still be in use by an operation in flight.
  if (!state_->scratch.empty()) STRATA_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(state_->scratch_released));
  state_->scratch.reset();
  STRATA_ASSIGN_OR_RETURN(state_->scratch, device_.allocate(bytes, "nccl exact-reduction scratch"));
  return Status::Ok();
}

Status NcclCommunicator::exact_reduce(const void* send, void* recv, const Slices& slices, DType dtype, DType wire,
                                      ReduceOp op, bool gather_result, Stream& stream, const std::string& what) {
  State& state = *state_;
  auto* native = static_cast<cudaStream_t>(stream.native_handle());
  const size_t wire_bytes = dtype_size(wire);
  const size_t data_bytes = dtype_size(dtype);
  const size_t me = static_cast<size_t>(rank_);
  const size_t mine = slices.count[me];
  const size_t total = slices.begin.back() + slices.count.back();
  const bool cast = wire != dtype;
  const size_t cast_bytes = cast ? total * wire_bytes : 0;
  const size_t needed = cast_bytes + static_cast<size_t>(world_size_) * mine * wire_bytes;
  STRATA_RETURN_IF_ERROR(reserve_scratch(needed));

  std::lock_guard<std::mutex> lock(state.mutex);
  if (state.comm == nullptr) return FailedPreconditionError(state.who + ": the communicator was aborted");
  // Another stream may still be using the scratch.
  STRATA_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(native, state.scratch_released, 0));
  auto* scratch = static_cast<std::byte*>(state.scratch.data());
  const std::byte* wire_send = cast ? scratch : static_cast<const std::byte*>(send);
  std::byte* contributions = scratch + cast_bytes;
  if (cast)
    STRATA_RETURN_IF_ERROR(nccl_communicator_internal::launch_cast_to_wire(static_cast<const float*>(send), scratch,
                                                                           wire, total, native));

  // Every rank sends each peer that peer's slice and receives every peer's copy of its own.
  {
    STRATA_RETURN_IF_NCCL_ERROR(ncclGroupStart());
    Status status = post_slice_exchange(wire_send, contributions, slices, wire, native);
    const ncclResult_t ended = ncclGroupEnd();  // always closes the group, even after a failed call
    STRATA_RETURN_IF_ERROR(std::move(status).with_context(state.who + ": " + what));
    STRATA_RETURN_IF_ERROR(state.settle(ended, "ncclGroupEnd (exchange of slices)", __FILE__, __LINE__));
  }
  if (mine > 0) {
    STRATA_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(contributions + me * mine * wire_bytes,
                                                wire_send + slices.begin[me] * wire_bytes, mine * wire_bytes,
                                                cudaMemcpyDeviceToDevice, native));
  }
  std::byte* reduced = static_cast<std::byte*>(recv) + (gather_result ? slices.begin[me] * data_bytes : 0);
  STRATA_RETURN_IF_ERROR(nccl_communicator_internal::launch_reduce_contributions(contributions, world_size_, mine, wire,
                                                                                 op, reduced, dtype, native));
  STRATA_RETURN_IF_CUDA_ERROR(cudaEventRecord(state.scratch_released, native));
  if (!gather_result) return Status::Ok();

  // all_reduce: every rank's reduced slice to every rank.
  STRATA_RETURN_IF_NCCL_ERROR(ncclGroupStart());
  Status status = post_reduced_gather(reduced, recv, slices, dtype, native);
  const ncclResult_t ended = ncclGroupEnd();
  STRATA_RETURN_IF_ERROR(std::move(status).with_context(state.who + ": " + what));
  STRATA_RETURN_IF_ERROR(state.settle(ended, "ncclGroupEnd (all-gather of reduced slices)", __FILE__, __LINE__));
  return Status::Ok();
}

// Inside the exact path's first group: each peer's slice of `wire_send` to that peer, and
// every peer's copy of this rank's slice into `contributions` (in rank order). Returns the
// first failed call's error; the caller closes the group either way.
Status NcclCommunicator::post_slice_exchange(const std::byte* wire_send, std::byte* contributions,
                                             const Slices& slices, DType wire, cudaStream_t native) {
  State& state = *state_;
  const size_t wire_bytes = dtype_size(wire);
  const size_t mine = slices.count[static_cast<size_t>(rank_)];
  const ncclDataType_t wire_type = nccl_type(wire);
  Status status;
  for (int peer = 0; peer < world_size_ && status.ok(); ++peer) {
    if (peer == rank_) continue;
    const size_t p = static_cast<size_t>(peer);
    if (slices.count[p] > 0) {
      const ncclResult_t result =
          ncclSend(wire_send + slices.begin[p] * wire_bytes, slices.count[p], wire_type, peer, state.comm, native);
      if (result != ncclSuccess && result != ncclInProgress)
        status = internal::nccl_error(result, "ncclSend", __FILE__, __LINE__);
    }
    if (mine > 0 && status.ok()) {
      const ncclResult_t result = ncclRecv(contributions + p * mine * wire_bytes, mine, wire_type, peer, state.comm, native);
      if (result != ncclSuccess && result != ncclInProgress)
        status = internal::nccl_error(result, "ncclRecv", __FILE__, __LINE__);
    }
  }
  return status;
}

// Inside all_reduce's second group of the exact path: this rank's `reduced` slice to every
// peer, and every peer's reduced slice into its place in `recv`. Returns the first failed
// call's error; the caller closes the group either way.
Status NcclCommunicator::post_reduced_gather(const std::byte* reduced, void* recv, const Slices& slices, DType dtype,
                                             cudaStream_t native) {
  State& state = *state_;
  const size_t data_bytes = dtype_size(dtype);
  const size_t mine = slices.count[static_cast<size_t>(rank_)];
  const ncclDataType_t data_type = nccl_type(dtype);
  Status status;
  for (int peer = 0; peer < world_size_ && status.ok(); ++peer) {
    if (peer == rank_) continue;
    const size_t p = static_cast<size_t>(peer);
    if (mine > 0) {
      const ncclResult_t result = ncclSend(reduced, mine, data_type, peer, state.comm, native);
      if (result != ncclSuccess && result != ncclInProgress)
        status = internal::nccl_error(result, "ncclSend", __FILE__, __LINE__);
    }
    if (slices.count[p] > 0 && status.ok()) {
      const ncclResult_t result = ncclRecv(static_cast<std::byte*>(recv) + slices.begin[p] * data_bytes, slices.count[p],
                                           data_type, peer, state.comm, native);
      if (result != ncclSuccess && result != ncclInProgress)
        status = internal::nccl_error(result, "ncclRecv", __FILE__, __LINE__);
    }
  }
  return status;
}

void NcclCommunicator::abort(std::string_view reason) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->abort_locked(CancelledError(state_->who + " aborted: " + std::string(reason)));
}

Status NcclCommunicator::async_error() { return state_->current_failure(); }

// ---------------------------------------------------------------------------
// NcclGroup
// ---------------------------------------------------------------------------

NcclGroup::NcclGroup(std::vector<std::shared_ptr<State>> states) : states_(std::move(states)), active_(true) {}

NcclGroup::NcclGroup(NcclGroup&& other) noexcept
    : states_(std::move(other.states_)), active_(std::exchange(other.active_, false)) {}

StatusOr<NcclGroup> NcclGroup::start(std::span<NcclCommunicator* const> communicators) {
  std::vector<std::shared_ptr<State>> states;
  for (NcclCommunicator* communicator : communicators) {
    if (communicator == nullptr) return InvalidArgumentError("nccl group: a null communicator");
    states.push_back(communicator->state_);
  }
  STRATA_RETURN_IF_NCCL_ERROR(ncclGroupStart());
  ++t_group_depth;
  return NcclGroup(std::move(states));
}

Status NcclGroup::end() {
  if (!active_) return FailedPreconditionError("nccl group: end() called twice");
  active_ = false;
  --t_group_depth;
  const ncclResult_t ended = ncclGroupEnd();
  if (ended != ncclSuccess && ended != ncclInProgress) return internal::nccl_error(ended, "ncclGroupEnd", __FILE__, __LINE__);
  if (ended == ncclSuccess || t_group_depth > 0) return Status::Ok();
  // NCCL returned ncclInProgress: wait for each communicator of the group.
  for (const std::shared_ptr<State>& state : states_) {
    std::lock_guard<std::mutex> lock(state->mutex);
    if (state->comm == nullptr) continue;
    STRATA_RETURN_IF_ERROR(state->settle(ncclInProgress, "ncclGroupEnd", __FILE__, __LINE__));
  }
  return Status::Ok();
}

NcclGroup::~NcclGroup() {
  if (!active_) return;
  if (Status status = end(); !status.ok()) STRATA_LOG(kError) << "nccl group ended by its destructor: " << status.to_string();
}

}  // namespace strata
