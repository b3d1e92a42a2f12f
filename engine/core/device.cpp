#include "engine/core/device.h"

#include <utility>

namespace strata {

std::string_view matmul_precision_name(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::kFp32: return "fp32";
    case MatmulPrecision::kTf32: return "tf32";
    case MatmulPrecision::kBf16: return "bf16";
  }
  return "unknown";
}

std::string_view device_kind_name(DeviceKind kind) {
  switch (kind) {
    case DeviceKind::kCpu: return "cpu";
    case DeviceKind::kCuda: return "cuda";
  }
  return "?";
}

StatusOr<DeviceKind> parse_device_kind(std::string_view text) {
  if (text == "cpu") return DeviceKind::kCpu;
  if (text == "cuda" || text == "gpu") return DeviceKind::kCuda;
  return InvalidArgumentError("unknown device '" + std::string(text) + "': expected cpu or cuda");
}

std::string_view copy_kind_name(CopyKind kind) {
  switch (kind) {
    case CopyKind::kHostToDevice: return "host_to_device";
    case CopyKind::kDeviceToHost: return "device_to_host";
    case CopyKind::kDeviceToDevice: return "device_to_device";
    case CopyKind::kHostToHost: return "host_to_host";
  }
  return "?";
}

StatusOr<std::unique_ptr<Stream>> Device::adopt_stream(void* /*native_handle*/, std::string name) {
  return UnimplementedError(description() + " has no native streams to adopt ('" + name +
                            "'): its callers wait for its events on their own thread");
}

DeviceBuffer& DeviceBuffer::operator=(DeviceBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    device_ = std::exchange(other.device_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
  }
  return *this;
}

void DeviceBuffer::reset() noexcept {
  if (device_ != nullptr && data_ != nullptr) device_->free_buffer(data_, bytes_);
  device_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
}

}  // namespace strata
