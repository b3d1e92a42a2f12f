// CudaDevice: one GPU as a compute device. Compiled only with STRATA_HAVE_CUDA; other
// code reaches it through create_cuda_device() in device.h.
//
// Yield policy: host threads that wait for the GPU sleep, they do not spin. Events are
// created with cudaEventBlockingSync and the device with cudaDeviceScheduleBlockingSync
// (stream and device synchronizations), so the engine's waiting threads leave the cores
// to CPU Adam and the I/O threads; a wake-up costs tens of microseconds, which no wait of
// the step's pipeline notices.
//
// Timing events (create_timing_event) tell the host steady_clock time at which the GPU
// reached them without a host function in the stream: the GPU's timestamp is converted
// through an anchor, an event recorded on an idle stream of the device's own while the
// host read its clock just before and just after it completed (polled, not slept on, so
// the window is microseconds). The anchor's host time is the middle of that window, so a
// converted time is off by at most half the window (logged at debug level when over
// 100 us) plus the drift of the GPU's clock against the host's since the anchor was
// taken, which is why a timing event recorded more than kAnchorRefresh after the
// current anchor gets a fresh one (cudaEventElapsedTime's float milliseconds also lose
// resolution with distance: a quarter of a millisecond an hour away). An event is always
// converted through the anchor current when it was recorded, which completed before it.
//
// Real CUDA streams (non-blocking) and events (timing disabled but for timing events), and a caching
// allocator under the budget: blocks are rounded to a size class and kept, when given
// back, in a free list per class for the next allocation of that class. Cached blocks
// count against the budget; an allocation that would exceed it first returns the cache
// to the driver and retries.
//
// Lifetimes as for CpuDevice: streams, events and buffers must not outlive the device,
// and a buffer may be given back only once the work using it has finished (a cached
// block goes to the next allocation of its class at once, whatever stream uses it).
#pragma once

#include <cuda_runtime_api.h>

#include <atomic>
#include <chrono>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "engine/core/device.h"

namespace strata {

namespace cuda_device_internal {
class StreamState;
struct TimingAnchor;
}

class CudaDevice final : public Device {
  struct ConstructorKey {
    explicit ConstructorKey() = default;
  };

 public:
  static StatusOr<std::unique_ptr<CudaDevice>> create(const CudaDeviceOptions& options);
  // Use create(); public only for make_unique.
  CudaDevice(ConstructorKey key, const CudaDeviceOptions& options, std::string gpu_name, size_t budget_bytes);
  ~CudaDevice() override;
  CudaDevice(const CudaDevice&) = delete;
  CudaDevice& operator=(const CudaDevice&) = delete;

  DeviceKind kind() const override { return DeviceKind::kCuda; }
  int ordinal() const override { return ordinal_; }
  MatmulPrecision matmul_precision() const override { return matmul_precision_; }
  std::string description() const override;

  StatusOr<DeviceBuffer> allocate(size_t bytes, std::string_view purpose) override;
  MemoryStats memory_stats() const override;
  Status release_cached_memory() override;

  StatusOr<std::unique_ptr<Stream>> create_stream(std::string name) override;
  // A cudaStream_t of this GPU made elsewhere (torch's current stream); never destroyed here.
  StatusOr<std::unique_ptr<Stream>> adopt_stream(void* native_handle, std::string name) override;
  StatusOr<std::unique_ptr<Event>> create_event() override;
  StatusOr<std::unique_ptr<TimingEvent>> create_timing_event() override;

  // How old the timing anchor may get before a timing event recorded then takes a new one.
  static constexpr std::chrono::milliseconds kAnchorRefresh{1000};

  Status copy_async(void* dst, const void* src, size_t bytes, CopyKind kind, Stream& stream) override;
  Status memset_async(void* dst, int value, size_t bytes, Stream& stream) override;

  Status synchronize() override;

  // The block size an allocation of `bytes` takes: a multiple of 512 B and of one
  // eighth of the largest power of two <= bytes (at most 2 MiB), so a block wastes at most 12.5%
  // of a small request and 2 MiB of a large one.
  static size_t block_size_for(size_t bytes);

 protected:
  void free_buffer(void* data, size_t bytes) noexcept override;

 private:
  friend class CudaStream;

  std::string name() const;  // "cuda:0"
  // Hands every cached block back to the driver (cudaFree). `lock` holds memory_mutex_
  // on entry and on return; it is released while the driver frees.
  Status release_cached(std::unique_lock<std::mutex>& lock);
  void on_stream_destroyed(const std::shared_ptr<cuda_device_internal::StreamState>& state);
  // A wrapper of `stream` counted among the live streams; `owned`: destroyed with it
  // (create_stream), else left to its owner (adopt_stream).
  std::unique_ptr<Stream> track_stream(cudaStream_t stream, std::string name, bool owned);
  // The anchor a timing event recorded now is converted through: the current one, or a
  // new one when it is older than kAnchorRefresh (or there is none yet).
  StatusOr<std::shared_ptr<const cuda_device_internal::TimingAnchor>> timing_anchor();
  // Logs once, at debug level, when a host pointer of a copy is pageable.
  void note_if_pageable(const void* host, CopyKind kind);

  const int ordinal_;
  const std::string gpu_name_;
  const MatmulPrecision matmul_precision_;

  mutable std::mutex memory_mutex_;
  MemoryStats stats_;                                // guarded by memory_mutex_
  std::unordered_map<void*, size_t> live_;           // block -> block size; guarded by memory_mutex_
  std::map<size_t, std::vector<void*>> cached_;      // block size -> free blocks; guarded by memory_mutex_

  std::atomic<bool> pageable_noted_{false};

  std::mutex anchor_mutex_;
  cudaStream_t anchor_stream_ = nullptr;  // idle stream the anchors are recorded on; made with the first; guarded by anchor_mutex_
  std::shared_ptr<const cuda_device_internal::TimingAnchor> anchor_;  // guarded by anchor_mutex_

  std::mutex streams_mutex_;
  // Live streams, plus destroyed ones whose host-function error is not reported yet.
  std::vector<std::shared_ptr<cuda_device_internal::StreamState>> streams_;  // guarded by streams_mutex_
  size_t live_stream_count_ = 0;                                             // guarded by streams_mutex_
};

}  // namespace strata
