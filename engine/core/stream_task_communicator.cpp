#include "engine/core/stream_task_communicator.h"

#include <atomic>
#include <limits>
#include <memory>
#include <string>
#include <utility>

namespace strata {
namespace {

// Calls `dropped` when destroyed before `ran` is set: the stream threw the task away.
struct DropGuard {
  explicit DropGuard(std::function<void()> on_drop) : dropped(std::move(on_drop)) {}
  DropGuard(const DropGuard&) = delete;
  DropGuard& operator=(const DropGuard&) = delete;
  ~DropGuard() {
    if (!ran) dropped();
  }
  std::function<void()> dropped;
  std::atomic<bool> ran{false};
};

const std::byte* bytes_of(const void* p) { return static_cast<const std::byte*>(p); }
std::byte* bytes_of(void* p) { return static_cast<std::byte*>(p); }

}  // namespace

Status StreamTaskCommunicator::all_gather(const void* send, void* recv, size_t send_count, DType dtype, Stream& stream) {
  return enqueue({.kind = CollectiveKind::kAllGather, .dtype = dtype, .wire = dtype, .count = send_count, .send = bytes_of(send), .recv = bytes_of(recv)},
                 std::nullopt, stream);
}

Status StreamTaskCommunicator::reduce_scatter(const void* send, void* recv, size_t recv_count, DType dtype, const ReduceOptions& options,
                                              Stream& stream) {
  return enqueue({.kind = CollectiveKind::kReduceScatter, .dtype = dtype, .count = recv_count, .send = bytes_of(send), .recv = bytes_of(recv)},
                 options, stream);
}

Status StreamTaskCommunicator::all_reduce(const void* send, void* recv, size_t count, DType dtype, const ReduceOptions& options,
                                          Stream& stream) {
  return enqueue({.kind = CollectiveKind::kAllReduce, .dtype = dtype, .count = count, .send = bytes_of(send), .recv = bytes_of(recv)}, options,
                 stream);
}

Status StreamTaskCommunicator::broadcast(const void* send, void* recv, size_t count, DType dtype, int root, Stream& stream) {
  return enqueue(
      {.kind = CollectiveKind::kBroadcast, .dtype = dtype, .wire = dtype, .count = count, .root = root, .send = bytes_of(send), .recv = bytes_of(recv)},
      std::nullopt, stream);
}

Status StreamTaskCommunicator::barrier(Stream& stream) { return enqueue({.kind = CollectiveKind::kBarrier}, std::nullopt, stream); }

Status StreamTaskCommunicator::check_call(CollectiveCall& call, const std::optional<ReduceOptions>& reduce, Stream& stream) const {
  if (&stream.device() != &device_)
    return InvalidArgumentError("stream '" + stream.name() + "' belongs to " + stream.device().description() +
                                ", not to this rank's device " + device_.description());
  if (reduce) {
    STRATA_ASSIGN_OR_RETURN(call.wire, resolve_wire_dtype(call.dtype, *reduce));
    call.op = reduce->op;
  }
  const int world = world_size();
  if (call.kind == CollectiveKind::kBroadcast && (call.root < 0 || call.root >= world))
    return InvalidArgumentError("broadcast root " + std::to_string(call.root) + " is outside [0, " + std::to_string(world - 1) + "]");
  if (call.count > std::numeric_limits<size_t>::max() / dtype_size(call.dtype) / static_cast<size_t>(world))
    return InvalidArgumentError("count " + std::to_string(call.count) + " is too large");
  if (call.count > 0 && call.kind != CollectiveKind::kBarrier) {
    const bool needs_send = call.kind != CollectiveKind::kBroadcast || call.root == rank();
    if ((needs_send && call.send == nullptr) || call.recv == nullptr)
      return InvalidArgumentError(std::string(collective_kind_name(call.kind)) + " of " + std::to_string(call.count) + " " +
                                  std::string(dtype_name(call.dtype)) + " with a null " + (call.recv == nullptr ? "receive" : "send") + " buffer");
  }
  return {};
}

Status StreamTaskCommunicator::launch_guarded(Stream& stream, std::function<void()> dropped, std::function<Status(const LaunchContext&)> body) {
  auto guard = std::make_shared<DropGuard>(std::move(dropped));
  Status launched = stream.launch([guard, body = std::move(body)](const LaunchContext& context) -> Status {
    guard->ran = true;
    return body(context);
  });
  if (!launched.ok()) guard->ran = true;  // the caller reports it, with the reason
  return launched;
}

}  // namespace strata
