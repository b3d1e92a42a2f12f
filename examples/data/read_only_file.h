// Opening a data file for reading, with the error a missing file deserves (internal to
// examples/data).
#pragma once

#include <cerrno>
#include <string>
#include <string_view>

#include "engine/core/file.h"

namespace strata::data::internal {

inline StatusOr<File> open_read_only(const std::string& path, std::string_view what) {
  StatusOr<File> file = File::open(path);
  if (!file.ok() && file.status().error_number() == ENOENT) {
    return NotFoundError(std::string(what) + " " + path + " does not exist");
  }
  return file;
}

}  // namespace strata::data::internal
