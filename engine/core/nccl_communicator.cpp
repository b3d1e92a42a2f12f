#include "engine/core/nccl_communicator.h"

#include <nccl.h>

#include <algorithm>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <deque>
#include <mutex>
#include <optional>
#include <set>
#include <thread>
#include <utility>

#include "engine/core/collective_text.h"
#include "engine/core/cuda_check.h"
#include "engine/core/log.h"
#include "engine/core/nccl_communicator_internal.h"
#include "engine/core/thread.h"

namespace strata {

namespace {
using Clock = std::chrono::steady_clock;
}  // namespace

static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<NcclUniqueIdBytes>, "NCCL unique id size");

namespace nccl_communicator_internal {

// Waits until NCCL has finished the non-blocking work on each of `comms` (a
// communicator whose call returned ncclInProgress), or until `deadline`.
Status wait_for_comms(const std::vector<ncclComm_t>& comms, Clock::time_point deadline, const char* statement,
                      const char* file, int line, bool* timed_out) {
  *timed_out = false;
  std::vector<bool> done(comms.size(), false);
  size_t remaining = comms.size();
  int spins = 0;
  while (remaining > 0) {
    for (size_t i = 0; i < comms.size(); ++i) {
      if (done[i]) continue;
      ncclResult_t state = ncclSuccess;
      STRATA_RETURN_IF_NCCL_ERROR(ncclCommGetAsyncError(comms[i], &state));
      if (state == ncclInProgress) continue;
      if (state != ncclSuccess) return internal::nccl_error(state, statement, file, line);
      done[i] = true;
      --remaining;
    }
    if (remaining == 0) break;
    if (Clock::now() >= deadline) {
      *timed_out = true;
      return DeadlineExceededError(std::string(statement) + " did not finish in time");
    }
    // Connecting takes milliseconds to seconds: spin briefly, then sleep a little.
    if (++spins < 1000) {
      std::this_thread::yield();
    } else {
      std::this_thread::sleep_for(std::chrono::microseconds(200));
    }
  }
  return Status::Ok();
}

thread_local int t_group_depth = 0;

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
  }
  return ncclFloat32;
}

void State::run_watchdog() {
  if (cudaSetDevice(ordinal) != cudaSuccess) (void)cudaGetLastError();
  std::unique_lock<std::mutex> watch_lock(watch_mutex);
  while (!stopping) {
    watch_wakeup.wait_for(watch_lock, options.watchdog_period, [&] { return stopping; });
    if (stopping) break;
    // Retire finished operations.
    Status event_error;
    while (!in_flight.empty()) {
      const cudaError_t query = cudaEventQuery(in_flight.front().event);
      if (query == cudaErrorNotReady) break;
      if (query != cudaSuccess) {
        (void)cudaGetLastError();
        event_error = InternalError(who + ": " + in_flight.front().what + " failed on the GPU: " +
                                    cudaGetErrorString(query) + " (" + cudaGetErrorName(query) + ")");
      }
      spare_events.push_back(in_flight.front().event);
      in_flight.pop_front();
      if (!event_error.ok()) break;
    }
    std::optional<std::string> overdue;
    if (!in_flight.empty() && Clock::now() - in_flight.front().enqueued > options.timeout)
      overdue = in_flight.front().what;
    watch_lock.unlock();

    {
      std::lock_guard<std::mutex> lock(mutex);
      if (comm != nullptr) {
        ncclResult_t async = ncclSuccess;
        const ncclResult_t queried = ncclCommGetAsyncError(comm, &async);
        if (queried != ncclSuccess) async = queried;
        if (async != ncclSuccess && async != ncclInProgress) {
          std::string detail = ncclGetErrorString(async);
          if (const char* last = ncclGetLastError(comm); last != nullptr && *last != '\0') detail += std::string(" (") + last + ")";
          abort_locked(InternalError(who + ": NCCL reported an asynchronous error: " + detail));
        } else if (!event_error.ok()) {
          abort_locked(event_error);
        } else if (overdue) {
          abort_locked(DeadlineExceededError(who + ": " + *overdue + " did not complete within " +
                                             seconds_text(options.timeout) +
                                             " (a peer failed, is stuck, or issued different collectives)"));
        }
      }
    }
    watch_lock.lock();
  }
}

}  // namespace nccl_communicator_internal

using nccl_communicator_internal::CurrentDevice;
using nccl_communicator_internal::State;
using nccl_communicator_internal::t_group_depth;
using nccl_communicator_internal::wait_for_comms;

StatusOr<NcclUniqueIdBytes> make_nccl_unique_id() {
  ncclUniqueId id;
  STRATA_RETURN_IF_NCCL_ERROR(ncclGetUniqueId(&id));
  NcclUniqueIdBytes bytes;
  std::memcpy(bytes.data(), &id, sizeof(id));
  return bytes;
}

// ---------------------------------------------------------------------------
// Creation
// ---------------------------------------------------------------------------

namespace {

// Every device must be a CUDA device, each given once: NCCL needs one GPU per rank.
Status check_nccl_devices(std::span<Device* const> devices) {
  std::set<int> ordinals;
  for (Device* device : devices) {
    if (device == nullptr || device->kind() != DeviceKind::kCuda)
      return InvalidArgumentError("nccl: " + (device == nullptr ? std::string("a null device") : device->description()) +
                                  " is not a CUDA device");
    if (!ordinals.insert(device->ordinal()).second)
      return InvalidArgumentError("nccl: cuda:" + std::to_string(device->ordinal()) +
                                  " is given twice; NCCL needs one GPU per rank");
  }
  return Status::Ok();
}

// Initializes one NCCL communicator per device (ranks first_rank, first_rank + 1, ...) in
// one group and waits, up to options.timeout, until all of them are ready. On failure
// none is left.
StatusOr<std::vector<ncclComm_t>> init_nccl_comms(std::span<Device* const> devices, int first_rank, int world_size,
                                                  const NcclUniqueIdBytes& id, const NcclCommunicatorOptions& options) {
  const int count = static_cast<int>(devices.size());
  ncclUniqueId unique_id;
  std::memcpy(&unique_id, id.data(), sizeof(unique_id));
  const std::string name = options.name.empty() ? std::string("strata") : options.name;
  ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
  config.blocking = 0;  // every call returns; we wait with a deadline (see wait_for_comms)
  config.commName = name.c_str();

  std::vector<ncclComm_t> comms(static_cast<size_t>(count), nullptr);
  const auto abort_all = [&] {
    for (ncclComm_t comm : comms)
      if (comm != nullptr) (void)ncclCommAbort(comm);
  };
  const std::string ranks_text = "rank" + (count == 1 ? " " + std::to_string(first_rank)
                                                      : "s " + std::to_string(first_rank) + ".." +
                                                            std::to_string(first_rank + count - 1)) +
                                 " of " + std::to_string(world_size);
  {
    int previous_device = 0;
    STRATA_RETURN_IF_CUDA_ERROR(cudaGetDevice(&previous_device));
    Status status;
    STRATA_RETURN_IF_NCCL_ERROR(ncclGroupStart());
    for (int i = 0; i < count && status.ok(); ++i) {
      if (const cudaError_t error = cudaSetDevice(devices[static_cast<size_t>(i)]->ordinal()); error != cudaSuccess) {
        status = internal::cuda_error(error, "cudaSetDevice", __FILE__, __LINE__);
        break;
      }
      const ncclResult_t result = ncclCommInitRankConfig(&comms[static_cast<size_t>(i)], world_size, unique_id,
                                                         first_rank + i, &config);
      if (result != ncclSuccess && result != ncclInProgress)
        status = internal::nccl_error(result, "ncclCommInitRankConfig", __FILE__, __LINE__);
    }
    const ncclResult_t ended = ncclGroupEnd();
    if (status.ok() && ended != ncclSuccess && ended != ncclInProgress)
      status = internal::nccl_error(ended, "ncclGroupEnd (communicator initialization)", __FILE__, __LINE__);
    if (cudaSetDevice(previous_device) != cudaSuccess) (void)cudaGetLastError();
    if (status.ok()) {
      bool timed_out = false;
      status = wait_for_comms(comms, Clock::now() + options.timeout, "ncclCommInitRankConfig", __FILE__, __LINE__,
                              &timed_out);
      if (timed_out)
        status = DeadlineExceededError("nccl: initialization of " + ranks_text + " did not finish within " +
                                       seconds_text(options.timeout) + ": are all " + std::to_string(world_size) +
                                       " ranks running, with the same unique id, and can they reach each other?");
    }
    if (!status.ok()) {
      abort_all();
      return std::move(status).with_context("nccl: creating " + ranks_text);
    }
  }
  return comms;
}

}  // namespace

StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> NcclCommunicator::create_ranks(
    std::span<Device* const> devices, int first_rank, int world_size, const NcclUniqueIdBytes& id,
    const NcclCommunicatorOptions& options) {
  const int count = static_cast<int>(devices.size());
  if (count == 0) return InvalidArgumentError("nccl: no devices given");
  if (first_rank < 0 || world_size < 1 || first_rank + count > world_size)
    return InvalidArgumentError("nccl: ranks " + std::to_string(first_rank) + ".." + std::to_string(first_rank + count - 1) +
                                " do not fit in a world of " + std::to_string(world_size));
  if (options.timeout.count() <= 0) return InvalidArgumentError("nccl: the timeout must be positive");
  if (t_group_depth > 0) return FailedPreconditionError("nccl: communicators cannot be created inside an NcclGroup");
  if (Status status = check_nccl_devices(devices); !status.ok()) return status;
  StatusOr<std::vector<ncclComm_t>> initialized = init_nccl_comms(devices, first_rank, world_size, id, options);
  if (!initialized.ok()) return initialized.status();
  std::vector<ncclComm_t> comms = std::move(initialized).value();

  std::vector<std::unique_ptr<NcclCommunicator>> communicators;
  for (int i = 0; i < count; ++i) {
    Device& device = *devices[static_cast<size_t>(i)];
    const int rank = first_rank + i;
    auto state = std::make_shared<State>(device.ordinal(), options,
                                         "nccl rank " + std::to_string(rank) + " of " + std::to_string(world_size) +
                                             " on cuda:" + std::to_string(device.ordinal()));
    state->comm = std::exchange(comms[static_cast<size_t>(i)], nullptr);
    // From here the communicator owns the NCCL communicator (its destructor cleans up).
    communicators.push_back(std::make_unique<NcclCommunicator>(state, device, rank, world_size));
  }
  for (std::unique_ptr<NcclCommunicator>& communicator : communicators) {
    State& state = *communicator->state_;
    STRATA_NCCL_ENTER_DEVICE(state.ordinal);
    STRATA_ASSIGN_OR_RETURN(state.barrier_word, communicator->device_.allocate(sizeof(float), "nccl barrier word"));
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&state.scratch_released, cudaEventDisableTiming | cudaEventBlockingSync));
    STRATA_ASSIGN_OR_RETURN(state.watchdog, spawn_thread("strata:nccl-dog", [raw = &state] { raw->run_watchdog(); }));
  }
  return communicators;
}

StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> NcclCommunicator::create_local(
    std::span<Device* const> devices, const NcclCommunicatorOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const NcclUniqueIdBytes id, make_nccl_unique_id());
  return create_ranks(devices, 0, static_cast<int>(devices.size()), id, options);
}

StatusOr<std::vector<std::unique_ptr<NcclCommunicator>>> NcclCommunicator::create_from_rendezvous(
    std::span<Device* const> devices, Rendezvous& rendezvous, const NcclCommunicatorOptions& options) {
  if (!rendezvous.joined()) return FailedPreconditionError("nccl: the rendezvous has not joined yet (call join())");
  const int per_process = static_cast<int>(devices.size());
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> counts,
                          rendezvous.all_gather_strings(std::to_string(per_process)));
  for (size_t rank = 0; rank < counts.size(); ++rank)
    if (counts[rank] != counts[0])
      return InvalidArgumentError("nccl: process rank " + std::to_string(rank) + " brings " + counts[rank] +
                                  " GPU(s) but rank 0 brings " + counts[0] + "; every process needs the same number");
  NcclUniqueIdBytes id{};
  if (rendezvous.rank() == 0) {
    STRATA_ASSIGN_OR_RETURN(id, make_nccl_unique_id());
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::byte> shared, rendezvous.broadcast(id, 0));
  if (shared.size() != id.size())
    return DataLossError("nccl: the shared unique id has " + std::to_string(shared.size()) + " bytes, expected " +
                         std::to_string(id.size()));
  std::copy(shared.begin(), shared.end(), id.begin());
  return create_ranks(devices, rendezvous.rank() * per_process, rendezvous.world_size() * per_process, id, options);
}

StatusOr<std::unique_ptr<NcclCommunicator>> NcclCommunicator::create_from_rendezvous(
    Device& device, Rendezvous& rendezvous, const NcclCommunicatorOptions& options) {
  Device* devices[] = {&device};
  STRATA_ASSIGN_OR_RETURN(std::vector<std::unique_ptr<NcclCommunicator>> communicators,
                          create_from_rendezvous(devices, rendezvous, options));
  return std::move(communicators.front());
}

NcclCommunicator::NcclCommunicator(std::shared_ptr<State> state, Device& device, int rank, int world_size)
    : state_(std::move(state)), device_(device), rank_(rank), world_size_(world_size) {}

namespace {

// Stops the watchdog of `state` (idempotent).
void stop_watchdog(State& state) {
  {
    std::lock_guard<std::mutex> lock(state.watch_mutex);
    state.stopping = true;
  }
  state.watch_wakeup.notify_all();
  if (state.watchdog.joinable()) state.watchdog.join();
}

// Waits until the operations this rank enqueued have finished on its GPU, or `deadline`.
bool wait_for_local_work(State& state, Clock::time_point deadline) {
  std::lock_guard<std::mutex> lock(state.watch_mutex);
  while (!state.in_flight.empty()) {
    const cudaError_t query = cudaEventQuery(state.in_flight.front().event);
    if (query == cudaErrorNotReady) {
      if (Clock::now() >= deadline) return false;
      std::this_thread::sleep_for(std::chrono::microseconds(200));
      continue;
    }
    if (query != cudaSuccess) (void)cudaGetLastError();
    state.spare_events.push_back(state.in_flight.front().event);
    state.in_flight.pop_front();
  }
  return true;
}

// Shuts the NCCL communicators of `states` down: after a failure, or if their work does
// not finish by `drain_deadline` or the finalization by `finalize_deadline`, by ncclCommAbort; otherwise by
// ncclCommFinalize on all of them first (finalization waits for the peers, so every
// communicator of a single-threaded process must be finalizing before any is awaited),
// then ncclCommDestroy. Callers hold no locks of the states.
void shut_down(const std::vector<State*>& states, Clock::time_point drain_deadline,
               Clock::time_point finalize_deadline) {
  std::vector<State*> finalizing;
  for (State* state : states) {
    stop_watchdog(*state);
    if (cudaSetDevice(state->ordinal) != cudaSuccess) (void)cudaGetLastError();
    const bool drained = wait_for_local_work(*state, drain_deadline);
    std::lock_guard<std::mutex> lock(state->mutex);
    if (state->comm == nullptr) continue;
    if (!state->current_failure().ok()) {
      state->abort_locked(state->current_failure());
    } else if (!drained) {
      state->abort_locked(DeadlineExceededError(state->who + ": operations still in flight at shutdown"));
    } else if (const ncclResult_t result = ncclCommFinalize(state->comm);
               result != ncclSuccess && result != ncclInProgress) {
      state->abort_locked(internal::nccl_error(result, "ncclCommFinalize", __FILE__, __LINE__));
    } else {
      finalizing.push_back(state);
    }
  }
  for (State* state : finalizing) {
    if (cudaSetDevice(state->ordinal) != cudaSuccess) (void)cudaGetLastError();
    std::lock_guard<std::mutex> lock(state->mutex);
    bool timed_out = false;
    Status finalized =
        wait_for_comms({state->comm}, finalize_deadline, "ncclCommFinalize", __FILE__, __LINE__, &timed_out);
    if (!finalized.ok()) {
      state->abort_locked(std::move(finalized).with_context(state->who + ": finalizing at shutdown"));
      continue;
    }
    if (const ncclResult_t result = ncclCommDestroy(state->comm); result != ncclSuccess)
      STRATA_LOG(kWarn) << state->who << ": ncclCommDestroy: " << ncclGetErrorString(result);
    state->comm = nullptr;
  }
}

}  // namespace

Status NcclCommunicator::destroy_all(std::vector<std::unique_ptr<NcclCommunicator>> communicators) {
  std::vector<State*> states;
  Clock::duration longest{0};
  for (const std::unique_ptr<NcclCommunicator>& communicator : communicators) {
    if (communicator == nullptr) continue;
    states.push_back(communicator->state_.get());
    longest = std::max<Clock::duration>(longest, communicator->state_->options.timeout);
  }
  int previous = 0;
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetDevice(&previous));
  const Clock::time_point deadline = Clock::now() + longest;
  shut_down(states, deadline, deadline);
  if (cudaSetDevice(previous) != cudaSuccess) (void)cudaGetLastError();
  Status first;
  for (State* state : states)
    if (Status failure = state->current_failure(); !failure.ok() && first.ok()) first = failure;
  communicators.clear();  // the destructors find the NCCL communicators gone and free the rest
  return first;
}

NcclCommunicator::~NcclCommunicator() {
  State& state = *state_;
  int previous = 0;
  if (cudaGetDevice(&previous) != cudaSuccess) (void)cudaGetLastError();
  // On its own, a communicator waits only briefly for its peers to finalize (they may be
  // driven by this same thread, after us); then it aborts, which is safe once its own work
  // has finished. destroy_all() finalizes a whole set properly.
  shut_down({&state}, Clock::now() + state.options.timeout,
            Clock::now() + std::min<Clock::duration>(state.options.timeout, std::chrono::seconds(5)));
  if (cudaSetDevice(state.ordinal) != cudaSuccess) (void)cudaGetLastError();
  {
    std::lock_guard<std::mutex> lock(state.mutex);
    if (state.scratch_released != nullptr) {
      if (cudaEventSynchronize(state.scratch_released) != cudaSuccess) (void)cudaGetLastError();
      (void)cudaEventDestroy(state.scratch_released);
      state.scratch_released = nullptr;
    }
    // Device memory goes back while the device surely exists.
    state.scratch.reset();
    state.barrier_word.reset();
  }
  {
    std::lock_guard<std::mutex> lock(state.watch_mutex);
    for (State::InFlight& operation : state.in_flight) (void)cudaEventDestroy(operation.event);
    for (cudaEvent_t event : state.spare_events) (void)cudaEventDestroy(event);
    state.in_flight.clear();
    state.spare_events.clear();
  }
  if (cudaSetDevice(previous) != cudaSuccess) (void)cudaGetLastError();
}

// ---------------------------------------------------------------------------

}  // namespace strata
