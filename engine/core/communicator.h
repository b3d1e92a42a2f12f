// Communicator: the collectives data-parallel ranks run over their device buffers.
//
// Each rank owns one Communicator bound to its Device. Every operation is enqueued on
// a Stream of that device and runs in that stream's order, asynchronously: the call
// returns once the operation is enqueued (errors found then — bad arguments, an
// aborted group — are returned at once), and errors that happen while it runs (a
// peer that never arrives, an abort) are reported by the stream's next synchronize()
// and by async_error(). Buffers must stay valid and unmodified until the operation
// has completed in stream order (record an Event after it). This is NCCL's model, and
// NcclCommunicator is a thin layer over NCCL; HostCommunicator implements the same
// semantics for CPU-device ranks that are threads of one process, GlooCommunicator
// (engine/core/gloo_communicator.h) for CPU-device ranks that are processes.
//
// Every rank must issue the same collectives, with the same counts, dtypes and
// options, in the same order (across all streams it uses for them).
//
// Counts are elements, as in NCCL: all_gather takes the count each rank sends,
// reduce_scatter the count each rank receives.
//
// ## Reductions (sum, mean, max), exactly
// Let x_r be rank r's input element, w(x) its value "on the wire", and N the world size.
//   w(x) = x widened to fp32 when the wire dtype is the data dtype;
//        = fp32(round_to_nearest_even(x, wire)) when fp32 data travels as bf16/fp16.
//   sum:  s = ((w(x_0) + w(x_1)) + w(x_2)) + ... + w(x_{N-1}), each + in fp32.
//   mean: s / N in fp32 (one division, after the sum).
//   max:  the largest w(x_r); a NaN anywhere gives NaN.
// The result is rounded once to the data dtype (a no-op for fp32: fp32 data reduced
// with a bf16 wire gives fp32 results that need not be representable in bf16).
// HostCommunicator follows these formulas for every dtype, so its results are
// bit-identical run to run; GlooCommunicator gives the same bits as HostCommunicator. NcclCommunicator follows them, with the same bits, for
// 16-bit data, for a 16-bit wire and for max; for fp32 sum/mean with an fp32 wire it
// uses NCCL's native reduction, whose summation order is NCCL's own (deterministic
// for a fixed topology and NCCL version, but not rank order), with mean as that sum
// divided by N.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>
#include <string>
#include <string_view>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"

namespace strata {

enum class ReduceOp : uint8_t {
  kSum,   // rank-ordered fp32 sum (see above)
  kMean,  // the sum divided by the world size
  kMax,   // NaN-propagating maximum
};
std::string_view reduce_op_name(ReduceOp op);  // "sum" | "mean" | "max"

struct ReduceOptions {
  ReduceOp op = ReduceOp::kSum;
  // The element type that travels between ranks; nullopt = the data dtype. fp32 data
  // may travel as kBFloat16 or kFloat16 (half the bytes; each input is rounded to it
  // before the sum). Any other combination is an InvalidArgument error.
  std::optional<DType> wire_dtype;
};

// The wire dtype `options` gives for `data_dtype`, or InvalidArgument naming both.
StatusOr<DType> resolve_wire_dtype(DType data_dtype, const ReduceOptions& options);

enum class CollectiveKind : uint8_t { kAllGather, kReduceScatter, kAllReduce, kBroadcast, kBarrier };
std::string_view collective_kind_name(CollectiveKind kind);  // "all_gather", "reduce_scatter", ...

class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int world_size() const = 0;
  // The device whose buffers and streams this rank's operations use.
  virtual Device& device() = 0;
  // "host", "gloo" or "nccl".
  virtual std::string_view backend_name() const = 0;

  // recv[r * send_count + i] = send of rank r [i], for every rank r and i < send_count.
  // `recv` holds world_size() * send_count elements. In place when
  // send == recv + rank() * send_count (in elements).
  virtual Status all_gather(const void* send, void* recv, size_t send_count, DType dtype, Stream& stream) = 0;

  // recv[i] = reduce over ranks r of (send of rank r)[rank() * recv_count + i], for
  // i < recv_count. `send` holds world_size() * recv_count elements. In place when
  // recv == send + rank() * recv_count (in elements).
  virtual Status reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype,
                                const ReduceOptions& options, Stream& stream) = 0;

  // recv[i] = reduce over ranks r of (send of rank r)[i], for i < count. send == recv
  // is allowed (in place).
  virtual Status all_reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options,
                            Stream& stream) = 0;

  // recv[i] = (send of rank `root`)[i], for i < count. `send` is read on the root only
  // (others may pass nullptr); on the root send == recv is allowed.
  virtual Status broadcast(const void* send, void* recv, size_t count, DType dtype, int root, Stream& stream) = 0;

  // Completes, in stream order, once every rank's barrier has been reached.
  virtual Status barrier(Stream& stream) = 0;

  // Fails this rank's pending and later operations with `reason` (HostCommunicator:
  // those of every rank in the group, which is then unusable; NcclCommunicator: aborts
  // the NCCL communicator, so that peers stuck in a collective with it fail too).
  virtual void abort(std::string_view reason) = 0;

  // The first asynchronous failure so far (a timeout, an abort, a peer that left, an
  // NCCL asynchronous error); OK when there is none. Does not block.
  virtual Status async_error() = 0;
};

}  // namespace strata
