#include "engine/core/self_communicator.h"

#include <cstring>
#include <utility>

#include "engine/core/dtype.h"

#if defined(STRATA_HAVE_CUDA)
#include <cuda_runtime_api.h>

#include "engine/core/nccl_communicator.h"
#endif

namespace strata {

Status SelfCommunicator::check_usable(std::string_view what, Stream& stream) {
  if (&stream.device() != &device_) {
    return InvalidArgumentError("self communicator: " + std::string(what) + " on stream '" + stream.name() + "' of " +
                                stream.device().description() + ", not of its device " + device_.description());
  }
  std::lock_guard<std::mutex> lock(mutex_);
  if (!aborted_.empty()) return FailedPreconditionError("self communicator: " + std::string(what) + " after abort: " + aborted_);
  return {};
}

Status SelfCommunicator::copy(const void* send, void* recv, size_t bytes, Stream& stream) {
  if (send == recv || bytes == 0) return {};
  return device_.copy_async(recv, send, bytes, CopyKind::kDeviceToDevice, stream);
}

Status SelfCommunicator::reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options,
                                Stream& stream, std::string_view what) {
  STRATA_RETURN_IF_ERROR(check_usable(what, stream));
  STRATA_ASSIGN_OR_RETURN(const DType wire, resolve_wire_dtype(dtype, options));
  // Sum, mean and max over one rank are the value itself (the mean divides by 1).
  if (wire == dtype) return copy(send, recv, count * dtype_size(dtype), stream);
  // fp32 data on a 16-bit wire: the value as it travelled (resolve_wire_dtype allows no other mix).
  const auto* src = static_cast<const float*>(send);
  auto* dst = static_cast<float*>(recv);
  return stream.launch([src, dst, wire, count](const LaunchContext& ctx) -> Status {
#if defined(STRATA_HAVE_CUDA)
    if (ctx.native_stream != nullptr) {
      return nccl_communicator_internal::launch_round_through_wire(src, dst, wire, count,
                                                                   static_cast<cudaStream_t>(ctx.native_stream));
    }
#else
    (void)ctx;
#endif
    for (size_t i = 0; i < count; ++i) {
      dst[i] = wire == DType::kBFloat16 ? bf16_bits_to_float(float_to_bf16_bits(src[i]))
                                        : fp16_bits_to_float(float_to_fp16_bits(src[i]));
    }
    return {};
  });
}

Status SelfCommunicator::all_gather(const void* send, void* recv, size_t send_count, DType dtype, Stream& stream) {
  STRATA_RETURN_IF_ERROR(check_usable("all_gather", stream));
  return copy(send, recv, send_count * dtype_size(dtype), stream);
}

Status SelfCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                        const ReduceOptions& options, Stream& stream) {
  return reduce(send, recv, recv_count, dtype, options, stream, "reduce_scatter");
}

Status SelfCommunicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options,
                                    Stream& stream) {
  return reduce(send, recv, count, dtype, options, stream, "all_reduce");
}

Status SelfCommunicator::broadcast(const void* send, void* recv, size_t count, DType dtype, int root, Stream& stream) {
  if (root != 0) return InvalidArgumentError("self communicator: broadcast from root " + std::to_string(root) + " in a world of 1");
  STRATA_RETURN_IF_ERROR(check_usable("broadcast", stream));
  return copy(send, recv, count * dtype_size(dtype), stream);
}

Status SelfCommunicator::barrier(Stream& stream) { return check_usable("barrier", stream); }

void SelfCommunicator::abort(std::string_view reason) {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.empty()) aborted_ = reason.empty() ? std::string("aborted") : std::string(reason);
}

Status SelfCommunicator::async_error() {
  std::lock_guard<std::mutex> lock(mutex_);
  if (aborted_.empty()) return {};
  return CancelledError("self communicator aborted: " + aborted_);
}

}  // namespace strata
