// The caller's compute stream joined with the engine's, for a front end whose model
// computes on a device with native streams (PyTorch on CUDA). The caller hands over its
// current stream's native handle; gathered parameters and gradient buffers are valid in
// the engine's compute-stream order, so:
//   - before the caller reads what gather() or gradient_buffer() returned, its stream
//     waits for the engine's compute stream (caller_after_engine);
//   - before release() or grads_ready(), the engine's compute stream waits for the
//     caller's (engine_after_caller), so a buffer is neither reused nor reduced while the
//     caller's kernels still read or write it.
// Each join is an event recorded on one stream and waited on by the other: nothing
// blocks the host, and nothing synchronizes the device.
#pragma once

#include <cstdint>
#include <memory>
#include <string_view>

#include "engine/core/device.h"
#include "engine/core/status.h"

namespace strata::python {

class StreamJoin {
 public:
  StreamJoin() = default;
  StreamJoin(StreamJoin&&) = default;
  StreamJoin& operator=(StreamJoin&&) = default;

  // The caller's stream from now on: `native_handle` is its cudaStream_t (0: the legacy
  // default stream). A handle already in use is kept; another replaces it (the old
  // stream is left to its owner: nothing of the front end's runs on it but events).
  Status use(Device& device, uintptr_t native_handle);
  bool joined() const { return caller_ != nullptr; }

  Status caller_after_engine(Stream& engine, std::string_view call);
  Status engine_after_caller(Stream& engine, std::string_view call);

 private:
  Status check_joined(std::string_view call) const;

  std::unique_ptr<Stream> caller_;
  uintptr_t handle_ = 0;
  std::unique_ptr<Event> join_;  // re-recorded for every join: a wait takes the record current at its call
};

}  // namespace strata::python
