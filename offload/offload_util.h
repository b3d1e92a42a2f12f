// Small helpers shared by the offload tier implementations; internal to offload/.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

namespace strata::offload_internal {

// "3145728 bytes (3.0 MiB)".
std::string format_bytes(uint64_t bytes);

// Rounds `value` up to a multiple of `alignment` (a power of two).
constexpr size_t round_up(size_t value, size_t alignment) { return (value + alignment - 1) & ~(alignment - 1); }
// Whether `value` is a multiple of `alignment` (a power of two).
constexpr bool is_aligned(size_t value, size_t alignment) { return (value & (alignment - 1)) == 0; }

}  // namespace strata::offload_internal
