// The parameter fetcher: brings each planned use's parameters to the device ahead of
// compute, on its own worker with its own queue of requests:
//
//   NVMe --read (ahead, as staging frees)--> pinned staging --H2D--> device shard
//        --all-gather--> the group in a gather slot (or a persistent group's buffer)
//
// Gather slots form a ring; a request's place in it is a PipelineState (slot index, and
// phase: how many times the ring wrapped before it). A fill of phase p waits until its
// slot's previous p occupants have been released (by the model after compute, or at
// once for a use that was abandoned), so the number of gathered groups in flight is
// bounded by the ring.
//
// Parameter versions come from the optimizer through a VersionBoard; a fill waits for
// the version its use needs.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <limits>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/communicator.h"
#include "engine/core/device.h"
#include "engine/engine_options.h"
#include "engine/engine_plan_types.h"
#include "engine/partition.h"
#include "engine/shard_store.h"
#include "engine/stage_wait.h"
#include "engine/stream_trace.h"
#include "engine/trace.h"
#include "engine/use_planner.h"
#include "engine/version_board.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"

namespace strata::engine_internal {

// A position in the gather-slot ring.
struct PipelineState {
  int index = -1;        // the slot; -1 = a persistent group's own buffer
  uint64_t phase = 0;    // uses of the slot before this one
};

struct ParamFetcherContext {
  const EngineOptions* options = nullptr;
  const EnginePlan* plan = nullptr;
  Device* device = nullptr;
  Stream* h2d = nullptr;
  Stream* gather = nullptr;
  Stream* compute = nullptr;
  Communicator* gather_comm = nullptr;
  Tracer* tracer = nullptr;
  StreamTrace* stream_trace = nullptr;  // device work on the streams, traced from timing events
  const std::vector<GroupLayout>* layouts = nullptr;  // every group, by id
  NvmeStore* nvme = nullptr;
  PinnedArena* arena = nullptr;
  VersionBoard* versions = nullptr;
  ShardStore* shards = nullptr;      // where each version of a group's shard lives
};

struct ParamFetcherHooks {
  std::function<void(Status)> failed;
  std::function<std::string()> describe_engine;
};

class ParamFetcher final : public FetchIssuer {
 public:
  static StatusOr<std::unique_ptr<ParamFetcher>> create(const ParamFetcherContext& context, ParamFetcherHooks hooks);
  ~ParamFetcher() override;
  ParamFetcher(const ParamFetcher&) = delete;
  ParamFetcher& operator=(const ParamFetcher&) = delete;

  Status allocate();  // the gather slots and persistent groups' buffers
  Status start();  // starts the worker thread (an error at the thread limit)
  void stop();
  void abort(const Status& status);

  // FetchIssuer (model thread).
  uint64_t plan_fetch(int group, int64_t step, int64_t version) override;
  void abandon(uint64_t request) override;
  bool takes_slot(int group) const override;

  // Model thread: waits until `request` is ready and takes it; returns where the group is
  // gathered (the compute stream already waits for it).
  StatusOr<void*> take(uint64_t request, PipelineState* position);
  // Model thread: a persistent group whose fetch of this use's version an earlier use
  // planned (plan_fetch gave 0); returns its gathered copy (the compute stream waits for it).
  StatusOr<void*> take_persistent(int group);
  // Model thread: blocks until the use taken at `position` (a slot, or the persistent copy
  // when its index is negative) holds the gathered group; for a caller that reads it on
  // the host rather than in compute stream order. Waits on that fetch alone.
  Status wait_taken(int group, const PipelineState& position);
  // Compute is enqueued up to the release of a use at `position`.
  Status release(int group, const PipelineState& position);
  // The step's uses are over (persistent buffers may be refilled for the next).
  void set_steps_finished(int64_t steps);
  // Every planned fetch has been carried out.
  Status wait_idle();
  // Persistent groups fetch again at their next use (after the parameters were rewritten).
  void forget_persistent_fetches();
  std::string describe() const;

  ParamFetcher(const ParamFetcherContext& context, ParamFetcherHooks hooks) : ctx_(context), hooks_(std::move(hooks)) {}

 private:
  struct Slot {
    DeviceBuffer full;                 // the gathered group
    DeviceBuffer shard;                // device staging shard (world > 1 with host or NVMe parameters)
    PinnedBuffer nvme_stage;           // NVMe read staging (NVMe parameters)
    std::unique_ptr<Event> ready;      // recorded when `full` holds the gathered group
    std::unique_ptr<Event> released;   // recorded when compute is done with `full`
    std::unique_ptr<Event> h2d_done;   // recorded when the H2D copy out of the staging finished
    uint64_t releases = 0;             // host fact: uses of the slot released so far
  };
  struct Request {
    uint64_t id = 0;
    int group = -1;
    PipelineState position;
    int64_t version = 0;               // the parameter version to fetch
    int64_t step = 0;                  // the step whose use this is
    bool abandoned = false;
    bool ready = false;                // the ready event has been recorded
    bool consumed = false;             // taken by the model, or abandoned
    // Fetcher-private: the NVMe read in flight.
    bool read_submitted = false;
    IoTicket read_ticket;
    TraceClock::time_point read_begin;
    TraceClock::time_point read_completed;  // stamped by the store when the bytes are in
  };
  // A persistent group (the plan keeps it gathered): its own buffers and events, as a slot's.
  struct Persistent {
    bool persistent = false;
    int64_t planned_version = -1;      // the version the latest planned fetch brings (model thread)
    DeviceBuffer full;                 // the gathered copy
    DeviceBuffer shard;                // device staging shard (world > 1 with host or NVMe parameters)
    PinnedBuffer stage;                // NVMe read staging
    std::unique_ptr<Event> ready, released, h2d_done;
  };
  // The buffers one fill writes.
  struct Target {
    void* dest = nullptr;
    void* staging = nullptr;
    PinnedBuffer* nvme_stage = nullptr;
    Event* ready = nullptr;
    Event* released = nullptr;
    Event* h2d_done = nullptr;
  };

  void loop();
  Status fetch(Request& r);
  Status wait_until_fillable(const Request& r);
  Target target_of(const Request& r);
  // The NVMe read of r (and the reads of the requests behind it that can start now).
  StatusOr<const void*> read_from_nvme(Request& r, const Target& target);
  Status submit_read_ahead(const Request& r);
  Status fill_device(const Request& r, const Target& target, const void* host_source);
  void retire_locked();
  Request& request_locked(uint64_t id) { return requests_[static_cast<size_t>(id - requests_.front().id)]; }
  const GroupLayout& group_layout(int g) const { return (*ctx_.layouts)[static_cast<size_t>(g)]; }
  Status allocate_persistent(int g);
  bool direct_view() const { return ctx_.options->param_tier == Tier::kDevice && ctx_.options->world_size == 1; }
  size_t param_bytes(size_t elements) const { return elements * dtype_size(ctx_.options->param_dtype); }
  std::function<std::string()> describer() const;

  ParamFetcherContext ctx_;
  ParamFetcherHooks hooks_;
  std::vector<Slot> slots_;
  std::vector<Persistent> persistent_;  // per group
  std::vector<uint64_t> slot_fills_;    // per slot: fills enqueued so far (worker only)
  uint64_t slot_uses_ = 0;              // slot-taking requests planned (model thread)

  mutable StageSync sync_;
  std::deque<Request> requests_;        // in id order, until ready and consumed
  uint64_t next_request_id_ = 1;
  uint64_t next_fetch_id_ = 1;          // the next request the worker fills
  int64_t steps_finished_ = 0;
};

}  // namespace strata::engine_internal
