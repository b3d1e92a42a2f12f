#include "engine/core/check.h"

#include <cstdio>
#include <cstdlib>

namespace strata::internal {

void check_failed(const char* what, const char* statement, const std::string& detail, const char* file, int line) {
  std::fprintf(stderr, "[strata F] %s failed: %s\n  statement: %s\n  %s\n", what, detail.c_str(), statement,
               source_location_context(file, line).c_str());
  std::fflush(stderr);
  std::abort();
}

Status syscall_error(int error_number, const char* statement, const char* file, int line) {
  return Status::FromErrno(error_number, statement).with_context(source_location_context(file, line));
}

}  // namespace strata::internal
