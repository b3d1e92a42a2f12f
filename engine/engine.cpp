#include "engine/engine.h"

#include <sys/resource.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/core/log.h"
#include "engine/engine_impl.h"
#include "engine/engine_plan.h"
#include "engine/gradient_path.h"
#include "engine/optimizer_stage.h"
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
    schedule_ = std::move(group_uses);
    schedule_valid_ = !schedule_.empty();
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
  StatusOr<GroupView> gradient_buffer(int group) override;
  Status grads_ready(int group) override;
  StatusOr<StepReport> step(double loss) override;
  Status finish() override;
  Status begin_forward(std::span<const int> order) override;
  Status end_forward() override;

  Status read_state_shard(int group, StateKind kind, std::span<float> out) override;
  Status write_state_shard(int group, StateKind kind, std::span<const float> in) override;
  Status refresh_parameters() override;
  Status wait_for_state_access(int g, size_t elements, const char* call);

 private:
  // Start-up pieces.
  Status allocate_and_initialize();
  Status create_optimizer_stage();
  Status create_gradient_path();
  // Exact mode without clipping or loss scaling: group g's update of `step` starts as
  // soon as its gradients have landed.
  Status submit_early_update(int g, int64_t step);
  Status initialize_group(GroupState& g, std::vector<float>& init, std::vector<uint16_t>& param16);

  // Threads.
  void fetcher_loop();
  Status fetch_one(FetchRequest& request);
  // Starts the NVMe reads of the requests after `r` that can start now.
  Status submit_read_ahead(const FetchRequest& r);
  // Parameters converted from fp32 values into the parameter tier's copy `copy` of g.
  Status store_parameters(GroupState& g, int copy, const float* values);
  void record_error(Status status);
  // A one-paragraph picture of where every stage stands (for errors and hangs).
  std::string describe_state();
  // How long a wait may last before it is reported: STRATA_HANG_WARNING_S, default 120 s.
  static std::chrono::seconds hang_warning_after() {
    static const std::chrono::seconds seconds = [] {
      const char* text = std::getenv("STRATA_HANG_WARNING_S");
      const long value = text != nullptr ? std::strtol(text, nullptr, 10) : 0;
      return std::chrono::seconds(value > 0 ? value : 120);
    }();
    return seconds;
  }
  Status background_error() {
    std::lock_guard<std::mutex> lock(mutex_);
    return failed_ ? first_error_ : Status();
  }
  void shutdown();

  // Helpers.
  GroupState& group(int g) { return *groups_[static_cast<size_t>(g)]; }
  Status check_group(int g, const char* call) const {
    if (!started_) return FailedPreconditionError(std::string(call) + " before start()");
    if (g < 0 || g >= static_cast<int>(groups_.size()))
      return InvalidArgumentError(std::string(call) + ": no group " + std::to_string(g));
    return {};
  }
  bool device_state() const { return options_.optimizer_tier == Tier::kDevice; }
  bool direct_view(const GroupState& /*state*/) const { return options_.param_tier == Tier::kDevice && options_.world_size == 1; }
  size_t param_bytes(size_t elements) const { return elements * dtype_size(options_.param_dtype); }
  int param_copies() const { return options_.overlap == OverlapMode::kDelayed ? 2 : 1; }
  int64_t required_version(int64_t step_index) const {
    return options_.overlap == OverlapMode::kDelayed ? std::max<int64_t>(0, step_index - 1) : step_index;
  }
  int parity(int64_t version) const { return param_copies() == 1 ? 0 : static_cast<int>(version % 2); }
  GroupView view_of(const GroupState& state, void* flat, DType dtype) const {
    GroupView view;
    view.group = state.layout.id;
    view.dtype = dtype;
    view.flat = flat;
    for (const auto& tensor : state.layout.tensors)
      view.tensors.push_back(static_cast<char*>(flat) + tensor.offset * dtype_size(dtype));
    return view;
  }
  // Enqueues `work` on `stream` with its execution interval traced.
  Status traced(Stream& stream, Stage stage, int group, std::string label, const std::function<Status()>& work);
  // Creates fetch requests ahead of the model, following the schedule (mutex held).
  void issue_ahead_locked();
  // The same for a forward-only pass with a declared order.
  void issue_forward_ahead_locked();
  // Slot uses planned ahead (persistent groups and direct views take no slot).
  int slot_uses_ahead_locked() {
    int count = 0;
    for (const auto& use : expected_)
      if (use.request != 0 && !group(use.group).persistent) ++count;
    return count;
  }
  // The next program position's group and step, following the schedule.
  struct ProgramCursor {
    int64_t step = 0;
    int micro = 0;
    size_t index = 0;
  };
  // Creates the fetch request a use of `g` in step `step_index` needs, or returns 0 when
  // the group needs no fetch (a direct view, or a persistent group already planned).
  uint64_t plan_use_locked(int g, int64_t step_index, int64_t version);
  // The parameter version the model's current pass uses: a step's (one behind in
  // delayed mode), or every update taken for a forward-only pass.
  int64_t current_use_version() const { return forward_only_ ? step_index_ : required_version(step_index_); }
  void abandon_outstanding_locked();
  FetchRequest& request_locked(uint64_t id) { return requests_[static_cast<size_t>(id - requests_.front().id)]; }
  // Waits on cv_ until `done()` or an error or shutdown; returns the error in those cases.
  template <class Predicate>
  Status wait_locked(std::unique_lock<std::mutex>& lock, Predicate done, const char* what) {
    // A wait that lasts says so once, with the state of every stage (a hang's diagnosis).
    const auto patience = hang_warning_after();
    if (!cv_.wait_for(lock, patience, [&] { return done() || failed_ || stopping_; })) {
      lock.unlock();
      STRATA_LOG(kWarn) << "rank " << options_.rank << " has waited " << patience.count() << " s for " << what << "\n"
                        << describe_state();
      lock.lock();
      cv_.wait(lock, [&] { return done() || failed_ || stopping_; });
    }
    if (failed_) return Status(first_error_).with_context(std::string("while waiting for ") + what);
    if (stopping_ && !done()) return CancelledError(std::string("engine shut down while waiting for ") + what);
    return {};
  }

  EngineOptions options_;
  Device& device_;
  Communicator& gather_comm_;
  Communicator& reduce_comm_;
  Tracer tracer_;
  std::unique_ptr<Stream> compute_stream_, h2d_stream_, gather_stream_, reduce_stream_, d2h_stream_, update_stream_;

  // The arena and the store first: everything below holds buffers or extents of them, and
  // members are destroyed in reverse order.
  std::unique_ptr<PinnedArena> arena_;
  std::unique_ptr<NvmeStore> nvme_;
  std::vector<std::unique_ptr<GroupState>> groups_;
  std::vector<GatherSlot> slots_;
  std::unique_ptr<OptimizerStage> optimizer_stage_;
  std::unique_ptr<GradientPath> gradient_path_;
  std::optional<LossScaler> loss_scaler_;
  DeviceBuffer norm_buffer_;           // one float for the norm all-reduce
  PinnedBuffer param_out_stage_;       // the optimizer's new parameters on their way to the device or NVMe
  DeviceBuffer param_out_device_;      // device-resident optimizer: new parameters on their way to the host or NVMe
  EnginePlan plan_;
  bool started_ = false;
  bool finished_cleanly_ = false;      // finish() drained everything: no collective of ours is pending
  bool early_update_ = false;          // exact mode without clipping or loss scaling: Adam(g) starts when g lands
  double learning_rate_ = 0.0;         // this step's rate (model thread; copied for the lander under mutex_)
  double step_learning_rate_ = 0.0;    // guarded by mutex_
  int64_t step_applied_number_ = 1;    // the applied-step number this step's early updates use; guarded by mutex_

  // Schedule and program position. The model thread owns these; the fetcher reads
  // requests only (under mutex_).
  std::vector<int> schedule_;
  bool schedule_valid_ = false;
  std::vector<int> recording_;
  bool recording_active_ = false;
  ProgramCursor issue_cursor_;          // next program position to plan a request for
  struct ExpectedUse {
    int64_t step;
    int micro;
    size_t index;
    int group;
    uint64_t request;                   // 0 = no fetch needed
  };
  std::deque<ExpectedUse> expected_;    // uses planned ahead, in program order
  struct ActiveUse {
    uint64_t request = 0;               // 0 = no fetch was needed
    int slot = -1;                      // gather slot, -1 for persistent groups and direct views
  };
  std::map<int, ActiveUse> active_uses_;  // groups gathered and not yet released (model thread only)
  int64_t step_index_ = 0;              // index of the current step (steps finished so far)
  int64_t step_number_base_ = 0;        // the metrics' step number is step_number_base_ + step_index_
  int micro_ = -1;                      // current micro-batch within the step
  bool forward_only_ = false;           // inside begin_forward() ... end_forward()
  std::vector<int> forward_order_;      // the pass's declared gathers (empty: on demand)
  size_t forward_cursor_ = 0;           // the next declared gather to plan
  size_t forward_use_index_ = 0;        // gathers so far in the pass
  size_t use_index_ = 0;                // uses so far in this micro-batch
  int64_t applied_steps_ = 0;           // updates applied (skipped steps do not count)
  TraceClock::time_point step_window_begin_;
  bool window_open_ = false;

  // Shared state, guarded by mutex_.
  std::mutex mutex_;
  std::condition_variable cv_;
  bool stopping_ = false;
  bool failed_ = false;
  Status first_error_;
  std::deque<FetchRequest> requests_;   // in id order, until processed and consumed
  uint64_t next_request_id_ = 1;
  uint64_t next_fetch_id_ = 1;          // the next request the fetcher processes
  uint64_t slot_counter_ = 0;
  std::vector<uint64_t> slot_last_request_;  // per slot: the last request assigned to it
  int64_t steps_finished_ = 0;          // step() calls completed
  int64_t optimizer_jobs_queued_ = 0;
  int64_t optimizer_jobs_done_ = 0;
  std::thread fetcher_;
  std::ofstream metrics_;
};

// =====================================================================================
// Planning and start-up
// =====================================================================================

Status EngineImpl::allocate_and_initialize() {
  const int world = options_.world_size;
  const bool nvme_params = options_.param_tier == Tier::kNvme;

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
  auto host_alloc = [&](size_t bytes, const std::string& purpose) -> StatusOr<PinnedBuffer> {
    return arena_->allocate(std::max<size_t>(bytes, 1), purpose);
  };
  if (plan_.nvme_bytes > 0) {
    NvmeStoreOptions store;
    store.nvme_path = options_.nvme_path;
    store.rank = options_.rank;
    store.checksums = options_.nvme_checksum;
    store.initial_bytes = plan_.nvme_bytes;
    store.io.queue_depth = static_cast<unsigned>(std::max(1, options_.nvme_queue_depth));
    store.io.max_request_bytes = std::max<size_t>(4096, options_.nvme_block_bytes);
    STRATA_ASSIGN_OR_RETURN(store.io.kind, parse_io_engine_kind(options_.io_engine));
    STRATA_ASSIGN_OR_RETURN(nvme_, NvmeStore::open(store));
    if (arena_) {
      auto registered = nvme_->io_engine().register_buffers(*arena_);
      if (!registered.ok()) STRATA_LOG(kWarn) << "io_uring buffer registration failed: " << registered.status().to_string();
    }
  }

  // Device buffers.
  const size_t max_padded = plan_.max_gather_elements, max_shard = plan_.max_gather_shard;
  const size_t all_max_shard = plan_.max_shard_elements;
  slots_.resize(static_cast<size_t>(plan_.gather_slots));
  slot_last_request_.assign(slots_.size(), 0);
  for (size_t i = 0; i < slots_.size(); ++i) {
    auto& slot = slots_[i];
    const std::string name = "gather slot " + std::to_string(i);
    STRATA_ASSIGN_OR_RETURN(slot.full, device_.allocate(param_bytes(max_padded), name));
    if (world > 1 && options_.param_tier != Tier::kDevice) {
      STRATA_ASSIGN_OR_RETURN(slot.shard, device_.allocate(param_bytes(max_shard), name + " staging shard"));
    }
    if (nvme_params) {
      STRATA_ASSIGN_OR_RETURN(slot.nvme_stage, host_alloc(param_bytes(max_shard), name + " NVMe staging"));
    }
    STRATA_ASSIGN_OR_RETURN(slot.ready, device_.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.released, device_.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.h2d_done, device_.create_event());
  }
  STRATA_ASSIGN_OR_RETURN(norm_buffer_, device_.allocate(256, "norm all-reduce"));
  if ((nvme_params || options_.param_tier == Tier::kDevice) && options_.optimizer_tier != Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(param_out_stage_, host_alloc(param_bytes(all_max_shard), "new-parameter staging"));
  }
  if (device_state() && options_.param_tier != Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(param_out_device_, device_.allocate(param_bytes(all_max_shard), "new-parameter staging"));
  }
  STRATA_RETURN_IF_ERROR(create_optimizer_stage());
  STRATA_RETURN_IF_ERROR(create_gradient_path());
  if (options_.fp16_loss_scaling) {
    STRATA_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::create(options_.loss_scaler));
    loss_scaler_.emplace(scaler);
  }
  early_update_ = options_.overlap == OverlapMode::kExact && options_.gradient_clipping <= 0.0f && !options_.fp16_loss_scaling;

  // Per group: storage, then the initial values of the local shards.
  std::vector<float> init(all_max_shard);
  std::vector<uint16_t> param16(all_max_shard);
  for (auto& gp : groups_) STRATA_RETURN_IF_ERROR(initialize_group(*gp, init, param16));
  return {};
}

Status EngineImpl::create_optimizer_stage() {
  OptimizerStageContext context;
  context.options = &options_;
  context.plan = &plan_;
  context.device = &device_;
  context.update_stream = update_stream_.get();
  context.tracer = &tracer_;
  context.groups = &groups_;
  context.nvme = nvme_.get();
  context.arena = arena_.get();
  context.param_out_stage = &param_out_stage_;
  context.param_out_device = &param_out_device_;
  OptimizerStageHooks hooks;
  hooks.group_updated = [this](int g, int64_t version) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      group(g).param_version = std::max(group(g).param_version, version);
    }
    cv_.notify_all();
  };
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
  context.groups = &groups_;
  context.arena = arena_.get();
  context.spill = optimizer_stage_->nvme_state();
  context.executor = &optimizer_stage_->adam().executor();
  GradientPathHooks hooks;
  hooks.landed = [this](int g, int64_t step) {
    if (!early_update_) return;
    Status status = submit_early_update(g, step);
    if (!status.ok()) record_error(std::move(status).with_context("planning the update of group " + std::to_string(g)));
  };
  hooks.failed = [this](Status status) { record_error(std::move(status)); };
  hooks.describe_engine = [this] { return describe_state(); };
  STRATA_ASSIGN_OR_RETURN(gradient_path_, GradientPath::create(context, std::move(hooks)));
  return gradient_path_->allocate();
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

// Stores fp32 values as group g's parameter copy `copy`, in the parameter dtype and tier.
Status EngineImpl::store_parameters(GroupState& g, int copy, const float* values) {
  const size_t shard = g.layout.shard_numel;
  const size_t bytes = param_bytes(shard);
  std::vector<char> converted;
  void* host = nullptr;
  if (options_.param_tier == Tier::kPinned || options_.param_tier == Tier::kHost) {
    host = g.param_host[static_cast<size_t>(copy)].data();
  } else {
    converted.resize(bytes);
    host = converted.data();
  }
  if (options_.param_dtype == DType::kFloat32) std::memcpy(host, values, bytes);
  else for (size_t i = 0; i < shard; ++i) store_from_float(host, options_.param_dtype, i, values[i]);
  if (options_.param_tier == Tier::kDevice) {
    STRATA_RETURN_IF_ERROR(device_.copy_async(g.param_device[static_cast<size_t>(copy)].data(), host, bytes, CopyKind::kHostToDevice, *update_stream_));
    return update_stream_->synchronize();
  }
  if (options_.param_tier == Tier::kNvme) return nvme_->write(g.param_nvme[static_cast<size_t>(copy)], host, bytes);
  return {};
}

Status EngineImpl::initialize_group(GroupState& g, std::vector<float>& init, std::vector<uint16_t>& /*param16*/) {
  const int world = options_.world_size;
  const size_t shard = g.layout.shard_numel;
  const std::string name = "group " + g.layout.name;
  g.decay_runs = decay_runs(g.layout, options_.rank);
  init_shard(g.layout, options_.rank, options_.seed, init.data());
  for (int c = 0; c < param_copies(); ++c) {
    std::string copy_name = name + " parameters";
    if (param_copies() > 1) copy_name += " copy " + std::to_string(c);
    switch (options_.param_tier) {
      case Tier::kDevice: {
        STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer, device_.allocate(param_bytes(shard), copy_name));
        g.param_device.push_back(std::move(buffer));
        break;
      }
      case Tier::kPinned:
      case Tier::kHost: {
        STRATA_ASSIGN_OR_RETURN(PinnedBuffer buffer, arena_->allocate(param_bytes(shard), copy_name));
        g.param_host.push_back(std::move(buffer));
        break;
      }
      case Tier::kNvme: {
        std::string key = "g";
        key += std::to_string(g.layout.id);
        key += ".param";
        key += std::to_string(c);
        STRATA_ASSIGN_OR_RETURN(NvmeExtent extent, nvme_->allocate(key, param_bytes(shard)));
        g.param_nvme.push_back(extent);
        break;
      }
    }
    STRATA_RETURN_IF_ERROR(store_parameters(g, c, init.data()));
  }
  // Optimizer state: master = the fp32 initial values, moments zero.
  STRATA_RETURN_IF_ERROR(optimizer_stage_->initialize_group(g.layout.id, init.data()));
  if (g.persistent && !direct_view(g)) {
    STRATA_ASSIGN_OR_RETURN(g.persistent_full, device_.allocate(param_bytes(g.layout.padded_numel), name + " persistent"));
    if (world > 1 && options_.param_tier != Tier::kDevice) {
      STRATA_ASSIGN_OR_RETURN(g.persistent_shard, device_.allocate(param_bytes(shard), name + " persistent staging"));
    }
    if (options_.param_tier == Tier::kNvme) {
      STRATA_ASSIGN_OR_RETURN(g.persistent_stage, arena_->allocate(param_bytes(shard), name + " persistent NVMe staging"));
    }
    STRATA_ASSIGN_OR_RETURN(g.persistent_ready, device_.create_event());
    STRATA_ASSIGN_OR_RETURN(g.persistent_released, device_.create_event());
    STRATA_ASSIGN_OR_RETURN(g.persistent_h2d_done, device_.create_event());
  }
  return {};
}

Status EngineImpl::start() {
  if (started_) return FailedPreconditionError("start() called twice");
  std::vector<GroupLayout> layouts;
  for (const auto& g : groups_) layouts.push_back(g->layout);
  PlanInputs inputs;
  inputs.options = &options_;
  inputs.layouts = layouts;
  inputs.schedule = schedule_;
  inputs.device_budget_bytes = device_.memory_stats().budget_bytes;
  STRATA_ASSIGN_OR_RETURN(plan_, make_engine_plan(inputs));
  for (size_t g = 0; g < groups_.size(); ++g) groups_[g]->persistent = plan_.persistent[g] != 0;
  if (options_.rank == 0) STRATA_LOG(kInfo) << plan_.text;
  STRATA_RETURN_IF_ERROR(check_plan_against_machine(plan_, options_));
  STRATA_RETURN_IF_ERROR(allocate_and_initialize());
  if (!options_.metrics_path.empty() && options_.rank == 0) {
    metrics_.open(options_.metrics_path, std::ios::app);
    if (!metrics_) return Status::FromErrno(errno, "cannot open the metrics file " + options_.metrics_path);
  }
  started_ = true;
  fetcher_ = std::thread([this] { fetcher_loop(); });
  gradient_path_->start();
  optimizer_stage_->start();
  return {};
}

// =====================================================================================
// Background errors and shutdown
// =====================================================================================

void EngineImpl::record_error(Status status) {
  if (status.ok()) return;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!failed_) {
      failed_ = true;
      first_error_ = status;
    }
  }
  if (gradient_path_) gradient_path_->abort(status);
  STRATA_LOG(kError) << "rank " << options_.rank << ": " << status.to_string() << "\n" << describe_state();
  // Peers blocked in a collective with us must not hang.
  gather_comm_.abort("rank " + std::to_string(options_.rank) + " failed: " + status.message());
  reduce_comm_.abort("rank " + std::to_string(options_.rank) + " failed: " + status.message());
  cv_.notify_all();
}

std::string EngineImpl::describe_state() {
  std::lock_guard<std::mutex> lock(mutex_);
  std::ostringstream text;
  text << "engine state, rank " << options_.rank << ": model at step " << step_index_ << " micro-batch " << micro_ << " use "
       << use_index_ << "; steps finished " << steps_finished_ << "; fetcher at request " << next_fetch_id_ << " of "
       << (next_request_id_ - 1) << " created";
  if (!requests_.empty()) {
    const FetchRequest& r = requests_.front();
    text << "; oldest request " << r.id << " (group " << r.group << ", slot " << r.slot << ", version " << r.required_version
         << ", ready " << r.ready << ", consumed " << r.consumed << ")";
  }
  text << "; slots released:";
  for (const auto& slot : slots_) text << " " << slot.released_id;
  if (gradient_path_) text << "; " << gradient_path_->describe();
  text << "; optimizer jobs " << optimizer_jobs_done_ << "/"
       << optimizer_jobs_queued_ << "; versions:";
  for (const auto& g : groups_) text << " " << g->param_version;
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
    stopping_ = true;
  }
  cv_.notify_all();
  if (fetcher_.joinable()) fetcher_.join();
  if (gradient_path_) gradient_path_->stop();
  if (optimizer_stage_) optimizer_stage_->stop();
  if (started_) {
    // Drain the streams so nothing still touches memory about to be freed.
    Status drained = device_.synchronize();
    if (!drained.ok() && !failed_) STRATA_LOG(kWarn) << "engine shutdown: " << drained.to_string();
    if (nvme_) {
      Status io = nvme_->wait_all();
      if (!io.ok() && !failed_) STRATA_LOG(kWarn) << "engine shutdown: " << io.to_string();
    }
  }
}

Status EngineImpl::traced(Stream& stream, Stage stage, int group, std::string label, const std::function<Status()>& work) {
  auto begin = std::make_shared<TraceClock::time_point>();
  STRATA_RETURN_IF_ERROR(stream.enqueue_host([begin] {
    *begin = TraceClock::now();
    return Status();
  }));
  STRATA_RETURN_IF_ERROR(work());
  return stream.enqueue_host([this, begin, stage, group, label = std::move(label)]() mutable {
    tracer_.record(stage, group, *begin, TraceClock::now(), std::move(label));
    return Status();
  });
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
  std::unique_lock<std::mutex> lock(mutex_);
  if (failed_) return first_error_;
  if (micro_ + 1 >= options_.gradient_accumulation_steps)
    return FailedPreconditionError("more micro-batches than gradient_accumulation_steps (" +
                                   std::to_string(options_.gradient_accumulation_steps) + ") in step " + std::to_string(step_index_));
  // A micro-batch that was being recorded becomes the schedule.
  if (recording_active_ && !recording_.empty()) {
    schedule_ = recording_;
    schedule_valid_ = true;
    recording_active_ = false;
    issue_cursor_ = {step_index_, micro_ + 1, 0};
    STRATA_LOG(kDebug) << "rank " << options_.rank << ": recorded a schedule of " << schedule_.size() << " group uses";
  }
  ++micro_;
  use_index_ = 0;
  if (!schedule_valid_) {
    recording_.clear();
    recording_active_ = true;
  } else if (expected_.empty() && (issue_cursor_.step < step_index_ ||
                                   (issue_cursor_.step == step_index_ && issue_cursor_.micro < micro_))) {
    issue_cursor_ = {step_index_, micro_, 0};
  }
  gradient_path_->begin_micro_batch();
  return {};
}

uint64_t EngineImpl::plan_use_locked(int g, int64_t step_index, int64_t version) {
  GroupState& state = group(g);
  if (direct_view(state)) return 0;
  if (state.persistent) {
    if (state.planned_persistent_version == version) return 0;
    state.planned_persistent_version = version;
  }
  FetchRequest request;
  request.id = next_request_id_++;
  request.group = g;
  request.step_index = step_index;
  request.required_version = version;
  if (!state.persistent) {
    request.slot = static_cast<int>(slot_counter_++ % slots_.size());
    request.previous_occupant = slot_last_request_[static_cast<size_t>(request.slot)];
    slot_last_request_[static_cast<size_t>(request.slot)] = request.id;
  } else {
    state.persistent_request = request.id;
  }
  requests_.push_back(request);
  cv_.notify_all();
  return request.id;
}

void EngineImpl::issue_ahead_locked() {
  if (!schedule_valid_ || schedule_.empty()) return;
  const int depth = plan_.prefetch_depth;
  // Plan up to `depth` slot uses beyond the use being gathered (at least one use when
  // nothing is planned); persistent groups and direct views cost no slot.
  while (true) {
    // Never plan past the next step: its uses' versions exist once this step's update
    // runs, and finish() can then carry out every planned fetch.
    if (issue_cursor_.step > step_index_ + 1) break;
    if (!expected_.empty() && slot_uses_ahead_locked() >= depth) {
      const GroupState& next = group(schedule_[issue_cursor_.index]);
      if (!direct_view(next) && !next.persistent) break;
    }
    ExpectedUse use{issue_cursor_.step, issue_cursor_.micro, issue_cursor_.index, schedule_[issue_cursor_.index], 0};
    use.request = plan_use_locked(use.group, use.step, required_version(use.step));
    expected_.push_back(use);
    // Advance the program cursor.
    if (++issue_cursor_.index >= schedule_.size()) {
      issue_cursor_.index = 0;
      if (++issue_cursor_.micro >= options_.gradient_accumulation_steps) {
        issue_cursor_.micro = 0;
        ++issue_cursor_.step;
      }
    }
  }
}

void EngineImpl::issue_forward_ahead_locked() {
  const int depth = plan_.prefetch_depth;
  while (forward_cursor_ < forward_order_.size()) {
    const GroupState& next = group(forward_order_[forward_cursor_]);
    if (!expected_.empty() && slot_uses_ahead_locked() >= depth && !direct_view(next) && !next.persistent) break;
    ExpectedUse use{step_index_, 0, forward_cursor_, forward_order_[forward_cursor_], 0};
    use.request = plan_use_locked(use.group, step_index_, current_use_version());
    expected_.push_back(use);
    ++forward_cursor_;
  }
}

void EngineImpl::abandon_outstanding_locked() {
  for (const auto& use : expected_) {
    if (use.request == 0) continue;
    FetchRequest& request = request_locked(use.request);
    request.abandoned = true;
    request.consumed = true;
    if (request.slot < 0) group(request.group).planned_persistent_version = -1;
    // A fetch already done frees its slot here (one still running frees it when done).
    // No release event is needed: the slot's next fill is enqueued on the streams that
    // made this one, so it follows it in stream order.
    if (request.ready && request.slot >= 0) {
      GatherSlot& slot = slots_[static_cast<size_t>(request.slot)];
      slot.released_id = std::max(slot.released_id, request.id);
    }
  }
  expected_.clear();
  cv_.notify_all();
}

StatusOr<GroupView> EngineImpl::gather(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "gather"));
  if (micro_ < 0) return FailedPreconditionError("gather() outside a step: call begin_step() (or begin_forward()) first");
  GroupState& state = group(g);
  uint64_t request_id = 0;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    if (failed_) return first_error_;
    if (active_uses_.count(g) != 0)
      return FailedPreconditionError("gather(" + std::to_string(g) + ") while the group is gathered: release() it first");
    bool planned = false;
    if (forward_only_) {
      // The declared order, while the model follows it; on demand after a deviation.
      if (!expected_.empty()) {
        const ExpectedUse& use = expected_.front();
        if (use.index == forward_use_index_ && use.group == g) {
          request_id = use.request;
          expected_.pop_front();
          planned = true;
          issue_forward_ahead_locked();
        } else {
          STRATA_LOG(kDebug) << "rank " << options_.rank << ": a forward-only pass left its declared order at gather "
                             << forward_use_index_ << " (group " << g << "); fetching on demand from here";
          abandon_outstanding_locked();
          forward_order_.clear();
          forward_cursor_ = 0;
        }
      }
      ++forward_use_index_;
    } else if (schedule_valid_) {
      if (expected_.empty()) issue_ahead_locked();
      if (!expected_.empty()) {
        const ExpectedUse& use = expected_.front();
        if (use.step == step_index_ && use.micro == micro_ && use.index == use_index_ && use.group == g) {
          request_id = use.request;
          expected_.pop_front();
          planned = true;
          // Keep `depth` slot uses planned beyond this one.
          issue_ahead_locked();
        }
      }
      if (!planned) {
        STRATA_LOG(kInfo) << "rank " << options_.rank << ": the model deviated from the recorded schedule at use "
                          << use_index_ << " of step " << step_index_ << " (gathered group " << g
                          << "); prefetches in flight complete, and the schedule is recorded again";
        abandon_outstanding_locked();
        schedule_valid_ = false;
        recording_active_ = false;  // record again from the next micro-batch
      }
    } else if (recording_active_) {
      recording_.push_back(g);
    }
    if (!planned) request_id = plan_use_locked(g, step_index_, current_use_version());
    if (!forward_only_) ++use_index_;
    // Wait for the data.
    int slot = -1;
    if (request_id != 0) {
      STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return request_locked(request_id).ready; }, "a gathered group"));
      FetchRequest& request = request_locked(request_id);
      slot = request.slot;
      request.consumed = true;
      while (!requests_.empty() && requests_.front().ready && requests_.front().consumed) requests_.pop_front();
    } else if (direct_view(state)) {
      const int64_t version = current_use_version();
      STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return state.param_version >= version; }, "the group's update"));
    }
    active_uses_[g] = {request_id, slot};
  }
  // Compute waits for the gathered data (the event was recorded before `ready` was set).
  void* flat = nullptr;
  const int slot = active_uses_[g].slot;
  if (direct_view(state)) {
    flat = state.param_device[static_cast<size_t>(parity(current_use_version()))].data();
  } else if (state.persistent) {
    STRATA_RETURN_IF_ERROR(compute_stream_->wait(*state.persistent_ready));
    flat = state.persistent_full.data();
  } else {
    STRATA_RETURN_IF_ERROR(compute_stream_->wait(*slots_[static_cast<size_t>(slot)].ready));
    flat = slots_[static_cast<size_t>(slot)].full.data();
  }
  STRATA_RETURN_IF_ERROR(compute_stream_->enqueue_host([&state] {
    state.compute_begin = TraceClock::now();
    return Status();
  }));
  return view_of(state, flat, options_.param_dtype);
}

Status EngineImpl::release(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "release"));
  auto it = active_uses_.find(g);
  if (it == active_uses_.end()) return FailedPreconditionError("release(" + std::to_string(g) + ") of a group that is not gathered");
  const ActiveUse use = it->second;
  active_uses_.erase(it);
  GroupState& state = group(g);
  const std::string label = state.layout.name;
  STRATA_RETURN_IF_ERROR(compute_stream_->enqueue_host([this, &state, label] {
    tracer_.record(Stage::kCompute, state.layout.id, state.compute_begin, TraceClock::now(), label);
    return Status();
  }));
  if (direct_view(state)) return {};
  if (state.persistent) return compute_stream_->record(*state.persistent_released);
  GatherSlot& slot = slots_[static_cast<size_t>(use.slot)];
  STRATA_RETURN_IF_ERROR(compute_stream_->record(*slot.released));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slot.released_id = std::max(slot.released_id, use.request);
  }
  cv_.notify_all();
  return {};
}

StatusOr<GroupView> EngineImpl::gradient_buffer(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "gradient_buffer"));
  if (micro_ < 0) return FailedPreconditionError("gradient_buffer() outside a step");
  if (forward_only_) return FailedPreconditionError("gradient_buffer() in a forward-only pass");
  STRATA_ASSIGN_OR_RETURN(float* buffer, gradient_path_->buffer(g));
  return view_of(group(g), buffer, DType::kFloat32);
}

Status EngineImpl::grads_ready(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "grads_ready"));
  if (forward_only_) return FailedPreconditionError("grads_ready() in a forward-only pass");
  if (micro_ < 0) return FailedPreconditionError("grads_ready() outside a step");
  STRATA_RETURN_IF_ERROR(background_error());
  return gradient_path_->hand_over(g, step_index_, micro_);
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
  // The global statistics: one all-reduce of the sum of squares, with inf carrying overflow.
  GradientStats global = local;
  if (options_.world_size > 1) {
    float value = local.non_finite ? std::numeric_limits<float>::infinity() : static_cast<float>(local.sum_of_squares);
    STRATA_RETURN_IF_ERROR(device_.copy_async(norm_buffer_.data(), &value, sizeof(float), CopyKind::kHostToDevice, *reduce_stream_));
    STRATA_RETURN_IF_ERROR(reduce_comm_.all_reduce(norm_buffer_.data(), norm_buffer_.data(), 1, DType::kFloat32, {}, *reduce_stream_));
    STRATA_RETURN_IF_ERROR(device_.copy_async(&value, norm_buffer_.data(), sizeof(float), CopyKind::kDeviceToHost, *reduce_stream_));
    STRATA_RETURN_IF_ERROR(reduce_stream_->synchronize());
    global.sum_of_squares = value;
    global.non_finite = !std::isfinite(value);
  }
  kernels::AdamHyperparams hyper = options_.adam;
  hyper.lr = learning_rate_;
  AdamStepPlanOptions plan_options;
  plan_options.loss_scale = loss_scale();
  plan_options.max_grad_norm = options_.gradient_clipping;
  OptimizerJob job;
  job.step_index = t;
  if (!early_update_) {
    STRATA_ASSIGN_OR_RETURN(job.decay_plan, plan_adam_step(hyper, applied_steps_ + 1, global, plan_options));
    kernels::AdamHyperparams no_decay = hyper;
    no_decay.weight_decay = 0.0;
    STRATA_ASSIGN_OR_RETURN(job.no_decay_plan, plan_adam_step(no_decay, applied_steps_ + 1, global, plan_options));
  }
  StepReport report;
  const float scale_used = loss_scale();
  if (early_update_) {
    report.grad_norm = std::sqrt(global.sum_of_squares);
    ++applied_steps_;
  } else {
    job.skip = job.decay_plan.skip;
    report.grad_norm = job.decay_plan.grad_norm;
    if (loss_scaler_) loss_scaler_->update(job.skip);
    if (!job.skip) ++applied_steps_;
    // Forward order: the first use of each group in the schedule, then any group not in it.
    std::set<int> seen;
    for (int g : schedule_)
      if (seen.insert(g).second) job.order.push_back(g);
    for (int g = 0; g < group_count(); ++g)
      if (seen.insert(g).second) job.order.push_back(g);
  }
  const bool skipped = !early_update_ && job.skip;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!early_update_) ++optimizer_jobs_queued_;
    steps_finished_ = t + 1;
  }
  if (!early_update_) optimizer_stage_->submit(std::move(job));
  cv_.notify_all();
  step_index_ = t + 1;
  micro_ = -1;

  // Report and metrics over the window since the previous step.
  const auto now = TraceClock::now();
  report.step = applied_steps_;
  report.loss = loss;
  report.skipped = skipped;
  report.loss_scale = scale_used;
  report.step_seconds = std::chrono::duration<double>(now - step_window_begin_).count();
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
  if (metrics_.is_open()) {
    nlohmann::json busy;
    for (size_t s = 0; s < kStageCount; ++s) busy[std::string(stage_name(static_cast<Stage>(s)))] = report.busy[s];
    nlohmann::json line = {{"step", step_number_base_ + step_index_},
                           {"applied_steps", report.step},
                           {"loss", report.loss},
                           {"step_seconds", report.step_seconds},
                           {"busy_seconds", busy},
                           {"grad_norm", report.grad_norm},
                           {"loss_scale", report.loss_scale},
                           {"skipped", report.skipped},
                           {"device_high_water_bytes", report.device_high_water_bytes},
                           {"device_budget_bytes", report.device_budget_bytes},
                           {"pinned_bytes", report.pinned_bytes},
                           {"nvme_bytes_read", report.nvme_bytes_read},
                           {"nvme_bytes_written", report.nvme_bytes_written}};
    metrics_ << line.dump() << '\n';
    metrics_.flush();
  }
  if (options_.trace_path.empty()) tracer_.forget_before(now - std::chrono::seconds(60));
  return report;
}

Status EngineImpl::finish() {
  if (!started_) return FailedPreconditionError("finish() before start()");
  // Inside a pass, fetches of versions no update will make could be planned: waiting for
  // them would never end.
  if (forward_only_) return FailedPreconditionError("finish() in a forward-only pass: call end_forward() first");
  if (micro_ >= 0) return FailedPreconditionError("finish() inside a step: call step() first");
  // Landings first: early updates are submitted as they land.
  STRATA_RETURN_IF_ERROR(gradient_path_->wait_drained());
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Every fetch already planned is carried out: the prefetcher runs ahead into a next
    // step, and every rank must issue the same gathers or its peers would wait for them.
    STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] {
      bool updated = true;
      for (auto& g : groups_) updated = updated && g->param_version >= steps_finished_;
      return optimizer_jobs_done_ == optimizer_jobs_queued_ && updated &&
             next_fetch_id_ == next_request_id_;
    }, "outstanding updates and fetches"));
  }
  STRATA_RETURN_IF_ERROR(device_.synchronize());
  if (nvme_) STRATA_RETURN_IF_ERROR(nvme_->wait_all());
  STRATA_RETURN_IF_ERROR(background_error());
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
  std::lock_guard<std::mutex> lock(mutex_);
  if (failed_) return first_error_;
  // The fetches planned for the next step carry an older version in delayed mode, and
  // their slots come before the pass's own in the ring: let them complete and free their
  // slots, and plan the next step again after the pass.
  abandon_outstanding_locked();
  forward_only_ = true;
  micro_ = 0;
  forward_order_.assign(order.begin(), order.end());
  forward_cursor_ = 0;
  forward_use_index_ = 0;
  issue_forward_ahead_locked();
  return {};
}

Status EngineImpl::end_forward() {
  if (!forward_only_) return FailedPreconditionError("end_forward() without begin_forward()");
  if (!active_uses_.empty())
    return FailedPreconditionError("end_forward() while group " + std::to_string(active_uses_.begin()->first) + " is still gathered");
  std::lock_guard<std::mutex> lock(mutex_);
  // Declared gathers the pass did not make: their fetches complete and free their slots.
  abandon_outstanding_locked();
  forward_order_.clear();
  forward_only_ = false;
  micro_ = -1;
  if (schedule_valid_) issue_cursor_ = {step_index_, 0, 0};
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
  std::unique_lock<std::mutex> lock(mutex_);
  // The whole update, the write-back of NVMe-resident state included.
  return wait_locked(lock, [&] {
    return state.param_version >= steps_finished_ && optimizer_jobs_done_ == optimizer_jobs_queued_;
  }, "the group's update");
}

Status EngineImpl::read_state_shard(int g, StateKind kind, std::span<float> out) {
  STRATA_RETURN_IF_ERROR(wait_for_state_access(g, out.size(), "read_state_shard"));
  return optimizer_stage_->read_state(g, kind, out);
}

Status EngineImpl::write_state_shard(int g, StateKind kind, std::span<const float> in) {
  STRATA_RETURN_IF_ERROR(wait_for_state_access(g, in.size(), "write_state_shard"));
  return optimizer_stage_->write_state(g, kind, in);
}

Status EngineImpl::refresh_parameters() {
  if (!started_) return FailedPreconditionError("refresh_parameters() before start()");
  if (micro_ >= 0) return FailedPreconditionError("refresh_parameters() inside a step");
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Fetches planned ahead would carry the old values: let them finish, then forget them.
    abandon_outstanding_locked();
    if (schedule_valid_) issue_cursor_ = {step_index_, 0, 0};
    STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] {
      for (auto& g : groups_) if (g->param_version < steps_finished_) return false;
      return optimizer_jobs_done_ == optimizer_jobs_queued_ && next_fetch_id_ == next_request_id_;
    }, "outstanding updates and fetches"));
    while (!requests_.empty() && requests_.front().ready && requests_.front().consumed) requests_.pop_front();
  }
  std::vector<float> master;
  for (auto& gp : groups_) {
    GroupState& g = *gp;
    master.resize(g.layout.shard_numel);
    STRATA_RETURN_IF_ERROR(read_state_shard(g.layout.id, StateKind::kMaster, master));
    // Every copy gets the same values: the next fetch reads whichever its version picks.
    for (int c = 0; c < param_copies(); ++c) STRATA_RETURN_IF_ERROR(store_parameters(g, c, master.data()));
    std::lock_guard<std::mutex> lock(mutex_);
    g.persistent_version = -1;
    g.planned_persistent_version = -1;
  }
  return {};
}

// =====================================================================================
// The fetcher: NVMe -> pinned -> device -> all-gather, ahead of compute
// =====================================================================================

void EngineImpl::fetcher_loop() {
  for (;;) {
    FetchRequest* request = nullptr;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || (!requests_.empty() && requests_.back().id >= next_fetch_id_); });
      if (stopping_) return;
      request = &request_locked(next_fetch_id_);
    }
    const int group_id = request->group;
    Status status = fetch_one(*request);
    if (!status.ok()) {
      record_error(std::move(status).with_context("fetching group " + std::to_string(group_id)));
      return;
    }
  }
}

Status EngineImpl::submit_read_ahead(const FetchRequest& r) {
  for (uint64_t id = r.id + 1;; ++id) {
    FetchRequest* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (requests_.empty() || id > requests_.back().id || id > r.id + static_cast<uint64_t>(std::max(1, plan_.prefetch_depth))) break;
      next = &request_locked(id);
      if (next->read_submitted) continue;
      // Only slot requests whose slot's previous user has been fetched (so its H2D out
      // of the staging buffer is enqueued and its event recorded), with their version in.
      if (next->slot < 0 || group(next->group).param_version < next->required_version || next->previous_occupant >= r.id) break;
    }
    GatherSlot& next_slot = slots_[static_cast<size_t>(next->slot)];
    STRATA_ASSIGN_OR_RETURN(bool staging_free, next_slot.h2d_done->query());
    if (!staging_free) break;
    GroupState& next_state = group(next->group);
    next->read_begin = TraceClock::now();
    STRATA_ASSIGN_OR_RETURN(next->read_ticket,
                            nvme_->read_async(next_state.param_nvme[static_cast<size_t>(parity(next->required_version))],
                                              next_slot.nvme_stage.data(), param_bytes(next_state.layout.shard_numel), 0,
                                              next_slot.nvme_stage.capacity()));
    next->read_submitted = true;
  }
  return {};
}

Status EngineImpl::fetch_one(FetchRequest& r) {
  GroupState& state = group(r.group);
  const bool persistent = r.slot < 0;
  GatherSlot* slot = persistent ? nullptr : &slots_[static_cast<size_t>(r.slot)];
  const size_t shard = state.layout.shard_numel;
  const size_t bytes = param_bytes(shard);
  const int world = options_.world_size;
  const std::string label = state.layout.name;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // The parameters must hold the version this use needs.
    STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return state.param_version >= r.required_version; }, "a parameter update"));
    // The buffer must be free: the slot's previous use released, or (persistent) the
    // previous step's uses over.
    if (slot != nullptr) {
      STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return slot->released_id >= r.previous_occupant; }, "a gather slot"));
    } else {
      STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return steps_finished_ >= r.step_index; }, "the previous step"));
    }
  }
  Event& ready = persistent ? *state.persistent_ready : *slot->ready;
  Event& released = persistent ? *state.persistent_released : *slot->released;
  Event& h2d_done = persistent ? *state.persistent_h2d_done : *slot->h2d_done;
  void* dest = persistent ? state.persistent_full.data() : slot->full.data();
  void* staging = persistent ? state.persistent_shard.data() : slot->shard.data();
  const int copy = parity(r.required_version);

  const void* host_source = nullptr;
  if (options_.param_tier == Tier::kNvme) {
    PinnedBuffer& stage = persistent ? state.persistent_stage : slot->nvme_stage;
    if (!r.read_submitted) {
      // The staging buffer's previous H2D must be over before the read overwrites it.
      STRATA_RETURN_IF_ERROR(h2d_done.synchronize());
      r.read_begin = TraceClock::now();
      STRATA_ASSIGN_OR_RETURN(r.read_ticket, nvme_->read_async(state.param_nvme[static_cast<size_t>(copy)], stage.data(), bytes, 0, stage.capacity()));
      r.read_submitted = true;
    }
    // While this read completes, keep starting the reads of the requests behind it as
    // they appear and their staging frees up (the model creates requests as it goes).
    for (;;) {
      STRATA_RETURN_IF_ERROR(submit_read_ahead(r));
      if (nvme_->io_engine().done(r.read_ticket)) break;
      std::unique_lock<std::mutex> lock(mutex_);
      if (failed_ || stopping_) break;
      cv_.wait_for(lock, std::chrono::microseconds(200));
    }
    STRATA_RETURN_IF_ERROR(nvme_->wait(r.read_ticket));
    tracer_.record(Stage::kNvmeRead, r.group, r.read_begin, TraceClock::now(), label);
    host_source = stage.data();
  } else if (options_.param_tier == Tier::kPinned || options_.param_tier == Tier::kHost) {
    host_source = state.param_host[static_cast<size_t>(copy)].data();
  }

  if (host_source != nullptr) {
    void* h2d_target = world == 1 ? dest : staging;
    // World 1 overwrites the gathered buffer itself: wait for its last reader. Otherwise
    // the staging shard: wait for the all-gather that read it last.
    STRATA_RETURN_IF_ERROR(h2d_stream_->wait(world == 1 ? released : ready));
    STRATA_RETURN_IF_ERROR(traced(*h2d_stream_, Stage::kH2D, r.group, label, [&] {
      return device_.copy_async(h2d_target, host_source, bytes, CopyKind::kHostToDevice, *h2d_stream_);
    }));
    STRATA_RETURN_IF_ERROR(h2d_stream_->record(h2d_done));
    if (world == 1) STRATA_RETURN_IF_ERROR(h2d_stream_->record(ready));
  }
  if (world > 1) {
    if (host_source != nullptr) STRATA_RETURN_IF_ERROR(gather_stream_->wait(h2d_done));
    STRATA_RETURN_IF_ERROR(gather_stream_->wait(released));
    const void* source = host_source != nullptr ? staging : state.param_device[static_cast<size_t>(copy)].data();
    STRATA_RETURN_IF_ERROR(traced(*gather_stream_, Stage::kAllGather, r.group, label, [&] {
      return gather_comm_.all_gather(source, dest, shard, options_.param_dtype, *gather_stream_);
    }));
    STRATA_RETURN_IF_ERROR(gather_stream_->record(ready));
  }
  bool abandoned = false;
  {
    std::lock_guard<std::mutex> lock(mutex_);
    abandoned = r.abandoned;
    if (persistent) {
      state.persistent_version = r.required_version;
    } else if (abandoned) {
      // Nobody will compute with it: the slot is free once the fill is done.
      slot->released_id = std::max(slot->released_id, r.id);
    }
    // Once ready, the model may retire the request: `r` is not touched after this.
    r.ready = true;
    ++next_fetch_id_;
    while (!requests_.empty() && requests_.front().ready && requests_.front().consumed) requests_.pop_front();
  }
  if (!persistent && abandoned) {
    Stream& last = world > 1 ? *gather_stream_ : *h2d_stream_;
    STRATA_RETURN_IF_ERROR(last.record(released));
  }
  cv_.notify_all();
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
