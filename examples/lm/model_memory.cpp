#include "examples/lm/model_memory.h"

#include <algorithm>
#include <bit>
#include <iomanip>
#include <sstream>

namespace strata::lm {

size_t device_reservation(size_t bytes, DeviceKind kind) {
  if (bytes == 0) return 0;
  if (kind == DeviceKind::kCpu) return round_up(bytes, bytes >= (size_t{1} << 20) ? 4096 : 256);
  constexpr size_t kMinBlock = 512;
  constexpr size_t kMaxGranule = size_t{2} << 20;
  if (bytes <= kMinBlock) return kMinBlock;
  const size_t granule = std::clamp(std::bit_floor(bytes) / 8, kMinBlock, kMaxGranule);
  return round_up(bytes, granule);
}

DType compute_dtype_for(DType param_dtype, DeviceKind device) {
  return device == DeviceKind::kCuda && param_dtype == DType::kBFloat16 ? DType::kBFloat16 : DType::kFloat32;
}

std::string bytes_text(size_t bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (bytes >= (size_t{1} << 30)) out << double(bytes) / double(size_t{1} << 30) << " GiB";
  else if (bytes >= (size_t{1} << 20)) out << double(bytes) / double(size_t{1} << 20) << " MiB";
  else if (bytes >= 1024) out << double(bytes) / 1024.0 << " KiB";
  else out << bytes << " B";
  return out.str();
}

Status copy_gradient_to_host(Engine& engine, int group, const GroupView& grads, std::vector<float>& out) {
  const size_t numel = engine.layout(group).numel;
  out.assign(numel, 0.0f);
  STRATA_RETURN_IF_ERROR(engine.device().copy_async(out.data(), grads.flat, numel * 4, CopyKind::kDeviceToHost, engine.compute_stream()));
  return engine.compute_stream().synchronize();
}

StatusOr<ModelBlas> create_model_blas(Device& device) {
  ModelBlas blas;
  kernels::BlasOptions blocks_options;
  blocks_options.cuda_workspace_bytes = kCudaBlasWorkspaceBytes;  // precision: the device's
  StatusOr<kernels::BlasContext> blocks = kernels::BlasContext::create(device, blocks_options);
  if (!blocks.ok()) return std::move(blocks).status().with_context("creating the model's BLAS handle");
  blas.blocks = std::make_unique<kernels::BlasContext>(*std::move(blocks));
  kernels::BlasOptions head_options;
  head_options.cuda_workspace_bytes = kCudaHeadBlasWorkspaceBytes;
  head_options.matmul_precision = MatmulPrecision::kFp32;
  StatusOr<kernels::BlasContext> head = kernels::BlasContext::create(device, head_options);
  if (!head.ok()) return std::move(head).status().with_context("creating the vocabulary head's BLAS handle");
  blas.head = std::make_unique<kernels::BlasContext>(*std::move(head));
  return blas;
}

size_t model_blas_device_bytes(DeviceKind device, std::vector<std::pair<std::string, size_t>>& lines) {
  if (device != DeviceKind::kCuda) return 0;
  lines.emplace_back("cuBLAS workspace", kCudaBlasWorkspaceBytes);
  lines.emplace_back("cuBLAS workspace (vocabulary head, IEEE fp32)", kCudaHeadBlasWorkspaceBytes);
  return device_reservation(kCudaBlasWorkspaceBytes, device) + device_reservation(kCudaHeadBlasWorkspaceBytes, device);
}

}  // namespace strata::lm
