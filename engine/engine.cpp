#include "engine/engine.h"

#include <algorithm>
#include <sstream>

#include "engine/core/file.h"
#include "engine/core/log.h"
#include "engine/engine_impl.h"
#include "engine/engine_plan.h"

namespace strata {

namespace engine_internal {

// =====================================================================================
// Planning and start-up
// =====================================================================================

Status EngineImpl::allocate_and_initialize() {
  // Host memory: one arena (locked when pin_memory), sized by the plan.
  const size_t host_bytes = plan_.pinned_bytes + plan_.host_bytes;
  if (host_bytes > 0) {
    PinnedArenaOptions arena_options;
    // With slack for the slab allocator: buffers are carved in plan order, but a best-fit
    // allocator can fragment. The plan's budget check counts it.
    arena_options.bytes = host_arena_bytes(host_bytes);
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

  // Per group: storage, then the initial values of the local shards, a chunk at a time.
  const size_t chunk = std::max<size_t>(std::min(plan_.max_shard_elements, kStateChunkElements), 1);
  STRATA_ASSIGN_OR_RETURN(AlignedBuffer init, AlignedBuffer::allocate(chunk * sizeof(float), 4096, "initial shard values"));
  for (auto& gp : groups_) STRATA_RETURN_IF_ERROR(initialize_group(*gp, {init.as<float>(), chunk}));
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
    return versions_->wait_for(g, version, "the previous update of the group (it reads the gradient buffer the model writes next)", describer());
  };
  hooks.host_wait_begins = [this] { return pause_compute_traces(); };
  hooks.host_wait_ends = [this] { return resume_compute_traces(); };
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

Status EngineImpl::initialize_group(GroupState& g, std::span<float> init) {
  const int id = g.layout.id;
  const bool loaded = static_cast<size_t>(id) < loaded_groups_.size() && loaded_groups_[static_cast<size_t>(id)];
  // Storage and zero moments; a frozen group is its parameters alone: no optimizer state.
  STRATA_RETURN_IF_ERROR(shards_->allocate_group(id));
  if (g.layout.trainable) STRATA_RETURN_IF_ERROR(optimizer_stage_->initialize_group(id));
  // The caller's load writes the master weights and the parameters.
  if (loaded) return {};
  ++initialized_groups_;
  // The fp32 initial values into every parameter copy and the master, chunk by chunk.
  const size_t shard = g.layout.shard_numel;
  for (size_t first = 0; first < shard; first += init.size()) {
    const std::span<float> values = init.first(std::min(init.size(), shard - first));
    init_shard_range(g.layout, options_.rank, options_.seed, first, values);
    for (int c = 0; c < shards_->copies(id); ++c) STRATA_RETURN_IF_ERROR(shards_->store_values(id, c, first, values));
    if (g.layout.trainable) STRATA_RETURN_IF_ERROR(optimizer_stage_->write_state(id, StateKind::kMaster, first, values));
  }
  return {};
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

}  // namespace engine_internal

StatusOr<std::unique_ptr<Engine>> Engine::create(const EngineOptions& options, Device& device, Communicator& gather_comm,
                                                  Communicator& reduce_comm) {
  auto engine = std::make_unique<engine_internal::EngineImpl>(options, device, gather_comm, reduce_comm);
  STRATA_RETURN_IF_ERROR(engine->init());
  return std::unique_ptr<Engine>(std::move(engine));
}

}  // namespace strata
