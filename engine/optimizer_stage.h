// The optimizer stage: one worker with its own queue of jobs (one step's update, group
// by group, in the order given). A job steps each group's shard with CPU Adam on state in
// host memory, with the device Adam on state in device memory, or with CPU Adam on state
// streamed from NVMe in chunks through NvmeAdamState's ring (the gradients, spilled next
// to the state, stream in with it). The new parameters go where the next fetch reads
// them (the host copy, or staged out to the device or NVMe), then the engine hears of it
// (`group_updated`), so compute never waits for more than the group it needs.
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

#include "engine/engine_impl.h"
#include "engine/shard_store.h"
#include "engine/stage_wait.h"
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

// What the stage works on; everything outlives the stage.
struct OptimizerStageContext {
  const EngineOptions* options = nullptr;
  const EnginePlan* plan = nullptr;
  Device* device = nullptr;
  Stream* update_stream = nullptr;   // device Adam and new-parameter copies
  Tracer* tracer = nullptr;
  std::vector<std::unique_ptr<GroupState>>* groups = nullptr;
  NvmeStore* nvme = nullptr;         // the NVMe tier (state on NVMe, or parameters on NVMe)
  PinnedArena* arena = nullptr;
  PinnedBuffer* param_out_stage = nullptr;   // new parameters on their way out (host state, device or NVMe params)
  DeviceBuffer* param_out_device = nullptr;  // device state: new parameters on their way to the host or NVMe
  ShardStore* shards = nullptr;              // where the new parameters go
};

struct OptimizerStageHooks {
  std::function<void(int group, int64_t version)> group_updated;  // the group's new parameters are in place
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
  void submit(OptimizerJob job);
  size_t queued() const;

  CpuAdam& adam() { return *adam_; }
  // The NVMe-resident state (optimizer state on NVMe), else nullptr.
  NvmeAdamState* nvme_state() { return nvme_state_.get(); }

  // Group g's state when no job runs (the engine waits for that): initial values, and
  // one kind at a time for checkpoints.
  // (master null: only the moments are zeroed; a load writes the master).
  Status initialize_group(int g, const float* master);
  Status read_state(int g, Engine::StateKind kind, std::span<float> out);
  Status write_state(int g, Engine::StateKind kind, std::span<const float> in);

  // Only create() constructs stages.
  OptimizerStage(const OptimizerStageContext& context, OptimizerStageHooks hooks) : ctx_(context), hooks_(std::move(hooks)) {}

 private:
  void loop();
  Status run_jobs(const std::vector<OptimizerJob>& jobs);
  Status run_nvme_jobs(const std::vector<const OptimizerJob*>& jobs);
  Status update_host_group(const OptimizerJob& job, int g);
  Status update_device_group(const OptimizerJob& job, int g);
  GroupState& group(int g) { return *(*ctx_.groups)[static_cast<size_t>(g)]; }
  std::vector<AdamPlanRun> plan_runs(const OptimizerJob& job, const GroupState& state) const;
  // The gradient copy a step lands in (two in delayed mode, by step parity; as the gradient path).
  int gradient_copy(int64_t step) const;
  // The host gradient a job reads for group g (nullptr: the copy stored on NVMe).
  const void* host_gradient(const GroupState& state, int64_t step_index, DType* type) const;

  OptimizerStageContext ctx_;
  OptimizerStageHooks hooks_;
  std::optional<CpuAdam> adam_;
  std::unique_ptr<NvmeAdamState> nvme_state_;

  mutable StageSync sync_;
  std::deque<OptimizerJob> jobs_;
};

}  // namespace strata::engine_internal
