// One check-macro family for CUDA, cuBLAS, NCCL and syscalls.
//
// Library code uses the STRATA_RETURN_IF_* forms, which turn a failed call into a
// Status naming the statement, the device, the file and the line. Programs and tests
// may use STRATA_CHECK / STRATA_CHECK_OK, which report through one cold [[noreturn]]
// function and abort.
//
// The CUDA, cuBLAS and NCCL forms live in engine/core/cuda_check.h so that this header
// never pulls in CUDA headers.
#pragma once

#include <cerrno>

#include "engine/core/status.h"

namespace strata::internal {

// Prints "<what> failed: <detail>\n  statement: <stmt>\n  at file:line" and aborts.
[[noreturn]] [[gnu::cold]] void check_failed(const char* what, const char* statement, const std::string& detail,
                                             const char* file, int line);

// Builds the Status for a failed syscall: "<statement>: <strerror> (errno N)" with the call site.
[[gnu::cold]] Status syscall_error(int error_number, const char* statement, const char* file, int line);

}  // namespace strata::internal

// Aborts unless `condition` holds. For programs, tests and broken invariants only.
#define STRATA_CHECK(condition)                                                                   \
  do {                                                                                            \
    if (!(condition)) [[unlikely]]                                                                \
      ::strata::internal::check_failed("check", #condition, "condition is false", __FILE__, __LINE__); \
  } while (0)

// Aborts with the status text unless `expr` (a Status or StatusOr) is OK. Programs and tests only.
#define STRATA_CHECK_OK(expr)                                                                     \
  do {                                                                                            \
    const ::strata::Status strata_check_status_ = ::strata::internal::as_status(expr);            \
    if (!strata_check_status_.ok()) [[unlikely]]                                                  \
      ::strata::internal::check_failed("status check", #expr, strata_check_status_.to_string(), __FILE__, __LINE__); \
  } while (0)

// Runs a syscall-style expression that returns -1 and sets errno on failure, retrying
// EINTR; on failure returns the errno Status from the enclosing function. The result is
// assigned to `result_var` (declare it first).
#define STRATA_SYSCALL(result_var, expr)                                                          \
  do {                                                                                            \
    do {                                                                                          \
      result_var = (expr);                                                                        \
    } while (result_var == -1 && errno == EINTR);                                                 \
    if (result_var == -1) [[unlikely]]                                                            \
      return ::strata::internal::syscall_error(errno, #expr, __FILE__, __LINE__);                 \
  } while (0)

// As STRATA_SYSCALL for calls (liburing, pthread_*) that return a negative errno or a
// positive error number instead of setting errno: non-zero `expr` < 0 is -errno.
#define STRATA_SYSCALL_NEGERRNO(result_var, expr)                                                 \
  do {                                                                                            \
    do {                                                                                          \
      result_var = (expr);                                                                        \
    } while (result_var == -EINTR);                                                               \
    if (result_var < 0) [[unlikely]]                                                              \
      return ::strata::internal::syscall_error(-result_var, #expr, __FILE__, __LINE__);           \
  } while (0)
