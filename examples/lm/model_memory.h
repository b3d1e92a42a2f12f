// Helpers every model family shares for planning and inspecting its device memory: what
// the device's allocator reserves for a request (so a plan's declared bytes equal what
// the budget is charged), the compute dtype for a parameter dtype, byte counts as text,
// and copying a group's full gradient to the host for tests.
#pragma once

#include <cstddef>
#include <memory>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "engine/engine.h"
#include "kernels/blas_context.h"

namespace strata::lm {

// Sub-buffers of a model's one device buffer start on this boundary.
inline constexpr size_t kSubBufferAlignment = 256;
// cuBLAS's workspace, out of the device budget: 32 MiB, NVIDIA's advice for Hopper (with
// 4 MiB cuBLAS falls back to slower kernels for the large GEMMs of GPT-2 XL and Llama-1B).
inline constexpr size_t kCudaBlasWorkspaceBytes = size_t{32} << 20;
// The vocabulary head's own handle needs little: its GEMMs are plain and few per chunk.
inline constexpr size_t kCudaHeadBlasWorkspaceBytes = size_t{4} << 20;

// A model's two BLAS handles. `blocks` computes the transformer blocks' fp32 GEMMs the way
// the device's matmul_precision() says (strata.matmul_precision). `head` serves the
// vocabulary head (lm::VocabHead), always in IEEE fp32: its chunked log-sum-exp combine
// transposes by a product with an identity, which is exact only without TF32/bf16 inputs.
struct ModelBlas {
  std::unique_ptr<kernels::BlasContext> blocks;
  std::unique_ptr<kernels::BlasContext> head;
};
StatusOr<ModelBlas> create_model_blas(Device& device);
// The device bytes create_model_blas takes (CUDA: both workspaces, as the allocator
// reserves them; CPU: none), with one line per workspace added to `lines`.
size_t model_blas_device_bytes(DeviceKind device, std::vector<std::pair<std::string, size_t>>& lines);

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
