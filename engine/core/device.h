// Devices: where compute runs.
//
// A Device gives streams (ordered queues of work), events (points in a stream that
// other streams and the host can wait for), a budgeted allocator (a hard cap: an
// allocation past it fails with a Status naming the request and the high-water mark),
// asynchronous copies and kernel launches.
//
// - CpuDevice: "device memory" is host memory counted against the budget; each stream
//   has its own worker thread, so copies on a copy stream really overlap compute on a
//   compute stream; compute kernels fan out through an Executor (oneTBB arena).
// - CudaDevice: real CUDA streams and events and a caching allocator under the budget.
//
// Errors raised by asynchronous work are kept by the stream and returned by the next
// synchronize() / Event::synchronize(); they are never lost and never crash. Until the
// error is reported, later work on that stream is skipped (cancelled): on a CpuDevice
// every later task, on a CudaDevice later host functions (GPU work already enqueued
// runs). An error is reported once, by whichever wait sees it first; a stream destroyed
// with an unreported error hands it to the next Device::synchronize().
#pragma once

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <string_view>

#include "engine/core/executor.h"
#include "engine/core/status.h"

namespace strata {

enum class DeviceKind : uint8_t { kCpu, kCuda };
std::string_view device_kind_name(DeviceKind kind);  // "cpu" | "cuda"
StatusOr<DeviceKind> parse_device_kind(std::string_view text);

// How a device runs fp32 matrix products (strata.matmul_precision); products of bf16
// operands always accumulate in fp32 whatever this says.
enum class MatmulPrecision : uint8_t {
  kFp32,  // IEEE fp32 products (CUBLAS_COMPUTE_32F); the default, and the CPU device's only one
  kTf32,  // tensor-core TF32 operands (10-bit mantissa), fp32 accumulation (CUBLAS_COMPUTE_32F_FAST_TF32)
  kBf16,  // tensor-core bf16 operands (7-bit mantissa), fp32 accumulation (CUBLAS_COMPUTE_32F_FAST_16BF: a
          // permission; cuBLAS may pick a TF32 kernel for a shape, as it did for a small one on an H200)
};
std::string_view matmul_precision_name(MatmulPrecision precision);  // "fp32" | "tf32" | "bf16"

// Direction of a copy, seen from the device.
enum class CopyKind : uint8_t {
  kHostToDevice,
  kDeviceToHost,
  kDeviceToDevice,
  kHostToHost,
};
std::string_view copy_kind_name(CopyKind kind);

struct MemoryStats {
  size_t budget_bytes = 0;        // the hard cap
  size_t in_use_bytes = 0;        // bytes held by live DeviceBuffers
  size_t reserved_bytes = 0;      // bytes the allocator holds from the system (>= in_use for a caching allocator)
  size_t high_water_bytes = 0;    // the most reserved_bytes ever reached (what counts against the budget)
  uint64_t allocation_count = 0;  // successful allocations
  uint64_t failed_allocations = 0;// allocations refused for the budget or by the system
};

class Device;
class Stream;

// Move-only owner of one allocation on a device; the destructor gives it back.
// Give a buffer back only once the work that uses it has finished (a synchronize or an
// event): a CudaDevice's caching allocator may hand the block to the next allocation at
// once, and a CpuDevice frees it. A buffer must not outlive its device.
class DeviceBuffer {
 public:
  DeviceBuffer() = default;
  DeviceBuffer(const DeviceBuffer&) = delete;
  DeviceBuffer& operator=(const DeviceBuffer&) = delete;
  DeviceBuffer(DeviceBuffer&& other) noexcept { *this = std::move(other); }
  DeviceBuffer& operator=(DeviceBuffer&& other) noexcept;
  ~DeviceBuffer() { reset(); }

  void* data() const { return data_; }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }
  size_t size() const { return bytes_; }
  bool empty() const { return data_ == nullptr; }
  Device* device() const { return device_; }
  // Returns the memory to the device now.
  void reset() noexcept;

 private:
  friend class Device;
  DeviceBuffer(Device* device, void* data, size_t bytes) : device_(device), data_(data), bytes_(bytes) {}
  Device* device_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// A point in a stream's work. Record on one stream, wait on others or on the host.
class Event {
 public:
  virtual ~Event() = default;
  // Blocks until the work recorded before this event has finished. An event never
  // recorded is complete. Returns the first error of the recording stream's work.
  virtual Status synchronize() = 0;
  // True when the recorded work has finished (non-blocking).
  virtual StatusOr<bool> query() = 0;
};

// An event that also says when the stream reached it, in host steady_clock time, so
// device work can be traced without a host callback in the stream (a CUDA host function
// holds its stream until a runtime thread has run it). Made by
// Device::create_timing_event(); recorded and waited on like any event.
//
// How exact the time is depends on the device: a CpuDevice's stream worker reads the
// clock when it reaches the event (exact); a CudaDevice converts the GPU's timestamp
// through an anchor event whose host time it measured (see cuda_device.h).
class TimingEvent : public Event {
 public:
  using Clock = std::chrono::steady_clock;
  // Non-blocking: nullopt while the work recorded before the event is unfinished, the
  // time the stream reached the event once it has. An error when the event was never
  // recorded, or (kCancelled) when the stream skipped it after an earlier error of its
  // work and so has no time for it.
  virtual StatusOr<std::optional<Clock::time_point>> completion_time() = 0;
};

// What a kernel gets when it runs.
struct LaunchContext {
  Device* device = nullptr;
  void* native_stream = nullptr;  // cudaStream_t on a CudaDevice; nullptr on a CpuDevice
  Executor* executor = nullptr;   // the CPU device's compute executor; nullptr on a CudaDevice
};

// A host-callable kernel. On a CudaDevice it runs at once on the calling thread and
// enqueues GPU work on ctx.native_stream; on a CpuDevice it runs later, in stream order,
// on the stream's worker, and does the work itself (through ctx.executor).
using Kernel = std::function<Status(const LaunchContext& ctx)>;

// An ordered queue of work on one device. Move-only, owned through unique_ptr. Its
// destructor drains its queue; it must not outlive its device. Events likewise.
class Stream {
 public:
  virtual ~Stream() = default;
  virtual Device& device() = 0;
  virtual const std::string& name() const = 0;
  // Marks the current end of this stream's work in `event` (recording again moves it).
  // The event must come from the same device.
  virtual Status record(Event& event) = 0;
  // Work enqueued on this stream after this call starts only after `event` (as recorded
  // at the time of this call) completes. Waiting does not carry the other stream's error.
  virtual Status wait(Event& event) = 0;
  // Blocks until all work so far has finished; returns the first asynchronous error.
  virtual Status synchronize() = 0;
  // Enqueues a kernel (see Kernel). On a CudaDevice the launcher runs now, so its
  // error (a bad launch configuration) comes back from launch() itself; errors of the GPU
  // work come back at the next synchronize.
  virtual Status launch(Kernel kernel) = 0;
  // Enqueues a host function to run in stream order once the work before it is done
  // (a CUDA host callback or a CPU stream task). Its error is reported like a kernel's.
  // On a CudaDevice it runs on a CUDA runtime thread and must not call CUDA.
  virtual Status enqueue_host(std::function<Status()> fn) = 0;
  // The native handle (cudaStream_t) or nullptr.
  virtual void* native_handle() = 0;
};

class Device {
 public:
  virtual ~Device() = default;
  virtual DeviceKind kind() const = 0;
  virtual int ordinal() const = 0;
  // e.g. "cpu:0 (budget 512 MiB)" or "cuda:0 NVIDIA H200".
  virtual std::string description() const = 0;
  // How this device's fp32 matrix products run (BlasContext follows it).
  virtual MatmulPrecision matmul_precision() const = 0;

  // Allocates `bytes` under the budget. `purpose` names the allocation in errors
  // ("gather buffer group 3"). Zero bytes gives an empty buffer.
  virtual StatusOr<DeviceBuffer> allocate(size_t bytes, std::string_view purpose) = 0;
  virtual MemoryStats memory_stats() const = 0;
  // Returns cached, unused memory to the system (no-op where nothing is cached).
  virtual Status release_cached_memory() = 0;

  virtual StatusOr<std::unique_ptr<Stream>> create_stream(std::string name) = 0;
  // A stream someone else made and owns (a framework's current stream, given as its
  // native handle: a cudaStream_t), so that work on the device's own streams and the
  // owner's can be ordered with events in both directions. The wrapper records, waits,
  // launches and synchronizes like a stream of create_stream(); its destructor neither
  // waits for the stream nor destroys it, which stay its owner's. Unimplemented
  // on a device without native streams (the CPU device, whose callers compute on their
  // own thread and wait for the device's events instead).
  virtual StatusOr<std::unique_ptr<Stream>> adopt_stream(void* native_handle, std::string name);
  virtual StatusOr<std::unique_ptr<Event>> create_event() = 0;
  // An event that records when it completed (see TimingEvent); a little dearer to record
  // than create_event()'s, so made only where a time is wanted.
  virtual StatusOr<std::unique_ptr<TimingEvent>> create_timing_event() = 0;

  // The one place copies are routed: copies `bytes` from `src` to `dst` in `stream`
  // order. Host pointers may be pinned or pageable; the device picks the fastest path
  // it has and says (at debug level) when it takes a slower one.
  virtual Status copy_async(void* dst, const void* src, size_t bytes, CopyKind kind, Stream& stream) = 0;
  // Fills device memory with a byte value in stream order.
  virtual Status memset_async(void* dst, int value, size_t bytes, Stream& stream) = 0;

  // Waits for all work on all of this device's streams; returns the first unreported
  // error of any of them, with the others as context lines.
  virtual Status synchronize() = 0;

 protected:
  // Hands a buffer's memory back to the allocator; called by DeviceBuffer only.
  virtual void free_buffer(void* data, size_t bytes) noexcept = 0;
  static DeviceBuffer make_buffer(Device* device, void* data, size_t bytes) { return DeviceBuffer(device, data, bytes); }
  friend class DeviceBuffer;
};

// The CPU device's threads' default nice value (CpuDeviceOptions::thread_nice,
// strata.device_thread_nice): the lowest priority, below every host stage.
inline constexpr int kCpuDeviceThreadNice = 19;

struct CpuDeviceOptions {
  int ordinal = 0;
  size_t budget_bytes = size_t{1} << 30;  // the hard cap on "device" memory
  ExecutorOptions compute;                // the executor kernels fan out through
  // The nice value of the device's own threads: its streams' workers and its executor's
  // workers (compute.worker_nice, where that is 0). The CPU device stands in for an
  // accelerator, whose work never takes a host core from the host pipeline (CPU Adam, the
  // gradient landing, the I/O): at 19 those stages run first and the device computes in
  // the time they leave; the work is the same, so the step is not longer (docs/benchmarks.md,
  // "the host stages given the cores"). 0 = the process's priority.
  int thread_nice = kCpuDeviceThreadNice;
  // Only kFp32: OpenBLAS's sgemm has no reduced-precision mode, so create_cpu_device
  // rejects the others rather than silently computing in fp32.
  MatmulPrecision matmul_precision = MatmulPrecision::kFp32;
};

struct CudaDeviceOptions {
  int ordinal = 0;                        // CUDA device index
  size_t budget_bytes = 0;                // hard cap; 0 = the GPU's free memory at creation
  MatmulPrecision matmul_precision = MatmulPrecision::kFp32;  // fp32 GEMMs: exact, TF32 or bf16 tensor cores
};

StatusOr<std::unique_ptr<Device>> create_cpu_device(const CpuDeviceOptions& options);
// Unavailable (with the reason) where this build has no CUDA or the machine no GPU.
StatusOr<std::unique_ptr<Device>> create_cuda_device(const CudaDeviceOptions& options);

}  // namespace strata
