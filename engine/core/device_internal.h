// Helpers shared by the device implementations (CpuDevice, CudaDevice); not part of the
// public device interface.
#pragma once

#include <cstddef>
#include <string>
#include <string_view>

#include "engine/core/device.h"
#include "engine/core/status.h"

namespace strata::internal {

// "3145728 bytes (3.0 MiB)".
std::string format_bytes(size_t bytes);

// The error for an allocation the budget refuses: names the device, the request (bytes
// and purpose), the budget, the bytes in use and reserved, and the high-water mark.
Status budget_exceeded_error(std::string_view device_name, size_t requested_bytes, std::string_view purpose,
                             const MemoryStats& stats);

// Rounds `value` up to a multiple of `alignment` (a power of two).
constexpr size_t round_up(size_t value, size_t alignment) { return (value + alignment - 1) & ~(alignment - 1); }

}  // namespace strata::internal
