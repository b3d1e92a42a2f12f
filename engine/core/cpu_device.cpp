#include "engine/core/cpu_device.h"

#include <pthread.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <functional>
#include <limits>
#include <string>
#include <system_error>
#include <thread>
#include <utility>

#include "engine/core/device_internal.h"
#include "engine/core/log.h"
#include "engine/core/thread.h"

namespace strata {

namespace cpu_device_internal {

// One unit of stream work: what it does and how errors name it.
struct Task {
  std::function<Status()> run;
  std::string what;  // "copy host_to_device of 4096 bytes", "kernel", "host function"
};

// The queue and progress counters of one stream, shared by the stream (which owns the
// worker thread), the events recorded on it and the device's registry, so that an event
// or the registry may outlive the stream.
//
// Tasks are numbered from 1 in enqueue order; the worker runs them in that order, so
// "task n has finished" is `completed_ >= n`. An event is a (core, task number) pair.
class StreamCore {
 public:
  StreamCore(std::string name, std::string device_name) : name_(std::move(name)), device_name_(std::move(device_name)) {}

  const std::string& name() const { return name_; }

  // Appends a task; returns its number, or an error when the stream is shutting down.
  StatusOr<uint64_t> push(Task task) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (stopping_) return FailedPreconditionError("stream '" + name_ + "' is being destroyed; cannot enqueue " + task.what);
    queue_.push_back(std::move(task));
    ++enqueued_;
    work_ready_.notify_one();
    return enqueued_;
  }

  // The number of the last task enqueued so far (0 when none).
  uint64_t enqueued() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return enqueued_;
  }

  // Blocks until tasks 1..target have finished (run, failed or skipped).
  void wait_until(uint64_t target) {
    std::unique_lock<std::mutex> lock(mutex_);
    task_done_.wait(lock, [&] { return completed_ >= target; });
  }

  bool finished_through(uint64_t target) const {
    std::lock_guard<std::mutex> lock(mutex_);
    return completed_ >= target;
  }

  // Reports (and clears) the stream's first error if it was raised by a task numbered
  // `through` or lower. Tasks enqueued before this report that have not run yet are
  // skipped too: whoever enqueued them did not know about the failure.
  Status take_error(uint64_t through) {
    std::lock_guard<std::mutex> lock(mutex_);
    return errors_.take(through, enqueued_, name_, "task(s)");
  }

  bool has_error() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return errors_.pending();
  }

  // Set once the owning stream has been destroyed (its queue drained).
  void mark_destroyed() {
    std::lock_guard<std::mutex> lock(mutex_);
    destroyed_ = true;
  }
  bool destroyed() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return destroyed_;
  }

  // The worker's loop: runs tasks in order until stopped and drained.
  void run_worker() {
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
      if (queue_.empty()) return;  // stopping, and everything enqueued has finished
      Task task = std::move(queue_.front());
      queue_.pop_front();
      const uint64_t number = completed_ + 1;
      const bool skip = errors_.skip(number);
      lock.unlock();
      Status status = skip ? Status() : run_task(task);
      lock.lock();
      if (skip) {
        STRATA_LOG(kTrace) << "stream '" << name_ << "': skipped " << task.what << " (cancelled by an earlier error)";
      } else if (!status.ok()) {
        errors_.record(number, std::move(status).with_context("in " + task.what + " (task " + std::to_string(number) +
                                                              ") on stream '" + name_ + "' of " + device_name_));
      }
      completed_ = number;
      task_done_.notify_all();
      // Drop the task's captures (buffers, callables) before sleeping, outside the lock.
      lock.unlock();
      task = Task();
      lock.lock();
    }
  }

  void request_stop() {
    std::lock_guard<std::mutex> lock(mutex_);
    stopping_ = true;
    work_ready_.notify_all();
  }

  void set_worker_id(std::thread::id id) {
    std::lock_guard<std::mutex> lock(mutex_);
    worker_id_ = id;
  }
  bool on_worker_thread() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return worker_id_ == std::this_thread::get_id();
  }

 private:
  static Status run_task(Task& task) {
    try {
      return task.run();
    } catch (const std::exception& e) {
      return InternalError(task.what + " threw an exception: " + e.what());
    } catch (...) {
      return InternalError(task.what + " threw a non-standard exception");
    }
  }

  const std::string name_;
  const std::string device_name_;
  mutable std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable task_done_;
  std::deque<Task> queue_;
  uint64_t enqueued_ = 0;     // number of the last task enqueued
  uint64_t completed_ = 0;    // number of the last task finished
  internal::StreamErrors errors_;
  bool stopping_ = false;
  bool destroyed_ = false;
  std::thread::id worker_id_;
};

}  // namespace cpu_device_internal

using cpu_device_internal::StreamCore;
using cpu_device_internal::Task;

// The time a stream worker reached a timing event: written once by the worker, read by
// whoever asks the event after the stream says the task finished (whose mutex orders the
// two; the atomic keeps the hand-over explicit). One per record, so a re-record cannot
// receive the stamp of the record before it.
struct TimingStamp {
  static constexpr TimingEvent::Clock::rep kUnset = std::numeric_limits<TimingEvent::Clock::rep>::min();
  std::atomic<TimingEvent::Clock::rep> ticks{kUnset};  // time_since_epoch of the moment reached
};

// Whether an event keeps the time it completed.
enum class EventTiming : uint8_t { kDisabled, kEnabled };

// An event: the stream it was last recorded on and the number of the last task enqueued
// there at that moment. Never recorded = complete. A timing event is recorded as a task
// of its own that stamps the clock when the worker reaches it.
class CpuEvent final : public TimingEvent {
 public:
  CpuEvent(const CpuDevice* device, EventTiming timing) : device_(device), timing_(timing) {}

  Status synchronize() override {
    auto [core, target] = snapshot();
    if (core == nullptr) return {};
    core->wait_until(target);
    return core->take_error(target);
  }

  StatusOr<bool> query() override {
    auto [core, target] = snapshot();
    return core == nullptr || core->finished_through(target);
  }

  StatusOr<std::optional<Clock::time_point>> completion_time() override {
    if (timing_ != EventTiming::kEnabled) {
      return FailedPreconditionError("completion_time() of an event made by create_event(): use create_timing_event()");
    }
    std::shared_ptr<StreamCore> core;
    uint64_t target = 0;
    std::shared_ptr<const TimingStamp> stamp;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      core = core_;
      target = target_;
      stamp = stamp_;
    }
    if (core == nullptr) return FailedPreconditionError("completion_time() of a timing event that was never recorded");
    if (!core->finished_through(target)) return std::optional<Clock::time_point>();
    const Clock::rep ticks = stamp->ticks.load(std::memory_order_acquire);
    if (ticks == TimingStamp::kUnset) {
      return CancelledError("timing event on stream '" + core->name() +
                            "' has no time: the stream skipped it after an earlier error of its work");
    }
    return std::optional<Clock::time_point>(Clock::time_point(Clock::duration(ticks)));
  }

  const CpuDevice* device() const { return device_; }
  EventTiming timing() const { return timing_; }

  void set(std::shared_ptr<StreamCore> core, uint64_t target, std::shared_ptr<const TimingStamp> stamp = nullptr) {
    std::lock_guard<std::mutex> lock(mutex_);
    core_ = std::move(core);
    target_ = target;
    stamp_ = std::move(stamp);
  }

  std::pair<std::shared_ptr<StreamCore>, uint64_t> snapshot() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return {core_, target_};
  }

 private:
  const CpuDevice* const device_;
  const EventTiming timing_;
  mutable std::mutex mutex_;
  std::shared_ptr<StreamCore> core_;         // guarded by mutex_
  uint64_t target_ = 0;                      // guarded by mutex_
  std::shared_ptr<const TimingStamp> stamp_; // the last record's stamp (timing events); guarded by mutex_
};

class CpuStream final : public Stream {
 public:
  // `worker` runs core->run_worker() (started by create_stream, which can fail).
  CpuStream(CpuDevice& device, std::shared_ptr<StreamCore> core, std::thread worker)
      : device_(device), core_(std::move(core)), worker_(std::move(worker)) {
    core_->set_worker_id(worker_.get_id());
  }

  // Drains the queue: everything enqueued runs (or is skipped after an error) first.
  ~CpuStream() override {
    core_->request_stop();
    worker_.join();
    device_.on_stream_destroyed(core_);
  }

  CpuStream(const CpuStream&) = delete;
  CpuStream& operator=(const CpuStream&) = delete;

  Device& device() override { return device_; }
  const std::string& name() const override { return core_->name(); }

  Status record(Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CpuEvent * cpu_event, own_event(event, "record"));
    if (cpu_event->timing() == EventTiming::kDisabled) {
      cpu_event->set(core_, core_->enqueued());
      return {};
    }
    // The stamp task is the event's point in the stream: it runs once the work before it
    // has finished, so its clock reading is when the stream reached the event.
    auto stamp = std::make_shared<TimingStamp>();
    STRATA_ASSIGN_OR_RETURN(const uint64_t number, core_->push({[stamp]() -> Status {
                                                                  stamp->ticks.store(TimingEvent::Clock::now().time_since_epoch().count(),
                                                                                     std::memory_order_release);
                                                                  return {};
                                                                },
                                                                "timing event"}));
    cpu_event->set(core_, number, std::move(stamp));
    return {};
  }

  Status wait(Event& event) override {
    STRATA_ASSIGN_OR_RETURN(CpuEvent * cpu_event, own_event(event, "wait on"));
    auto [other, target] = cpu_event->snapshot();
    // Never recorded, or recorded on this stream: stream order already gives the wait.
    if (other == nullptr || other == core_ || target == 0) return {};
    std::string what = "wait for an event of stream '" + other->name() + "'";
    return enqueue({[other = std::move(other), target = target]() -> Status {
                      other->wait_until(target);
                      return {};
                    },
                    std::move(what)});
  }

  Status synchronize() override {
    if (core_->on_worker_thread()) {
      return FailedPreconditionError("stream '" + core_->name() + "': synchronize() called from its own worker (a task of the stream) would deadlock");
    }
    core_->wait_until(core_->enqueued());
    return core_->take_error(std::numeric_limits<uint64_t>::max());
  }

  Status launch(Kernel kernel) override {
    if (!kernel) return InvalidArgumentError("stream '" + core_->name() + "': launch of an empty kernel");
    return enqueue({[kernel = std::move(kernel), ctx = LaunchContext{&device_, nullptr, &device_.executor()}]() -> Status {
                      return kernel(ctx);
                    },
                    "kernel"});
  }

  Status enqueue_host(std::function<Status()> fn) override {
    if (!fn) return InvalidArgumentError("stream '" + core_->name() + "': enqueue_host of an empty function");
    return enqueue({std::move(fn), "host function"});
  }

  void* native_handle() override { return nullptr; }

  Status enqueue(Task task) {
    STRATA_ASSIGN_OR_RETURN(uint64_t number, core_->push(std::move(task)));
    (void)number;
    return {};
  }

 private:
  StatusOr<CpuEvent*> own_event(Event& event, std::string_view verb) {
    auto* cpu_event = dynamic_cast<CpuEvent*>(&event);
    if (cpu_event == nullptr || cpu_event->device() != &device_) {
      return InvalidArgumentError("stream '" + core_->name() + "' of " + device_.name() + " cannot " + std::string(verb) +
                                  " an event created by another device");
    }
    return cpu_event;
  }

  CpuDevice& device_;
  std::shared_ptr<StreamCore> core_;
  std::thread worker_;
};

// ---------------------------------------------------------------------------------------

StatusOr<std::unique_ptr<CpuDevice>> CpuDevice::create(const CpuDeviceOptions& options) {
  if (options.ordinal < 0) return InvalidArgumentError("cpu device ordinal must be >= 0, got " + std::to_string(options.ordinal));
  if (options.matmul_precision != MatmulPrecision::kFp32) {
    return InvalidArgumentError("cpu:" + std::to_string(options.ordinal) + ": strata.matmul_precision is \"" +
                                std::string(matmul_precision_name(options.matmul_precision)) +
                                "\", but the CPU device computes matrix products in fp32 only (OpenBLAS sgemm): set it "
                                "to \"fp32\" or run on --device cuda");
  }
  ExecutorOptions compute = options.compute;
  if (compute.worker_nice == 0) compute.worker_nice = options.thread_nice;
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Executor> executor, make_executor(compute));
  return std::make_unique<CpuDevice>(ConstructorKey(), options, std::move(executor));
}

CpuDevice::CpuDevice(ConstructorKey /*key*/, const CpuDeviceOptions& options, std::unique_ptr<Executor> executor)
    : options_(options), executor_(std::move(executor)) {
  stats_.budget_bytes = options.budget_bytes;
}

CpuDevice::~CpuDevice() {
  const Status status = synchronize();
  if (!status.ok()) {
    STRATA_LOG(kError) << name() << " destroyed with an unreported asynchronous error: " << status.to_string();
  }
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    if (live_stream_count_ > 0) {
      STRATA_LOG(kError) << name() << " destroyed while " << live_stream_count_
                         << " of its streams still exist (streams must not outlive their device)";
    }
  }
  std::lock_guard<std::mutex> lock(memory_mutex_);
  if (!live_.empty()) {
    STRATA_LOG(kError) << name() << " destroyed while " << live_.size() << " buffer(s) of "
                       << internal::format_bytes(stats_.in_use_bytes)
                       << " are still allocated (buffers must not outlive their device); their memory is leaked";
  }
}

std::string CpuDevice::name() const { return "cpu:" + std::to_string(options_.ordinal); }

std::string CpuDevice::description() const {
  return name() + " (budget " + internal::format_bytes(options_.budget_bytes) + ", " + std::string(executor_->name()) +
         " executor x" + std::to_string(executor_->concurrency()) + ")";
}

StatusOr<DeviceBuffer> CpuDevice::allocate(size_t bytes, std::string_view purpose) {
  if (bytes == 0) return DeviceBuffer();
  const size_t alignment = bytes >= kLargeThreshold ? kLargeAlignment : kSmallAlignment;
  if (bytes > std::numeric_limits<size_t>::max() - alignment) {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    ++stats_.failed_allocations;
    return internal::budget_exceeded_error(name(), bytes, purpose, stats_);
  }
  const size_t reserved = internal::round_up(bytes, alignment);
  {
    // Reserve under the lock first, so that concurrent allocations cannot both pass the check.
    std::lock_guard<std::mutex> lock(memory_mutex_);
    if (reserved > stats_.budget_bytes - std::min(stats_.budget_bytes, stats_.reserved_bytes)) {
      ++stats_.failed_allocations;
      return internal::budget_exceeded_error(name(), bytes, purpose, stats_);
    }
    stats_.reserved_bytes += reserved;
    stats_.in_use_bytes += reserved;
    stats_.high_water_bytes = std::max(stats_.high_water_bytes, stats_.reserved_bytes);
  }
  void* data = std::aligned_alloc(alignment, reserved);
  std::lock_guard<std::mutex> lock(memory_mutex_);
  if (data == nullptr) {
    stats_.reserved_bytes -= reserved;
    stats_.in_use_bytes -= reserved;
    ++stats_.failed_allocations;
    return OutOfMemoryError(name() + ": the system refused " + internal::format_bytes(reserved) + " for '" +
                            std::string(purpose) + "' (aligned_alloc) although the budget allowed it");
  }
  live_.emplace(reinterpret_cast<uintptr_t>(data), reserved);
  ++stats_.allocation_count;
  return make_buffer(this, data, bytes);
}

void CpuDevice::free_buffer(void* data, size_t bytes) noexcept {
  {
    std::lock_guard<std::mutex> lock(memory_mutex_);
    auto it = live_.find(reinterpret_cast<uintptr_t>(data));
    if (it == live_.end()) {
      STRATA_LOG(kError) << name() << ": free of " << bytes << " bytes at " << data
                         << " which this device did not allocate (or freed twice); ignored";
      return;
    }
    stats_.reserved_bytes -= it->second;
    stats_.in_use_bytes -= it->second;
    live_.erase(it);
  }
  std::free(data);
}

MemoryStats CpuDevice::memory_stats() const {
  std::lock_guard<std::mutex> lock(memory_mutex_);
  return stats_;
}

Status CpuDevice::check_device_range(const void* data, size_t bytes, std::string_view role, std::string_view what) const {
  const auto address = reinterpret_cast<uintptr_t>(data);
  std::lock_guard<std::mutex> lock(memory_mutex_);
  auto it = live_.upper_bound(address);
  if (it != live_.begin()) {
    --it;
    if (address >= it->first && bytes <= it->second && address - it->first <= it->second - bytes) return {};
  }
  char text[32];
  std::snprintf(text, sizeof(text), "%p", data);
  return InvalidArgumentError(name() + ": " + std::string(what) + ": the " + std::string(role) + " range [" + text + ", +" +
                              std::to_string(bytes) + " bytes) is not inside one live allocation of this device");
}

StatusOr<std::unique_ptr<Stream>> CpuDevice::create_stream(std::string name) {
  auto core = std::make_shared<StreamCore>(std::move(name), this->name());
  StatusOr<std::thread> worker = spawn_thread("strata:" + core->name(), [core, nice = options_.thread_nice] {
    lower_current_thread_priority(nice);
    core->run_worker();
  });
  if (!worker.ok()) return std::move(worker).status().with_context(this->name() + ": the worker of stream '" + core->name() + "'");
  auto stream = std::make_unique<CpuStream>(*this, core, *std::move(worker));
  std::lock_guard<std::mutex> lock(streams_mutex_);
  streams_.push_back(std::move(core));
  ++live_stream_count_;
  return std::unique_ptr<Stream>(std::move(stream));
}

StatusOr<std::unique_ptr<Event>> CpuDevice::create_event() {
  return std::unique_ptr<Event>(std::make_unique<CpuEvent>(this, EventTiming::kDisabled));
}

StatusOr<std::unique_ptr<TimingEvent>> CpuDevice::create_timing_event() {
  return std::unique_ptr<TimingEvent>(std::make_unique<CpuEvent>(this, EventTiming::kEnabled));
}

void CpuDevice::on_stream_destroyed(const std::shared_ptr<StreamCore>& core) {
  std::lock_guard<std::mutex> lock(streams_mutex_);
  --live_stream_count_;
  core->mark_destroyed();
  // Keep a stream whose error nobody has seen yet: the next Device::synchronize reports it.
  if (core->has_error()) return;
  streams_.erase(std::remove(streams_.begin(), streams_.end(), core), streams_.end());
}

Status CpuDevice::copy_async(void* dst, const void* src, size_t bytes, CopyKind kind, Stream& stream) {
  auto* cpu_stream = dynamic_cast<CpuStream*>(&stream);
  if (cpu_stream == nullptr || &cpu_stream->device() != this) {
    return InvalidArgumentError(name() + ": copy_async on stream '" + stream.name() + "', which belongs to another device");
  }
  if (bytes == 0) return {};
  std::string what = "copy " + std::string(copy_kind_name(kind)) + " of " + std::to_string(bytes) + " bytes";
  if (dst == nullptr || src == nullptr) return InvalidArgumentError(name() + ": " + what + " with a null pointer");
  if (kind == CopyKind::kHostToDevice || kind == CopyKind::kDeviceToDevice) {
    STRATA_RETURN_IF_ERROR(check_device_range(dst, bytes, "destination", what));
  }
  if (kind == CopyKind::kDeviceToHost || kind == CopyKind::kDeviceToDevice) {
    STRATA_RETURN_IF_ERROR(check_device_range(src, bytes, "source", what));
  }
  const auto d = reinterpret_cast<uintptr_t>(dst);
  const auto s = reinterpret_cast<uintptr_t>(src);
  if (d < s + bytes && s < d + bytes) return InvalidArgumentError(name() + ": " + what + ": source and destination overlap");
  return cpu_stream->enqueue({[dst, src, bytes]() -> Status {
                                std::memcpy(dst, src, bytes);
                                return {};
                              },
                              std::move(what)});
}

Status CpuDevice::memset_async(void* dst, int value, size_t bytes, Stream& stream) {
  auto* cpu_stream = dynamic_cast<CpuStream*>(&stream);
  if (cpu_stream == nullptr || &cpu_stream->device() != this) {
    return InvalidArgumentError(name() + ": memset_async on stream '" + stream.name() + "', which belongs to another device");
  }
  if (bytes == 0) return {};
  std::string what = "memset of " + std::to_string(bytes) + " bytes";
  STRATA_RETURN_IF_ERROR(check_device_range(dst, bytes, "destination", what));
  return cpu_stream->enqueue({[dst, value, bytes]() -> Status {
                                std::memset(dst, value, bytes);
                                return {};
                              },
                              std::move(what)});
}

Status CpuDevice::synchronize() {
  std::vector<std::shared_ptr<StreamCore>> cores;
  {
    std::lock_guard<std::mutex> lock(streams_mutex_);
    cores = streams_;
  }
  for (const auto& core : cores) {
    if (core->on_worker_thread()) {
      return FailedPreconditionError(name() + ": synchronize() called from a task of stream '" + core->name() +
                                     "' would wait for itself");
    }
  }
  internal::StreamErrorFold errors;
  for (const auto& core : cores) {
    core->wait_until(core->enqueued());
    errors.add(core->take_error(std::numeric_limits<uint64_t>::max()));
  }
  {
    // Destroyed streams stay registered only until their error is reported.
    std::lock_guard<std::mutex> lock(streams_mutex_);
    std::erase_if(streams_, [](const std::shared_ptr<StreamCore>& core) { return core->destroyed() && !core->has_error(); });
  }
  return errors.take(name());
}

}  // namespace strata
