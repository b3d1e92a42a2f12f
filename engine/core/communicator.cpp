#include "engine/core/communicator.h"

#include <string>

namespace strata {

std::string_view reduce_op_name(ReduceOp op) {
  switch (op) {
    case ReduceOp::kSum: return "sum";
    case ReduceOp::kMean: return "mean";
    case ReduceOp::kMax: return "max";
  }
  return "?";
}

std::string_view collective_kind_name(CollectiveKind kind) {
  switch (kind) {
    case CollectiveKind::kAllGather: return "all_gather";
    case CollectiveKind::kReduceScatter: return "reduce_scatter";
    case CollectiveKind::kAllReduce: return "all_reduce";
    case CollectiveKind::kBroadcast: return "broadcast";
    case CollectiveKind::kBarrier: return "barrier";
  }
  return "?";
}

StatusOr<DType> resolve_wire_dtype(DType data_dtype, const ReduceOptions& options) {
  if (options.op != ReduceOp::kSum && options.op != ReduceOp::kMean && options.op != ReduceOp::kMax)
    return InvalidArgumentError("reduce: unknown reduce op " + std::to_string(static_cast<int>(options.op)));
  if (!options.wire_dtype || *options.wire_dtype == data_dtype) return data_dtype;
  if (data_dtype == DType::kFloat32 && (*options.wire_dtype == DType::kBFloat16 || *options.wire_dtype == DType::kFloat16))
    return *options.wire_dtype;
  return InvalidArgumentError("reduce: " + std::string(dtype_name(data_dtype)) + " data cannot travel as " +
                              std::string(dtype_name(*options.wire_dtype)) +
                              ": the wire dtype must be the data dtype, or bf16/fp16 for fp32 data");
}

}  // namespace strata
