#include "engine/optimizer_stage.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "engine/core/file.h"
#include "engine/core/log.h"
#include "engine/engine_plan.h"

namespace strata::engine_internal {

StatusOr<std::unique_ptr<OptimizerStage>> OptimizerStage::create(const OptimizerStageContext& context, OptimizerStageHooks hooks) {
  if (context.adam == nullptr || context.shards == nullptr || context.gradients == nullptr || context.versions == nullptr)
    return InternalError("optimizer stage: the CPU Adam, the shard store, the gradient board and the version board are all needed");
  if (context.options->optimizer_tier == Tier::kNvme && context.nvme_state == nullptr)
    return InternalError("optimizer stage: optimizer state on NVMe but no NVMe state to step");
  if (context.options->optimizer_tier != Tier::kNvme && context.nvme_state != nullptr)
    return InternalError("optimizer stage: NVMe state given for optimizer state on " + std::string(tier_name(context.options->optimizer_tier)));
  auto stage = std::make_unique<OptimizerStage>(context, std::move(hooks));
  stage->groups_.resize(context.layouts->size());
  STRATA_RETURN_IF_ERROR(stage->allocate_staging());
  return stage;
}

// The new parameters' way out, where they are not written in place: through host memory
// to the device or NVMe (host state), or from the device to the host or NVMe (device
// state). Sized by the largest trainable shard.
Status OptimizerStage::allocate_staging() {
  const EngineOptions& o = *ctx_.options;
  const size_t bytes = std::max<size_t>(ctx_.plan->max_trainable_shard_elements, 1) * dtype_size(o.param_dtype);
  if ((o.param_tier == Tier::kNvme || o.param_tier == Tier::kDevice) && o.optimizer_tier != Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(param_out_stage_, ctx_.arena->allocate(bytes, "new-parameter staging"));
  }
  if (o.optimizer_tier == Tier::kDevice && o.param_tier != Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(param_out_device_, ctx_.device->allocate(bytes, "new-parameter staging"));
  }
  return {};
}

size_t update_queue_position(const std::deque<OptimizerJob>& queued, size_t taken, const OptimizerJob& job) {
  size_t at = queued.size();
  if (job.order.size() != 1) return at;
  auto later = [&](const OptimizerJob& q) {
    return q.order.size() == 1 && q.step_index == job.step_index && q.order.front() > job.order.front();
  };
  while (at > taken && later(queued[at - 1])) --at;
  return at;
}

OptimizerStage::~OptimizerStage() { stop(); }

Status OptimizerStage::start() {
  return sync_.start("strata:optimizer", [this] { loop(); });
}

void OptimizerStage::stop() { sync_.stop(); }

void OptimizerStage::submit(OptimizerJob job) {
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    const size_t at = update_queue_position(jobs_, taken_, job);
    jobs_.insert(jobs_.begin() + static_cast<std::ptrdiff_t>(at), std::move(job));
  }
  sync_.cv.notify_all();
}

size_t OptimizerStage::queued() const {
  std::lock_guard<std::mutex> lock(sync_.mutex);
  return jobs_.size();
}

void OptimizerStage::loop() {
  // Jobs stepped but not yet reported done: their NVMe write-backs may still be in flight.
  size_t unflushed = 0;
  for (;;) {
    std::vector<OptimizerJob> batch;
    {
      std::unique_lock<std::mutex> lock(sync_.mutex);
      sync_.cv.wait(lock, [&] { return sync_.halt.stopping || !jobs_.empty(); });
      if (sync_.halt.stopping) return;
      // NVMe-resident state: the jobs queued now go through the ring in one pass, so the
      // reads of the next job's groups overlap the steps of this one's; a group steps at
      // most once per pass (a second update of it must read what the first wrote).
      std::set<int> groups;
      for (const OptimizerJob& job : jobs_) {
        const bool disjoint = std::none_of(job.order.begin(), job.order.end(), [&](int g) { return groups.count(g) != 0; });
        if (!batch.empty() && (!ctx_.nvme_state || !disjoint)) break;
        groups.insert(job.order.begin(), job.order.end());
        batch.push_back(job);
      }
      taken_ = batch.size();
    }
    Status status = run_jobs(batch);
    {
      std::lock_guard<std::mutex> lock(sync_.mutex);
      for (size_t i = 0; i < batch.size(); ++i) jobs_.pop_front();
      taken_ = 0;
    }
    unflushed += batch.size();
    // Idle now: the state write-backs are waited for before the jobs count as done (state
    // access and finish() wait for done jobs).
    if (status.ok() && queued() == 0 && ctx_.nvme_state) status = ctx_.nvme_state->flush();
    if (!status.ok()) {
      hooks_.failed(std::move(status).with_context("optimizer step " + std::to_string(batch.front().step_index)));
      return;
    }
    if (queued() == 0 || !ctx_.nvme_state) {
      for (; unflushed > 0; --unflushed) hooks_.job_done();
    }
  }
}

Status OptimizerStage::run_jobs(const std::vector<OptimizerJob>& jobs) {
  std::vector<const OptimizerJob*> nvme_jobs;
  for (const OptimizerJob& job : jobs) {
    if (!job.skip && ctx_.nvme_state) {
      nvme_jobs.push_back(&job);
      continue;
    }
    for (int g : job.order) {
      if (!job.skip) {
        Tracer::Scope scope(ctx_.tracer, Stage::kOptimizer, g, group_layout(g).name);
        STRATA_RETURN_IF_ERROR(ctx_.options->optimizer_tier == Tier::kDevice ? update_device_group(job, g) : update_host_group(job, g));
      }
      publish(g, job.step_index + 1);
    }
  }
  if (!nvme_jobs.empty()) STRATA_RETURN_IF_ERROR(run_nvme_jobs(nvme_jobs));
  // Versions count steps, skipped ones included: every group of every job moves on.
  for (const OptimizerJob& job : jobs)
    for (int g : job.order) publish(g, job.step_index + 1);
  return {};
}

std::vector<AdamPlanRun> OptimizerStage::plan_runs(const OptimizerJob& job, int g) const {
  std::vector<AdamPlanRun> runs;
  for (const DecayRun& run : groups_[static_cast<size_t>(g)].decay_runs)
    runs.push_back({run.begin, run.end, run.decay ? &job.decay_plan : &job.no_decay_plan});
  return runs;
}

// NVMe-resident state: every group of the jobs through the ring, pipelined across group
// (and job) boundaries; each group's new parameters are in place before the engine hears
// of it.
Status OptimizerStage::run_nvme_jobs(const std::vector<const OptimizerJob*>& jobs) {
  std::vector<std::vector<AdamPlanRun>> runs;
  std::vector<NvmeAdamGroupStep> steps;
  std::vector<const OptimizerJob*> job_of;  // per step
  size_t groups = 0;
  for (const OptimizerJob* job : jobs) groups += job->order.size();
  runs.reserve(groups);
  for (const OptimizerJob* job : jobs) {
    for (int g : job->order) {
      runs.push_back(plan_runs(*job, g));
      STRATA_ASSIGN_OR_RETURN(const GradientView gradient, ctx_.gradients->landed(g, job->step_index));
      AdamGroupIo io;
      io.grad = gradient.data;
      io.grad_type = gradient.dtype;
      io.stored_gradient_copy = gradient.stored_copy;
      io.param = ctx_.shards->host_writable_copy(g, ctx_.shards->copy_of(g, job->step_index + 1));  // nullptr: staged, written out piece by piece
      io.param_type = ctx_.options->param_dtype;
      steps.push_back({static_cast<size_t>(g), io, runs.back()});
      job_of.push_back(job);
    }
  }
  size_t current = 0;  // the step being stepped: group_stepped comes in step order
  NvmeAdamStepSinks sinks;
  sinks.staged_params = [&](size_t g, size_t begin, size_t end, const void* param) {
    const int out_copy = ctx_.shards->copy_of(static_cast<int>(g), job_of[current]->step_index + 1);
    return ctx_.shards->write(static_cast<int>(g), out_copy, begin, end - begin, param, 0);
  };
  sinks.group_stepped = [&](size_t g) {
    publish(static_cast<int>(g), job_of[current]->step_index + 1);
    ++current;
    return Status();
  };
  sinks.stepped = [this](size_t g, TraceClock::time_point begin, TraceClock::time_point end) {
    ctx_.tracer->record(Stage::kOptimizer, static_cast<int>(g), begin, end, group_layout(static_cast<int>(g)).name);
  };
  // Reports may come after this call (write-backs left in flight): only `this` is captured.
  sinks.transfer_done = [this](size_t g, bool write, TraceClock::time_point begin, TraceClock::time_point end) {
    ctx_.tracer->record(write ? Stage::kNvmeWrite : Stage::kNvmeRead, static_cast<int>(g), begin, end,
                        group_layout(static_cast<int>(g)).name + " optimizer state");
  };
  return ctx_.nvme_state->step_groups(*ctx_.adam, steps, sinks);
}

// Host-resident state: CPU Adam on the group's buffers, the new parameters straight into
// the host copy, or the CPU device's copy (else staged out to the GPU or NVMe).
Status OptimizerStage::update_host_group(const OptimizerJob& job, int g) {
  const EngineOptions& o = *ctx_.options;
  GroupOptimizerState& s = groups_[static_cast<size_t>(g)];
  const int out_copy = ctx_.shards->copy_of(g, job.step_index + 1);
  STRATA_ASSIGN_OR_RETURN(const GradientView gradient, ctx_.gradients->landed(g, job.step_index));
  if (gradient.data == nullptr || gradient.on_device)
    return InternalError("group " + group_layout(g).name + ": host optimizer state needs its gradient in host memory");
  kernels::AdamBuffers buffers;
  buffers.grad = gradient.data;
  buffers.grad_type = gradient.dtype;
  buffers.master = s.master.as<float>();
  buffers.exp_avg = s.exp_avg.data();
  buffers.exp_avg_sq = s.exp_avg_sq.data();
  buffers.moment_type = DType::kFloat32;
  void* in_place = ctx_.shards->host_writable_copy(g, out_copy);
  void* param_out = in_place != nullptr ? in_place : param_out_stage_.data();
  buffers.param = param_out;
  buffers.param_type = o.param_dtype;
  const size_t grad_size = dtype_size(buffers.grad_type);
  const size_t param_size = dtype_size(o.param_dtype);
  for (const AdamPlanRun& run : plan_runs(job, g)) {
    kernels::AdamBuffers part = buffers;
    part.grad = static_cast<const char*>(buffers.grad) + run.begin * grad_size;
    part.master = buffers.master + run.begin;
    part.exp_avg = static_cast<float*>(buffers.exp_avg) + run.begin;
    part.exp_avg_sq = static_cast<float*>(buffers.exp_avg_sq) + run.begin;
    part.param = static_cast<char*>(param_out) + run.begin * param_size;
    part.count = run.end - run.begin;
    STRATA_RETURN_IF_ERROR(ctx_.adam->step(part, *run.plan));
  }
  if (in_place != nullptr) return {};
  return ctx_.shards->write(g, out_copy, 0, group_layout(g).shard_numel, param_out, param_out_stage_.capacity());
}

// Device-resident state: the Adam kernel on the update stream, the new parameters written
// straight into the device shard (or staged out to the host tier).
Status OptimizerStage::update_device_group(const OptimizerJob& job, int g) {
  const EngineOptions& o = *ctx_.options;
  const size_t shard = group_layout(g).shard_numel;
  const int out_copy = ctx_.shards->copy_of(g, job.step_index + 1);
  STRATA_ASSIGN_OR_RETURN(const GradientView gradient, ctx_.gradients->landed(g, job.step_index));
  if (!gradient.on_device || gradient.dtype != DType::kFloat32)
    return InternalError("group " + group_layout(g).name + ": device optimizer state needs its fp32 gradient on the device");
  float* state = groups_[static_cast<size_t>(g)].device.as<float>();
  const float* grad = static_cast<const float*>(gradient.data);
  void* on_device = ctx_.shards->device_copy(g, out_copy);
  void* param_out = on_device != nullptr ? on_device : param_out_device_.data();
  const size_t param_size = dtype_size(o.param_dtype);
  for (const AdamPlanRun& run : plan_runs(job, g)) {
    kernels::AdamBuffers part;
    part.grad = grad + run.begin;
    part.grad_type = DType::kFloat32;
    part.master = state + run.begin;
    part.exp_avg = state + shard + run.begin;
    part.exp_avg_sq = state + 2 * shard + run.begin;
    part.moment_type = DType::kFloat32;
    part.param = static_cast<char*>(param_out) + run.begin * param_size;
    part.param_type = o.param_dtype;
    part.count = run.end - run.begin;
    STRATA_RETURN_IF_ERROR(kernels::adam_step(*ctx_.update_stream, part, run.plan->scalars));
  }
  if (on_device != nullptr) return ctx_.update_stream->synchronize();
  // The new parameters go to the host copy, or through the staging to NVMe.
  void* in_place = ctx_.shards->host_copy(g, out_copy);
  void* host = in_place != nullptr ? in_place : param_out_stage_.data();
  STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(host, param_out, shard * param_size, CopyKind::kDeviceToHost, *ctx_.update_stream));
  STRATA_RETURN_IF_ERROR(ctx_.update_stream->synchronize());
  if (in_place != nullptr) return {};
  return ctx_.shards->write(g, out_copy, 0, shard, host, param_out_stage_.capacity());
}

// ----------------------------------------------------------------------------- state

Status OptimizerStage::initialize_group(int g) {
  const EngineOptions& o = *ctx_.options;
  const GroupLayout& layout = group_layout(g);
  GroupOptimizerState& s = groups_[static_cast<size_t>(g)];
  const size_t shard = layout.shard_numel;
  const std::string name = "group " + layout.name;
  s.decay_runs = decay_runs(layout, o.rank);
  switch (o.optimizer_tier) {
    case Tier::kDevice: {
      STRATA_ASSIGN_OR_RETURN(s.device, ctx_.device->allocate(shard * 12, name + " optimizer state"));
      STRATA_RETURN_IF_ERROR(ctx_.device->memset_async(s.device.data(), 0, shard * 12, *ctx_.update_stream));
      return ctx_.update_stream->synchronize();
    }
    case Tier::kNvme: {
      // A chunk at a time: a large group's zeros would otherwise be a shard-sized buffer.
      const size_t chunk = std::min(shard, kStateChunkElements);
      STRATA_ASSIGN_OR_RETURN(AlignedBuffer zeros, AlignedBuffer::allocate(std::max<size_t>(chunk, 1) * sizeof(float), 4096, name + " zero moments"));
      std::memset(zeros.data(), 0, zeros.capacity());
      using Array = NvmeAdamState::Array;
      for (size_t first = 0; first < shard; first += chunk) {
        const size_t count = std::min(chunk, shard - first);
        STRATA_RETURN_IF_ERROR(ctx_.nvme_state->store_range(static_cast<size_t>(g), Array::kExpAvg, first, count, zeros.data()));
        STRATA_RETURN_IF_ERROR(ctx_.nvme_state->store_range(static_cast<size_t>(g), Array::kExpAvgSq, first, count, zeros.data()));
      }
      return {};
    }
    case Tier::kPinned:
    case Tier::kHost: {
      STRATA_ASSIGN_OR_RETURN(s.master, ctx_.arena->allocate(shard * 4, name + " master"));
      STRATA_ASSIGN_OR_RETURN(s.exp_avg, ctx_.arena->allocate(shard * 4, name + " exp_avg"));
      STRATA_ASSIGN_OR_RETURN(s.exp_avg_sq, ctx_.arena->allocate(shard * 4, name + " exp_avg_sq"));
      std::memset(s.exp_avg.data(), 0, shard * 4);
      std::memset(s.exp_avg_sq.data(), 0, shard * 4);
      return {};
    }
  }
  return InternalError("unknown optimizer tier");
}

Status OptimizerStage::read_state(int g, StateKind kind, size_t first, std::span<float> out) {
  if (kind == StateKind::kStaleParams) return InternalError("the optimizer stage keeps no parameter copies");
  GroupOptimizerState& s = groups_[static_cast<size_t>(g)];
  const size_t shard = group_layout(g).shard_numel;
  const size_t k = static_cast<size_t>(kind);
  switch (ctx_.options->optimizer_tier) {
    case Tier::kNvme:
      return ctx_.nvme_state->load_range(static_cast<size_t>(g), static_cast<NvmeAdamState::Array>(k), first, out.size(), out.data());
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(out.data(), s.device.as<float>() + k * shard + first, out.size_bytes(),
                                                     CopyKind::kDeviceToHost, *ctx_.update_stream));
      return ctx_.update_stream->synchronize();
    case Tier::kPinned:
    case Tier::kHost: {
      const PinnedBuffer& buffer = k == 0 ? s.master : k == 1 ? s.exp_avg : s.exp_avg_sq;
      std::memcpy(out.data(), buffer.as<float>() + first, out.size_bytes());
      return {};
    }
  }
  return InternalError("unknown optimizer tier");
}

Status OptimizerStage::write_state(int g, StateKind kind, size_t first, std::span<const float> in) {
  if (kind == StateKind::kStaleParams) return InternalError("the optimizer stage keeps no parameter copies");
  GroupOptimizerState& s = groups_[static_cast<size_t>(g)];
  const size_t shard = group_layout(g).shard_numel;
  const size_t k = static_cast<size_t>(kind);
  switch (ctx_.options->optimizer_tier) {
    case Tier::kNvme:
      return ctx_.nvme_state->store_range(static_cast<size_t>(g), static_cast<NvmeAdamState::Array>(k), first, in.size(), in.data());
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(s.device.as<float>() + k * shard + first, in.data(), in.size_bytes(),
                                                     CopyKind::kHostToDevice, *ctx_.update_stream));
      return ctx_.update_stream->synchronize();
    case Tier::kPinned:
    case Tier::kHost: {
      PinnedBuffer& buffer = k == 0 ? s.master : k == 1 ? s.exp_avg : s.exp_avg_sq;
      std::memcpy(buffer.as<float>() + first, in.data(), in.size_bytes());
      return {};
    }
  }
  return InternalError("unknown optimizer tier");
}

}  // namespace strata::engine_internal
