// The gradient path: from the model's full-group fp32 gradient buffer on the device to
// the shard the optimizer reads on the host (or on NVMe beside the state).
//
//   model thread:  buffer(g) -> [backward kernels] -> hand_over(g):
//                  reduce-scatter (in reduce_bucket_size pieces) -> cast -> D2H into a
//                  landing buffer (the group's own, or one of the ring when spilled)
//   lander worker: waits for the copy, frees the device slot, accumulates micro-batches
//                  in fp32, takes the sum of squares and inf/NaN flag of the final shard
//                  (GradientOps: vectorized, parallel on the optimizer's executor,
//                  deterministic), spills it to NVMe when the plan says so, publishes it
//                  on the GradientBoard and tells the engine (`landed`).
//
// It owns the gradient buffers: the device slots, the landing buffers (each group's, or
// the ring when spilled), the fp32 accumulators, and the device accumulators when the
// optimizer state lives on the device; where a step's final gradient lies is placed on
// the board once, at allocation (gradient_board.h).
//
// Its own mutex guards its slots, ring and queue; the lander's queue is bounded by the
// device gradient slots (a slot is busy until its shard has landed).
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/communicator.h"
#include "engine/core/device.h"
#include "engine/engine_options.h"
#include "engine/engine_plan_types.h"
#include "engine/gradient_board.h"
#include "engine/partition.h"
#include "engine/stage_wait.h"
#include "engine/stream_trace.h"
#include "engine/trace.h"
#include "offload/pinned_arena.h"
#include "optim/gradient_ops.h"
#include "optim/nvme_adam_state.h"

namespace strata::engine_internal {

struct GradientPathContext {
  const EngineOptions* options = nullptr;
  const EnginePlan* plan = nullptr;
  Device* device = nullptr;
  Stream* compute = nullptr;         // where the model writes gradients
  Stream* reduce = nullptr;          // reduce-scatter, casts, device accumulation
  Stream* d2h = nullptr;
  Communicator* reduce_comm = nullptr;
  Tracer* tracer = nullptr;
  StreamTrace* stream_trace = nullptr;  // device work on the streams, traced from timing events
  const std::vector<GroupLayout>* layouts = nullptr;  // every group, by id
  GradientBoard* board = nullptr;    // where each final gradient is published
  PinnedArena* arena = nullptr;
  NvmeAdamState* spill = nullptr;    // where spilled gradients go (plan->gradients_spilled)
  Executor* executor = nullptr;      // GradientOps' parallel loops (shared with CPU Adam)
};

struct GradientPathHooks {
  // Group g's final gradient of step `step` has landed; called before wait_step_landed
  // can return for that step.
  std::function<void(int group, int64_t step)> landed;
  std::function<void(Status)> failed;
  std::function<std::string()> describe_engine;  // for hang warnings
  // Waits until group g's parameters reach `version` (the update of step version - 1 is
  // done): device-resident optimizer state has one gradient accumulator per group, which
  // that update reads and the next step's gradients overwrite.
  std::function<Status(int group, int64_t version)> wait_for_update;
  // buffer() may make the model's thread wait (for the group's update, its landing buffer,
  // a free slot) while the compute stream idles: called before such a wait and after it,
  // so the compute stream's busy time leaves the wait out. Optional.
  std::function<Status()> host_wait_begins;
  std::function<Status()> host_wait_ends;
};

class GradientPath {
 public:
  static StatusOr<std::unique_ptr<GradientPath>> create(const GradientPathContext& context, GradientPathHooks hooks);
  ~GradientPath();
  GradientPath(const GradientPath&) = delete;
  GradientPath& operator=(const GradientPath&) = delete;

  // Device slots, the landing ring or the per-group host buffers, as the plan says.
  Status allocate();
  Status start();  // starts the worker thread (an error at the thread limit)
  void stop();
  // An error elsewhere in the engine: every wait here returns it.
  void abort(const Status& status);

  // Model thread. A micro-batch starts: no group holds a slot.
  void begin_micro_batch();
  // Group g's fp32 gradient buffer for micro-batch of `step` (one slot per group and
  // micro-batch; waits for a free slot), zeroed on the compute stream when taken, or
  // handed out unwritten (the slot is free: nothing reads it until hand_over). Unwritten,
  // where the path lands in place (lands_in_place()), it is the group's landing buffer
  // itself: no slot, and no copy at hand_over.
  StatusOr<float*> buffer(int g, int64_t step, GradientStart start = GradientStart::kZeroed);
  // Whether an unwritten buffer is the landing buffer: the CPU device (its memory is the
  // host's), one rank (nothing to reduce), fp32 transfer (nothing to cast), host optimizer
  // state and each group's own landing buffer (not spilled).
  bool lands_in_place() const;
  // The model's gradients of g for this micro-batch are enqueued on the compute stream.
  Status hand_over(int g, int64_t step, int micro);
  // Every trainable group's final gradient of `step` has landed: their statistics, added
  // in group order (so the sum does not depend on landing order). Frozen groups take no
  // gradients and add nothing.
  StatusOr<GradientStats> wait_step_landed(int64_t step);
  // Every landing queued so far is done.
  Status wait_drained();
  std::string describe() const;

  GradientPath(const GradientPathContext& context, GradientPathHooks hooks) : ctx_(context), hooks_(std::move(hooks)) {}

 private:
  // A device gradient slot: the full-group buffer the model accumulates into, the
  // reduce-scatter output and the cast for the device->host copy.
  struct Slot {
    DeviceBuffer full, shard, bucket;
    size_t elements = 0;             // the padded group elements it holds
    std::unique_ptr<Event> grads_done, reduced, copied;
    bool busy = false;               // handed out, not yet returned by the lander
  };
  struct Landing {
    int group = -1;
    int slot = -1;                   // -1: landed in place
    int64_t step = 0;
    int micro = 0;
    bool last_micro = false;
    int ring = -1;                   // the ring buffer it landed in (spilled), -1 = the group's own
  };
  // A group's host and device gradient buffers (trainable groups; none when spilled).
  struct GroupBuffers {
    // The landing buffer (transfer dtype; the fp32 copy for the statistics with device
    // state) and the fp32 accumulator (micro-batches > 1, host state): two each in
    // delayed mode, by step parity.
    std::vector<PinnedBuffer> landing;
    std::vector<PinnedBuffer> accum;
    DeviceBuffer device_accum;       // device state: the reduced shard, accumulated (fp32)
    std::unique_ptr<Event> written;  // landing in place: recorded on the compute stream at hand_over
  };
  // GroupFacts::active_slot besides a slot's index (model thread).
  static constexpr int kNoSlot = -1;       // no buffer taken this micro-batch
  static constexpr int kHandedOver = -2;   // grads_ready came
  static constexpr int kInPlace = -3;      // the model writes the landing buffer itself
  struct GroupFacts {
    int active_slot = kNoSlot;       // this micro-batch's slot, or one of the k* above (model thread)
    void* in_place = nullptr;        // kInPlace: the landing buffer handed out
    uint64_t sent = 0, processed = 0;  // landings of the group queued / done
    int64_t landed_step = -1;
    GradientStats stats;
  };

  void loop();
  Status check_slot_can_free(int g, size_t elements);
  Status land(const Landing& item);
  // The landing buffer of g for `step` once the lander is done with its previous landing.
  StatusOr<void*> own_landing_when_free(int g, int64_t step);
  Status hand_over_in_place(int g, int64_t step, int micro, bool last);
  // The final gradient's statistics, accumulating first where micro-batches add up.
  StatusOr<GradientStats> accumulate_host(const Landing& item, const void* landed);
  // A spilled gradient: the host pass (accumulation, statistics), then its write to NVMe.
  struct SpillPiece {
    GradientStats stats;
    const void* stored = nullptr;  // what goes to NVMe: the landed shard, or the fp32 running sum
    size_t capacity = 0;
  };
  StatusOr<SpillPiece> accumulate_spilled(const Landing& item, const void* landed);
  Status store_spilled(const Landing& item, const SpillPiece& piece);
  Status reduce(int g, Slot& slot);
  Status land_on_device(int g, Slot& slot, int64_t step, int micro, bool last, void** landing);
  StatusOr<void*> landing_target(int g, int64_t step, int* ring);
  Status enqueue_copy(int g, Slot& slot, const void* source, size_t bytes, void* landing);
  // The smallest free slot that holds `elements`, or -1.
  int free_slot_for(size_t elements) const;
  Status allocate_group_buffers(const GroupLayout& layout);
  // The board's places of group g's final gradient (after its buffers are allocated).
  void place_on_board(const GroupLayout& layout);
  const GroupLayout& group_layout(int g) const { return (*ctx_.layouts)[static_cast<size_t>(g)]; }
  int copy_of(int64_t step) const { return ctx_.options->overlap == OverlapMode::kDelayed ? static_cast<int>(step % 2) : 0; }
  std::function<std::string()> describer() const;

  GradientPathContext ctx_;
  GradientPathHooks hooks_;
  std::optional<GradientOps> ops_;
  std::vector<Slot> slots_;
  // The transfer-dtype cast of a shard on its way to the host: one, shared by the slots
  // (a cast waits until the previous copy out of it is done).
  DeviceBuffer cast_;
  std::unique_ptr<Event> cast_free_;
  std::vector<PinnedBuffer> ring_;   // spilled: the landing ring
  PinnedBuffer scratch_;             // spilled with micro-batches: the fp32 running sum

  mutable StageSync sync_;
  std::vector<char> ring_busy_;
  std::deque<Landing> queue_;
  std::vector<GroupFacts> facts_;
  std::vector<GroupBuffers> buffers_;  // by group
  uint64_t queued_ = 0, done_ = 0;
};

}  // namespace strata::engine_internal
