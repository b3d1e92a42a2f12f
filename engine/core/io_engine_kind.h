// Which I/O engine moves NVMe bytes, as strata.io_engine names it (offload/io_engine.h
// implements them).
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/core/status.h"

namespace strata {

// Which implementation of offload/io_engine.h moves NVMe bytes.
enum class IoEngineKind : uint8_t {
  kAuto,     // io_uring where the kernel allows it, else psync (logged once)
  kIoUring,  // io_uring or an error
  kPsync,    // the pread/pwrite thread pool
};
std::string_view io_engine_kind_name(IoEngineKind kind);  // "auto" | "io_uring" | "psync"
// Also accepts "uring" and "pread".
StatusOr<IoEngineKind> parse_io_engine_kind(std::string_view text);

}  // namespace strata
