// Status and StatusOr: how library code reports failure.
//
// Library functions return Status (or StatusOr<T>) and never abort. Each level that
// propagates an error may add a line of context, so the final message reads as a
// trail from the failing call outwards:
//
//   nvme store: write of extent 17 failed: No space left on device (errno 28)
//     -> at offload/nvme_store.cpp:212 while writing group 3 master shard
//     -> at engine/swapper.cpp:88
#pragma once

#include <cerrno>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

namespace strata {

enum class StatusCode : uint8_t {
  kOk = 0,
  kInvalidArgument,   // a caller or a config gave a value that cannot work
  kNotFound,          // a file, key or tensor that should exist does not
  kAlreadyExists,     // e.g. a second live process on the same nvme_path
  kOutOfMemory,       // a budget (device, pinned) or the machine refused bytes
  kResourceExhausted, // disk full, queue full, locked-memory limit
  kFailedPrecondition,// the object is not in a state where the call can run
  kDataLoss,          // a checksum mismatch, a truncated file
  kUnavailable,       // a facility (GPU, io_uring, O_DIRECT) is not present
  kDeadlineExceeded,  // a rendezvous or wait timed out
  kIoError,           // a syscall failed for another reason
  kInternal,          // a broken invariant or a failed CUDA/NCCL/cuBLAS call
  kCancelled,         // work abandoned because an earlier stage failed
  kUnimplemented,     // a path the running build does not have
};

std::string_view status_code_name(StatusCode code);

class [[nodiscard]] Status {
 public:
  Status() = default;  // OK
  Status(StatusCode code, std::string message);

  static Status Ok() { return Status(); }
  // An error from errno, naming what was attempted: "open(/x/y): Permission denied (errno 13)".
  static Status FromErrno(int error_number, std::string_view what);

  bool ok() const { return code_ == StatusCode::kOk; }
  StatusCode code() const { return code_; }
  // The innermost message, without the trail.
  const std::string& message() const { return message_; }
  // Context lines added on the way out, innermost first.
  const std::vector<std::string>& trail() const { return trail_; }
  // The errno this status was made from, 0 when it did not come from a syscall.
  int error_number() const { return errno_; }

  // Adds a line of context; a no-op on OK.
  Status& with_context(std::string context) &;
  Status&& with_context(std::string context) &&;

  // "CODE: message\n  -> context\n  -> context".
  std::string to_string() const;

 private:
  StatusCode code_ = StatusCode::kOk;
  int errno_ = 0;
  std::string message_;
  std::vector<std::string> trail_;
};

// Convenience constructors.
Status InvalidArgumentError(std::string message);
Status NotFoundError(std::string message);
Status AlreadyExistsError(std::string message);
Status OutOfMemoryError(std::string message);
Status ResourceExhaustedError(std::string message);
Status FailedPreconditionError(std::string message);
Status DataLossError(std::string message);
Status UnavailableError(std::string message);
Status DeadlineExceededError(std::string message);
Status IoError(std::string message);
Status InternalError(std::string message);
Status CancelledError(std::string message);
Status UnimplementedError(std::string message);

// A value or the Status that explains why there is none.
template <class T>
class [[nodiscard]] StatusOr {
  static_assert(!std::is_same_v<std::remove_cvref_t<T>, Status>, "StatusOr<Status> is not allowed");

 public:
  StatusOr(Status status) : status_(std::move(status)) {  // NOLINT: implicit by design
    if (status_.ok()) status_ = InternalError("StatusOr constructed from an OK Status without a value");
  }
  StatusOr(T value) : value_(std::move(value)) {}  // NOLINT: implicit by design
  template <class U, std::enable_if_t<std::is_constructible_v<T, U&&> && !std::is_same_v<std::remove_cvref_t<U>, Status> &&
                                          !std::is_same_v<std::remove_cvref_t<U>, StatusOr<T>> && !std::is_same_v<std::remove_cvref_t<U>, T>,
                                      int> = 0>
  StatusOr(U&& value) : value_(T(std::forward<U>(value))) {}  // NOLINT

  bool ok() const { return value_.has_value(); }
  const Status& status() const& { return status_; }
  Status status() && { return std::move(status_); }

  T& value() & { return *value_; }
  const T& value() const& { return *value_; }
  T&& value() && { return std::move(*value_); }
  T* operator->() { return &*value_; }
  const T* operator->() const { return &*value_; }
  T& operator*() & { return *value_; }
  const T& operator*() const& { return *value_; }
  T&& operator*() && { return std::move(*value_); }

 private:
  Status status_;
  std::optional<T> value_;
};

namespace internal {
std::string source_location_context(const char* file, int line);
inline Status as_status(Status s) { return s; }
template <class T>
Status as_status(const StatusOr<T>& s) { return s.status(); }
}  // namespace internal

}  // namespace strata

#define STRATA_STATUS_CONCAT_INNER(a, b) a##b
#define STRATA_STATUS_CONCAT(a, b) STRATA_STATUS_CONCAT_INNER(a, b)

// Evaluates a Status expression; on error returns it from the enclosing function with
// the call site added to its trail.
#define STRATA_RETURN_IF_ERROR(expr)                                                             \
  do {                                                                                           \
    ::strata::Status strata_status_ = (expr);                                                    \
    if (!strata_status_.ok())                                                                    \
      return std::move(strata_status_).with_context(::strata::internal::source_location_context(__FILE__, __LINE__)); \
  } while (0)

// As above, adding a caller-supplied line of context (any expression yielding a string).
#define STRATA_RETURN_IF_ERROR_CTX(expr, context)                                                \
  do {                                                                                           \
    ::strata::Status strata_status_ = (expr);                                                    \
    if (!strata_status_.ok()) return std::move(strata_status_).with_context(context);            \
  } while (0)

// `STRATA_ASSIGN_OR_RETURN(auto x, f());` or `STRATA_ASSIGN_OR_RETURN(x, f());`
#define STRATA_ASSIGN_OR_RETURN(lhs, expr) \
  STRATA_ASSIGN_OR_RETURN_IMPL(STRATA_STATUS_CONCAT(strata_statusor_, __LINE__), lhs, expr)
#define STRATA_ASSIGN_OR_RETURN_IMPL(tmp, lhs, expr)                                              \
  auto tmp = (expr);                                                                             \
  if (!tmp.ok())                                                                                 \
    return std::move(tmp).status().with_context(::strata::internal::source_location_context(__FILE__, __LINE__)); \
  lhs = std::move(tmp).value()
