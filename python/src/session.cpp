#include "python/src/session.h"

#include <algorithm>
#include <map>
#include <utility>

#include "engine/core/log.h"
#include "engine/engine_config.h"
#include "examples/hf/hf_checkpoint.h"
#include "examples/hf/hf_weights.h"
#include "examples/run_config/run_config.h"

namespace strata::python {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

// Settings of strata-train that the front end cannot honour: its model and data come from
// the caller. Rejected rather than ignored, so a config copied from a trainer run says so.
Status reject_trainer_keys(const StrataConfig& config) {
  for (const auto& [key, where] : config.given) {
    const bool trainer_key = key.starts_with("strata.model.") || key.starts_with("strata.data.") || key == "strata.steps";
    if (trainer_key)
      return InvalidArgumentError(key + " (" + where + ") is a strata-train setting; the Python front end takes the model, the data and " +
                                  "the number of steps from the calling script");
  }
  return {};
}

StatusOr<LocalClusterOptions> cluster_options(const StrataConfig& config, DeviceKind device) {
  LocalClusterOptions options;
  options.device = device;
  options.device_budget_bytes = config.strata.device_budget_mib > 0 ? static_cast<size_t>(config.strata.device_budget_mib) * kMiB
                                : device == DeviceKind::kCpu        ? size_t{1} << 30
                                                                    : 0;
  options.compute_threads = static_cast<int>(config.strata.compute_threads);
  options.device_thread_nice = static_cast<int>(config.strata.device_thread_nice);
  options.matmul_precision = config.strata.matmul_precision;
  STRATA_ASSIGN_OR_RETURN(options.process_group, LocalCluster::process_group_from_env());
  const int64_t configured = config.strata.world_size;
  if (options.process_group) {
    if (config.was_given("strata.world_size") && configured != options.process_group->world_size)
      return InvalidArgumentError("strata.world_size is " + std::to_string(configured) + " but the launcher's WORLD_SIZE is " +
                                  std::to_string(options.process_group->world_size) + "; drop the key or make them agree");
  } else if (configured > 1) {
    return InvalidArgumentError("strata.world_size is " + std::to_string(configured) +
                                ", but the Python front end runs one rank per process: start the ranks with torchrun, strata-launch or "
                                "srun (which set WORLD_SIZE and RANK), or drop the key");
  }
  return options;
}

}  // namespace

StatusOr<std::unique_ptr<Session>> Session::create(const std::string& config_text, const std::string& source) {
  std::unique_ptr<Session> session(new Session());
  // Parsed with strata-train's keys so that a trainer key is named and refused below, not unknown.
  STRATA_ASSIGN_OR_RETURN(RunConfig run, parse_run_config_json(config_text, source));
  session->config_ = std::move(run.engine);
  StrataConfig& config = session->config_;
  STRATA_RETURN_IF_ERROR(reject_trainer_keys(config));
  const DeviceKind device = resolve_device(config);
  STRATA_ASSIGN_OR_RETURN(const LocalClusterOptions options, cluster_options(config, device));
  STRATA_ASSIGN_OR_RETURN(session->cluster_, LocalCluster::create(options));
  LocalCluster& cluster = *session->cluster_;
  session->rank_ = cluster.first_rank();
  session->world_size_ = cluster.world_size();
  STRATA_RETURN_IF_ERROR(finalize(config, session->world_size_));
  STRATA_ASSIGN_OR_RETURN(session->options_, engine_options_from_config(config, session->rank_));
  session->placement_ = run.placement;
  session->profile_path_ = run.profile;
  STRATA_RETURN_IF_ERROR(session->create_engine());
  STRATA_ASSIGN_OR_RETURN(LrSchedule schedule, LrSchedule::create(config.scheduler, config.optimizer.lr));
  session->schedule_ = std::move(schedule);
  return session;
}

Status Session::create_engine() {
  STRATA_ASSIGN_OR_RETURN(engine_, Engine::create(options_, cluster_->device(rank_), cluster_->gather_communicator(rank_),
                                                  cluster_->reduce_communicator(rank_)));
  return {};
}

Session::~Session() {
  if (!closed_) {
    const Status status = close();
    if (!status.ok()) STRATA_LOG(kWarn) << "closing the engine: " << status.to_string();
  }
}

Status Session::check_open(std::string_view call) const {
  if (closed_) return FailedPreconditionError(std::string(call) + " after close()");
  if (!started_) return FailedPreconditionError(std::string(call) + " before the engine started");
  return {};
}

StatusOr<int> Session::register_group(const std::string& name, const std::vector<TensorEntry>& tensors, bool trainable,
                                      DType dtype) {
  if (started_) return FailedPreconditionError("register_group(" + name + ") after start()");
  const size_t factor = trainable ? 1 : pack_factor(dtype, options_.param_dtype);
  GroupSpec spec;
  spec.name = name;
  spec.trainable = trainable;
  std::vector<std::vector<int64_t>> shapes;
  for (const TensorEntry& entry : tensors) {
    TensorSpec tensor;
    tensor.name = entry.name;
    tensor.shape = entry.shape;
    tensor.weight_decay = entry.weight_decay;
    if (factor > 1) {  // one flat run of packed words
      int64_t numel = 1;
      for (const int64_t d : entry.shape) numel *= d;
      tensor.shape = {packed_words(numel, factor)};
    }
    shapes.push_back(entry.shape);
    spec.tensors.push_back(std::move(tensor));
  }
  STRATA_ASSIGN_OR_RETURN(const int id, engine_->register_group(spec));
  specs_.push_back(spec);
  packed_shapes_.resize(static_cast<size_t>(id) + 1);
  packed_dtypes_.resize(static_cast<size_t>(id) + 1, options_.param_dtype);
  if (factor > 1) {
    packed_shapes_[static_cast<size_t>(id)] = std::move(shapes);
    packed_dtypes_[static_cast<size_t>(id)] = dtype;
  }
  return id;
}

Status Session::declare_held_gradients(int count) {
  STRATA_RETURN_IF_ERROR(engine_->declare_held_gradients(count));
  held_gradients_ = count;
  return {};
}

StatusOr<ChosenPlacement> Session::search_placement() {
  if (!work_) return FailedPreconditionError("strata.placement \"auto\": the model's work was not declared before start()");
  STRATA_ASSIGN_OR_RETURN(const profile::RunProfile profile, profile::resolve_run_profile(profile_path_));
  PlacementRequest request;
  request.config = &config_;
  request.rank = rank_;
  request.world_size = world_size_;
  request.groups = specs_;
  request.held_gradients = held_gradients_;
  request.device_budget_bytes = cluster_->device(rank_).memory_stats().budget_bytes;
  request.work = *work_;
  request.profile = &profile;
  STRATA_ASSIGN_OR_RETURN(const profile::PlacementChoice choice, choose_session_placement(request));
  return ChosenPlacement{choice.best.placement, profile::placement_choice_text(choice)};
}

Status Session::place_automatically() {
  // With more than one process rank 0 searches, against its own machine, and every rank
  // takes its choice: ranks that searched alone could choose differently.
  STRATA_ASSIGN_OR_RETURN(const ChosenPlacement chosen, world_size_ > 1 ? placement_of_rank_0() : search_placement());
  placement_text_ = chosen.text;
  if (rank_ == 0) STRATA_LOG(kInfo) << placement_text_;
  apply_session_placement(chosen.placement, config_);
  STRATA_ASSIGN_OR_RETURN(options_, engine_options_from_config(config_, rank_));
  engine_.reset();
  STRATA_RETURN_IF_ERROR(create_engine());
  for (const GroupSpec& spec : specs_) STRATA_RETURN_IF_ERROR(engine_->register_group(spec).status());
  if (held_gradients_ >= 0) STRATA_RETURN_IF_ERROR(engine_->declare_held_gradients(held_gradients_));
  return {};
}

Status Session::start() {
  if (closed_) return FailedPreconditionError("start() after close()");
  if (started_) return FailedPreconditionError("start() called twice");
  if (engine_->group_count() == 0) return InvalidArgumentError("the model has no parameters to train: no group was registered");
  if (placement_ == PlacementMode::kAuto) STRATA_RETURN_IF_ERROR(place_automatically().with_context("strata.placement \"auto\""));
  for (int g = 0; g < engine_->group_count(); ++g) STRATA_RETURN_IF_ERROR(engine_->declare_loaded(g));
  STRATA_RETURN_IF_ERROR(engine_->start());
  packed_.assign(static_cast<size_t>(engine_->group_count()), std::nullopt);
  for (int g = 0; g < engine_->group_count(); ++g) {
    const DType dtype = packed_dtypes_[static_cast<size_t>(g)];
    const size_t factor = pack_factor(dtype, options_.param_dtype);
    if (factor == 1) continue;
    packed_[static_cast<size_t>(g)] = PackedGroup{dtype, factor, logical_layout(engine_->layout(g), packed_shapes_[static_cast<size_t>(g)], factor)};
  }
  started_ = true;
  return {};
}

const PackedGroup* Session::packed(int group) const {
  const size_t g = static_cast<size_t>(group);
  return g < packed_.size() && packed_[g] ? &*packed_[g] : nullptr;
}

const GroupLayout& Session::layout(int group) const {
  const PackedGroup* p = packed(group);
  return p ? p->logical : engine_->layout(group);
}

DType Session::group_dtype(int group) const {
  const PackedGroup* p = packed(group);
  return p ? p->dtype : options_.param_dtype;
}

std::vector<GroupLayout> Session::layouts() const {
  std::vector<GroupLayout> out;
  for (int g = 0; g < engine_->group_count(); ++g) out.push_back(layout(g));
  return out;
}

Status Session::read_shard(int group, std::span<float> shard) {
  const PackedGroup* p = packed(group);
  if (!p) return engine_->read_state_shard(group, Engine::StateKind::kMaster, shard);
  std::vector<float> words(engine_->layout(group).shard_numel);
  STRATA_RETURN_IF_ERROR(engine_->read_state_shard(group, Engine::StateKind::kMaster, words));
  unpack_elements(words, p->dtype, shard);
  return {};
}

Status Session::write_shard(int group, std::span<const float> shard) {
  const PackedGroup* p = packed(group);
  if (!p) return engine_->write_state_shard(group, Engine::StateKind::kMaster, shard);
  std::vector<float> words(engine_->layout(group).shard_numel);
  pack_elements(shard, p->dtype, words);
  return engine_->write_state_shard(group, Engine::StateKind::kMaster, words);
}

Status Session::write_group(int group, std::span<const float> full) {
  STRATA_RETURN_IF_ERROR(check_open("write_group"));
  const GroupLayout& l = layout(group);
  if (full.size() != l.numel)
    return InvalidArgumentError("write_group(" + l.name + "): " + std::to_string(full.size()) + " values for a group of " +
                                std::to_string(l.numel));
  std::vector<float> shard(l.shard_numel, 0.0f);
  const size_t begin = l.shard_begin(rank_);
  if (begin < l.numel) {
    const size_t count = std::min(l.shard_numel, l.numel - begin);
    std::copy_n(full.begin() + static_cast<std::ptrdiff_t>(begin), count, shard.begin());
  }
  return write_shard(group, shard);
}

Status Session::read_group(int group, std::span<float> full) {
  STRATA_RETURN_IF_ERROR(check_open("read_group"));
  const GroupLayout& l = layout(group);
  if (full.size() != l.numel) return InvalidArgumentError("read_group(" + l.name + "): the buffer holds " + std::to_string(full.size()) +
                                                          " values for a group of " + std::to_string(l.numel));
  if (world_size_ > 1) return all_gather_group(group, full);
  std::vector<float> shard(l.shard_numel);
  STRATA_RETURN_IF_ERROR(read_shard(group, shard));
  std::copy_n(shard.begin(), l.numel, full.begin());
  return {};
}

Status Session::begin_micro_batch() {
  STRATA_RETURN_IF_ERROR(check_open("a forward pass"));
  if (micro_open_) return {};
  settled_ = false;  // the step gathers: the engine's fetches run again
  if (micro_ == 0) STRATA_RETURN_IF_ERROR(engine_->begin_step(schedule_->current_lr()));
  else STRATA_RETURN_IF_ERROR(engine_->begin_micro_batch());
  micro_open_ = true;
  return {};
}

Status Session::use_caller_stream(uintptr_t native_handle) {
  STRATA_RETURN_IF_ERROR(check_open("use_caller_stream"));
  return caller_.use(cluster_->device(rank_), native_handle);
}

Region Session::region(void* data, size_t numel, DType dtype) const {
  return Region{data, numel, dtype, device_kind(), device_ordinal()};
}

Status Session::caller_after_engine(std::string_view call) {
  if (device_kind() == DeviceKind::kCpu) return {};
  return caller_.caller_after_engine(engine_->compute_stream(), call);
}

Status Session::engine_after_caller(std::string_view call) {
  // The CPU device's caller computed on this thread: its work is done.
  if (device_kind() == DeviceKind::kCpu) return {};
  return caller_.engine_after_caller(engine_->compute_stream(), call);
}

StatusOr<Region> Session::gather(int group) {
  STRATA_RETURN_IF_ERROR(check_open("gather"));
  STRATA_ASSIGN_OR_RETURN(const GroupView view, engine_->gather(group));
  if (device_kind() == DeviceKind::kCpu) {
    // PyTorch computes on this thread, not in the compute stream's order: wait for the
    // gathered data to be there (for this group's fetch alone).
    STRATA_RETURN_IF_ERROR(engine_->wait_gathered(group));
  } else {
    STRATA_RETURN_IF_ERROR(caller_after_engine("gather"));
  }
  const PackedGroup* p = packed(group);
  if (p) return region(view.flat, p->logical.padded_numel, p->dtype);
  return region(view.flat, engine_->layout(group).padded_numel, view.dtype);
}

Status Session::release(int group) {
  STRATA_RETURN_IF_ERROR(check_open("release"));
  STRATA_RETURN_IF_ERROR(engine_after_caller("release"));
  return engine_->release(group);
}

StatusOr<Region> Session::gradient_buffer(int group) {
  STRATA_RETURN_IF_ERROR(check_open("gradient_buffer"));
  // Unwritten: the front end writes every element before grads_ready (the first gradient
  // of a tensor is a copy; what no gradient reached, padding included, it zeroes), so
  // nothing waits for a zeroing on the compute stream.
  STRATA_ASSIGN_OR_RETURN(const GroupView view, engine_->gradient_buffer(group, GradientStart::kUnwritten));
  STRATA_RETURN_IF_ERROR(caller_after_engine("gradient_buffer"));
  return region(view.flat, engine_->layout(group).padded_numel, DType::kFloat32);
}

Status Session::grads_ready(int group) {
  STRATA_RETURN_IF_ERROR(check_open("grads_ready"));
  STRATA_RETURN_IF_ERROR(engine_after_caller("grads_ready"));
  return engine_->grads_ready(group);
}

StatusOr<std::optional<StepReport>> Session::end_micro_batch(double loss) {
  STRATA_RETURN_IF_ERROR(check_open("step"));
  if (!micro_open_) return FailedPreconditionError("step() without a forward and backward pass since the last step()");
  micro_open_ = false;
  if (++micro_ < options_.gradient_accumulation_steps) return std::optional<StepReport>();
  micro_ = 0;
  STRATA_ASSIGN_OR_RETURN(StepReport report, engine_->step(loss));
  if (!report.skipped) schedule_->step();
  return std::optional<StepReport>(std::move(report));
}

Status Session::close() {
  if (closed_) return {};
  closed_ = true;
  Status status;
  // Inside a step the engine cannot finish: the step is abandoned (its updates never run).
  const bool between_steps = !micro_open_ && micro_ == 0;
  if (engine_ && started_ && between_steps) status = engine_->finish();
  if (saver_) {
    const Status saved = saver_->finish();
    if (status.ok()) status = saved;
  }
  saver_.reset();
  engine_.reset();
  return status;
}

}  // namespace strata::python
