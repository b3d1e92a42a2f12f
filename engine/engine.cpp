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
#include "kernels/cast.h"
#include "kernels/transformer_ops.h"

namespace strata {

namespace engine_internal {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

std::string format_bytes(size_t bytes) {
  char text[64];
  if (bytes >= (size_t{1} << 30)) std::snprintf(text, sizeof(text), "%.2f GiB", double(bytes) / double(size_t{1} << 30));
  else if (bytes >= kMiB) std::snprintf(text, sizeof(text), "%.1f MiB", double(bytes) / double(kMiB));
  else if (bytes >= 1024) std::snprintf(text, sizeof(text), "%.1f KiB", double(bytes) / 1024.0);
  else std::snprintf(text, sizeof(text), "%zu B", bytes);
  return text;
}

size_t round_up_4k(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }

// MemAvailable from /proc/meminfo, or 0 when unknown.
size_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  size_t value = 0;
  std::string unit;
  while (in >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

// Host-side accumulation of a landed gradient shard into fp32.
void accumulate_into(float* accum, const void* src, DType type, size_t count, bool assign) {
  if (type == DType::kFloat32) {
    const float* s = static_cast<const float*>(src);
    if (assign) std::memcpy(accum, s, count * sizeof(float));
    else for (size_t i = 0; i < count; ++i) accum[i] += s[i];
    return;
  }
  if (assign) for (size_t i = 0; i < count; ++i) accum[i] = load_as_float(src, type, i);
  else for (size_t i = 0; i < count; ++i) accum[i] += load_as_float(src, type, i);
}

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
  StatusOr<float*> state_for_access(int g, StateKind kind, size_t elements, const char* call);

 private:
  // Plan pieces.
  Status build_plan();
  Status check_plan_against_machine();
  Status allocate_and_initialize();

  // Threads.
  void fetcher_loop();
  void lander_loop();
  void optimizer_loop();
  Status fetch_one(FetchRequest& request);
  // Starts the NVMe reads of the requests after `r` that can start now.
  Status submit_read_ahead(const FetchRequest& r);
  Status land_one(const LandingItem& item);
  Status land_on_device(int g, int slot_index, const float* reduced);
  Status update_group(const OptimizerJob& job, int group);
  Status update_group_on_device(const OptimizerJob& job, int group);
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
  std::vector<GradientSlot> gradient_slots_;
  std::optional<CpuAdam> adam_;
  std::optional<CpuAdam> stats_adam_;  // the lander's own instance (a CpuAdam serves one caller at a time)
  std::optional<LossScaler> loss_scaler_;
  DeviceBuffer norm_buffer_;           // one float for the norm all-reduce
  PinnedBuffer param_out_stage_;       // the optimizer's new parameters on their way to the device or NVMe
  DeviceBuffer param_out_device_;      // device-resident optimizer: new parameters on their way to the host or NVMe
  std::vector<PinnedBuffer> state_stage_;  // NVMe optimizer state staging (3 groups: read, step, write)
  PinnedBuffer state_access_stage_;    // NVMe optimizer state for read/write_state_shard (model thread)
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
  std::deque<LandingItem> landing_;
  std::deque<OptimizerJob> optimizer_jobs_;
  int64_t steps_finished_ = 0;          // step() calls completed
  int64_t optimizer_jobs_queued_ = 0;
  int64_t optimizer_jobs_done_ = 0;
  int64_t landings_queued_ = 0;
  int64_t landings_done_ = 0;
  std::thread fetcher_, lander_, optimizer_;
  std::ofstream metrics_;
};

// =====================================================================================
// Planning and start-up
// =====================================================================================

Status EngineImpl::build_plan() {
  const int world = options_.world_size;
  const size_t psize = dtype_size(options_.param_dtype);
  const size_t tsize = dtype_size(options_.grad_transfer_dtype);
  const bool host_params = options_.param_tier == Tier::kPinned || options_.param_tier == Tier::kHost;
  const bool nvme_params = options_.param_tier == Tier::kNvme;
  const bool nvme_state = options_.optimizer_tier == Tier::kNvme;
  const bool device_state = options_.optimizer_tier == Tier::kDevice;
  const int copies = param_copies();
  // Host fp32 accumulators only when the optimizer state is on the host.
  const int accum = options_.gradient_accumulation_steps > 1 && !device_state ? copies : 0;

  size_t max_padded = 0, max_shard = 0, total_numel = 0, total_shard = 0, persistent_full_bytes = 0, persistent_shard_bytes = 0;
  size_t all_max_padded = 0, all_max_shard = 0;
  for (auto& g : groups_) {
    g->persistent = g->layout.padded_numel <= options_.persistence_threshold;
    total_numel += g->layout.numel;
    total_shard += g->layout.shard_numel;
    all_max_padded = std::max(all_max_padded, g->layout.padded_numel);
    all_max_shard = std::max(all_max_shard, g->layout.shard_numel);
    if (g->persistent) {
      if (!direct_view(*g)) persistent_full_bytes += param_bytes(g->layout.padded_numel);
      if (world > 1 && options_.param_tier != Tier::kDevice) persistent_shard_bytes += param_bytes(g->layout.shard_numel);
    } else {
      max_padded = std::max(max_padded, g->layout.padded_numel);
      max_shard = std::max(max_shard, g->layout.shard_numel);
    }
  }
  if (groups_.empty()) return FailedPreconditionError("start(): no parameter groups registered");

  // Prefetch depth and gather slots, under the caps.
  int depth = options_.prefetch_depth == EngineOptions::kAutoDepth ? 2 : options_.prefetch_depth;
  if (options_.prefetch_bucket_elements > 0 && max_padded > 0)
    depth = std::min<int>(depth, static_cast<int>(std::max<size_t>(1, options_.prefetch_bucket_elements / max_padded)));
  int slots = depth + 1;
  if (options_.max_live_elements > 0 && max_padded > 0)
    slots = std::min<int>(slots, static_cast<int>(std::max<size_t>(1, options_.max_live_elements / max_padded)));
  depth = slots - 1;
  const bool any_slot_groups = max_padded > 0 && !(options_.param_tier == Tier::kDevice && world == 1);
  if (!any_slot_groups) slots = 0;
  plan_.prefetch_depth = depth;
  plan_.gather_slots = slots;

  // Gradient slots: two (one being written, one draining to the host), plus one for
  // every group gathered more than twice per micro-batch (a tied group: its gradient
  // buffer stays live between its backward uses). Without a declared schedule, assume
  // one such group.
  int gradient_slots = 2;
  {
    std::map<int, int> uses;
    for (int g : schedule_) ++uses[g];
    for (auto& [g, n] : uses) gradient_slots += n > 2 ? 1 : 0;
    if (schedule_.empty()) gradient_slots = 3;
  }
  gradient_slots_.resize(static_cast<size_t>(gradient_slots));

  auto line = [&](std::string what, Tier tier, size_t bytes) {
    if (bytes > 0) plan_.lines.push_back({std::move(what), tier, bytes});
  };
  const std::string pname = std::string(dtype_name(options_.param_dtype));
  // Device.
  size_t device = 0;
  auto add_device = [&](std::string what, size_t bytes) {
    line(std::move(what), Tier::kDevice, bytes);
    device += bytes;
  };
  add_device("gather buffers (" + std::to_string(slots) + " x " + format_bytes(param_bytes(max_padded)) + ")",
             static_cast<size_t>(slots) * param_bytes(max_padded));
  if (world > 1 && options_.param_tier != Tier::kDevice)
    add_device("device staging shards", static_cast<size_t>(slots) * param_bytes(max_shard));
  if (options_.param_tier == Tier::kDevice) add_device("parameter shards (" + pname + ")", copies * param_bytes(total_shard));
  add_device("persistent groups (gathered)", persistent_full_bytes + persistent_shard_bytes);
  add_device("gradient buffers (" + std::to_string(gradient_slots) + " x fp32 " + format_bytes(all_max_padded * 4) + ")",
             static_cast<size_t>(gradient_slots) * all_max_padded * 4);
  if (world > 1) add_device("reduce-scatter shards", static_cast<size_t>(gradient_slots) * all_max_shard * 4);
  if (options_.grad_transfer_dtype != DType::kFloat32)
    add_device("gradient transfer casts", static_cast<size_t>(gradient_slots) * all_max_shard * tsize);
  if (device_state) {
    size_t state = 0;
    for (auto& g : groups_) state += g->layout.shard_numel * 16;
    add_device("master weights + exp_avg + exp_avg_sq + gradient accumulators (fp32)", state);
    if (options_.param_tier != Tier::kDevice) add_device("new-parameter staging", param_bytes(all_max_shard));
  }
  add_device("norm all-reduce", 256);
  add_device("activations (declared by the model)", options_.activation_bytes);
  plan_.device_bytes = device;
  plan_.device_budget_bytes = device_.memory_stats().budget_bytes;

  // Host (pinned or pageable: one arena, locked or not).
  size_t host = 0;
  auto add_host = [&](std::string what, size_t bytes) {
    line(std::move(what), options_.pin_memory ? Tier::kPinned : Tier::kHost, bytes);
    host += bytes;
  };
  auto sum_shards = [&](size_t bytes_per_element) {
    size_t total = 0;
    for (auto& g : groups_) total += round_up_4k(g->layout.shard_numel * bytes_per_element);
    return total;
  };
  if (host_params) add_host("parameter shards (" + pname + ")", copies * sum_shards(psize));
  if (nvme_params) {
    add_host("NVMe parameter read staging", static_cast<size_t>(std::max(slots, 1)) * round_up_4k(param_bytes(std::max(max_shard, all_max_shard))));
    for (auto& g : groups_)
      if (g->persistent) host += round_up_4k(param_bytes(g->layout.shard_numel));
  }
  if (nvme_params || options_.param_tier == Tier::kDevice)
    add_host("new-parameter staging", round_up_4k(param_bytes(all_max_shard)));
  if (nvme_state) add_host("NVMe optimizer-state staging (3 groups + 1 for state access)", 4 * round_up_4k(all_max_shard * 12));
  else if (device_state) add_host("optimizer-state access staging", round_up_4k(all_max_shard * 12));
  else add_host("master weights + exp_avg + exp_avg_sq (fp32)", 3 * sum_shards(4));
  add_host("gradient landing shards (" + std::string(dtype_name(options_.grad_transfer_dtype)) + ")", copies * sum_shards(tsize));
  if (accum > 0) add_host("gradient accumulators (fp32)", static_cast<size_t>(accum) * sum_shards(4));
  if (options_.pin_memory) plan_.pinned_bytes = host;
  else plan_.host_bytes = host;

  // NVMe.
  size_t nvme = 0;
  if (nvme_params) {
    const size_t bytes = copies * sum_shards(psize);
    line("parameter shards (" + pname + ")", Tier::kNvme, bytes);
    nvme += bytes;
  }
  if (nvme_state) {
    const size_t bytes = sum_shards(12);
    line("master weights + exp_avg + exp_avg_sq (fp32)", Tier::kNvme, bytes);
    nvme += bytes;
  }
  plan_.nvme_bytes = nvme;
  plan_.state_bytes = total_numel * (psize + 12 + 4);

  // The printed plan.
  std::ostringstream text;
  text << "Strata plan, rank " << options_.rank << " of " << world << ": " << groups_.size() << " groups, "
       << total_numel << " parameters; training state " << format_bytes(plan_.state_bytes) << " (all ranks)\n";
  text << "  parameters: " << pname << " on " << tier_name(options_.param_tier) << "; optimizer state: fp32 on "
       << tier_name(options_.optimizer_tier) << "; gradients: " << dtype_name(options_.grad_wire_dtype) << " on the wire, "
       << dtype_name(options_.grad_transfer_dtype) << " to the host\n";
  for (const auto& l : plan_.lines) text << "  " << tier_name(l.tier) << ": " << l.what << " = " << format_bytes(l.bytes) << "\n";
  text << "  device: " << format_bytes(plan_.device_bytes) << " of a " << format_bytes(plan_.device_budget_bytes) << " budget; ";
  text << (options_.pin_memory ? "pinned: " : "pageable host: ") << format_bytes(host) << "; nvme: " << format_bytes(nvme);
  if (nvme > 0) text << " under " << options_.nvme_path;
  text << "\n  prefetch depth " << depth << " (" << slots << " gather slots), optimizer overlap "
       << overlap_mode_name(options_.overlap) << ", " << options_.gradient_accumulation_steps << " micro-batch(es) per step";
  plan_.text = text.str();
  (void)max_shard;
  return {};
}

Status EngineImpl::check_plan_against_machine() {
  // Device budget.
  if (plan_.device_bytes > plan_.device_budget_bytes) {
    std::ostringstream message;
    message << "the device budget of " << format_bytes(plan_.device_budget_bytes) << " cannot hold the plan's "
            << format_bytes(plan_.device_bytes) << ":";
    for (const auto& l : plan_.lines)
      if (l.tier == Tier::kDevice) message << " " << l.what << " " << format_bytes(l.bytes) << ";";
    // Settings that would fit: the budget needed, or a shallower prefetch.
    const size_t per_slot = plan_.gather_slots > 0 ? plan_.lines.front().bytes / static_cast<size_t>(plan_.gather_slots) : 0;
    message << " settings that would fit: a device budget of at least " << (plan_.device_bytes + kMiB - 1) / kMiB << " MiB";
    if (plan_.gather_slots > 1 && per_slot > 0) {
      const size_t fixed = plan_.device_bytes - per_slot * static_cast<size_t>(plan_.gather_slots);
      if (fixed + 2 * per_slot <= plan_.device_budget_bytes) {
        const size_t max_slots = (plan_.device_budget_bytes - fixed) / per_slot;
        message << ", or prefetch depth " << (max_slots - 1) << " (stage3_max_live_parameters / strata.prefetch_depth)";
      }
    }
    if (options_.activation_bytes > 0) message << ", or fewer activations (smaller micro-batch or activation checkpointing)";
    return OutOfMemoryError(message.str());
  }
  // Host memory.
  const size_t host_needed = plan_.pinned_bytes + plan_.host_bytes;
  if (const size_t available = host_memory_available(); available > 0 && host_needed > available) {
    return OutOfMemoryError("the plan needs " + format_bytes(host_needed) + " of host memory (" +
                            (options_.pin_memory ? "pinned" : "pageable") + ") but only " + format_bytes(available) +
                            " is available (MemAvailable); move optimizer state to nvme (offload_optimizer.device) or use fewer ranks per machine");
  }
  // Locked memory.
  if (options_.pin_memory && plan_.pinned_bytes > 0) {
    rlimit limit{};
    if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY && plan_.pinned_bytes > limit.rlim_cur &&
        geteuid() != 0) {
      STRATA_LOG(kWarn) << "the plan pins " << format_bytes(plan_.pinned_bytes) << " but RLIMIT_MEMLOCK is "
                        << format_bytes(limit.rlim_cur) << ": host state will be pageable unless the limit is raised "
                        << "(ulimit -l) or CUDA registers it";
    }
  }
  // NVMe space.
  if (plan_.nvme_bytes > 0) {
    std::error_code ignored;
    std::filesystem::create_directories(options_.nvme_path, ignored);
    struct statvfs fs {};
    if (statvfs(options_.nvme_path.c_str(), &fs) != 0)
      return Status::FromErrno(errno, "nvme_path " + options_.nvme_path + " cannot be used (statvfs)");
    size_t free_bytes = static_cast<size_t>(fs.f_bavail) * fs.f_frsize;
    // A file a finished run left is reused: its size counts as room.
    const auto existing = std::filesystem::path(options_.nvme_path) / ("strata-rank" + std::to_string(options_.rank) + ".swap");
    if (std::filesystem::exists(existing, ignored)) free_bytes += std::filesystem::file_size(existing, ignored);
    if (plan_.nvme_bytes > free_bytes) {
      return ResourceExhaustedError("nvme_path " + options_.nvme_path + " has " + format_bytes(free_bytes) +
                                    " free but rank " + std::to_string(options_.rank) + " needs " +
                                    format_bytes(plan_.nvme_bytes) +
                                    " there; free space, point nvme_path at a larger disk, or keep optimizer state on cpu");
    }
  }
  return {};
}

Status EngineImpl::allocate_and_initialize() {
  const int world = options_.world_size;
  const int rank = options_.rank;
  const size_t psize = dtype_size(options_.param_dtype);
  const size_t tsize = dtype_size(options_.grad_transfer_dtype);
  const int copies = param_copies();
  const bool nvme_params = options_.param_tier == Tier::kNvme;
  const bool nvme_state = options_.optimizer_tier == Tier::kNvme;

  // Host memory: one arena (locked when pin_memory), sized by the plan.
  const size_t host_bytes = plan_.pinned_bytes + plan_.host_bytes;
  if (host_bytes > 0) {
    PinnedArenaOptions arena_options;
    // Slack for the slab allocator: buffers are carved in plan order, but some are freed
    // and carved again (state-access staging), and a best-fit allocator can fragment.
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
    store.rank = rank;
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
  size_t max_padded = 0, max_shard = 0, all_max_padded = 0, all_max_shard = 0;
  for (auto& g : groups_) {
    all_max_padded = std::max(all_max_padded, g->layout.padded_numel);
    all_max_shard = std::max(all_max_shard, g->layout.shard_numel);
    if (!g->persistent) {
      max_padded = std::max(max_padded, g->layout.padded_numel);
      max_shard = std::max(max_shard, g->layout.shard_numel);
    }
  }
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
  for (size_t i = 0; i < gradient_slots_.size(); ++i) {
    auto& slot = gradient_slots_[i];
    const std::string name = "gradient slot " + std::to_string(i);
    STRATA_ASSIGN_OR_RETURN(slot.full, device_.allocate(all_max_padded * 4, name));
    if (world > 1) {
      STRATA_ASSIGN_OR_RETURN(slot.shard, device_.allocate(all_max_shard * 4, name + " shard"));
    }
    if (options_.grad_transfer_dtype != DType::kFloat32) {
      STRATA_ASSIGN_OR_RETURN(slot.cast, device_.allocate(all_max_shard * tsize, name + " transfer cast"));
    }
    STRATA_ASSIGN_OR_RETURN(slot.grads_done, device_.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.reduced, device_.create_event());
    STRATA_ASSIGN_OR_RETURN(slot.copied, device_.create_event());
  }
  STRATA_ASSIGN_OR_RETURN(norm_buffer_, device_.allocate(256, "norm all-reduce"));
  if (nvme_params || options_.param_tier == Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(param_out_stage_, host_alloc(param_bytes(all_max_shard), "new-parameter staging"));
  }
  if (device_state()) {
    STRATA_ASSIGN_OR_RETURN(state_access_stage_, host_alloc(all_max_shard * 12, "optimizer-state access staging"));
    if (options_.param_tier != Tier::kDevice) {
      STRATA_ASSIGN_OR_RETURN(param_out_device_, device_.allocate(param_bytes(all_max_shard), "new-parameter staging"));
    }
  }
  if (nvme_state) {
    for (int i = 0; i < 3; ++i) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer stage, host_alloc(all_max_shard * 12, "optimizer-state staging " + std::to_string(i)));
      state_stage_.push_back(std::move(stage));
    }
    STRATA_ASSIGN_OR_RETURN(state_access_stage_, host_alloc(all_max_shard * 12, "optimizer-state access staging"));
  }

  // Optimizer.
  CpuAdamOptions adam_options;
  adam_options.threads = options_.optimizer_threads > 0
                             ? options_.optimizer_threads
                             : std::max(1, available_cpu_count() / std::max(1, options_.world_size));
  STRATA_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::create(adam_options));
  adam_.emplace(std::move(adam));
  CpuAdamOptions stats_options = adam_options;
  stats_options.threads = 1;
  STRATA_ASSIGN_OR_RETURN(CpuAdam stats_adam, CpuAdam::create(stats_options));
  stats_adam_.emplace(std::move(stats_adam));
  if (options_.fp16_loss_scaling) {
    STRATA_ASSIGN_OR_RETURN(LossScaler scaler, LossScaler::create(options_.loss_scaler));
    loss_scaler_.emplace(scaler);
  }
  early_update_ = options_.overlap == OverlapMode::kExact && options_.gradient_clipping <= 0.0f && !options_.fp16_loss_scaling;

  // Per group: storage, then the initial values of the local shards.
  std::vector<float> init(all_max_shard);
  std::vector<uint16_t> param16(all_max_shard);
  std::unique_ptr<Stream>& setup = update_stream_;
  for (auto& gp : groups_) {
    GroupState& g = *gp;
    const size_t shard = g.layout.shard_numel;
    const std::string name = "group " + g.layout.name;
    g.decay_runs = decay_runs(g.layout, rank);
    init_shard(g.layout, rank, options_.seed, init.data());
    // The initial parameter copy in the parameter dtype.
    const void* param_init = init.data();
    if (options_.param_dtype != DType::kFloat32) {
      for (size_t i = 0; i < shard; ++i) store_from_float(param16.data(), options_.param_dtype, i, init[i]);
      param_init = param16.data();
    }
    for (int c = 0; c < copies; ++c) {
      const std::string copy_name = name + " parameters" + (copies > 1 ? " copy " + std::to_string(c) : "");
      switch (options_.param_tier) {
        case Tier::kDevice: {
          STRATA_ASSIGN_OR_RETURN(DeviceBuffer buffer, device_.allocate(param_bytes(shard), copy_name));
          STRATA_RETURN_IF_ERROR(device_.copy_async(buffer.data(), param_init, param_bytes(shard), CopyKind::kHostToDevice, *setup));
          STRATA_RETURN_IF_ERROR(setup->synchronize());
          g.param_device.push_back(std::move(buffer));
          break;
        }
        case Tier::kPinned:
        case Tier::kHost: {
          STRATA_ASSIGN_OR_RETURN(PinnedBuffer buffer, host_alloc(param_bytes(shard), copy_name));
          std::memcpy(buffer.data(), param_init, param_bytes(shard));
          g.param_host.push_back(std::move(buffer));
          break;
        }
        case Tier::kNvme: {
          STRATA_ASSIGN_OR_RETURN(NvmeExtent extent, nvme_->allocate("g" + std::to_string(g.layout.id) + ".param" + std::to_string(c), param_bytes(shard)));
          std::memcpy(param_out_stage_.data(), param_init, param_bytes(shard));
          STRATA_RETURN_IF_ERROR(nvme_->write(extent, param_out_stage_.data(), param_bytes(shard), 0, param_out_stage_.capacity()));
          g.param_nvme.push_back(extent);
          break;
        }
      }
    }
    // Optimizer state: master = the fp32 initial values, moments zero.
    if (device_state()) {
      STRATA_ASSIGN_OR_RETURN(g.state_device, device_.allocate(shard * 16, name + " optimizer state"));
      STRATA_RETURN_IF_ERROR(device_.memset_async(g.state_device.data(), 0, shard * 16, *setup));
      STRATA_RETURN_IF_ERROR(device_.copy_async(g.state_device.data(), init.data(), shard * 4, CopyKind::kHostToDevice, *setup));
      STRATA_RETURN_IF_ERROR(setup->synchronize());
    } else if (nvme_state) {
      STRATA_ASSIGN_OR_RETURN(g.state_nvme, nvme_->allocate("g" + std::to_string(g.layout.id) + ".state", shard * 12));
      PinnedBuffer& stage = state_stage_[0];
      std::memcpy(stage.data(), init.data(), shard * 4);
      std::memset(stage.as<char>() + shard * 4, 0, shard * 8);
      STRATA_RETURN_IF_ERROR(nvme_->write(g.state_nvme, stage.data(), shard * 12, 0, stage.capacity()));
    } else {
      STRATA_ASSIGN_OR_RETURN(g.master, host_alloc(shard * 4, name + " master"));
      STRATA_ASSIGN_OR_RETURN(g.exp_avg, host_alloc(shard * 4, name + " exp_avg"));
      STRATA_ASSIGN_OR_RETURN(g.exp_avg_sq, host_alloc(shard * 4, name + " exp_avg_sq"));
      std::memcpy(g.master.data(), init.data(), shard * 4);
      std::memset(g.exp_avg.data(), 0, shard * 4);
      std::memset(g.exp_avg_sq.data(), 0, shard * 4);
    }
    for (int c = 0; c < copies; ++c) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer landing, host_alloc(shard * tsize, name + " gradient landing"));
      g.grad_landing.push_back(std::move(landing));
      if (options_.gradient_accumulation_steps > 1) {
        STRATA_ASSIGN_OR_RETURN(PinnedBuffer accum, host_alloc(shard * 4, name + " gradient accumulator"));
        g.grad_accum.push_back(std::move(accum));
      }
    }
    if (g.persistent && !direct_view(g)) {
      STRATA_ASSIGN_OR_RETURN(g.persistent_full, device_.allocate(param_bytes(g.layout.padded_numel), name + " persistent"));
      if (world > 1 && options_.param_tier != Tier::kDevice) {
        STRATA_ASSIGN_OR_RETURN(g.persistent_shard, device_.allocate(param_bytes(shard), name + " persistent staging"));
      }
      if (nvme_params) {
        STRATA_ASSIGN_OR_RETURN(g.persistent_stage, host_alloc(param_bytes(shard), name + " persistent NVMe staging"));
      }
      STRATA_ASSIGN_OR_RETURN(g.persistent_ready, device_.create_event());
      STRATA_ASSIGN_OR_RETURN(g.persistent_released, device_.create_event());
      STRATA_ASSIGN_OR_RETURN(g.persistent_h2d_done, device_.create_event());
    }
  }
  if (nvme_) {
    const auto stats = nvme_->stats();
    (void)stats;
  }
  (void)psize;
  return {};
}

Status EngineImpl::start() {
  if (started_) return FailedPreconditionError("start() called twice");
  STRATA_RETURN_IF_ERROR(build_plan());
  if (options_.rank == 0) STRATA_LOG(kInfo) << plan_.text;
  STRATA_RETURN_IF_ERROR(check_plan_against_machine());
  STRATA_RETURN_IF_ERROR(allocate_and_initialize());
  if (!options_.metrics_path.empty() && options_.rank == 0) {
    metrics_.open(options_.metrics_path, std::ios::app);
    if (!metrics_) return Status::FromErrno(errno, "cannot open the metrics file " + options_.metrics_path);
  }
  started_ = true;
  fetcher_ = std::thread([this] { fetcher_loop(); });
  lander_ = std::thread([this] { lander_loop(); });
  optimizer_ = std::thread([this] { optimizer_loop(); });
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
  text << "; gradient slots busy:";
  for (const auto& slot : gradient_slots_) text << " " << slot.busy;
  text << "; landings " << landings_done_ << "/" << landings_queued_ << "; optimizer jobs " << optimizer_jobs_done_ << "/"
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
  if (lander_.joinable()) lander_.join();
  if (optimizer_.joinable()) optimizer_.join();
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
  for (auto& g : groups_) g->active_gradient_slot = -1;
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
  GroupState& state = group(g);
  if (state.active_gradient_slot < 0) {
    int chosen = -1;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      auto free_slot = [&] {
        for (size_t i = 0; i < gradient_slots_.size(); ++i)
          if (!gradient_slots_[i].busy) return static_cast<int>(i);
        return -1;
      };
      STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return free_slot() >= 0; }, "a free gradient buffer"));
      chosen = free_slot();
      gradient_slots_[static_cast<size_t>(chosen)].busy = true;
    }
    state.active_gradient_slot = chosen;
    STRATA_RETURN_IF_ERROR(device_.memset_async(gradient_slots_[static_cast<size_t>(chosen)].full.data(), 0,
                                                state.layout.padded_numel * sizeof(float), *compute_stream_));
  }
  return view_of(state, gradient_slots_[static_cast<size_t>(state.active_gradient_slot)].full.data(), DType::kFloat32);
}

// Device-resident optimizer state: the reduced shard accumulates into the group's device
// gradient accumulator; after the last micro-batch its fp32 copy goes to the host for the
// norm and overflow statistics (the update itself reads the device copy).
Status EngineImpl::land_on_device(int g, int slot_index, const float* reduced) {
  GroupState& state = group(g);
  GradientSlot& slot = gradient_slots_[static_cast<size_t>(slot_index)];
  const size_t shard = state.layout.shard_numel;
  float* accum = state.state_device.as<float>() + 3 * shard;
  if (micro_ == 0) {
    STRATA_RETURN_IF_ERROR(device_.copy_async(accum, reduced, shard * 4, CopyKind::kDeviceToDevice, *reduce_stream_));
  } else {
    STRATA_RETURN_IF_ERROR(kernels::residual_forward(*reduce_stream_, DType::kFloat32, accum, reduced, accum, shard));
  }
  STRATA_RETURN_IF_ERROR(reduce_stream_->record(*slot.reduced));
  const bool last = micro_ + 1 == options_.gradient_accumulation_steps;
  if (last) {
    {
      std::unique_lock<std::mutex> lock(mutex_);
      STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return state.landings_processed == state.landings_sent; }, "the previous gradient landing"));
    }
    STRATA_RETURN_IF_ERROR(d2h_stream_->wait(*slot.reduced));
    const int copy = options_.overlap == OverlapMode::kDelayed ? static_cast<int>(step_index_ % 2) : 0;
    void* landing = state.grad_landing[static_cast<size_t>(copy)].data();
    STRATA_RETURN_IF_ERROR(traced(*d2h_stream_, Stage::kD2H, g, state.layout.name, [&] {
      return device_.copy_async(landing, accum, shard * 4, CopyKind::kDeviceToHost, *d2h_stream_);
    }));
    STRATA_RETURN_IF_ERROR(d2h_stream_->record(*slot.copied));
  } else {
    STRATA_RETURN_IF_ERROR(reduce_stream_->record(*slot.copied));
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    landing_.push_back({g, slot_index, step_index_, micro_, last, TraceClock::now()});
    ++landings_queued_;
    ++state.landings_sent;
  }
  cv_.notify_all();
  return {};
}

Status EngineImpl::grads_ready(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "grads_ready"));
  if (forward_only_) return FailedPreconditionError("grads_ready() in a forward-only pass");
  STRATA_RETURN_IF_ERROR(background_error());
  GroupState& state = group(g);
  const int slot_index = state.active_gradient_slot;
  if (slot_index < 0)
    return FailedPreconditionError("grads_ready(" + std::to_string(g) + ") without gradient_buffer(" + std::to_string(g) +
                                   ") in this micro-batch (or twice)");
  state.active_gradient_slot = -2;  // handed over: a second grads_ready this micro-batch is an error
  GradientSlot& slot = gradient_slots_[static_cast<size_t>(slot_index)];
  const size_t shard = state.layout.shard_numel;
  const std::string label = state.layout.name;
  STRATA_RETURN_IF_ERROR(compute_stream_->record(*slot.grads_done));
  STRATA_RETURN_IF_ERROR(reduce_stream_->wait(*slot.grads_done));
  const float* reduced = slot.full.as<float>();
  if (options_.world_size > 1) {
    ReduceOptions reduce;
    reduce.op = ReduceOp::kSum;
    reduce.wire_dtype = options_.grad_wire_dtype;
    STRATA_RETURN_IF_ERROR(traced(*reduce_stream_, Stage::kReduceScatter, g, label, [&] {
      return reduce_comm_.reduce_scatter(slot.full.data(), slot.shard.data(), shard, DType::kFloat32, reduce, *reduce_stream_);
    }));
    reduced = slot.shard.as<float>();
  }
  if (device_state()) return land_on_device(g, slot_index, reduced);
  const void* transfer = reduced;
  if (options_.grad_transfer_dtype != DType::kFloat32) {
    STRATA_RETURN_IF_ERROR(kernels::cast(*reduce_stream_, reduced, DType::kFloat32, slot.cast.data(), options_.grad_transfer_dtype, shard));
    transfer = slot.cast.data();
  }
  STRATA_RETURN_IF_ERROR(reduce_stream_->record(*slot.reduced));
  STRATA_RETURN_IF_ERROR(d2h_stream_->wait(*slot.reduced));
  {
    // The landing buffer is read by the lander (accumulation, statistics) after each
    // copy: the next copy into it waits until that is done.
    std::unique_lock<std::mutex> lock(mutex_);
    STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] { return state.landings_processed == state.landings_sent; }, "the previous gradient landing"));
  }
  const int copy = options_.overlap == OverlapMode::kDelayed ? static_cast<int>(step_index_ % 2) : 0;
  void* landing = state.grad_landing[static_cast<size_t>(copy)].data();
  const size_t bytes = shard * dtype_size(options_.grad_transfer_dtype);
  STRATA_RETURN_IF_ERROR(traced(*d2h_stream_, Stage::kD2H, g, label, [&] {
    return device_.copy_async(landing, transfer, bytes, CopyKind::kDeviceToHost, *d2h_stream_);
  }));
  STRATA_RETURN_IF_ERROR(d2h_stream_->record(*slot.copied));
  {
    std::lock_guard<std::mutex> lock(mutex_);
    landing_.push_back({g, slot_index, step_index_, micro_, micro_ + 1 == options_.gradient_accumulation_steps, TraceClock::now()});
    ++landings_queued_;
    ++state.landings_sent;
  }
  cv_.notify_all();
  return {};
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
  GradientStats local;
  {
    std::unique_lock<std::mutex> lock(mutex_);
    STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] {
      for (auto& g : groups_) if (g->landed_step < t) return false;
      return true;
    }, "every group's gradients of this step"));
    // A fixed order: the sum does not depend on landing order.
    for (auto& g : groups_) local += g->landed_stats;
  }
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
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!early_update_) {
      optimizer_jobs_.push_back(std::move(job));
      ++optimizer_jobs_queued_;
    }
    steps_finished_ = t + 1;
  }
  cv_.notify_all();
  step_index_ = t + 1;
  micro_ = -1;

  // Report and metrics over the window since the previous step.
  const auto now = TraceClock::now();
  report.step = applied_steps_;
  report.loss = loss;
  report.skipped = !early_update_ && job.skip;
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
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // Every fetch already planned is carried out: the prefetcher runs ahead into a next
    // step, and every rank must issue the same gathers or its peers would wait for them.
    STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] {
      bool updated = true;
      for (auto& g : groups_) updated = updated && g->param_version >= steps_finished_;
      return optimizer_jobs_done_ == optimizer_jobs_queued_ && landings_done_ == landings_queued_ && updated &&
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

// Where one kind of state of one group lives on the host, once no update of it is
// pending (model thread): the host buffer, or the NVMe extent read whole into the access
// staging buffer (checksummed blocks are read whole).
StatusOr<float*> EngineImpl::state_for_access(int g, StateKind kind, size_t elements, const char* call) {
  STRATA_RETURN_IF_ERROR(check_group(g, call));
  GroupState& state = group(g);
  const size_t shard = state.layout.shard_numel;
  if (elements != shard)
    return InvalidArgumentError(std::string(call) + ": group " + state.layout.name + " has " + std::to_string(shard) +
                                " elements per shard, the span has " + std::to_string(elements));
  {
    std::unique_lock<std::mutex> lock(mutex_);
    // The whole update, the write-back of NVMe-resident state included.
    STRATA_RETURN_IF_ERROR(wait_locked(lock, [&] {
      return state.param_version >= steps_finished_ && optimizer_jobs_done_ == optimizer_jobs_queued_;
    }, "the group's update"));
  }
  if (options_.optimizer_tier == Tier::kNvme) {
    PinnedBuffer& staging = state_access_stage_;
    STRATA_RETURN_IF_ERROR(nvme_->read(state.state_nvme, staging.data(), shard * 12, 0, staging.capacity()));
    return staging.as<float>() + static_cast<size_t>(kind) * shard;
  }
  if (device_state()) {
    PinnedBuffer& staging = state_access_stage_;
    STRATA_RETURN_IF_ERROR(device_.copy_async(staging.data(), state.state_device.data(), shard * 12, CopyKind::kDeviceToHost, *update_stream_));
    STRATA_RETURN_IF_ERROR(update_stream_->synchronize());
    return staging.as<float>() + static_cast<size_t>(kind) * shard;
  }
  PinnedBuffer& buffer = kind == StateKind::kMaster ? state.master : kind == StateKind::kExpAvg ? state.exp_avg : state.exp_avg_sq;
  return buffer.as<float>();
}

Status EngineImpl::read_state_shard(int g, StateKind kind, std::span<float> out) {
  STRATA_ASSIGN_OR_RETURN(const float* source, state_for_access(g, kind, out.size(), "read_state_shard"));
  std::memcpy(out.data(), source, out.size_bytes());
  return {};
}

Status EngineImpl::write_state_shard(int g, StateKind kind, std::span<const float> in) {
  STRATA_ASSIGN_OR_RETURN(float* target, state_for_access(g, kind, in.size(), "write_state_shard"));
  std::memcpy(target, in.data(), in.size_bytes());
  GroupState& state = group(g);
  if (options_.optimizer_tier == Tier::kNvme)
    return nvme_->write(state.state_nvme, state_access_stage_.data(), state.layout.shard_numel * 12, 0, state_access_stage_.capacity());
  if (device_state()) {
    STRATA_RETURN_IF_ERROR(device_.copy_async(state.state_device.data(), state_access_stage_.data(), state.layout.shard_numel * 12,
                                              CopyKind::kHostToDevice, *update_stream_));
    return update_stream_->synchronize();
  }
  return {};
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
    const size_t shard = g.layout.shard_numel;
    master.resize(shard);
    STRATA_RETURN_IF_ERROR(read_state_shard(g.layout.id, StateKind::kMaster, master));
    const int copies = param_copies();
    for (int c = 0; c < copies; ++c) {
      // Every copy gets the same values: the next fetch reads whichever its version picks.
      void* host_target = nullptr;
      if (options_.param_tier == Tier::kPinned || options_.param_tier == Tier::kHost) host_target = g.param_host[static_cast<size_t>(c)].data();
      else host_target = param_out_stage_.data();
      for (size_t i = 0; i < shard; ++i) store_from_float(host_target, options_.param_dtype, i, master[i]);
      if (options_.param_tier == Tier::kDevice) {
        STRATA_RETURN_IF_ERROR(device_.copy_async(g.param_device[static_cast<size_t>(c)].data(), host_target, param_bytes(shard),
                                                  CopyKind::kHostToDevice, *update_stream_));
        STRATA_RETURN_IF_ERROR(update_stream_->synchronize());
      } else if (options_.param_tier == Tier::kNvme) {
        STRATA_RETURN_IF_ERROR(nvme_->write(g.param_nvme[static_cast<size_t>(c)], host_target, param_bytes(shard), 0, param_out_stage_.capacity()));
      }
    }
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

// =====================================================================================
// The lander: gradient shards arriving in host memory
// =====================================================================================

void EngineImpl::lander_loop() {
  for (;;) {
    LandingItem item;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !landing_.empty(); });
      if (stopping_) return;
      item = landing_.front();
    }
    Status status = land_one(item);
    if (!status.ok()) {
      record_error(std::move(status).with_context("landing the gradients of group " + std::to_string(item.group)));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      landing_.pop_front();
      ++landings_done_;
      ++group(item.group).landings_processed;
    }
    cv_.notify_all();
  }
}

Status EngineImpl::land_one(const LandingItem& item) {
  GradientSlot& slot = gradient_slots_[static_cast<size_t>(item.slot)];
  STRATA_RETURN_IF_ERROR(slot.copied->synchronize());
  {
    std::lock_guard<std::mutex> lock(mutex_);
    slot.busy = false;
  }
  cv_.notify_all();
  GroupState& state = group(item.group);
  const size_t shard = state.layout.shard_numel;
  const size_t copy = options_.overlap == OverlapMode::kDelayed ? static_cast<size_t>(item.step % 2) : 0;
  const void* final_grad = state.grad_landing[copy].data();
  DType final_type = options_.grad_transfer_dtype;
  if (options_.gradient_accumulation_steps > 1 && !device_state()) {
    float* accum = state.grad_accum[copy].as<float>();
    accumulate_into(accum, state.grad_landing[copy].data(), options_.grad_transfer_dtype, shard, item.micro == 0);
    final_grad = accum;
    final_type = DType::kFloat32;
  }
  if (!item.last_micro) return {};
  STRATA_ASSIGN_OR_RETURN(GradientStats stats, stats_adam_->gradient_stats(final_grad, final_type, shard));
  OptimizerJob job;
  bool push = false;
  if (early_update_) {
    double lr = 0.0;
    int64_t applied = 0;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      lr = step_learning_rate_;
      applied = step_applied_number_;
    }
    kernels::AdamHyperparams hyper = options_.adam;
    hyper.lr = lr;
    GradientStats none;  // no clipping, no loss scale: the plan does not depend on the norm
    STRATA_ASSIGN_OR_RETURN(job.decay_plan, plan_adam_step(hyper, applied, none, {}));
    hyper.weight_decay = 0.0;
    STRATA_ASSIGN_OR_RETURN(job.no_decay_plan, plan_adam_step(hyper, applied, none, {}));
    job.step_index = item.step;
    job.order = {item.group};
    push = true;
  }
  {
    std::lock_guard<std::mutex> lock(mutex_);
    state.landed_stats = stats;
    state.landed_step = item.step;
    if (push) {
      optimizer_jobs_.push_back(std::move(job));
      ++optimizer_jobs_queued_;
    }
  }
  cv_.notify_all();
  return {};
}

// =====================================================================================
// The optimizer: Adam per group, state in memory or streamed from NVMe
// =====================================================================================

void EngineImpl::optimizer_loop() {
  for (;;) {
    OptimizerJob job;
    {
      std::unique_lock<std::mutex> lock(mutex_);
      cv_.wait(lock, [&] { return stopping_ || !optimizer_jobs_.empty(); });
      if (stopping_) return;
      job = optimizer_jobs_.front();
    }
    // NVMe-resident state: keep the next group's read in flight while this one steps
    // (and the previous one's write-back drains): read g+1, step g, write g-1.
    const bool nvme_state = options_.optimizer_tier == Tier::kNvme && !job.skip;
    std::vector<IoTicket> reads(job.order.size()), writes(job.order.size());
    std::vector<TraceClock::time_point> read_begin(job.order.size()), write_begin(job.order.size());
    auto submit_read = [&](size_t i) -> Status {
      GroupState& s = group(job.order[i]);
      // The stage rotates over three buffers: the write of group i-3... i-2 used it last.
      if (i >= 3 && writes[i - 3].valid()) {
        STRATA_RETURN_IF_ERROR(nvme_->wait(writes[i - 3]));
        tracer_.record(Stage::kNvmeWrite, job.order[i - 3], write_begin[i - 3], TraceClock::now(), group(job.order[i - 3]).layout.name);
        writes[i - 3] = {};
      }
      PinnedBuffer& stage = state_stage_[i % 3];
      read_begin[i] = TraceClock::now();
      STRATA_ASSIGN_OR_RETURN(reads[i], nvme_->read_async(s.state_nvme, stage.data(), s.layout.shard_numel * 12, 0, stage.capacity()));
      return {};
    };
    Status status;
    if (nvme_state && !job.order.empty()) status = submit_read(0);
    for (size_t i = 0; i < job.order.size() && status.ok(); ++i) {
      const int g = job.order[i];
      if (nvme_state) {
        if (i + 1 < job.order.size()) status = submit_read(i + 1);
        if (!status.ok()) break;
        status = nvme_->wait(reads[i]);
        if (!status.ok()) break;
        tracer_.record(Stage::kNvmeRead, g, read_begin[i], TraceClock::now(), group(g).layout.name);
      }
      status = update_group(job, g);
      if (!status.ok()) break;
      if (nvme_state) {
        GroupState& s = group(g);
        PinnedBuffer& stage = state_stage_[i % 3];
        write_begin[i] = TraceClock::now();
        auto ticket = nvme_->write_async(s.state_nvme, stage.data(), s.layout.shard_numel * 12, 0, stage.capacity());
        if (!ticket.ok()) {
          status = ticket.status();
          break;
        }
        writes[i] = *ticket;
      }
      {
        std::lock_guard<std::mutex> lock(mutex_);
        group(g).param_version = std::max(group(g).param_version, job.step_index + 1);
      }
      cv_.notify_all();
    }
    for (size_t i = 0; i < writes.size() && status.ok(); ++i) {
      if (!writes[i].valid()) continue;
      status = nvme_->wait(writes[i]);
      tracer_.record(Stage::kNvmeWrite, job.order[i], write_begin[i], TraceClock::now(), group(job.order[i]).layout.name);
    }
    if (!status.ok()) {
      record_error(std::move(status).with_context("optimizer step " + std::to_string(job.step_index)));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(mutex_);
      optimizer_jobs_.pop_front();
      ++optimizer_jobs_done_;
    }
    cv_.notify_all();
  }
}

// Device-resident optimizer state: the Adam kernel on the update stream, the new
// parameters written straight into the device shard (or staged out to the host tier).
Status EngineImpl::update_group_on_device(const OptimizerJob& job, int g) {
  GroupState& s = group(g);
  const size_t shard = s.layout.shard_numel;
  const int out_copy = parity(job.step_index + 1);
  Tracer::Scope scope(&tracer_, Stage::kOptimizer, g, s.layout.name);
  float* state = s.state_device.as<float>();
  void* param_out = options_.param_tier == Tier::kDevice ? s.param_device[static_cast<size_t>(out_copy)].data() : param_out_device_.data();
  const size_t param_size = dtype_size(options_.param_dtype);
  for (const DecayRun& run : s.decay_runs) {
    kernels::AdamBuffers part;
    part.grad = state + 3 * shard + run.begin;
    part.grad_type = DType::kFloat32;
    part.master = state + run.begin;
    part.exp_avg = state + shard + run.begin;
    part.exp_avg_sq = state + 2 * shard + run.begin;
    part.moment_type = DType::kFloat32;
    part.param = static_cast<char*>(param_out) + run.begin * param_size;
    part.param_type = options_.param_dtype;
    part.count = run.end - run.begin;
    STRATA_RETURN_IF_ERROR(kernels::adam_step(*update_stream_, part, (run.decay ? job.decay_plan : job.no_decay_plan).scalars));
  }
  if (options_.param_tier == Tier::kPinned || options_.param_tier == Tier::kHost) {
    STRATA_RETURN_IF_ERROR(device_.copy_async(s.param_host[static_cast<size_t>(out_copy)].data(), param_out, param_bytes(shard),
                                              CopyKind::kDeviceToHost, *update_stream_));
  } else if (options_.param_tier == Tier::kNvme) {
    STRATA_RETURN_IF_ERROR(device_.copy_async(param_out_stage_.data(), param_out, param_bytes(shard), CopyKind::kDeviceToHost, *update_stream_));
  }
  STRATA_RETURN_IF_ERROR(update_stream_->synchronize());
  if (options_.param_tier == Tier::kNvme) {
    const auto begin = TraceClock::now();
    STRATA_RETURN_IF_ERROR(nvme_->write(s.param_nvme[static_cast<size_t>(out_copy)], param_out_stage_.data(), param_bytes(shard), 0,
                                        param_out_stage_.capacity()));
    tracer_.record(Stage::kNvmeWrite, g, begin, TraceClock::now(), s.layout.name + " parameters");
  }
  return {};
}

Status EngineImpl::update_group(const OptimizerJob& job, int g) {
  if (job.skip) return {};
  GroupState& s = group(g);
  const size_t shard = s.layout.shard_numel;
  const size_t copy = options_.overlap == OverlapMode::kDelayed ? static_cast<size_t>(job.step_index % 2) : 0;
  const int out_copy = parity(job.step_index + 1);
  Tracer::Scope scope(&tracer_, Stage::kOptimizer, g, s.layout.name);
  if (device_state()) return update_group_on_device(job, g);
  kernels::AdamBuffers buffers;
  if (options_.gradient_accumulation_steps > 1) {
    buffers.grad = s.grad_accum[copy].data();
    buffers.grad_type = DType::kFloat32;
  } else {
    buffers.grad = s.grad_landing[copy].data();
    buffers.grad_type = options_.grad_transfer_dtype;
  }
  if (options_.optimizer_tier == Tier::kNvme) {
    // The state was read into this group's stage (see optimizer_loop's rotation).
    size_t position = 0;
    for (size_t i = 0; i < job.order.size(); ++i)
      if (job.order[i] == g) position = i;
    float* stage = state_stage_[position % 3].as<float>();
    buffers.master = stage;
    buffers.exp_avg = stage + shard;
    buffers.exp_avg_sq = stage + 2 * shard;
  } else {
    buffers.master = s.master.as<float>();
    buffers.exp_avg = s.exp_avg.data();
    buffers.exp_avg_sq = s.exp_avg_sq.data();
  }
  buffers.moment_type = DType::kFloat32;
  const bool host_params = options_.param_tier == Tier::kPinned || options_.param_tier == Tier::kHost;
  void* param_out = host_params ? s.param_host[static_cast<size_t>(out_copy)].data() : param_out_stage_.data();
  buffers.param = param_out;
  buffers.param_type = options_.param_dtype;
  const size_t grad_size = dtype_size(buffers.grad_type);
  const size_t param_size = dtype_size(options_.param_dtype);
  for (const DecayRun& run : s.decay_runs) {
    kernels::AdamBuffers part = buffers;
    part.grad = static_cast<const char*>(buffers.grad) + run.begin * grad_size;
    part.master = buffers.master + run.begin;
    part.exp_avg = static_cast<float*>(buffers.exp_avg) + run.begin;
    part.exp_avg_sq = static_cast<float*>(buffers.exp_avg_sq) + run.begin;
    part.param = static_cast<char*>(param_out) + run.begin * param_size;
    part.count = run.end - run.begin;
    STRATA_RETURN_IF_ERROR(adam_->step(part, run.decay ? job.decay_plan : job.no_decay_plan));
  }
  if (options_.param_tier == Tier::kDevice) {
    STRATA_RETURN_IF_ERROR(traced(*update_stream_, Stage::kH2D, g, s.layout.name + " update", [&] {
      return device_.copy_async(s.param_device[static_cast<size_t>(out_copy)].data(), param_out, param_bytes(shard),
                                CopyKind::kHostToDevice, *update_stream_);
    }));
    STRATA_RETURN_IF_ERROR(update_stream_->synchronize());
  } else if (options_.param_tier == Tier::kNvme) {
    const auto begin = TraceClock::now();
    STRATA_RETURN_IF_ERROR(nvme_->write(s.param_nvme[static_cast<size_t>(out_copy)], param_out, param_bytes(shard), 0, param_out_stage_.capacity()));
    tracer_.record(Stage::kNvmeWrite, g, begin, TraceClock::now(), s.layout.name + " parameters");
  }
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
