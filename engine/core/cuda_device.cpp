#include "engine/core/cuda_device.h"

#include <algorithm>
#include <bit>
#include <chrono>
#include <cstdint>
#include <exception>
#include <functional>
#include <limits>
#include <string>
#include <utility>

#include "engine/core/cuda_check.h"
#include "engine/core/device_internal.h"
#include "engine/core/log.h"

namespace strata {

namespace {

// Makes `ordinal` the calling thread's current device for a scope and restores the
// previous one after; the CUDA runtime's current device is per thread, and callers may
// drive several GPUs from one thread.
class DeviceScope {
 public:
  explicit DeviceScope(int ordinal) {
    const cudaError_t error = cudaGetDevice(&previous_);
    if (error != cudaSuccess) {
      status_ = internal::cuda_error(error, "cudaGetDevice(&previous)", __FILE__, __LINE__);
      return;
    }
    if (previous_ == ordinal) return;
    const cudaError_t set_error = cudaSetDevice(ordinal);
    if (set_error != cudaSuccess) {
      status_ = internal::cuda_error(set_error, "cudaSetDevice(ordinal)", __FILE__, __LINE__);
      return;
    }
    changed_ = true;
  }
  ~DeviceScope() {
    if (changed_ && cudaSetDevice(previous_) != cudaSuccess) (void)cudaGetLastError();
  }
  DeviceScope(const DeviceScope&) = delete;
  DeviceScope& operator=(const DeviceScope&) = delete;
  const Status& status() const { return status_; }

 private:
  int previous_ = 0;
  bool changed_ = false;
  Status status_;
};

#define STRATA_ENTER_DEVICE(ordinal)     \
  DeviceScope device_scope_(ordinal);    \
  STRATA_RETURN_IF_ERROR(device_scope_.status())

cudaMemcpyKind to_cuda(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice: return cudaMemcpyHostToDevice;
    case CopyKind::kDeviceToHost: return cudaMemcpyDeviceToHost;
    case CopyKind::kDeviceToDevice: return cudaMemcpyDeviceToDevice;
    case CopyKind::kHostToHost: return cudaMemcpyHostToHost;
  }
  return cudaMemcpyDefault;
}

}  // namespace

namespace cuda_device_internal {

// What the host side knows about one stream: its name and the errors of its host
// functions, which run on a CUDA runtime thread and cannot return them. Shared by the
// stream, the host functions in flight, the events recorded on it and the device.
//
// Host functions are numbered from 1 in enqueue order; an event remembers the number of
// the last host function enqueued before it, so that Event::synchronize reports only the
// errors of work before the event.
class StreamState {
 public:
  explicit StreamState(std::string name) : name_(std::move(name)) {}
  const std::string& name() const { return name_; }

  uint64_t next_host_number() {
    std::lock_guard<std::mutex> lock(mutex_);
    return ++host_enqueued_;
  }
  // Gives back a number whose host function could not be enqueued.
  void host_not_enqueued(uint64_t number) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (number == host_enqueued_) --host_enqueued_;
  }
  uint64_t host_enqueued() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return host_enqueued_;
  }

  // Runs host function `number` unless an unreported error (or one reported after the
  // function was enqueued) cancels it.
  void run_host(uint64_t number, const std::function<Status()>& fn) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (errors_.skip(number)) return;
    }
    Status status;
    try {
      status = fn();
    } catch (const std::exception& e) {
      status = InternalError(std::string("host function threw an exception: ") + e.what());
    } catch (...) {
      status = InternalError("host function threw a non-standard exception");
    }
    if (status.ok()) return;
    std::lock_guard<std::mutex> lock(mutex_);
    errors_.record(number, std::move(status).with_context("in host function " + std::to_string(number) + " on stream '" + name_ + "'"));
  }

  // Reports (and clears) the first host-function error if it came from host function
  // `through` or earlier; host functions enqueued before this report are cancelled.
  Status take_error(uint64_t through) {
    std::lock_guard<std::mutex> lock(mutex_);
    return errors_.take(through, host_enqueued_, name_, "host function(s)");
  }

  bool has_error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return errors_.pending();
  }
  void mark_destroyed() {
    std::lock_guard<std::mutex> lock(mutex_);
    destroyed_ = true;
  }
  bool destroyed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return destroyed_;
  }

 private:
  const std::string name_;
  mutable std::mutex mutex_;
  uint64_t host_enqueued_ = 0;
  internal::StreamErrors errors_;
  bool destroyed_ = false;
};

// A GPU timestamp with the host steady_clock time it was taken at (see cuda_device.h).
struct TimingAnchor {
  explicit TimingAnchor(int device_ordinal) : ordinal(device_ordinal) {}
  ~TimingAnchor() {
    if (event == nullptr) return;
    DeviceScope scope(ordinal);
    if (cudaEventDestroy(event) != cudaSuccess) (void)cudaGetLastError();
  }
  TimingAnchor(const TimingAnchor&) = delete;
  TimingAnchor& operator=(const TimingAnchor&) = delete;

  const int ordinal;
  cudaEvent_t event = nullptr;               // timing enabled, completed
  TimingEvent::Clock::time_point host_time;  // when the GPU took its timestamp, in host time
  TimingEvent::Clock::duration window{};     // the host time is within half of this of the truth
};

}  // namespace cuda_device_internal

using cuda_device_internal::StreamState;
using cuda_device_internal::TimingAnchor;

namespace {

// The payload of one cudaLaunchHostFunc; the callback takes ownership back.
struct HostCall {
  std::function<Status()> fn;
  std::shared_ptr<StreamState> state;
  uint64_t number = 0;
};

void CUDART_CB run_host_call(void* user_data) {
  std::unique_ptr<HostCall> call(static_cast<HostCall*>(user_data));
  call->state->run_host(call->number, call->fn);
}

}  // namespace

// Whether an event keeps the time it completed.
enum class EventTiming : uint8_t { kDisabled, kEnabled };

class CudaEvent final : public TimingEvent {
 public:
  CudaEvent(CudaDevice* device, cudaEvent_t event, EventTiming timing) : device_(device), event_(event), timing_(timing) {}
  ~CudaEvent() override {
    DeviceScope scope(device_->ordinal());
    const cudaError_t error = cudaEventDestroy(event_);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      STRATA_LOG(kWarn) << "cudaEventDestroy failed: " << cudaGetErrorString(error);
    }
  }
  CudaEvent(const CudaEvent&) = delete;
  CudaEvent& operator=(const CudaEvent&) = delete;

  Status synchronize() override {
    STRATA_ENTER_DEVICE(device_->ordinal());
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventSynchronize(event_));
    auto [state, target] = snapshot();
    if (state == nullptr) return {};
    return state->take_error(target);
  }

  StatusOr<bool> query() override {
    STRATA_ENTER_DEVICE(device_->ordinal());
    const cudaError_t error = cudaEventQuery(event_);
    if (error == cudaSuccess) return true;
    if (error == cudaErrorNotReady) {
      (void)cudaGetLastError();
      return false;
    }
    STRATA_RETURN_IF_CUDA_ERROR(error);
    return false;
  }

  StatusOr<std::optional<Clock::time_point>> completion_time() override {
    if (timing_ != EventTiming::kEnabled) {
      return FailedPreconditionError("completion_time() of an event made by create_event(): use create_timing_event()");
    }
    std::shared_ptr<const TimingAnchor> anchor;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      anchor = anchor_;
    }
    if (anchor == nullptr) return FailedPreconditionError("completion_time() of a timing event that was never recorded");
    STRATA_ASSIGN_OR_RETURN(const bool done, query());
    if (!done) return std::optional<Clock::time_point>();
    STRATA_ENTER_DEVICE(device_->ordinal());
    float milliseconds = 0.0f;
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventElapsedTime(&milliseconds, anchor->event, event_));
    const auto since_anchor = std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double, std::milli>(milliseconds));
    return std::optional<Clock::time_point>(anchor->host_time + since_anchor);
  }

  CudaDevice* device() const { return device_; }
  EventTiming timing() const { return timing_; }
  cudaEvent_t native() const { return event_; }

  void set(std::shared_ptr<StreamState> state, uint64_t target, std::shared_ptr<const TimingAnchor> anchor = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    state_ = std::move(state);
    target_ = target;
    anchor_ = std::move(anchor);
  }
  std::pair<std::shared_ptr<StreamState>, uint64_t> snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {state_, target_};
  }

 private:
  CudaDevice* const device_;
  const cudaEvent_t event_;
  const EventTiming timing_;
  mutable std::mutex mutex_;
  std::shared_ptr<StreamState> state_;  // the stream last recorded on; guarded by mutex_
  uint64_t target_ = 0;                 // its host functions enqueued by then; guarded by mutex_
  std::shared_ptr<const TimingAnchor> anchor_;  // timing events: the anchor of the last record; guarded by mutex_
};

// Whether a CudaStream destroys its cudaStream_t (create_stream) or leaves it to the
// owner it was adopted from (adopt_stream).
enum class StreamOwnership : uint8_t { kOwned, kAdopted };

class CudaStream final : public Stream {
 public:
  CudaStream(CudaDevice& device, cudaStream_t stream, std::shared_ptr<StreamState> state, StreamOwnership ownership)
      : device_(device), stream_(stream), state_(std::move(state)), ownership_(ownership) {}

  // Drains the stream before destroying it, so that its work (and its host functions'
  // errors) is finished when the destructor returns. An adopted stream is its owner's,
  // who may have destroyed it already: it is neither drained nor destroyed here (a host
  // function enqueued through the wrapper holds the state it reports to).
  ~CudaStream() override {
    if (ownership_ == StreamOwnership::kOwned) drain_and_destroy();
    device_.on_stream_destroyed(state_);
  }
  CudaStream(const CudaStream&) = delete;
  CudaStream& operator=(const CudaStream&) = delete;

  Device& device() override { return device_; }
  const std::string& name() const override { return state_->name(); }

  Status record(Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * cuda_event, own_event(event, "record"));
    std::shared_ptr<const TimingAnchor> anchor;
    // Taken before the record: the anchor has completed, so the event's timestamp follows it.
    if (cuda_event->timing() == EventTiming::kEnabled) {
      STRATA_ASSIGN_OR_RETURN(anchor, device_.timing_anchor());
    }
    STRATA_ENTER_DEVICE(device_.ordinal());
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventRecord(cuda_event->native(), stream_));
    cuda_event->set(state_, state_->host_enqueued(), std::move(anchor));
    return {};
  }

  Status wait(Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CudaEvent * cuda_event, own_event(event, "wait on"));
    STRATA_ENTER_DEVICE(device_.ordinal());
    STRATA_RETURN_IF_CUDA_ERROR(cudaStreamWaitEvent(stream_, cuda_event->native(), 0));
    return {};
  }

  Status synchronize() override {
    STRATA_ENTER_DEVICE(device_.ordinal());
    STRATA_RETURN_IF_ERROR_CTX(
        [&]() -> Status {
          STRATA_RETURN_IF_CUDA_ERROR(cudaStreamSynchronize(stream_));
          return {};
        }(),
        "while synchronizing stream '" + state_->name() + "' of " + device_.name());
    return state_->take_error(std::numeric_limits<uint64_t>::max());
  }

  Status launch(Kernel kernel) override {
    if (!kernel) return InvalidArgumentError("stream '" + state_->name() + "': launch of an empty kernel");
    STRATA_ENTER_DEVICE(device_.ordinal());
    STRATA_RETURN_IF_ERROR_CTX(kernel(LaunchContext{&device_, stream_, nullptr}),
                               "in a kernel launched on stream '" + state_->name() + "' of " + device_.name());
    return {};
  }

  Status enqueue_host(std::function<Status()> fn) override {
    if (!fn) return InvalidArgumentError("stream '" + state_->name() + "': enqueue_host of an empty function");
    STRATA_ENTER_DEVICE(device_.ordinal());
    const uint64_t number = state_->next_host_number();
    auto call = std::make_unique<HostCall>(HostCall{std::move(fn), state_, number});
    const cudaError_t error = cudaLaunchHostFunc(stream_, run_host_call, call.get());
    if (error != cudaSuccess) {
      state_->host_not_enqueued(number);
      STRATA_RETURN_IF_CUDA_ERROR(error);
    }
    (void)call.release();  // run_host_call owns it now
    return {};
  }

  void* native_handle() override { return stream_; }
  cudaStream_t native() const { return stream_; }

 private:
  void drain_and_destroy() noexcept {
    DeviceScope scope(device_.ordinal());
    cudaError_t error = cudaStreamSynchronize(stream_);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      STRATA_LOG(kError) << "stream '" << state_->name() << "' of " << device_.name()
                         << ": cudaStreamSynchronize at destruction failed: " << cudaGetErrorString(error);
    }
    error = cudaStreamDestroy(stream_);
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      STRATA_LOG(kError) << "stream '" << state_->name() << "' of " << device_.name()
                         << ": cudaStreamDestroy failed: " << cudaGetErrorString(error);
    }
  }

  StatusOr<CudaEvent*> own_event(Event& event, std::string_view verb) {
    auto* cuda_event = dynamic_cast<CudaEvent*>(&event);
    if (cuda_event == nullptr || cuda_event->device() != &device_) {
      return InvalidArgumentError("stream '" + state_->name() + "' of " + device_.name() + " cannot " + std::string(verb) +
                                  " an event created by another device");
    }
    return cuda_event;
  }

  CudaDevice& device_;
  const cudaStream_t stream_;
  std::shared_ptr<StreamState> state_;
  const StreamOwnership ownership_;
};

// ---------------------------------------------------------------------------------------

StatusOr<std::unique_ptr<CudaDevice>> CudaDevice::create(const CudaDeviceOptions& options) {
  STRATA_ENTER_DEVICE(options.ordinal);
  // The yield policy (see cuda_device.h): a host thread waiting for this GPU sleeps instead
  // of spinning, so waiting engine threads leave the cores to CPU Adam.
  if (const cudaError_t error = cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync); error != cudaSuccess) {
    (void)cudaGetLastError();
    STRATA_LOG(kWarn) << "cuda:" << options.ordinal << ": cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) failed ("
                      << cudaGetErrorString(error) << "): stream synchronizations will spin; event waits still sleep";
  }
  cudaDeviceProp properties{};
  STRATA_RETURN_IF_CUDA_ERROR(cudaGetDeviceProperties(&properties, options.ordinal));
  size_t free_bytes = 0;
  size_t total_bytes = 0;
  STRATA_RETURN_IF_CUDA_ERROR(cudaMemGetInfo(&free_bytes, &total_bytes));
  const size_t budget = options.budget_bytes == 0 ? free_bytes : options.budget_bytes;
  if (budget > free_bytes) {
    STRATA_LOG(kWarn) << "cuda:" << options.ordinal << ": budget " << internal::format_bytes(budget) << " exceeds the "
                      << internal::format_bytes(free_bytes) << " free on the GPU; the driver will refuse first";
  }
  auto device = std::make_unique<CudaDevice>(ConstructorKey(), options, std::string(properties.name), budget);
  STRATA_LOG(kDebug) << "created " << device->description();
  return device;
}

CudaDevice::CudaDevice(ConstructorKey /*key*/, const CudaDeviceOptions& options, std::string gpu_name, size_t budget_bytes)
    : ordinal_(options.ordinal), gpu_name_(std::move(gpu_name)), matmul_precision_(options.matmul_precision) {
  stats_.budget_bytes = budget_bytes;
}

CudaDevice::~CudaDevice() {
  const Status status = synchronize();
  if (!status.ok()) STRATA_LOG(kError) << name() << " destroyed with an unreported asynchronous error: " << status.to_string();
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    if (live_stream_count_ > 0) {
      STRATA_LOG(kError) << name() << " destroyed while " << live_stream_count_
                         << " of its streams still exist (streams must not outlive their device)";
    }
  }
  {
    std::lock_guard<std::mutex> lock(anchor_mutex_);
    anchor_.reset();  // timing events still alive keep theirs
    if (anchor_stream_ != nullptr) {
      DeviceScope scope(ordinal_);
      if (cudaStreamDestroy(anchor_stream_) != cudaSuccess) (void)cudaGetLastError();
    }
  }
  std::unique_lock<std::mutex> lock(memory_mutex_);
  const Status released = release_cached(lock);
  if (!released.ok()) STRATA_LOG(kError) << name() << ": releasing cached memory at destruction: " << released.to_string();
  if (!live_.empty()) {
    STRATA_LOG(kError) << name() << " destroyed while " << live_.size() << " buffer(s) of "
                       << internal::format_bytes(stats_.in_use_bytes)
                       << " are still allocated (buffers must not outlive their device); their memory is leaked";
  }
}

std::string CudaDevice::name() const { return "cuda:" + std::to_string(ordinal_); }

std::string CudaDevice::description() const {
  return name() + " " + gpu_name_ + " (budget " + internal::format_bytes(memory_stats().budget_bytes) + ")";
}

size_t CudaDevice::block_size_for(size_t bytes) {
  constexpr size_t kMinBlock = 512;
  constexpr size_t kMaxGranule = size_t{2} << 20;
  if (bytes <= kMinBlock) return kMinBlock;
  if (bytes > (size_t{1} << 62)) return 0;  // no such block; the caller reports the request
  const size_t granule = std::clamp(std::bit_floor(bytes) / 8, kMinBlock, kMaxGranule);
  return internal::round_up(bytes, granule);
}

StatusOr<DeviceBuffer> CudaDevice::allocate(size_t bytes, std::string_view purpose) {
  if (bytes == 0) return DeviceBuffer();
  const size_t block = block_size_for(bytes);
  std::unique_lock<std::mutex> lock(memory_mutex_);
  if (block == 0) {
    ++stats_.failed_allocations;
    return internal::budget_exceeded_error(name(), bytes, purpose, stats_);
  }
  // A cached block of the same class: no driver call, no change to reserved bytes.
  if (auto it = cached_.find(block); it != cached_.end() && !it->second.empty()) {
    void* data = it->second.back();
    it->second.pop_back();
    live_.emplace(data, block);
    stats_.in_use_bytes += block;
    ++stats_.allocation_count;
    return make_buffer(this, data, bytes);
  }
  auto fits = [&] { return block <= stats_.budget_bytes - std::min(stats_.budget_bytes, stats_.reserved_bytes); };
  if (!fits()) {
    // Cached blocks of other classes count against the budget: give them back and retry.
    STRATA_RETURN_IF_ERROR(release_cached(lock));
    if (!fits()) {
      ++stats_.failed_allocations;
      return internal::budget_exceeded_error(name(), bytes, purpose, stats_);
    }
  }
  // Reserve the block before calling the driver without the lock, so that concurrent
  // allocations cannot together pass the budget.
  stats_.reserved_bytes += block;
  stats_.high_water_bytes = std::max(stats_.high_water_bytes, stats_.reserved_bytes);
  lock.unlock();
  void* data = nullptr;
  Status status = [&]() -> Status {
    STRATA_ENTER_DEVICE(ordinal_);
    cudaError_t error = cudaMalloc(&data, block);
    if (error == cudaErrorMemoryAllocation) {
      // The driver is out of memory although the budget is not: return the cache, retry.
      (void)cudaGetLastError();
      std::unique_lock<std::mutex> relock(memory_mutex_);
      STRATA_RETURN_IF_ERROR(release_cached(relock));
      relock.unlock();
      error = cudaMalloc(&data, block);
    }
    if (error != cudaSuccess) {
      (void)cudaGetLastError();
      return internal::cuda_error(error, "cudaMalloc(&data, block)", __FILE__, __LINE__);
    }
    return {};
  }();
  lock.lock();
  if (!status.ok()) {
    stats_.reserved_bytes -= block;
    ++stats_.failed_allocations;
    return std::move(status).with_context(
        name() + ": allocating " + internal::format_bytes(bytes) + " for '" + std::string(purpose) + "' (block " +
        internal::format_bytes(block) + "); in use " + internal::format_bytes(stats_.in_use_bytes) + ", reserved " +
        internal::format_bytes(stats_.reserved_bytes) + ", high-water " + internal::format_bytes(stats_.high_water_bytes) +
        ", budget " + internal::format_bytes(stats_.budget_bytes));
  }
  live_.emplace(data, block);
  stats_.in_use_bytes += block;
  ++stats_.allocation_count;
  return make_buffer(this, data, bytes);
}

// Never calls CUDA: it may run on a CUDA host-function thread (a host function that
// drops the last use of a buffer), where CUDA calls are not allowed.
void CudaDevice::free_buffer(void* data, size_t bytes) noexcept {
  std::lock_guard<std::mutex> lock(memory_mutex_);
  auto it = live_.find(data);
  if (it == live_.end()) {
    STRATA_LOG(kError) << name() << ": free of " << bytes << " bytes at " << data
                       << " which this device did not allocate (or freed twice); ignored";
    return;
  }
  const size_t block = it->second;
  live_.erase(it);
  stats_.in_use_bytes -= block;
  cached_[block].push_back(data);
}

Status CudaDevice::release_cached(std::unique_lock<std::mutex>& lock) {
  // cudaFree waits for the device to go idle, which may wait for a host function that is
  // itself waiting for memory_mutex_ (in free_buffer): free without the lock. The blocks
  // stay counted as reserved until they are gone, so the budget holds meanwhile.
  std::map<size_t, std::vector<void*>> blocks = std::move(cached_);
  cached_.clear();
  lock.unlock();
  Status first;
  size_t freed = 0;
  {
    DeviceScope scope(ordinal_);
    first = scope.status();
    for (auto& [block, list] : blocks) {
      for (void*& data : list) {
        if (!first.ok()) break;
        // cudaFree also waits for work still reading a block given back early.
        const cudaError_t error = cudaFree(data);
        if (error != cudaSuccess) {
          (void)cudaGetLastError();
          first = internal::cuda_error(error, "cudaFree(cached block)", __FILE__, __LINE__);
          break;
        }
        data = nullptr;
        freed += block;
      }
    }
  }
  lock.lock();
  stats_.reserved_bytes -= freed;
  // Blocks not freed after a failure go back to the cache.
  for (auto& [block, list] : blocks) {
    for (void* data : list) {
      if (data != nullptr) cached_[block].push_back(data);
    }
  }
  return first;
}

Status CudaDevice::release_cached_memory() {
  std::unique_lock<std::mutex> lock(memory_mutex_);
  return release_cached(lock);
}

MemoryStats CudaDevice::memory_stats() const {
  std::lock_guard<std::mutex> lock(memory_mutex_);
  return stats_;
}

StatusOr<std::unique_ptr<Stream>> CudaDevice::create_stream(std::string name) {
  STRATA_ENTER_DEVICE(ordinal_);
  cudaStream_t stream = nullptr;
  STRATA_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking));
  return track_stream(stream, std::move(name), /*owned=*/true);
}

std::unique_ptr<Stream> CudaDevice::track_stream(cudaStream_t stream, std::string name, bool owned) {
  auto state = std::make_shared<StreamState>(std::move(name));
  auto wrapper = std::make_unique<CudaStream>(*this, stream, state, owned ? StreamOwnership::kOwned : StreamOwnership::kAdopted);
  std::lock_guard<std::mutex> lock(streams_mutex_);
  streams_.push_back(std::move(state));
  ++live_stream_count_;
  return wrapper;
}

StatusOr<std::unique_ptr<Stream>> CudaDevice::adopt_stream(void* native_handle, std::string name) {
  auto stream = static_cast<cudaStream_t>(native_handle);
  STRATA_ENTER_DEVICE(ordinal_);
  // The handle must be a live stream of this GPU: its device, asked of the driver.
  int stream_device = -1;
  STRATA_RETURN_IF_ERROR_CTX(
      [&]() -> Status {
        STRATA_RETURN_IF_CUDA_ERROR(cudaStreamGetDevice(stream, &stream_device));
        return {};
      }(),
      "adopting stream '" + name + "'");
  if (stream_device != ordinal_)
    return InvalidArgumentError("stream '" + name + "' belongs to cuda:" + std::to_string(stream_device) + ", not to " + this->name());
  return track_stream(stream, std::move(name), /*owned=*/false);
}

StatusOr<std::unique_ptr<Event>> CudaDevice::create_event() {
  STRATA_ENTER_DEVICE(ordinal_);
  cudaEvent_t event = nullptr;
  // BlockingSync: Event::synchronize sleeps until the GPU signals, whatever the device flags.
  STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&event, cudaEventDisableTiming | cudaEventBlockingSync));
  return std::unique_ptr<Event>(std::make_unique<CudaEvent>(this, event, EventTiming::kDisabled));
}

StatusOr<std::unique_ptr<TimingEvent>> CudaDevice::create_timing_event() {
  STRATA_ENTER_DEVICE(ordinal_);
  cudaEvent_t event = nullptr;
  // Timing enabled (no cudaEventDisableTiming); BlockingSync as for every event.
  STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&event, cudaEventBlockingSync));
  return std::unique_ptr<TimingEvent>(std::make_unique<CudaEvent>(this, event, EventTiming::kEnabled));
}

StatusOr<std::shared_ptr<const TimingAnchor>> CudaDevice::timing_anchor() {
  using Clock = TimingEvent::Clock;
  std::lock_guard<std::mutex> lock(anchor_mutex_);
  if (anchor_ != nullptr && Clock::now() - anchor_->host_time < kAnchorRefresh) return anchor_;
  STRATA_ENTER_DEVICE(ordinal_);
  if (anchor_stream_ == nullptr) STRATA_RETURN_IF_CUDA_ERROR(cudaStreamCreateWithFlags(&anchor_stream_, cudaStreamNonBlocking));
  auto anchor = std::make_shared<TimingAnchor>(ordinal_);
  // No BlockingSync: the anchor is polled, never slept on.
  STRATA_RETURN_IF_CUDA_ERROR(cudaEventCreateWithFlags(&anchor->event, cudaEventDefault));
  constexpr auto kGoodWindow = std::chrono::microseconds(100);
  constexpr int kAttempts = 3;  // a preempted host thread widens a window; retry a few times
  for (int attempt = 0; attempt < kAttempts; ++attempt) {
    const Clock::time_point before = Clock::now();
    STRATA_RETURN_IF_CUDA_ERROR(cudaEventRecord(anchor->event, anchor_stream_));
    // Polled: an event on an idle stream completes within microseconds, and a sleeping
    // wait would widen the window by its wake-up. Past 10 ms something else holds the
    // GPU; sleep then, and accept the wide window.
    cudaError_t state = cudaEventQuery(anchor->event);
    while (state == cudaErrorNotReady && Clock::now() - before < std::chrono::milliseconds(10)) state = cudaEventQuery(anchor->event);
    if (state == cudaErrorNotReady) {
      (void)cudaGetLastError();
      state = cudaEventSynchronize(anchor->event);
    }
    STRATA_RETURN_IF_CUDA_ERROR(state);
    const Clock::time_point after = Clock::now();
    anchor->window = after - before;
    anchor->host_time = before + anchor->window / 2;
    if (anchor->window <= kGoodWindow) break;
  }
  if (anchor->window > kGoodWindow) {
    STRATA_LOG(kDebug) << name() << ": timing anchor taken within a window of "
                       << std::chrono::duration<double, std::micro>(anchor->window).count()
                       << " us: traced GPU times may be off by half of it";
  }
  anchor_ = std::move(anchor);
  return anchor_;
}

void CudaDevice::on_stream_destroyed(const std::shared_ptr<StreamState>& state) {
  std::lock_guard<std::mutex> lock(streams_mutex_);
  --live_stream_count_;
  state->mark_destroyed();
  if (state->has_error()) return;  // the next Device::synchronize reports it
  streams_.erase(std::remove(streams_.begin(), streams_.end(), state), streams_.end());
}

void CudaDevice::note_if_pageable(const void* host, CopyKind kind) {
  if (!log_enabled(LogLevel::kDebug) || pageable_noted_.load(std::memory_order_relaxed)) return;
  cudaPointerAttributes attributes{};
  const cudaError_t error = cudaPointerGetAttributes(&attributes, host);
  if (error != cudaSuccess) (void)cudaGetLastError();
  const bool pageable = error != cudaSuccess || attributes.type == cudaMemoryTypeUnregistered;
  if (pageable && !pageable_noted_.exchange(true)) {
    STRATA_LOG(kDebug) << name() << ": copy " << copy_kind_name(kind) << " with pageable host memory at " << host
                       << ": the driver stages it through its own pinned buffer, which is slower than a copy "
                          "from pinned memory (noted once)";
  }
}

Status CudaDevice::copy_async(void* dst, const void* src, size_t bytes, CopyKind kind, Stream& stream) {
  auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
  if (cuda_stream == nullptr || &cuda_stream->device() != this) {
    return InvalidArgumentError(name() + ": copy_async on stream '" + stream.name() + "', which belongs to another device");
  }
  if (bytes == 0) return {};
  if (dst == nullptr || src == nullptr) {
    return InvalidArgumentError(name() + ": copy " + std::string(copy_kind_name(kind)) + " of " + std::to_string(bytes) +
                                " bytes with a null pointer");
  }
  STRATA_ENTER_DEVICE(ordinal_);
  if (kind == CopyKind::kHostToDevice || kind == CopyKind::kHostToHost) note_if_pageable(src, kind);
  if (kind == CopyKind::kDeviceToHost || kind == CopyKind::kHostToHost) note_if_pageable(dst, kind);
  STRATA_RETURN_IF_ERROR_CTX(
      [&]() -> Status {
        STRATA_RETURN_IF_CUDA_ERROR(cudaMemcpyAsync(dst, src, bytes, to_cuda(kind), cuda_stream->native()));
        return {};
      }(),
      name() + ": copy " + std::string(copy_kind_name(kind)) + " of " + std::to_string(bytes) + " bytes on stream '" +
          stream.name() + "'");
  return {};
}

Status CudaDevice::memset_async(void* dst, int value, size_t bytes, Stream& stream) {
  auto* cuda_stream = dynamic_cast<CudaStream*>(&stream);
  if (cuda_stream == nullptr || &cuda_stream->device() != this) {
    return InvalidArgumentError(name() + ": memset_async on stream '" + stream.name() + "', which belongs to another device");
  }
  if (bytes == 0) return {};
  STRATA_ENTER_DEVICE(ordinal_);
  STRATA_RETURN_IF_CUDA_ERROR(cudaMemsetAsync(dst, value, bytes, cuda_stream->native()));
  return {};
}

Status CudaDevice::synchronize() {
  Status first;
  {
    DeviceScope scope(ordinal_);
    first = scope.status();
    if (first.ok()) {
      const cudaError_t error = cudaDeviceSynchronize();
      if (error != cudaSuccess) first = internal::cuda_error(error, "cudaDeviceSynchronize()", __FILE__, __LINE__);
    }
  }
  std::vector<std::shared_ptr<StreamState>> states;
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    states = streams_;
  }
  internal::StreamErrorFold errors;
  errors.add(std::move(first));
  for (const auto& state : states) errors.add(state->take_error(std::numeric_limits<uint64_t>::max()));
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    std::erase_if(streams_, [](const std::shared_ptr<StreamState>& state) { return state->destroyed() && !state->has_error(); });
  }
  return errors.take(name());
}

}  // namespace strata
