#include "engine/core/cuda_check.h"

namespace strata::internal {
namespace {
std::string current_device_text() {
  int device = -1;
  if (cudaGetDevice(&device) != cudaSuccess) {
    (void)cudaGetLastError();
    return "device ?";
  }
  return "device " + std::to_string(device);
}
}  // namespace

Status cuda_error(cudaError_t error, const char* statement, const char* file, int line) {
  std::string message = std::string(statement) + " failed on " + current_device_text() + ": " + cudaGetErrorString(error) +
                        " (" + cudaGetErrorName(error) + ")";
  const StatusCode code = error == cudaErrorMemoryAllocation ? StatusCode::kOutOfMemory : StatusCode::kInternal;
  return Status(code, std::move(message)).with_context(source_location_context(file, line));
}

Status cublas_error(cublasStatus_t error, const char* statement, const char* file, int line) {
  std::string message = std::string(statement) + " failed on " + current_device_text() + ": " + cublasGetStatusString(error) +
                        " (" + cublasGetStatusName(error) + ")";
  return Status(StatusCode::kInternal, std::move(message)).with_context(source_location_context(file, line));
}

Status nccl_error(ncclResult_t error, const char* statement, const char* file, int line) {
  std::string message = std::string(statement) + " failed on " + current_device_text() + ": " + ncclGetErrorString(error);
  if (const char* last = ncclGetLastError(nullptr); last != nullptr && *last != '\0') message += std::string(" (") + last + ")";
  return Status(StatusCode::kInternal, std::move(message)).with_context(source_location_context(file, line));
}

}  // namespace strata::internal
