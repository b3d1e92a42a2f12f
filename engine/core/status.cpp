#include "engine/core/status.h"

#include <algorithm>
#include <cstring>

namespace strata {

std::string_view status_code_name(StatusCode code) {
  switch (code) {
    case StatusCode::kOk: return "OK";
    case StatusCode::kInvalidArgument: return "INVALID_ARGUMENT";
    case StatusCode::kNotFound: return "NOT_FOUND";
    case StatusCode::kAlreadyExists: return "ALREADY_EXISTS";
    case StatusCode::kOutOfMemory: return "OUT_OF_MEMORY";
    case StatusCode::kResourceExhausted: return "RESOURCE_EXHAUSTED";
    case StatusCode::kFailedPrecondition: return "FAILED_PRECONDITION";
    case StatusCode::kDataLoss: return "DATA_LOSS";
    case StatusCode::kUnavailable: return "UNAVAILABLE";
    case StatusCode::kDeadlineExceeded: return "DEADLINE_EXCEEDED";
    case StatusCode::kIoError: return "IO_ERROR";
    case StatusCode::kInternal: return "INTERNAL";
    case StatusCode::kCancelled: return "CANCELLED";
    case StatusCode::kUnimplemented: return "UNIMPLEMENTED";
  }
  return "UNKNOWN";
}

Status::Status(StatusCode code, std::string message) : code_(code), message_(std::move(message)) {}

Status Status::FromErrno(int error_number, std::string_view what) {
  StatusCode code = StatusCode::kIoError;
  switch (error_number) {
    case ENOSPC:
    case EDQUOT:
    case EFBIG:
    case EMFILE:
    case ENFILE:
    case EAGAIN: code = StatusCode::kResourceExhausted; break;
    case ENOMEM: code = StatusCode::kOutOfMemory; break;
    case ENOENT: code = StatusCode::kNotFound; break;
    case EEXIST: code = StatusCode::kAlreadyExists; break;
    case EINVAL: code = StatusCode::kInvalidArgument; break;
    case ENOSYS:
    case EOPNOTSUPP: code = StatusCode::kUnavailable; break;
    case ETIMEDOUT: code = StatusCode::kDeadlineExceeded; break;
    case ECANCELED: code = StatusCode::kCancelled; break;
    default: break;
  }
  char buffer[256];
  // GNU strerror_r returns the message pointer (which may or may not be `buffer`).
  const char* text = strerror_r(error_number, buffer, sizeof(buffer));
  Status status(code, std::string(what) + ": " + text + " (errno " + std::to_string(error_number) + ")");
  status.errno_ = error_number;
  return status;
}

Status& Status::with_context(std::string context) & {
  if (!ok() && !context.empty()) trail_.push_back(std::move(context));
  return *this;
}

Status&& Status::with_context(std::string context) && {
  if (!ok() && !context.empty()) trail_.push_back(std::move(context));
  return std::move(*this);
}

std::string Status::to_string() const {
  if (ok()) return "OK";
  std::string out(status_code_name(code_));
  out += ": ";
  out += message_;
  for (const auto& line : trail_) {
    out += "\n  -> ";
    out += line;
  }
  return out;
}

Status InvalidArgumentError(std::string m) { return Status(StatusCode::kInvalidArgument, std::move(m)); }
Status NotFoundError(std::string m) { return Status(StatusCode::kNotFound, std::move(m)); }
Status AlreadyExistsError(std::string m) { return Status(StatusCode::kAlreadyExists, std::move(m)); }
Status OutOfMemoryError(std::string m) { return Status(StatusCode::kOutOfMemory, std::move(m)); }
Status ResourceExhaustedError(std::string m) { return Status(StatusCode::kResourceExhausted, std::move(m)); }
Status FailedPreconditionError(std::string m) { return Status(StatusCode::kFailedPrecondition, std::move(m)); }
Status DataLossError(std::string m) { return Status(StatusCode::kDataLoss, std::move(m)); }
Status UnavailableError(std::string m) { return Status(StatusCode::kUnavailable, std::move(m)); }
Status DeadlineExceededError(std::string m) { return Status(StatusCode::kDeadlineExceeded, std::move(m)); }
Status IoError(std::string m) { return Status(StatusCode::kIoError, std::move(m)); }
Status InternalError(std::string m) { return Status(StatusCode::kInternal, std::move(m)); }
Status CancelledError(std::string m) { return Status(StatusCode::kCancelled, std::move(m)); }
Status UnimplementedError(std::string m) { return Status(StatusCode::kUnimplemented, std::move(m)); }

namespace internal {
std::string source_location_context(const char* file, int line) {
  // The build maps the source root away (-fmacro-prefix-map); for other builds, cut the
  // path at the leftmost top-level project folder.
  std::string_view path(file);
  size_t cut = std::string_view::npos;
  for (std::string_view root : {"/engine/", "/offload/", "/optim/", "/kernels/", "/examples/", "/tests/"}) {
    cut = std::min(cut, path.find(root));
  }
  if (!path.empty() && path.front() == '/' && cut != std::string_view::npos) path.remove_prefix(cut + 1);
  return "at " + std::string(path) + ":" + std::to_string(line);
}
}  // namespace internal

}  // namespace strata
