#include "python/src/stream_join.h"

#include <string>
#include <utility>

namespace strata::python {

Status StreamJoin::use(Device& device, uintptr_t native_handle) {
  if (caller_ != nullptr && handle_ == native_handle) return {};
  // The new wrapper first: a refused handle leaves the old join in place.
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> caller,
                          device.adopt_stream(reinterpret_cast<void*>(native_handle), "caller stream"));
  if (join_ == nullptr) {
    STRATA_ASSIGN_OR_RETURN(join_, device.create_event());
  }
  caller_ = std::move(caller);
  handle_ = native_handle;
  return {};
}

Status StreamJoin::check_joined(std::string_view call) const {
  if (caller_ != nullptr) return {};
  return FailedPreconditionError(std::string(call) + " on a device with streams before the caller's stream was given (use_caller_stream)");
}

Status StreamJoin::caller_after_engine(Stream& engine, std::string_view call) {
  STRATA_RETURN_IF_ERROR(check_joined(call));
  STRATA_RETURN_IF_ERROR(engine.record(*join_).with_context(std::string(call) + ": marking the engine's stream"));
  return caller_->wait(*join_).with_context(std::string(call) + ": the caller's stream waiting for the engine's");
}

Status StreamJoin::engine_after_caller(Stream& engine, std::string_view call) {
  STRATA_RETURN_IF_ERROR(check_joined(call));
  STRATA_RETURN_IF_ERROR(caller_->record(*join_).with_context(std::string(call) + ": marking the caller's stream"));
  return engine.wait(*join_).with_context(std::string(call) + ": the engine's stream waiting for the caller's");
}

}  // namespace strata::python
