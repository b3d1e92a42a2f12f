// CpuDevice: the host as a compute device.
//
// "Device memory" is host memory counted against a hard budget. Each stream owns a
// worker thread that runs its tasks (copies, memsets, kernels, host functions) in
// enqueue order, so a copy stream really overlaps a compute stream. Kernels fan out
// through the device's compute Executor (a oneTBB arena; plain threads under TSan).
//
// Lifetimes: streams, events and buffers must not outlive their device. A stream may
// be destroyed before the device; its destructor drains its queue, and an error it
// still holds is reported by the next Device::synchronize(). A buffer may be given back
// only once the work that uses it has finished (a synchronize or an event).
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/executor.h"

namespace strata {

namespace cpu_device_internal {
class StreamCore;
}

class CpuDevice final : public Device {
  struct ConstructorKey {
    explicit ConstructorKey() = default;
  };

 public:
  // Allocations are aligned to kSmallAlignment, or kLargeAlignment from kLargeThreshold up.
  static constexpr size_t kSmallAlignment = 256;
  static constexpr size_t kLargeAlignment = 4096;
  static constexpr size_t kLargeThreshold = size_t{1} << 20;

  static StatusOr<std::unique_ptr<CpuDevice>> create(const CpuDeviceOptions& options);
  // Use create(); public only for make_unique.
  CpuDevice(ConstructorKey key, const CpuDeviceOptions& options, std::unique_ptr<Executor> executor);
  ~CpuDevice() override;
  CpuDevice(const CpuDevice&) = delete;
  CpuDevice& operator=(const CpuDevice&) = delete;

  DeviceKind kind() const override { return DeviceKind::kCpu; }
  int ordinal() const override { return options_.ordinal; }
  MatmulPrecision matmul_precision() const override { return MatmulPrecision::kFp32; }
  std::string description() const override;

  StatusOr<DeviceBuffer> allocate(size_t bytes, std::string_view purpose) override;
  MemoryStats memory_stats() const override;
  Status release_cached_memory() override { return {}; }

  StatusOr<std::unique_ptr<Stream>> create_stream(std::string name) override;
  StatusOr<std::unique_ptr<Event>> create_event() override;
  // Recording one enqueues a task that reads the clock when the worker reaches it.
  StatusOr<std::unique_ptr<TimingEvent>> create_timing_event() override;

  Status copy_async(void* dst, const void* src, size_t bytes, CopyKind kind, Stream& stream) override;
  Status memset_async(void* dst, int value, size_t bytes, Stream& stream) override;

  Status synchronize() override;

  // The executor kernels fan out through (also handed to them in LaunchContext).
  Executor& executor() { return *executor_; }

 protected:
  void free_buffer(void* data, size_t bytes) noexcept override;

 private:
  friend class CpuStream;

  // "cpu:0".
  std::string name() const;
  // OK when [data, data + bytes) lies inside one live allocation of this device;
  // otherwise an error naming the range, `role` ("destination") and `what`.
  Status check_device_range(const void* data, size_t bytes, std::string_view role, std::string_view what) const;
  // Called by a stream's destructor after it has drained.
  void on_stream_destroyed(const std::shared_ptr<cpu_device_internal::StreamCore>& core);

  const CpuDeviceOptions options_;
  std::unique_ptr<Executor> executor_;

  mutable std::mutex memory_mutex_;
  MemoryStats stats_;                   // guarded by memory_mutex_
  std::map<uintptr_t, size_t> live_;    // address -> reserved bytes; guarded by memory_mutex_

  std::mutex streams_mutex_;
  // Every stream this device created and not yet destroyed, plus destroyed streams whose
  // error has not been reported yet. Guarded by streams_mutex_.
  std::vector<std::shared_ptr<cpu_device_internal::StreamCore>> streams_;
  size_t live_stream_count_ = 0;        // guarded by streams_mutex_
};

}  // namespace strata
