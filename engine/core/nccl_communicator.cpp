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
#include "engine/core/thread.h"

namespace strata {

static_assert(sizeof(ncclUniqueId) == std::tuple_size_v<NcclUniqueIdBytes>, "NCCL unique id size");

namespace {

using Clock = std::chrono::steady_clock;

// How many NcclGroups this thread has open. It mirrors NCCL's own per-thread group
// state, which NCCL does not expose: inside a group NCCL defers its transfers to the
// group's end, so work enqueued after an NCCL call (a reduction kernel, an event) would
// run before the transfer. Operations that need that refuse to run inside a group.
thread_local int t_group_depth = 0;

ncclDataType_t nccl_type(DType dtype) {
  switch (dtype) {
    case DType::kFloat32: return ncclFloat32;
    case DType::kBFloat16: return ncclBfloat16;
    case DType::kFloat16: return ncclFloat16;
  }
  return ncclFloat32;
}

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

}  // namespace

namespace nccl_communicator_internal {

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

using nccl_communicator_internal::State;

// Settles an NCCL call on state_->comm that may return ncclInProgress. Caller holds state_->mutex.
#define STRATA_NCCL_SETTLE(state, expr) STRATA_RETURN_IF_ERROR((state).settle((expr), #expr, __FILE__, __LINE__))

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
bool takes_native_path(DType dtype, DType wire, ReduceOp op) {
  return dtype == DType::kFloat32 && wire == DType::kFloat32 && op != ReduceOp::kMax;
}
}  // namespace

Status NcclCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                        const ReduceOptions& options, Stream& stream) {
  const std::string what = "reduce_scatter #" + std::to_string(issued_++);
  STRATA_ASSIGN_OR_RETURN(const DType wire, resolve_wire_dtype(dtype, options));
  STRATA_ASSIGN_OR_RETURN(cudaStream_t native, begin(stream, what));
  STRATA_NCCL_ENTER_DEVICE(state_->ordinal);
  if (!takes_native_path(dtype, wire, options.op) || options.op == ReduceOp::kMean) {
    if (t_group_depth > 0)
      return FailedPreconditionError(state_->who + ": " + what + " (" + std::string(dtype_name(dtype)) + ", " +
                                     std::string(reduce_op_name(options.op)) + ", wire " + std::string(dtype_name(wire)) +
                                     ") needs a kernel after the transfer and cannot run inside an NcclGroup");
  }
  if (takes_native_path(dtype, wire, options.op)) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (state_->comm == nullptr) return FailedPreconditionError(state_->who + ": the communicator was aborted");
      STRATA_NCCL_SETTLE(*state_,
                         ncclReduceScatter(send, recv, recv_count, ncclFloat32, ncclSum, state_->comm, native));
    }
    if (options.op == ReduceOp::kMean)
      STRATA_RETURN_IF_ERROR(nccl_communicator_internal::launch_divide(static_cast<float*>(recv), recv_count,
                                                                       static_cast<float>(world_size_), native));
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
  if ((!takes_native_path(dtype, wire, options.op) || options.op == ReduceOp::kMean) && t_group_depth > 0)
    return FailedPreconditionError(state_->who + ": " + what + " (" + std::string(dtype_name(dtype)) + ", " +
                                   std::string(reduce_op_name(options.op)) + ", wire " + std::string(dtype_name(wire)) +
                                   ") needs a kernel after the transfer and cannot run inside an NcclGroup");
  if (takes_native_path(dtype, wire, options.op)) {
    {
      std::lock_guard<std::mutex> lock(state_->mutex);
      if (state_->comm == nullptr) return FailedPreconditionError(state_->who + ": the communicator was aborted");
      STRATA_NCCL_SETTLE(*state_, ncclAllReduce(send, recv, count, ncclFloat32, ncclSum, state_->comm, native));
    }
    if (options.op == ReduceOp::kMean)
      STRATA_RETURN_IF_ERROR(nccl_communicator_internal::launch_divide(static_cast<float*>(recv), count,
                                                                       static_cast<float>(world_size_), native));
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
