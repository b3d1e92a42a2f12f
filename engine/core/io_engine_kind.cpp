#include "engine/core/io_engine_kind.h"

#include <string>

namespace strata {

std::string_view io_engine_kind_name(IoEngineKind kind) {
  switch (kind) {
    case IoEngineKind::kAuto: return "auto";
    case IoEngineKind::kIoUring: return "io_uring";
    case IoEngineKind::kPsync: return "psync";
  }
  return "?";
}

StatusOr<IoEngineKind> parse_io_engine_kind(std::string_view text) {
  if (text == "auto") return IoEngineKind::kAuto;
  if (text == "io_uring" || text == "uring") return IoEngineKind::kIoUring;
  if (text == "psync" || text == "pread") return IoEngineKind::kPsync;
  return InvalidArgumentError("unknown I/O engine \"" + std::string(text) + "\": expected auto, io_uring or psync");
}

}  // namespace strata
