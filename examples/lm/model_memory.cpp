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

}  // namespace strata::lm
