#include "engine/engine.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <set>
#include <sstream>

#include "engine/core/log.h"
#include "engine/engine_impl.h"
#include "engine/engine_plan.h"
#include "engine/gradient_board.h"
#include "engine/gradient_path.h"
#include "engine/metrics.h"
#include "engine/optimizer_stage.h"
#include "engine/param_fetcher.h"
#include "engine/shard_store.h"
#include "engine/use_planner.h"
#include "engine/version_board.h"
#include "kernels/cast.h"
#include "kernels/transformer_ops.h"

namespace strata {

namespace engine_internal {
namespace {

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

  // ----------------------------------------------------------------- the step
  Status begin_step(double learning_rate) override;
  Status begin_micro_batch() override;
  StatusOr<GroupView> gather(int group) override;
  Status release(int group) override;
  Status check_gather_slot_free(int g) const;
  StatusOr<GroupView> gradient_buffer(int group) override;
  Status grads_ready(int group) override;
  StatusOr<StepReport> step(double loss) override;
  Status finish() override;
  Status begin_forward(std::span<const int> order) override;
  Status end_forward() override;

  Status read_state_shard(int group, StateKind kind, std::span<float> out) override;
  Status write_state_shard(int group, StateKind kind, std::span<const float> in) override;
  Status refresh_parameters() override;
  bool has_stale_parameters() const override { return options_.overlap == OverlapMode::kDelayed && step_index_ >= 1; }
  OverlapMode overlap_mode() const override { return options_.overlap; }
  Status wait_for_state_access(int g, size_t elements, const char* call);

 private:
  // Start-up pieces.
  Status allocate_and_initialize();
  Status create_hand_offs();
  Status create_optimizer_stage();
  Status create_gradient_path();
  // Exact mode without clipping or loss scaling: group g's update of `step` starts as
  // soon as its gradients have landed.
  Status submit_early_update(int g, int64_t step);
  Status initialize_group(GroupState& g, std::vector<float>& init);

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
  Status write_stale_parameters(int g, std::span<const float> in);
  Status write_frozen_parameters(int g, std::span<const float> in);

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

// =====================================================================================
// Planning and start-up
// =====================================================================================

Status EngineImpl::allocate_and_initialize() {
  // Host memory: one arena (locked when pin_memory), sized by the plan.
  const size_t host_bytes = plan_.pinned_bytes + plan_.host_bytes;
  if (host_bytes > 0) {
    PinnedArenaOptions arena_options;
    // Slack for the slab allocator: buffers are carved in plan order, but a best-fit
    // allocator can fragment.
    arena_options.bytes = host_bytes + host_bytes / 32 + (size_t{4} << 20);
    arena_options.lock = options_.pin_memory;
    arena_options.register_with_gpu = options_.pin_memory;
    STRATA_ASSIGN_OR_RETURN(arena_, PinnedArena::create(arena_options));
  }
  if (plan_.nvme_bytes > 0) {
    NvmeStoreOptions store;
    store.nvme_path = options_.nvme_path;
    store.rank = options_.rank;
    store.checksums = options_.nvme_checksum;
    store.initial_bytes = plan_.nvme_bytes;
    store.io.queue_depth = static_cast<unsigned>(std::max(1, options_.nvme_queue_depth));
    store.io.max_request_bytes = std::max<size_t>(4096, options_.nvme_block_bytes);
    store.io.kind = options_.io_engine;
    store.io.faults = options_.io_faults;
    STRATA_ASSIGN_OR_RETURN(nvme_, NvmeStore::open(store));
    if (arena_) {
      auto registered = nvme_->io_engine().register_buffers(*arena_);
      if (!registered.ok()) STRATA_LOG(kWarn) << "io_uring buffer registration failed: " << registered.status().to_string();
    }
  }

  STRATA_ASSIGN_OR_RETURN(norm_buffer_, device_.allocate(256, "norm all-reduce"));
  STRATA_RETURN_IF_ERROR(create_hand_offs());
  ShardStoreContext shard_context{&options_, &device_, update_stream_.get(), arena_.get(), nvme_.get(), &tracer_, &layouts_};
  shards_ = std::make_unique<ShardStore>(shard_context);
  STRATA_RETURN_IF_ERROR(create_optimizer_stage());
  STRATA_RETURN_IF_ERROR(create_gradient_path());
  STRATA_RETURN_IF_ERROR(create_param_fetcher());
  if (options_.fp16_loss_scaling) {
    STRATA_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::create(options_.loss_scaler));
    loss_scaler_.emplace(scaler);
  }
  early_update_ = options_.overlap == OverlapMode::kExact && options_.gradient_clipping <= 0.0f && !options_.fp16_loss_scaling &&
                  !options_.skip_non_finite_updates;

  // Per group: storage, then the initial values of the local shards.
  std::vector<float> init(plan_.max_shard_elements);
  for (auto& gp : groups_) STRATA_RETURN_IF_ERROR(initialize_group(*gp, init));
  return {};
}

// What the stages share and hand each other: the CPU Adam (its threads also run the
// gradient path's loops), the NVMe optimizer state (the gradient path spills beside it),
// the gradient board (gradient path -> optimizer) and the version board (optimizer ->
// fetcher and model).
Status EngineImpl::create_hand_offs() {
  CpuAdamOptions adam_options;
  adam_options.threads = options_.optimizer_threads > 0 ? options_.optimizer_threads
                                                        : std::max(1, available_cpu_count() / std::max(1, options_.world_size));
  STRATA_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::create(adam_options));
  adam_.emplace(std::move(adam));
  if (options_.optimizer_tier == Tier::kNvme) {
    std::vector<size_t> shards;
    for (const GroupLayout& layout : layouts_) shards.push_back(layout.trainable ? layout.shard_numel : 0);  // frozen: no state
    STRATA_ASSIGN_OR_RETURN(nvme_state_, NvmeAdamState::create(*nvme_, *arena_, std::move(shards), state_ring_options(options_, plan_)));
  }
  gradient_board_ = std::make_unique<GradientBoard>(layouts_.size());
  std::vector<bool> trainable;
  for (const GroupLayout& layout : layouts_) trainable.push_back(layout.trainable);
  versions_ = std::make_unique<VersionBoard>(trainable);
  return {};
}

Status EngineImpl::create_optimizer_stage() {
  OptimizerStageContext context;
  context.options = &options_;
  context.plan = &plan_;
  context.device = &device_;
  context.update_stream = update_stream_.get();
  context.tracer = &tracer_;
  context.layouts = &layouts_;
  context.arena = arena_.get();
  context.adam = &*adam_;
  context.nvme_state = nvme_state_.get();
  context.shards = shards_.get();
  context.gradients = gradient_board_.get();
  context.versions = versions_.get();
  OptimizerStageHooks hooks;
  hooks.job_done = [this] {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++optimizer_jobs_done_;
    }
    cv_.notify_all();
  };
  hooks.failed = [this](Status status) { record_error(std::move(status)); };
  STRATA_ASSIGN_OR_RETURN(optimizer_stage_, OptimizerStage::create(context, std::move(hooks)));
  return {};
}

Status EngineImpl::create_gradient_path() {
  GradientPathContext context;
  context.options = &options_;
  context.plan = &plan_;
  context.device = &device_;
  context.compute = compute_stream_.get();
  context.reduce = reduce_stream_.get();
  context.d2h = d2h_stream_.get();
  context.reduce_comm = &reduce_comm_;
  context.tracer = &tracer_;
  context.stream_trace = stream_trace_.get();
  context.layouts = &layouts_;
  context.board = gradient_board_.get();
  context.arena = arena_.get();
  context.spill = nvme_state_.get();
  context.executor = &adam_->executor();
  GradientPathHooks hooks;
  hooks.landed = [this](int g, int64_t step) {
    if (!early_update_) return;
    Status status = submit_early_update(g, step);
    if (!status.ok()) record_error(std::move(status).with_context("planning the update of group " + std::to_string(g)));
  };
  hooks.failed = [this](Status status) { record_error(std::move(status)); };
  hooks.describe_engine = [this] { return describe_state(); };
  hooks.wait_for_update = [this](int g, int64_t version) {
    return versions_->wait_for(g, version, "the previous step's update of the group (it reads the device gradient)", describer());
  };
  STRATA_ASSIGN_OR_RETURN(gradient_path_, GradientPath::create(context, std::move(hooks)));
  return gradient_path_->allocate();
}

Status EngineImpl::create_param_fetcher() {
  ParamFetcherContext context;
  context.options = &options_;
  context.plan = &plan_;
  context.device = &device_;
  context.h2d = h2d_stream_.get();
  context.gather = gather_stream_.get();
  context.compute = compute_stream_.get();
  context.gather_comm = &gather_comm_;
  context.tracer = &tracer_;
  context.stream_trace = stream_trace_.get();
  context.layouts = &layouts_;
  context.nvme = nvme_.get();
  context.arena = arena_.get();
  context.versions = versions_.get();
  context.shards = shards_.get();
  ParamFetcherHooks hooks;
  hooks.failed = [this](Status status) { record_error(std::move(status)); };
  hooks.describe_engine = [this] { return describe_state(); };
  STRATA_ASSIGN_OR_RETURN(fetcher_, ParamFetcher::create(context, std::move(hooks)));
  STRATA_RETURN_IF_ERROR(fetcher_->allocate());
  UsePlannerOptions uses;
  uses.prefetch_depth = plan_.prefetch_depth;
  uses.micro_batches = options_.gradient_accumulation_steps;
  uses.overlap = options_.overlap;
  uses_ = std::make_unique<UsePlanner>(uses, *fetcher_);
  uses_->declare(declared_schedule_);
  return {};
}

Status EngineImpl::submit_early_update(int g, int64_t step) {
  double lr = 0.0;
  int64_t applied = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    lr = step_learning_rate_;
    applied = step_applied_number_;
  }
  OptimizerJob job;
  kernels::AdamHyperparams hyper = options_.adam;
  hyper.lr = lr;
  GradientStats none;  // no clipping, no loss scale: the plan does not depend on the norm
  STRATA_ASSIGN_OR_RETURN(job.decay_plan, plan_adam_step(hyper, applied, none, {}));
  hyper.weight_decay = 0.0;
  STRATA_ASSIGN_OR_RETURN(job.no_decay_plan, plan_adam_step(hyper, applied, none, {}));
  job.step_index = step;
  job.order = {g};
  {
    std::lock_guard<std::mutex> lock(mutex_);
    ++optimizer_jobs_queued_;
  }
  optimizer_stage_->submit(std::move(job));
  return {};
}

Status EngineImpl::initialize_group(GroupState& g, std::vector<float>& init) {
  const size_t id = static_cast<size_t>(g.layout.id);
  if (id < loaded_groups_.size() && loaded_groups_[id]) {
    // The caller's load writes the master weights and the parameters: storage, zero moments.
    STRATA_RETURN_IF_ERROR(shards_->allocate_group(g.layout.id, nullptr));
    if (!g.layout.trainable) return {};
    return optimizer_stage_->initialize_group(g.layout.id, nullptr);
  }
  ++initialized_groups_;
  init_shard(g.layout, options_.rank, options_.seed, init.data());
  STRATA_RETURN_IF_ERROR(shards_->allocate_group(g.layout.id, init.data()));
  // A frozen group is its parameters alone: no optimizer state.
  if (!g.layout.trainable) return {};
  // Optimizer state: master = the fp32 initial values, moments zero.
  return optimizer_stage_->initialize_group(g.layout.id, init.data());
}

Status EngineImpl::start() {
  if (started_) return FailedPreconditionError("start() called twice");
  layouts_.clear();
  for (const auto& g : groups_) layouts_.push_back(g->layout);
  PlanInputs inputs;
  inputs.options = &options_;
  inputs.layouts = layouts_;
  inputs.schedule = declared_schedule_;
  inputs.held_gradients = held_gradients_;
  inputs.device_budget_bytes = device_.memory_stats().budget_bytes;
  STRATA_ASSIGN_OR_RETURN(plan_, make_engine_plan(inputs));
  if (options_.rank == 0) STRATA_LOG(kInfo) << plan_.text;
  STRATA_RETURN_IF_ERROR(check_plan_against_machine(plan_, options_));
  STRATA_RETURN_IF_ERROR(allocate_and_initialize());
  StepMetricsOptions metrics;
  metrics.jsonl_path = options_.metrics_path;
  metrics.steps_per_print = options_.steps_per_print;
  metrics.wall_clock_breakdown = options_.wall_clock_breakdown;
  metrics.rank = options_.rank;
  STRATA_RETURN_IF_ERROR(metrics_.open(metrics));
  started_ = true;
  STRATA_RETURN_IF_ERROR(fetcher_->start());
  STRATA_RETURN_IF_ERROR(gradient_path_->start());
  STRATA_RETURN_IF_ERROR(optimizer_stage_->start());
  return {};
}

// =====================================================================================
// Background errors and shutdown
// =====================================================================================

void EngineImpl::record_error(Status status) {
  if (status.ok()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!halt_.failure.ok()) return;  // the first error is the one that counts
    halt_.failure = status;
  }
  cv_.notify_all();
  // Every stage's waits return the error.
  if (versions_) versions_->abort(status);
  if (fetcher_) fetcher_->abort(status);
  if (gradient_path_) gradient_path_->abort(status);
  STRATA_LOG(kError) << "rank " << options_.rank << ": " << status.to_string() << "\n" << describe_state();
  // Peers blocked in a collective with us must not hang.
  gather_comm_.abort("rank " + std::to_string(options_.rank) + " failed: " + status.message());
  reduce_comm_.abort("rank " + std::to_string(options_.rank) + " failed: " + status.message());
}

std::string EngineImpl::describe_state() {
  std::ostringstream text;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    text << "engine state, rank " << options_.rank << ": model at step " << step_index_ << " micro-batch " << micro_ << "; steps finished "
         << steps_finished_ << "; optimizer jobs " << optimizer_jobs_done_ << "/" << optimizer_jobs_queued_;
  }
  if (uses_) text << "; use " << uses_->use_index() << " of the micro-batch, " << uses_->planned_ahead() << " planned ahead";
  if (fetcher_) text << "; " << fetcher_->describe();
  if (gradient_path_) text << "; " << gradient_path_->describe();
  if (versions_) text << "; " << versions_->describe();
  return text.str();
}

void EngineImpl::shutdown() {
  if (started_ && !finished_cleanly_) {
    // Gathers this rank planned may never be issued now: peers must not wait for them.
    gather_comm_.abort("rank " + std::to_string(options_.rank) + "'s engine was destroyed before finish()");
    reduce_comm_.abort("rank " + std::to_string(options_.rank) + "'s engine was destroyed before finish()");
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    halt_.stopping = true;
  }
  cv_.notify_all();
  if (versions_) versions_->stop();
  if (fetcher_) fetcher_->stop();
  if (gradient_path_) gradient_path_->stop();
  if (optimizer_stage_) optimizer_stage_->stop();
  if (started_) {
    const bool failed = !background_error().ok();
    // Drain the streams so nothing still touches memory about to be freed.
    Status drained = device_.synchronize();
    if (!drained.ok() && !failed) STRATA_LOG(kWarn) << "engine shutdown: " << drained.to_string();
    if (nvme_) {
      Status io = nvme_->wait_all();
      if (!io.ok() && !failed) STRATA_LOG(kWarn) << "engine shutdown: " << io.to_string();
    }
  }
}

// =====================================================================================
// The model-facing step API (model thread)
// =====================================================================================

Status EngineImpl::begin_step(double learning_rate) {
  if (!started_) return FailedPreconditionError("begin_step() before start()");
  STRATA_RETURN_IF_ERROR(background_error());
  if (forward_only_) return FailedPreconditionError("begin_step() in a forward-only pass: call end_forward() first");
  if (micro_ >= 0) return FailedPreconditionError("begin_step() twice without step()");
  if (learning_rate >= 0.0) learning_rate_ = learning_rate;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    step_learning_rate_ = learning_rate_;
    step_applied_number_ = applied_steps_ + 1;
  }
  if (!window_open_) {
    step_window_begin_ = TraceClock::now();
    window_open_ = true;
  }
  micro_ = -1;
  return begin_micro_batch();
}

Status EngineImpl::begin_micro_batch() {
  if (!started_) return FailedPreconditionError("begin_micro_batch() before start()");
  if (forward_only_) return FailedPreconditionError("begin_micro_batch() in a forward-only pass");
  STRATA_RETURN_IF_ERROR(background_error());
  if (micro_ + 1 >= options_.gradient_accumulation_steps)
    return FailedPreconditionError("more micro-batches than gradient_accumulation_steps (" +
                                   std::to_string(options_.gradient_accumulation_steps) + ") in step " + std::to_string(step_index_));
  ++micro_;
  uses_->begin_micro_batch(step_index_, micro_);
  gradient_path_->begin_micro_batch();
  return {};
}

StatusOr<GroupView> EngineImpl::gather(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "gather"));
  if (micro_ < 0) return FailedPreconditionError("gather() outside a step: call begin_step() (or begin_forward()) first");
  STRATA_RETURN_IF_ERROR(background_error());
  if (active_uses_.count(g) != 0)
    return FailedPreconditionError("gather(" + std::to_string(g) + ") while the group is gathered: release() it first");
  GroupState& state = group(g);
  // Before the use is planned: a refused gather leaves no fetch behind.
  if (plan_.persistent[static_cast<size_t>(g)] == 0 && !direct_view(state)) STRATA_RETURN_IF_ERROR(check_gather_slot_free(g));
  const uint64_t request = forward_only_ ? uses_->next_forward_gather(g, step_index_) : uses_->next_gather(g, step_index_, micro_);
  ActiveUse use{request, {}};
  void* flat = nullptr;
  if (request != 0) {
    STRATA_ASSIGN_OR_RETURN(flat, fetcher_->take(request, &use.position));
  } else if (direct_view(state)) {
    const int64_t version = current_use_version();
    STRATA_RETURN_IF_ERROR(versions_->wait_for(g, version, "the group's update", describer()));
    flat = const_cast<void*>(shards_->source(g, version).device);
  } else {
    // A persistent group whose fetch of this version was planned by an earlier use.
    STRATA_ASSIGN_OR_RETURN(flat, fetcher_->take_persistent(g));
  }
  active_uses_[g] = use;
  // A timing event, not a host callback: a CUDA host function would hold the compute
  // stream until a runtime thread had run it, at every gather and release.
  STRATA_ASSIGN_OR_RETURN(state.compute_trace, stream_trace_->open(*compute_stream_));
  return view_of(state, flat, options_.param_dtype);
}

// A gather waits for the fetcher to fill a slot; a slot the model holds (gathered, not
// released) is never refilled. With every slot held the wait could not end: an error naming
// the holders, not a hang.
Status EngineImpl::check_gather_slot_free(int g) const {
  std::string held;
  int holding = 0;
  for (const auto& [h, use] : active_uses_) {
    if (use.position.index < 0) continue;
    ++holding;
    held += (held.empty() ? "" : ", ") + groups_[static_cast<size_t>(h)]->layout.name;
  }
  if (holding < plan_.gather_slots) return {};
  return FailedPreconditionError("gather(" + std::to_string(g) + "): all " + std::to_string(plan_.gather_slots) +
                                 " gather slots hold groups that are gathered and not released (" + held +
                                 "): release one first, or plan more slots (a deeper prefetch, strata.prefetch_depth)");
}

Status EngineImpl::release(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "release"));
  auto it = active_uses_.find(g);
  if (it == active_uses_.end()) return FailedPreconditionError("release(" + std::to_string(g) + ") of a group that is not gathered");
  const ActiveUse use = it->second;
  active_uses_.erase(it);
  GroupState& state = group(g);
  STRATA_RETURN_IF_ERROR(stream_trace_->close(std::move(state.compute_trace), Stage::kCompute, state.layout.id, state.layout.name));
  if (direct_view(state)) return {};
  return fetcher_->release(g, use.position);
}

StatusOr<GroupView> EngineImpl::gradient_buffer(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "gradient_buffer"));
  STRATA_RETURN_IF_ERROR(check_trainable(g, "gradient_buffer(" + std::to_string(g) + ")"));
  if (micro_ < 0) return FailedPreconditionError("gradient_buffer() outside a step");
  if (forward_only_) return FailedPreconditionError("gradient_buffer() in a forward-only pass");
  STRATA_ASSIGN_OR_RETURN(float* buffer, gradient_path_->buffer(g));
  return view_of(group(g), buffer, DType::kFloat32);
}

Status EngineImpl::grads_ready(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "grads_ready"));
  STRATA_RETURN_IF_ERROR(check_trainable(g, "grads_ready(" + std::to_string(g) + ")"));
  if (forward_only_) return FailedPreconditionError("grads_ready() in a forward-only pass");
  if (micro_ < 0) return FailedPreconditionError("grads_ready() outside a step");
  STRATA_RETURN_IF_ERROR(background_error());
  return gradient_path_->hand_over(g, step_index_, micro_);
}

// The global statistics: one all-reduce of the sum of squares, with inf carrying overflow.
StatusOr<GradientStats> EngineImpl::reduce_statistics(const GradientStats& local) {
  GradientStats global = local;
  if (options_.world_size == 1) return global;
  float value = local.non_finite ? std::numeric_limits<float>::infinity() : static_cast<float>(local.sum_of_squares);
  STRATA_RETURN_IF_ERROR(device_.copy_async(norm_buffer_.data(), &value, sizeof(float), CopyKind::kHostToDevice, *reduce_stream_));
  STRATA_RETURN_IF_ERROR(reduce_comm_.all_reduce(norm_buffer_.data(), norm_buffer_.data(), 1, DType::kFloat32, {}, *reduce_stream_));
  STRATA_RETURN_IF_ERROR(device_.copy_async(&value, norm_buffer_.data(), sizeof(float), CopyKind::kDeviceToHost, *reduce_stream_));
  STRATA_RETURN_IF_ERROR(reduce_stream_->synchronize());
  global.sum_of_squares = value;
  global.non_finite = !std::isfinite(value);
  return global;
}

// The update of step t, now that the global statistics are known (exact mode with
// clipping or loss scaling, and delayed mode): every group, in forward order.
StatusOr<OptimizerJob> EngineImpl::plan_update(int64_t t, const GradientStats& global) {
  kernels::AdamHyperparams hyper = options_.adam;
  hyper.lr = learning_rate_;
  AdamStepPlanOptions plan_options;
  plan_options.loss_scale = loss_scale();
  plan_options.max_grad_norm = options_.gradient_clipping;
  OptimizerJob job;
  job.step_index = t;
  STRATA_ASSIGN_OR_RETURN(job.decay_plan, plan_adam_step(hyper, applied_steps_ + 1, global, plan_options));
  kernels::AdamHyperparams no_decay = hyper;
  no_decay.weight_decay = 0.0;
  STRATA_ASSIGN_OR_RETURN(job.no_decay_plan, plan_adam_step(no_decay, applied_steps_ + 1, global, plan_options));
  job.skip = job.decay_plan.skip;
  // Forward order: the first use of each group in the schedule, then any group not in it.
  // Frozen groups have nothing to update (their versions are always current).
  std::set<int> seen;
  for (int g = 0; g < group_count(); ++g)
    if (!group(g).layout.trainable) seen.insert(g);
  for (int g : uses_->schedule())
    if (seen.insert(g).second) job.order.push_back(g);
  for (int g = 0; g < group_count(); ++g)
    if (seen.insert(g).second) job.order.push_back(g);
  return job;
}

StatusOr<StepReport> EngineImpl::step(double loss) {
  if (!started_) return FailedPreconditionError("step() before start()");
  if (forward_only_) return FailedPreconditionError("step() in a forward-only pass: call end_forward()");
  if (micro_ < 0) return FailedPreconditionError("step() without begin_step()");
  if (micro_ + 1 != options_.gradient_accumulation_steps)
    return FailedPreconditionError("step() after " + std::to_string(micro_ + 1) + " micro-batches; gradient_accumulation_steps is " +
                                   std::to_string(options_.gradient_accumulation_steps));
  if (!active_uses_.empty())
    return FailedPreconditionError("step() while group " + std::to_string(active_uses_.begin()->first) + " is still gathered");
  const int64_t t = step_index_;
  STRATA_ASSIGN_OR_RETURN(const GradientStats local, gradient_path_->wait_step_landed(t));
  STRATA_ASSIGN_OR_RETURN(const GradientStats global, reduce_statistics(local));
  StepReport report;
  report.loss_scale = loss_scale();
  // Where this step's report window ends. A job submitted below runs on the optimizer's
  // thread; it counts in the next step's window whole, never partly in this one by how
  // soon that thread wakes (its params are not fetched again before it has run).
  TraceClock::time_point window_end = TraceClock::now();
  if (early_update_) {
    // The updates were planned as the gradients landed.
    report.grad_norm = std::sqrt(global.sum_of_squares);
    ++applied_steps_;
  } else {
    STRATA_ASSIGN_OR_RETURN(OptimizerJob job, plan_update(t, global));
    report.grad_norm = job.decay_plan.grad_norm;
    report.skipped = job.skip;
    if (loss_scaler_) loss_scaler_->update(job.skip);
    if (!job.skip) ++applied_steps_;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++optimizer_jobs_queued_;
    }
    window_end = TraceClock::now();
    optimizer_stage_->submit(std::move(job));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    steps_finished_ = t + 1;
  }
  fetcher_->set_steps_finished(t + 1);
  step_index_ = t + 1;
  micro_ = -1;
  report.step = applied_steps_;
  report.loss = loss;
  STRATA_RETURN_IF_ERROR(finish_report(report, window_end));
  return report;
}

// The report and metrics over the window from the previous step's end to `now` (step()'s window end).
Status EngineImpl::finish_report(StepReport& report, TraceClock::time_point now) {
  report.step_seconds = std::chrono::duration<double>(now - step_window_begin_).count();
  // The streams' intervals that have completed by now (non-blocking; the rest count in a later window).
  STRATA_RETURN_IF_ERROR(stream_trace_->collect());
  report.busy = tracer_.busy_seconds(step_window_begin_, now);
  const MemoryStats memory = device_.memory_stats();
  report.device_high_water_bytes = memory.high_water_bytes;
  report.device_budget_bytes = memory.budget_bytes;
  report.pinned_bytes = arena_ ? arena_->stats().arena_bytes : 0;
  if (nvme_) {
    const auto io = nvme_->stats();
    report.nvme_bytes_read = io.bytes_read;
    report.nvme_bytes_written = io.bytes_written;
  }
  step_window_begin_ = now;
  if (options_.trace_path.empty()) tracer_.forget_before(now - std::chrono::seconds(60));
  return metrics_.record(step_number_base_ + step_index_, report);
}

Status EngineImpl::wait_for_updates(const char* what) {
  std::unique_lock<std::mutex> lock(mutex_);
  return stage_wait(lock, cv_, halt_, [&] { return optimizer_jobs_done_ == optimizer_jobs_queued_; }, what, nullptr);
}

// Everything planned is carried out: landings (early updates are submitted as they land),
// updates with their write-backs, and every fetch already planned (the prefetcher runs
// ahead into a next step, and every rank must issue the same gathers or its peers wait).
Status EngineImpl::drain() {
  STRATA_RETURN_IF_ERROR(gradient_path_->wait_drained());
  int64_t steps = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    steps = steps_finished_;
  }
  STRATA_RETURN_IF_ERROR(versions_->wait_all(steps, "every group's update", describer()));
  STRATA_RETURN_IF_ERROR(wait_for_updates("outstanding updates"));
  return fetcher_->wait_idle();
}

Status EngineImpl::finish() {
  if (!started_) return FailedPreconditionError("finish() before start()");
  // Inside a pass, fetches of versions no update will make could be planned: waiting for
  // them would never end.
  if (forward_only_) return FailedPreconditionError("finish() in a forward-only pass: call end_forward() first");
  if (micro_ >= 0) return FailedPreconditionError("finish() inside a step: call step() first");
  STRATA_RETURN_IF_ERROR(drain());
  STRATA_RETURN_IF_ERROR(device_.synchronize());
  if (nvme_) STRATA_RETURN_IF_ERROR(nvme_->wait_all());
  STRATA_RETURN_IF_ERROR(background_error());
  // The streams are drained: every interval closed so far resolves.
  STRATA_RETURN_IF_ERROR(stream_trace_->collect());
  if (const StreamTraceStats traced = stream_trace_->stats(); traced.dropped > 0) {
    STRATA_LOG(kInfo) << "rank " << options_.rank << ": " << traced.dropped << " stream interval(s) of " << traced.resolved + traced.dropped
                      << " are missing from the trace and the busy seconds (the pool of timing events was exhausted, or a stream "
                         "skipped them after an error)";
  }
  if (!options_.trace_path.empty() && options_.rank == 0) STRATA_RETURN_IF_ERROR(write_chrome_trace(options_.trace_path, {&tracer_}));
  finished_cleanly_ = true;
  return {};
}

Status EngineImpl::begin_forward(std::span<const int> order) {
  if (!started_) return FailedPreconditionError("begin_forward() before start()");
  for (int g : order)
    if (g < 0 || g >= static_cast<int>(groups_.size()))
      return InvalidArgumentError("begin_forward(): the order names group " + std::to_string(g) + ", and there are " +
                                  std::to_string(groups_.size()));
  STRATA_RETURN_IF_ERROR(background_error());
  if (forward_only_) return FailedPreconditionError("begin_forward() twice without end_forward()");
  if (micro_ >= 0) return FailedPreconditionError("begin_forward() inside a step: call step() first");
  forward_only_ = true;
  micro_ = 0;
  uses_->begin_forward(order, step_index_);
  return {};
}

Status EngineImpl::end_forward() {
  if (!forward_only_) return FailedPreconditionError("end_forward() without begin_forward()");
  if (!active_uses_.empty())
    return FailedPreconditionError("end_forward() while group " + std::to_string(active_uses_.begin()->first) + " is still gathered");
  uses_->end_forward(step_index_);
  forward_only_ = false;
  micro_ = -1;
  return {};
}

Status EngineImpl::restore_loss_scaler_state(const LossScaler::State& state) {
  if (!loss_scaler_) return FailedPreconditionError("restore_loss_scaler_state(): this engine does not scale losses (fp16 loss scaling is off)");
  if (micro_ >= 0) return FailedPreconditionError("restore_loss_scaler_state() inside a step");
  if (!std::isfinite(state.scale) || state.scale <= 0.0f || state.clean_steps < 0 || state.remaining_hysteresis < 0)
    return InvalidArgumentError("restore_loss_scaler_state(): scale " + std::to_string(state.scale) + ", clean steps " +
                                std::to_string(state.clean_steps) + ", remaining hysteresis " + std::to_string(state.remaining_hysteresis) +
                                " is not a loss scaler's state");
  loss_scaler_->restore(state);
  return {};
}

// State access (model thread), once no update of the group is pending: the optimizer
// stage reads or writes one kind of the group's state wherever it lives.
Status EngineImpl::wait_for_state_access(int g, size_t elements, const char* call) {
  STRATA_RETURN_IF_ERROR(check_group(g, call));
  GroupState& state = group(g);
  const size_t shard = state.layout.shard_numel;
  if (elements != shard)
    return InvalidArgumentError(std::string(call) + ": group " + state.layout.name + " has " + std::to_string(shard) +
                                " elements per shard, the span has " + std::to_string(elements));
  int64_t steps = 0;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    steps = steps_finished_;
  }
  // The whole update, the write-back of NVMe-resident state included.
  STRATA_RETURN_IF_ERROR(versions_->wait_for(g, steps, "the group's update", describer()));
  return wait_for_updates("the group's update");
}

const char* state_kind_name(Engine::StateKind kind) {
  switch (kind) {
    case Engine::StateKind::kMaster: return "master";
    case Engine::StateKind::kExpAvg: return "exp_avg";
    case Engine::StateKind::kExpAvgSq: return "exp_avg_sq";
    case Engine::StateKind::kStaleParams: return "stale parameters";
  }
  return "?";
}

// A frozen group's only state is its parameter copy, which stands in for its master.
Status EngineImpl::read_state_shard(int g, StateKind kind, std::span<float> out) {
  STRATA_RETURN_IF_ERROR(wait_for_state_access(g, out.size(), "read_state_shard"));
  if (!group(g).layout.trainable) {
    if (kind != StateKind::kMaster)
      return check_trainable(g, "read_state_shard(" + std::to_string(g) + ", " + state_kind_name(kind) + ")");
    return shards_->load_values(g, 0, out.data());
  }
  if (kind != StateKind::kStaleParams) return optimizer_stage_->read_state(g, kind, out);
  if (!has_stale_parameters())
    return FailedPreconditionError("read_state_shard(" + std::to_string(g) + ", stale parameters): there is no stale copy (" +
                                   (options_.overlap == OverlapMode::kExact ? "exact overlap mode" : "no step taken yet") +
                                   "); ask has_stale_parameters() first");
  // Between steps: the copy the next step reads, one version behind the masters.
  return shards_->load_values(g, shards_->copy_of(g, uses_->step_version(step_index_)), out.data());
}

Status EngineImpl::write_state_shard(int g, StateKind kind, std::span<const float> in) {
  STRATA_RETURN_IF_ERROR(wait_for_state_access(g, in.size(), "write_state_shard"));
  if (!group(g).layout.trainable) {
    if (kind != StateKind::kMaster)
      return check_trainable(g, "write_state_shard(" + std::to_string(g) + ", " + state_kind_name(kind) + ")");
    return write_frozen_parameters(g, in);
  }
  if (kind == StateKind::kStaleParams) return write_stale_parameters(g, in);
  return optimizer_stage_->write_state(g, kind, in);
}

// As refresh_parameters() for one group, whose new values come from the caller.
Status EngineImpl::write_frozen_parameters(int g, std::span<const float> in) {
  if (micro_ >= 0 || forward_only_)
    return FailedPreconditionError("write_state_shard(" + std::to_string(g) + ", master) of frozen group '" + group(g).layout.name +
                                   "' inside a step or a forward-only pass");
  // Fetches planned ahead would carry the old values: let them finish, then forget them.
  uses_->restart(step_index_);
  STRATA_RETURN_IF_ERROR(drain());
  STRATA_RETURN_IF_ERROR(shards_->store_values(g, 0, in.data()));
  fetcher_->forget_persistent_fetches();
  return {};
}

Status EngineImpl::write_stale_parameters(int g, std::span<const float> in) {
  if (options_.overlap != OverlapMode::kDelayed)
    return FailedPreconditionError("write_state_shard(" + std::to_string(g) +
                                   ", stale parameters): exact overlap mode computes with the masters and keeps no stale copy");
  if (micro_ >= 0 || forward_only_) return FailedPreconditionError("write_state_shard(stale parameters) inside a step or a forward-only pass");
  if (step_index_ == 0) STRATA_RETURN_IF_ERROR(enter_stale_position());
  // The next step reads version step_index_ - 1; the masters' version step_index_ is in the
  // other copy (refresh_parameters() wrote it).
  STRATA_RETURN_IF_ERROR(shards_->store_values(g, shards_->copy_of(g, uses_->step_version(step_index_)), in.data()));
  fetcher_->forget_persistent_fetches();
  return {};
}

// Before the first step the next two steps would both read version 0 (there is nothing
// older). With a stale copy, version 0 is that copy and version 1 the masters (every copy
// holds them after refresh_parameters()): the engine stands where one step has finished
// and its update has been published.
Status EngineImpl::enter_stale_position() {
  uses_->restart(step_index_);
  STRATA_RETURN_IF_ERROR(drain());
  for (int g = 0; g < group_count(); ++g) versions_->publish(g, 1);
  {
    std::lock_guard<std::mutex> lock(mutex_);
    steps_finished_ = 1;
  }
  fetcher_->set_steps_finished(1);
  step_index_ = 1;
  --step_number_base_;  // the metrics' numbering stays where it was
  uses_->restart(step_index_);
  return {};
}

Status EngineImpl::refresh_parameters() {
  if (!started_) return FailedPreconditionError("refresh_parameters() before start()");
  if (micro_ >= 0) return FailedPreconditionError("refresh_parameters() inside a step");
  // Fetches planned ahead would carry the old values: let them finish, then forget them.
  uses_->restart(step_index_);
  STRATA_RETURN_IF_ERROR(drain());
  std::vector<float> master;
  for (auto& gp : groups_) {
    GroupState& g = *gp;
    if (!g.layout.trainable) continue;  // its parameters are its state: nothing to refresh from
    master.resize(g.layout.shard_numel);
    STRATA_RETURN_IF_ERROR(read_state_shard(g.layout.id, StateKind::kMaster, master));
    // Every copy gets the same values: the next fetch reads whichever its version picks.
    for (int c = 0; c < shards_->copies(g.layout.id); ++c) STRATA_RETURN_IF_ERROR(shards_->store_values(g.layout.id, c, master.data()));
  }
  fetcher_->forget_persistent_fetches();
  return {};
}

}  // namespace

}  // namespace engine_internal

StatusOr<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options, Device& device, Communicator& gather_comm,
                                                  Communicator& reduce_comm) {
  auto engine = std::make_unique<engine_internal::EngineImpl>(options, device, gather_comm, reduce_comm);
  STRATA_RETURN_IF_ERROR(engine->init());
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace strata
