// The NCCL communicator's internals that its two files share (internal to engine/core):
// the state a communicator shares with its watchdog, the device scope, NCCL's dtypes, the
// per-thread group depth. nccl_communicator.cpp creates, watches and destroys
// communicators; nccl_collectives.cpp issues the collectives and groups.
#pragma once

#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <deque>
#include <mutex>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "engine/core/collective_text.h"
#include "engine/core/cuda_check.h"
#include "engine/core/log.h"
#include "engine/core/nccl_communicator.h"

namespace strata::nccl_communicator_internal {

using Clock = std::chrono::steady_clock;

// How many NcclGroups this thread has open. It mirrors NCCL's own per-thread group
// state, which NCCL does not expose: inside a group NCCL defers its transfers to the
// group's end, so work enqueued after an NCCL call (a reduction kernel, an event) would
// run before the transfer. Operations that need that refuse to run inside a group.
extern thread_local int t_group_depth;

ncclDataType_t nccl_type(DType dtype);

// Makes `ordinal` the calling thread's current CUDA device and restores the previous
// one on destruction.
class CurrentDevice {
 public:
  static StatusOr<CurrentDevice> enter(int ordinal) {
    CurrentDevice scope;
    STRATA_RETURN_IF_CUDA_ERROR(cudaGetDevice(&scope.previous_));
    if (scope.previous_ != ordinal) STRATA_RETURN_IF_CUDA_ERROR(cudaSetDevice(ordinal));
    scope.restore_ = scope.previous_ != ordinal;
    return scope;
  }
  CurrentDevice(CurrentDevice&& other) noexcept
      : previous_(other.previous_), restore_(std::exchange(other.restore_, false)) {}
  CurrentDevice& operator=(CurrentDevice&&) = delete;
  CurrentDevice(const CurrentDevice&) = delete;
  CurrentDevice& operator=(const CurrentDevice&) = delete;
  ~CurrentDevice() {
    if (restore_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }

 private:
  CurrentDevice() = default;
  int previous_ = 0;
  bool restore_ = false;
};

#define STRATA_NCCL_ENTER_DEVICE(ordinal) \
  STRATA_ASSIGN_OR_RETURN(CurrentDevice STRATA_STATUS_CONCAT(strata_device_scope_, __LINE__), CurrentDevice::enter(ordinal))

// Waits until NCCL has finished the non-blocking work on each of `comms` (a
// communicator whose call returned ncclInProgress), or until `deadline`.
Status wait_for_comms(const std::vector<ncclComm_t>& comms, Clock::time_point deadline, const char* statement,
                      const char* file, int line, bool* timed_out);

// What a communicator shares with its watchdog and with the host functions it leaves on
// streams (both may outlive the NcclCommunicator object briefly).
struct State {
  State(int device_ordinal, const NcclCommunicatorOptions& communicator_options, std::string description)
      : ordinal(device_ordinal), options(communicator_options), who(std::move(description)) {}

  const int ordinal;
  const NcclCommunicatorOptions options;
  const std::string who;  // "nccl rank 3 of 8 on cuda:3"

  std::mutex mutex;            // serializes every use of `comm` (NCCL calls, abort, destroy) and the scratch
  ncclComm_t comm = nullptr;   // guarded by mutex; null once aborted or destroyed
  DeviceBuffer scratch;        // guarded by mutex; the exact path's scratch
  cudaEvent_t scratch_released = nullptr;  // recorded after each use of the scratch
  DeviceBuffer barrier_word;   // one float all-reduced by barrier()

  std::mutex failure_mutex;    // never held across an NCCL or CUDA call
  Status failure;              // guarded by failure_mutex; the first failure

  // The watchdog's view of the operations in flight.
  struct InFlight {
    cudaEvent_t event = nullptr;
    Clock::time_point enqueued;
    std::string what;
  };
  std::mutex watch_mutex;
  std::condition_variable watch_wakeup;
  bool stopping = false;                // guarded by watch_mutex
  std::deque<InFlight> in_flight;       // guarded by watch_mutex
  std::vector<cudaEvent_t> spare_events;// guarded by watch_mutex
  std::thread watchdog;

  Status record_failure(Status status) {
    std::lock_guard<std::mutex> lock(failure_mutex);
    if (failure.ok()) failure = status;
    return status;
  }
  Status current_failure() {
    std::lock_guard<std::mutex> lock(failure_mutex);
    return failure;
  }

  // Records `reason` and aborts the NCCL communicator, which ends the kernels of this
  // rank's collectives and, through NCCL, the peers' copies of them. Caller holds mutex.
  void abort_locked(Status reason) {
    (void)record_failure(reason);
    if (comm == nullptr) return;
    STRATA_LOG(kError) << who << ": aborting the NCCL communicator: " << reason.message();
    const ncclResult_t result = ncclCommAbort(comm);
    if (result != ncclSuccess) STRATA_LOG(kWarn) << who << ": ncclCommAbort: " << ncclGetErrorString(result);
    comm = nullptr;
  }

  // Settles a call on `comm` that may have returned ncclInProgress. Caller holds mutex.
  Status settle(ncclResult_t result, const char* statement, const char* file, int line) {
    if (result == ncclSuccess) return Status::Ok();
    if (result != ncclInProgress) return internal::nccl_error(result, statement, file, line);
    bool timed_out = false;
    Status status = wait_for_comms({comm}, Clock::now() + options.timeout, statement, file, line, &timed_out);
    if (timed_out) {
      status = DeadlineExceededError(who + ": " + statement + " was still in progress after " +
                                     seconds_text(options.timeout) +
                                     " (NCCL is connecting to peers that do not answer: did a rank fail?)");
      abort_locked(status);
    }
    return status;
  }

  void run_watchdog();
};

// Settles an NCCL call on state_->comm that may return ncclInProgress. Caller holds state_->mutex.
#define STRATA_NCCL_SETTLE(state, expr) STRATA_RETURN_IF_ERROR((state).settle((expr), #expr, __FILE__, __LINE__))

}  // namespace strata::nccl_communicator_internal
