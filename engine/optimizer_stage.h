// The optimizer stage: one worker with its own queue of jobs (one step's update, group
// by group, in the order given). A job steps each group's shard with CPU Adam on state in
// host memory, with the device Adam on state in device memory, or with CPU Adam on state
// streamed from NVMe in chunks through NvmeAdamState's ring (the gradients, spilled next
// to the state, stream in with it). The new parameters go where the next fetch reads
// them (the host copy, or staged out to the device or NVMe), then their version goes on
// the VersionBoard, so compute never waits for more than the group it needs.
//
// It owns the optimizer state: master weights and moments in host memory, or on the
// device (master, exp_avg, exp_avg_sq: 3 x shard fp32 per group), and the staging of new
// parameters on their way out. NVMe-resident state is the NvmeAdamState the engine hands
// it (the gradient path spills gradients beside it). Gradients come from the
// GradientBoard, which says where each group's final gradient of a step lies.
//
// Errors stop the worker and reach the engine through `failed`; the engine returns them
// at its next wait.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <thread>
#include <vector>

#include "engine/core/device.h"
#include "engine/engine_options.h"
#include "engine/engine_plan_types.h"
#include "engine/gradient_board.h"
#include "engine/partition.h"
#include "engine/shard_store.h"
#include "engine/stage_wait.h"
#include "engine/trace.h"
#include "engine/version_board.h"
#include "offload/pinned_arena.h"
#include "optim/cpu_adam.h"
#include "optim/nvme_adam_state.h"

namespace strata::engine_internal {

// One step's update, group by group.
struct OptimizerJob {
  int64_t step_index = 0;            // 0-based index of the step whose gradients are used
  bool skip = false;
  AdamStepPlan decay_plan;           // for tensors with weight decay
  AdamStepPlan no_decay_plan;        // for tensors without
  std::vector<int> order;            // groups in the order to update
};

// Where OptimizerStage::submit queues `job` among `queued`, whose first `taken` jobs are
// running: at the end, or, for a one-group update, ahead of the not yet started one-group
// updates of the same step with a higher group id (see submit()).
size_t update_queue_position(const std::deque<OptimizerJob>& queued, size_t taken, const OptimizerJob& job);

// What the stage works on; everything outlives the stage.
struct OptimizerStageContext {
  const EngineOptions* options = nullptr;
  const EnginePlan* plan = nullptr;
  Device* device = nullptr;
  Stream* update_stream = nullptr;   // device Adam and new-parameter copies
  Tracer* tracer = nullptr;
  const std::vector<GroupLayout>* layouts = nullptr;  // every group, by id
  PinnedArena* arena = nullptr;
  CpuAdam* adam = nullptr;                   // the CPU Adam (host and NVMe state)
  NvmeAdamState* nvme_state = nullptr;       // the state on NVMe (optimizer_tier kNvme), else nullptr
  ShardStore* shards = nullptr;              // where the new parameters go
  const GradientBoard* gradients = nullptr;  // where each final gradient lies
  VersionBoard* versions = nullptr;          // where each group's new version is published
};

struct OptimizerStageHooks {
  std::function<void()> job_done;                                 // the job's state is written back too
  std::function<void(Status)> failed;
};

class OptimizerStage {
 public:
  static StatusOr<std::unique_ptr<OptimizerStage>> create(const OptimizerStageContext& context, OptimizerStageHooks hooks);
  ~OptimizerStage();
  OptimizerStage(const OptimizerStage&) = delete;
  OptimizerStage& operator=(const OptimizerStage&) = delete;

  Status start();  // starts the worker thread (an error at the thread limit)
  // Drops queued jobs and joins the worker (after the running job's group).
  void stop();
  // Queued behind the jobs there are, except that a one-group update (exact overlap: as its
  // gradient lands) goes ahead of the queued, not yet started one-group updates of the same
  // step with a higher group id: groups are numbered in the order the models register them,
  // their forward order, so with a backlog at the end of backward the group the next
  // forward needs first is updated first.
  void submit(OptimizerJob job);
  size_t queued() const;

  // Group g's state when no job runs (the engine waits for that): its storage with zero
  // moments (the master is undefined until write_state() writes it: initial values or a
  // load), and one kind at a time for checkpoints.
  Status initialize_group(int g);
  // kind: kMaster, kExpAvg or kExpAvgSq; elements [first, first + size) of the shard (the
  // engine has checked the range).
  Status read_state(int g, StateKind kind, size_t first, std::span<float> out);
  Status write_state(int g, StateKind kind, size_t first, std::span<const float> in);

  // Only create() constructs stages.
  OptimizerStage(const OptimizerStageContext& context, OptimizerStageHooks hooks) : ctx_(context), hooks_(std::move(hooks)) {}

 private:
  void loop();
  Status run_jobs(const std::vector<OptimizerJob>& jobs);
  Status run_nvme_jobs(const std::vector<const OptimizerJob*>& jobs);
  Status update_host_group(const OptimizerJob& job, int g);
  Status update_device_group(const OptimizerJob& job, int g);
  Status allocate_staging();
  const GroupLayout& group_layout(int g) const { return (*ctx_.layouts)[static_cast<size_t>(g)]; }
  std::vector<AdamPlanRun> plan_runs(const OptimizerJob& job, int g) const;
  // The group's new version is in place.
  void publish(int g, int64_t version) { ctx_.versions->publish(g, version); }

  // One group's state in host memory or on the device (by optimizer tier), and its runs
  // of elements with and without weight decay.
  struct GroupOptimizerState {
    PinnedBuffer master, exp_avg, exp_avg_sq;  // kPinned / kHost
    DeviceBuffer device;                       // kDevice: master, exp_avg, exp_avg_sq (3 x shard fp32)
    std::vector<DecayRun> decay_runs;
  };

  OptimizerStageContext ctx_;
  OptimizerStageHooks hooks_;
  std::vector<GroupOptimizerState> groups_;
  PinnedBuffer param_out_stage_;   // new parameters on their way out (host state, device or NVMe params)
  DeviceBuffer param_out_device_;  // device state: new parameters on their way to the host or NVMe

  mutable StageSync sync_;
  std::deque<OptimizerJob> jobs_;
  size_t taken_ = 0;  // jobs at the front of jobs_ the worker is running (not reordered)
};

}  // namespace strata::engine_internal
