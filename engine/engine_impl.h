// The facade behind engine.h: its record per group and EngineImpl. Internal to the
// facade's files (engine.cpp, engine_step.cpp, engine_state.cpp): the
// stages share no record; each owns its state and they meet at hand-offs (the gradient
// board, the version board, the shard store).
//
// Threads per rank, each stage with its own queue (engine/stage_wait.h):
//   - the model's thread: calls the API (engine.cpp), enqueues compute, plans uses
//     (use_planner.h) and hands gradients to the gradient path;
//   - the parameter fetcher (param_fetcher.h): follows the planned uses ahead of compute,
//     NVMe -> pinned -> device -> all-gather into the gather-slot ring;
//   - the lander (gradient_path.h): waits for each gradient shard's device->host copy,
//     accumulates it in fp32 across micro-batches, takes its statistics, spills it to NVMe
//     when the optimizer state lives there;
//   - the optimizer stage (optimizer_stage.h): steps each group's shard (CPU Adam on host
//     state or on NVMe state streamed in chunks, or the device Adam) and writes the new
//     parameters through the shard store (shard_store.h), publishing their version.
// Device ordering goes through streams and events; host facts through each stage's own
// mutex, and errors reach every stage's next wait.
#pragma once

#include <condition_variable>
#include <deque>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <thread>
#include <vector>

#include "engine/engine.h"
#include "engine/gradient_board.h"
#include "engine/gradient_path.h"
#include "engine/metrics.h"
#include "engine/optimizer_stage.h"
#include "engine/param_fetcher.h"
#include "engine/shard_store.h"
#include "engine/stream_trace.h"
#include "engine/use_planner.h"
#include "engine/version_board.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "optim/cpu_adam.h"
#include "optim/loss_scaler.h"
#include "optim/nvme_adam_state.h"

namespace strata::engine_internal {

// What the model thread keeps per group; each stage keeps its own per-group state
// (parameter copies: the shard store; gradient buffers: the gradient path; optimizer state:
// the optimizer stage; persistent gathered copies: the fetcher).
struct GroupState {
  GroupLayout layout;
  StreamTrace::Opened compute_trace;         // the current use's compute interval, opened by gather() (model thread)
  bool compute_resumed = false;              // compute_trace reopened after a wait in gradient_buffer() (labelled so)
};

// The Engine behind the API. Its definitions are in three files: engine.cpp (start-up:
// the plan, the stages and their hand-offs; errors and shutdown), engine_step.cpp (the
// model-facing step API) and engine_state.cpp (state access for checkpoints).
class EngineImpl final : public Engine {
 public:
  EngineImpl(const EngineOptions& options, Device& device, Communicator& gather_comm, Communicator& reduce_comm)
      : options_(options), device_(device), gather_comm_(gather_comm), reduce_comm_(reduce_comm), tracer_(options.rank) {}

  ~EngineImpl() override { shutdown(); }

  Status init() {
    if (options_.world_size < 1 || options_.rank < 0 || options_.rank >= options_.world_size)
      return InvalidArgumentError("engine: rank " + std::to_string(options_.rank) + " is not in a world of " +
                                  std::to_string(options_.world_size));
    if (gather_comm_.world_size() != options_.world_size || reduce_comm_.world_size() != options_.world_size ||
        gather_comm_.rank() != options_.rank || reduce_comm_.rank() != options_.rank)
      return InvalidArgumentError("engine: the communicators' rank/world size do not match the options (rank " +
                                  std::to_string(options_.rank) + " of " + std::to_string(options_.world_size) + ")");
    if (options_.gradient_accumulation_steps < 1)
      return InvalidArgumentError("gradient_accumulation_steps must be >= 1, got " + std::to_string(options_.gradient_accumulation_steps));
    if (options_.prefetch_depth < 0 && options_.prefetch_depth != EngineOptions::kAutoDepth)
      return InvalidArgumentError("prefetch depth must be >= 0 (or automatic), got " + std::to_string(options_.prefetch_depth));
    if (options_.param_dtype == DType::kFloat16 && !options_.fp16_loss_scaling)
      STRATA_LOG(kDebug) << "fp16 parameters without loss scaling";
    if (options_.overlap == OverlapMode::kDelayed && options_.fp16_loss_scaling)
      return UnimplementedError("delayed optimizer overlap with fp16 dynamic loss scaling is not supported: use exact");
    if (options_.optimizer_tier == Tier::kDevice) {
      // The gradient stays on the device; what reaches the host is its fp32 copy for the
      // norm and overflow statistics.
      options_.grad_transfer_dtype = DType::kFloat32;
    }
    if ((options_.param_tier == Tier::kNvme || options_.optimizer_tier == Tier::kNvme) && options_.nvme_path.empty())
      return InvalidArgumentError("an NVMe placement needs nvme_path (--nvme-path)");
    STRATA_ASSIGN_OR_RETURN(compute_stream_, device_.create_stream("compute"));
    STRATA_ASSIGN_OR_RETURN(h2d_stream_, device_.create_stream("h2d"));
    STRATA_ASSIGN_OR_RETURN(gather_stream_, device_.create_stream("gather"));
    STRATA_ASSIGN_OR_RETURN(reduce_stream_, device_.create_stream("reduce"));
    STRATA_ASSIGN_OR_RETURN(d2h_stream_, device_.create_stream("d2h"));
    STRATA_ASSIGN_OR_RETURN(update_stream_, device_.create_stream("update"));
    STRATA_ASSIGN_OR_RETURN(stream_trace_, StreamTrace::create(device_, tracer_));
    learning_rate_ = options_.adam.lr;
    return {};
  }

  // ----------------------------------------------------------------- registration
  StatusOr<int> register_group(const GroupSpec& spec) override {
    if (started_) return FailedPreconditionError("register_group('" + spec.name + "') after start()");
    const int id = static_cast<int>(groups_.size());
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(spec, id, options_.world_size));
    auto state = std::make_unique<GroupState>();
    state->layout = std::move(layout);
    groups_.push_back(std::move(state));
    return id;
  }

  Status declare_schedule(std::vector<int> group_uses) override {
    if (started_) return FailedPreconditionError("declare_schedule after start()");
    for (int g : group_uses) {
      if (g < 0 || g >= static_cast<int>(groups_.size()))
        return InvalidArgumentError("declared schedule names group " + std::to_string(g) + " but only " +
                                    std::to_string(groups_.size()) + " are registered");
    }
    declared_schedule_ = std::move(group_uses);
    return {};
  }
  Status declare_loaded(int group) override {
    if (started_) return FailedPreconditionError("declare_loaded after start()");
    if (group < 0 || static_cast<size_t>(group) >= groups_.size())
      return InvalidArgumentError("declare_loaded(" + std::to_string(group) + "): no such group (" + std::to_string(groups_.size()) + " registered)");
    if (loaded_groups_.size() < groups_.size()) loaded_groups_.resize(groups_.size(), false);
    loaded_groups_[static_cast<size_t>(group)] = true;
    return {};
  }
  int initialized_group_count() const override { return initialized_groups_; }

  Status declare_held_gradients(int count) override {
    if (started_) return FailedPreconditionError("declare_held_gradients after start()");
    if (count < 0) return InvalidArgumentError("declare_held_gradients(" + std::to_string(count) + "): a count cannot be negative");
    held_gradients_ = count;
    return {};
  }

  // ----------------------------------------------------------------- planning
  Status start() override;
  const EnginePlan& plan() const override { return plan_; }
  const GroupLayout& layout(int group) const override { return groups_.at(static_cast<size_t>(group))->layout; }
  int group_count() const override { return static_cast<int>(groups_.size()); }
  Stream& compute_stream() override { return *compute_stream_; }
  Device& device() override { return device_; }
  float loss_scale() const override { return loss_scaler_ ? loss_scaler_->scale() : 1.0f; }
  int64_t steps_taken() const override { return applied_steps_; }
  void set_steps_taken(int64_t steps) override { applied_steps_ = steps; }
  void set_step_number(int64_t steps_done) override { step_number_base_ = steps_done - step_index_; }
  std::optional<LossScaler::State> loss_scaler_state() const override {
    if (!loss_scaler_) return std::nullopt;
    return loss_scaler_->state();
  }
  Status restore_loss_scaler_state(const LossScaler::State& state) override;
  const Tracer& tracer() const override { return tracer_; }
  void set_trace_prediction(const TracePrediction& prediction) override { tracer_.set_prediction(prediction); }

  // ----------------------------------------------------------------- the step
  Status begin_step(double learning_rate) override;
  Status begin_micro_batch() override;
  StatusOr<GroupView> gather(int group) override;
  Status wait_gathered(int group) override;
  Status release(int group) override;
  Status check_gather_slot_free(int g) const;
  StatusOr<GroupView> gradient_buffer(int group, GradientStart start) override;
  // Around a wait of the model's thread in the gradient path (GradientPathHooks).
  Status pause_compute_traces();
  Status resume_compute_traces();
  Status close_compute_trace(GroupState& state);
  Status grads_ready(int group) override;
  StatusOr<StepReport> step(double loss) override;
  Status finish() override;
  Status begin_forward(std::span<const int> order) override;
  Status end_forward() override;

  Status read_state_shard(int group, StateKind kind, std::span<float> out) override;
  Status write_state_shard(int group, StateKind kind, std::span<const float> in) override;
  Status read_state_range(int group, StateKind kind, size_t first, std::span<float> out) override;
  Status write_state_range(int group, StateKind kind, size_t first, std::span<const float> in) override;
  Status refresh_parameters() override;
  bool has_stale_parameters() const override { return options_.overlap == OverlapMode::kDelayed && step_index_ >= 1; }
  OverlapMode overlap_mode() const override { return options_.overlap; }
  Status wait_for_state_access(int g, size_t first, size_t elements, const char* call);

 private:
  // Start-up pieces.
  Status allocate_and_initialize();
  Status create_hand_offs();
  Status create_optimizer_stage();
  Status create_gradient_path();
  // Exact mode without clipping or loss scaling: group g's update of `step` starts as
  // soon as its gradients have landed.
  Status submit_early_update(int g, int64_t step);
  // `init`: a buffer the group's initial fp32 values pass through, a chunk at a time.
  Status initialize_group(GroupState& g, std::span<float> init);

  Status create_param_fetcher();
  void record_error(Status status);
  // A one-paragraph picture of where every stage stands (for errors and hangs).
  std::string describe_state();
  std::function<std::string()> describer() {
    return [this] { return describe_state(); };
  }
  Status background_error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return halt_.failure;
  }
  void shutdown();
  // The optimizer's updates queued so far are done (their state written back).
  Status wait_for_updates(const char* what);

  // Helpers.
  GroupState& group(int g) { return *groups_[static_cast<size_t>(g)]; }
  Status check_group(int g, const char* call) const {
    if (!started_) return FailedPreconditionError(std::string(call) + " before start()");
    if (g < 0 || g >= static_cast<int>(groups_.size()))
      return InvalidArgumentError(std::string(call) + ": no group " + std::to_string(g));
    return {};
  }
  // Gradients and optimizer state exist for trainable groups only.
  Status check_trainable(int g, const std::string& call) const {
    const GroupLayout& layout = groups_[static_cast<size_t>(g)]->layout;
    if (layout.trainable) return {};
    return FailedPreconditionError(call + ": group " + std::to_string(g) + " ('" + layout.name +
                                   "') is frozen (GroupSpec::trainable is false): it has no gradients and no optimizer state");
  }
  bool device_state() const { return options_.optimizer_tier == Tier::kDevice; }
  bool direct_view(const GroupState& /*state*/) const { return options_.param_tier == Tier::kDevice && options_.world_size == 1; }
  size_t param_bytes(size_t elements) const { return elements * dtype_size(options_.param_dtype); }
  GroupView view_of(const GroupState& state, void* flat, DType dtype) const {
    GroupView view;
    view.group = state.layout.id;
    view.dtype = dtype;
    view.flat = flat;
    for (const auto& tensor : state.layout.tensors)
      view.tensors.push_back(static_cast<char*>(flat) + tensor.offset * dtype_size(dtype));
    return view;
  }
  // The parameter version the model's current pass uses: a step's (one behind in
  // delayed mode), or every update taken for a forward-only pass.
  int64_t current_use_version() const { return forward_only_ ? step_index_ : uses_->step_version(step_index_); }
  StatusOr<GradientStats> reduce_statistics(const GradientStats& local);
  StatusOr<OptimizerJob> plan_update(int64_t t, const GradientStats& global);
  Status finish_report(StepReport& report, TraceClock::time_point window_end);
  // Waits until everything planned is carried out (landings, updates, fetches).
  Status drain();
  // Delayed mode, loading a stale copy before any step: the engine moves to the position
  // after one (empty) step, where the next step reads the copy one version behind the
  // masters, and the step number the metrics give is kept.
  Status enter_stale_position();
  // The state access behind the whole-shard and ranged calls; `call` names the caller in errors.
  Status check_whole_shard(int g, size_t elements, const char* call);
  Status read_state_part(int g, StateKind kind, size_t first, std::span<float> out, const char* call);
  Status write_state_part(int g, StateKind kind, size_t first, std::span<const float> in, const char* call);
  Status write_stale_parameters(int g, size_t first, std::span<const float> in, const char* call);
  Status write_frozen_parameters(int g, size_t first, std::span<const float> in, const char* call);

  EngineOptions options_;
  Device& device_;
  Communicator& gather_comm_;
  Communicator& reduce_comm_;
  Tracer tracer_;
  std::unique_ptr<Stream> compute_stream_, h2d_stream_, gather_stream_, reduce_stream_, d2h_stream_, update_stream_;
  // Before the groups: their open compute intervals give their events back to it.
  std::unique_ptr<StreamTrace> stream_trace_;

  // The arena and the store first: everything below holds buffers or extents of them, and
  // members are destroyed in reverse order.
  std::unique_ptr<PinnedArena> arena_;
  std::unique_ptr<NvmeStore> nvme_;
  std::vector<std::unique_ptr<GroupState>> groups_;
  std::vector<GroupLayout> layouts_;  // every group's, by id (from start(): the stages read them)
  std::vector<int> declared_schedule_;
  int held_gradients_ = -1;  // declare_held_gradients(); -1: inferred by the plan
  std::vector<bool> loaded_groups_;  // declare_loaded(): no initial values written at start()
  int initialized_groups_ = 0;
  std::unique_ptr<ShardStore> shards_;  // the parameter copies
  // What the stages share: the CPU Adam and its threads, the NVMe optimizer state.
  std::optional<CpuAdam> adam_;
  std::unique_ptr<NvmeAdamState> nvme_state_;
  // The stages (each with its own worker and queue but the use planner, which is the
  // model thread's), and their hand-offs: the gradients the gradient path publishes to
  // the optimizer, the versions the optimizer publishes to the fetcher.
  std::unique_ptr<GradientBoard> gradient_board_;
  std::unique_ptr<VersionBoard> versions_;
  std::unique_ptr<OptimizerStage> optimizer_stage_;
  std::unique_ptr<GradientPath> gradient_path_;
  std::unique_ptr<ParamFetcher> fetcher_;
  std::unique_ptr<UsePlanner> uses_;
  std::optional<LossScaler> loss_scaler_;
  DeviceBuffer norm_buffer_;           // one float for the norm all-reduce
  EnginePlan plan_;
  bool started_ = false;
  bool finished_cleanly_ = false;      // finish() drained everything: no collective of ours is pending
  bool early_update_ = false;          // exact mode without clipping or loss scaling: Adam(g) starts when g lands
  double learning_rate_ = 0.0;         // this step's rate (model thread; copied for the lander under mutex_)

  // The model thread's program position.
  struct ActiveUse {
    uint64_t request = 0;               // 0 = no fetch was needed
    PipelineState position;             // where the group is gathered (index -1: persistent or direct)
  };
  std::map<int, ActiveUse> active_uses_;  // groups gathered and not yet released
  int64_t step_index_ = 0;              // index of the current step (steps finished so far)
  int64_t step_number_base_ = 0;        // the metrics' step number is step_number_base_ + step_index_
  int micro_ = -1;                      // current micro-batch within the step
  bool forward_only_ = false;           // inside begin_forward() ... end_forward()
  int64_t applied_steps_ = 0;           // updates applied (skipped steps do not count)
  TraceClock::time_point step_window_begin_;
  bool window_open_ = false;

  // Facts shared with the stages' hooks, guarded by mutex_.
  std::mutex mutex_;
  std::condition_variable cv_;
  StageHalt halt_;                      // the first error of any stage; shutdown
  double step_learning_rate_ = 0.0;     // the rate this step's early updates use
  int64_t step_applied_number_ = 1;     // the applied-step number this step's early updates use
  int64_t steps_finished_ = 0;          // step() calls completed
  int64_t optimizer_jobs_queued_ = 0;
  int64_t optimizer_jobs_done_ = 0;
  StepMetrics metrics_;
};

}  // namespace strata::engine_internal
