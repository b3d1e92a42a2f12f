#include "engine/core/host_communicator.h"

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdio>
#include <cstring>
#include <limits>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/collective_text.h"
#include "engine/core/log.h"
#include "engine/core/rank_order_reduction.h"

namespace strata {
namespace host_communicator_internal {

// One rank's view of one collective.
using Arrival = CollectiveCall;

// One collective as the whole group sees it, keyed by sequence number.
struct Slot {
  explicit Slot(int world_size)
      : arrivals(static_cast<size_t>(world_size)), streams(static_cast<size_t>(world_size), nullptr) {}
  std::vector<std::optional<Arrival>> arrivals;
  std::vector<const Stream*> streams;  // where each rank enqueued it (set at enqueue time), for deadlock detection
  int arrived = 0;   // ranks whose arrival is recorded
  int reduced = 0;   // all_reduce: ranks that finished reducing their slice
  int finished = 0;  // ranks that finished reading the others' buffers
  int left = 0;      // ranks done with the slot; the last one erases it
};

struct GroupState {
  explicit GroupState(const HostCommunicatorOptions& options)
      : world_size(options.world_size),
        timeout(options.timeout),
        handed_out(static_cast<size_t>(options.world_size), false),
        issued_when_gone(static_cast<size_t>(options.world_size), kStillHere) {}

  static constexpr uint64_t kStillHere = std::numeric_limits<uint64_t>::max();

  const int world_size;
  const std::chrono::milliseconds timeout;

  std::mutex mutex;
  std::condition_variable changed;       // any field below changed
  Status aborted;                        // guarded by mutex; the first reason the group failed
  std::vector<bool> handed_out;          // guarded by mutex
  std::vector<uint64_t> issued_when_gone;// guarded by mutex; collectives a destroyed rank had issued
  std::map<uint64_t, Slot> slots;        // guarded by mutex

  void abort_locked(Status reason) {
    if (aborted.ok()) {
      STRATA_LOG(kDebug) << "host communicator group aborted: " << reason.message();
      aborted = std::move(reason);
    }
    changed.notify_all();
  }
};

}  // namespace host_communicator_internal

using host_communicator_internal::Arrival;
using host_communicator_internal::GroupState;
using host_communicator_internal::Slot;

namespace {

std::string call_text(const Arrival& call) {
  std::string text = std::string(collective_kind_name(call.kind));
  if (call.kind == CollectiveKind::kBarrier) return text + "()";
  text += "(count " + std::to_string(call.count) + ", " + std::string(dtype_name(call.dtype));
  if (call.kind == CollectiveKind::kReduceScatter || call.kind == CollectiveKind::kAllReduce) {
    text += ", " + std::string(reduce_op_name(call.op));
    if (call.wire != call.dtype) text += ", wire " + std::string(dtype_name(call.wire));
  }
  if (call.kind == CollectiveKind::kBroadcast) text += ", root " + std::to_string(call.root);
  return text + ")";
}

bool same_collective(const Arrival& a, const Arrival& b) {
  if (a.kind != b.kind || a.dtype != b.dtype || a.count != b.count) return false;
  if (a.kind == CollectiveKind::kReduceScatter || a.kind == CollectiveKind::kAllReduce)
    if (a.op != b.op || a.wire != b.wire) return false;
  if (a.kind == CollectiveKind::kBroadcast && a.root != b.root) return false;
  return true;
}

std::string op_text(const Arrival& call, uint64_t sequence) {
  return std::string(collective_kind_name(call.kind)) + " #" + std::to_string(sequence);
}

Status aborted_error(const Status& reason, const std::string& what, int rank) {
  return Status(reason.code(), "host communicator: " + what + " on rank " + std::to_string(rank) +
                                   " failed because the group was aborted: " + reason.message());
}

void copy_bytes(std::byte* dst, const std::byte* src, size_t bytes) {
  if (bytes != 0 && dst != src) std::memcpy(dst, src, bytes);
}

// ---------------------------------------------------------------------------
// One collective on one rank, run in stream order on the rank's stream worker.
// ---------------------------------------------------------------------------

// Records this rank's arrival at `slot` (lock held), after checking that the ranks already
// there issued the same collective.
Status record_arrival(GroupState& group, Slot& slot, int rank, uint64_t sequence, const Arrival& mine) {
  for (int other = 0; other < group.world_size; ++other) {
    const std::optional<Arrival>& theirs = slot.arrivals[static_cast<size_t>(other)];
    if (theirs && !same_collective(*theirs, mine)) {
      Status mismatch = FailedPreconditionError(
          "host communicator: ranks disagree at collective #" + std::to_string(sequence) + ": rank " +
          std::to_string(other) + " issued " + call_text(*theirs) + " but rank " + std::to_string(rank) + " issued " +
          call_text(mine) + "; every rank must issue the same collectives in the same order");
      group.abort_locked(mismatch);
      return mismatch;
    }
  }
  slot.arrivals[static_cast<size_t>(rank)] = mine;
  ++slot.arrived;
  group.changed.notify_all();
  return Status::Ok();
}

// Waits (lock held) for the other ranks to arrive at `slot`, as long as they can still
// come: not when the group is aborted, another rank's task sits behind this one on the
// same stream, a missing rank's communicator is gone, or the timeout passes.
Status wait_for_arrivals(GroupState& group, Slot& slot, int rank, uint64_t sequence, const Arrival& mine, const std::string& what,
                         std::unique_lock<std::mutex>& lock) {
  const int world = group.world_size;
  const auto deadline = std::chrono::steady_clock::now() + group.timeout;
  const auto gone_missing_rank = [&]() -> int {
    for (int other = 0; other < world; ++other)
      if (!slot.arrivals[static_cast<size_t>(other)] && group.issued_when_gone[static_cast<size_t>(other)] <= sequence)
        return other;
    return -1;
  };
  while (slot.arrived < world) {
    if (!group.aborted.ok()) return aborted_error(group.aborted, what, rank);
    for (int other = 0; other < world; ++other) {
      if (slot.arrivals[static_cast<size_t>(other)] || slot.streams[static_cast<size_t>(other)] == nullptr ||
          slot.streams[static_cast<size_t>(other)] != slot.streams[static_cast<size_t>(rank)])
        continue;
      // Its task is queued behind this one on the same stream: it could never arrive.
      Status shared = FailedPreconditionError(
          "host communicator: ranks " + std::to_string(rank) + " and " + std::to_string(other) + " enqueued " + what +
          " on the same stream '" + slot.streams[static_cast<size_t>(rank)]->name() +
          "'; each rank needs a stream of its own, or the first would wait forever for the second");
      group.abort_locked(shared);
      return shared;
    }
    if (const int gone = gone_missing_rank(); gone >= 0) {
      Status left = UnavailableError(
          "host communicator: " + what + " cannot complete: rank " + std::to_string(gone) +
          "'s communicator was destroyed after it had issued " +
          std::to_string(group.issued_when_gone[static_cast<size_t>(gone)]) + " collectives (did that rank fail?)");
      group.abort_locked(left);
      return left;
    }
    if (group.changed.wait_until(lock, deadline) == std::cv_status::timeout && slot.arrived < world &&
        group.aborted.ok() && gone_missing_rank() < 0) {
      std::vector<int> missing;
      for (int other = 0; other < world; ++other)
        if (!slot.arrivals[static_cast<size_t>(other)]) missing.push_back(other);
      Status timeout = DeadlineExceededError(
          "host communicator: " + what + " " + call_text(mine) + " on rank " + std::to_string(rank) + " waited " +
          seconds_text(group.timeout) + " but " + ranks_text(missing) + " of " + std::to_string(world) +
          " did not arrive (a rank failed, is stuck, or issued fewer collectives); the group is aborted");
      group.abort_locked(timeout);
      return timeout;
    }
  }
  return Status::Ok();
}

// Counts this rank in at `counter` and waits (lock held) until every rank has. Once all
// have arrived every rank is only moving data, so neither abort nor timeout may end this
// wait early: a rank that left now could reuse a buffer another rank is still reading.
void wait_for_all(GroupState& group, Slot& slot, int Slot::*counter, std::unique_lock<std::mutex>& lock) {
  ++(slot.*counter);
  group.changed.notify_all();
  group.changed.wait(lock, [&] { return slot.*counter == group.world_size; });
}

// Moves this rank's data once every rank has arrived (lock not held; the all-reduce takes
// it for the barrier between its reduce and its copies).
void move_data(GroupState& group, Slot& slot, int rank, const Arrival& mine, Executor* executor, std::unique_lock<std::mutex>& lock) {
  const int world = group.world_size;
  std::vector<const Arrival*> all(static_cast<size_t>(world));
  for (int other = 0; other < world; ++other) all[static_cast<size_t>(other)] = &*slot.arrivals[static_cast<size_t>(other)];
  const size_t element = dtype_size(mine.dtype);
  switch (mine.kind) {
    case CollectiveKind::kBarrier: break;
    case CollectiveKind::kAllGather: {
      const size_t piece = mine.count * element;
      for (int other = 0; other < world; ++other)
        copy_bytes(mine.recv + static_cast<size_t>(other) * piece, all[static_cast<size_t>(other)]->send, piece);
      break;
    }
    case CollectiveKind::kBroadcast:
      copy_bytes(mine.recv, all[static_cast<size_t>(mine.root)]->send, mine.count * element);
      break;
    case CollectiveKind::kReduceScatter: {
      std::vector<const std::byte*> inputs(static_cast<size_t>(world));
      for (int other = 0; other < world; ++other)
        inputs[static_cast<size_t>(other)] =
            all[static_cast<size_t>(other)]->send + static_cast<size_t>(rank) * mine.count * element;
      reduce_in_rank_order(inputs, mine.count, mine.dtype, mine.wire, mine.op, mine.dtype, mine.recv, executor);
      break;
    }
    case CollectiveKind::kAllReduce: {
      // Reduce this rank's slice into its own recv, then copy the other slices from
      // the ranks that reduced them.
      const auto [begin, end] = all_reduce_slice(mine.count, world, rank);
      std::vector<const std::byte*> inputs(static_cast<size_t>(world));
      for (int other = 0; other < world; ++other)
        inputs[static_cast<size_t>(other)] = all[static_cast<size_t>(other)]->send + begin * element;
      reduce_in_rank_order(inputs, end - begin, mine.dtype, mine.wire, mine.op, mine.dtype, mine.recv + begin * element,
                           executor);
      lock.lock();
      wait_for_all(group, slot, &Slot::reduced, lock);
      lock.unlock();
      for (int other = 0; other < world; ++other) {
        if (other == rank) continue;
        const auto [other_begin, other_end] = all_reduce_slice(mine.count, world, other);
        copy_bytes(mine.recv + other_begin * element, all[static_cast<size_t>(other)]->recv + other_begin * element,
                   (other_end - other_begin) * element);
      }
      break;
    }
  }
}

Status run_collective(GroupState& group, int rank, uint64_t sequence, const Arrival& mine, Executor* executor) {
  const std::string what = op_text(mine, sequence);
  std::unique_lock<std::mutex> lock(group.mutex);
  if (!group.aborted.ok()) return aborted_error(group.aborted, what, rank);
  Slot& slot = group.slots.try_emplace(sequence, group.world_size).first->second;
  STRATA_RETURN_IF_ERROR(record_arrival(group, slot, rank, sequence, mine));
  STRATA_RETURN_IF_ERROR(wait_for_arrivals(group, slot, rank, sequence, mine, what, lock));
  lock.unlock();
  move_data(group, slot, rank, mine, executor, lock);
  lock.lock();
  wait_for_all(group, slot, &Slot::finished, lock);
  if (++slot.left == group.world_size) group.slots.erase(sequence);
  return Status::Ok();
}

// Aborts the group when the task it rides in is destroyed without having run.

}  // namespace

// ---------------------------------------------------------------------------
// HostCommunicatorGroup
// ---------------------------------------------------------------------------

HostCommunicatorGroup::HostCommunicatorGroup(std::shared_ptr<GroupState> state) : state_(std::move(state)) {}

StatusOr<HostCommunicatorGroup> HostCommunicatorGroup::create(const HostCommunicatorOptions& options) {
  if (options.world_size < 1)
    return InvalidArgumentError("host communicator: world size " + std::to_string(options.world_size) +
                                ": expected at least 1");
  if (options.timeout.count() <= 0)
    return InvalidArgumentError("host communicator: timeout " + std::to_string(options.timeout.count()) +
                                " ms: expected a positive duration");
  return HostCommunicatorGroup(std::make_shared<GroupState>(options));
}

int HostCommunicatorGroup::world_size() const { return state_->world_size; }

StatusOr<std::unique_ptr<HostCommunicator>> HostCommunicatorGroup::communicator(int rank, Device& device) {
  if (rank < 0 || rank >= state_->world_size)
    return InvalidArgumentError("host communicator: rank " + std::to_string(rank) + " is outside [0, " +
                                std::to_string(state_->world_size - 1) + "]");
  if (device.kind() != DeviceKind::kCpu)
    return InvalidArgumentError("host communicator: rank " + std::to_string(rank) + " is on " + device.description() +
                                "; HostCommunicator moves data with the CPU and needs CPU-device ranks "
                                "(use NcclCommunicator for GPUs)");
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->handed_out[static_cast<size_t>(rank)])
      return AlreadyExistsError("host communicator: rank " + std::to_string(rank) + "'s communicator was already taken");
    state_->handed_out[static_cast<size_t>(rank)] = true;
  }
  return std::make_unique<HostCommunicator>(state_, rank, device);
}

void HostCommunicatorGroup::abort(std::string_view reason) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->abort_locked(CancelledError("aborted: " + std::string(reason)));
}

// ---------------------------------------------------------------------------
// HostCommunicator
// ---------------------------------------------------------------------------

HostCommunicator::HostCommunicator(std::shared_ptr<GroupState> state, int rank, Device& device)
    : StreamTaskCommunicator(device), state_(std::move(state)), rank_(rank) {}

HostCommunicator::~HostCommunicator() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->issued_when_gone[static_cast<size_t>(rank_)] = next_sequence_.load();
  state_->changed.notify_all();
}

int HostCommunicator::world_size() const { return state_->world_size; }

Status HostCommunicator::enqueue(CollectiveCall call, const std::optional<ReduceOptions>& reduce, Stream& stream) {
  const std::string what = std::string(collective_kind_name(call.kind)) + " #" + std::to_string(issued());
  // Every enqueue-time failure aborts the group: the other ranks would otherwise wait
  // for a collective this rank never issues.
  const auto reject = [&](Status problem) {
    Status status = std::move(problem).with_context("host communicator: rank " + std::to_string(rank_) + "'s " + what + " was rejected");
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->abort_locked(status);
    return status;
  };
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!state_->aborted.ok()) return aborted_error(state_->aborted, what, rank_);
  }
  if (Status problem = check_call(call, reduce, stream); !problem.ok()) return reject(std::move(problem));

  const uint64_t sequence = next_sequence_.fetch_add(1);
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->slots.try_emplace(sequence, state_->world_size).first->second.streams[static_cast<size_t>(rank_)] = &stream;
    state_->changed.notify_all();
  }
  auto dropped = [state = state_, rank = rank_, text = op_text(call, sequence), stream_name = stream.name()] {
    std::lock_guard<std::mutex> lock(state->mutex);
    state->abort_locked(CancelledError("host communicator: rank " + std::to_string(rank) + "'s " + text + " never ran: stream '" + stream_name +
                                       "' dropped it (an earlier error on that stream, or the stream went away)"));
  };
  Status launched = launch_guarded(stream, std::move(dropped), [state = state_, rank = rank_, call, sequence](const LaunchContext& context) {
    return run_collective(*state, rank, sequence, call, context.executor);
  });
  if (!launched.ok()) return reject(std::move(launched));
  return Status::Ok();
}

void HostCommunicator::abort(std::string_view reason) {
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->abort_locked(CancelledError("rank " + std::to_string(rank_) + " aborted: " + std::string(reason)));
}

Status HostCommunicator::async_error() {
  std::lock_guard<std::mutex> lock(state_->mutex);
  if (state_->aborted.ok()) return Status::Ok();
  return Status(state_->aborted.code(), "host communicator (rank " + std::to_string(rank_) +
                                            "): the group was aborted: " + state_->aborted.message());
}

}  // namespace strata
