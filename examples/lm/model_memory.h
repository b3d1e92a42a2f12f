// Helpers every model family shares for planning and inspecting its device memory: what
// the device's allocator reserves for a request (so a plan's declared bytes equal what
// the budget is charged), the compute dtype for a parameter dtype, byte counts as text,
// and copying a group's full gradient to the host for tests.
#pragma once

#include <cstddef>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/engine.h"

namespace strata::lm {

// Sub-buffers of a model's one device buffer start on this boundary.
inline constexpr size_t kSubBufferAlignment = 256;
// cuBLAS's workspace, out of the device budget: 32 MiB, NVIDIA's advice for Hopper (with
// 4 MiB cuBLAS falls back to slower kernels for the large GEMMs of GPT-2 XL and Llama-1B).
inline constexpr size_t kCudaBlasWorkspaceBytes = size_t{32} << 20;

inline size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

// What the device's allocator reserves for a request of `bytes` (CpuDevice: 256-byte
// granules, 4 KiB from 1 MiB up; CudaDevice: its caching allocator's block sizes).
size_t device_reservation(size_t bytes, DeviceKind kind);

// The dtype activations are computed in: bf16 on a CudaDevice with bf16 parameters, else fp32.
DType compute_dtype_for(DType param_dtype, DeviceKind device);

// "1.5 GiB", "12.0 MiB", "3.0 KiB", "17 B".
std::string bytes_text(size_t bytes);

// Tests: group `group`'s full fp32 gradient (`grads.flat`, layout(group).numel floats)
// copied into `out` after the compute stream's work so far (synchronizes the stream).
Status copy_gradient_to_host(Engine& engine, int group, const GroupView& grads, std::vector<float>& out);

}  // namespace strata::lm
