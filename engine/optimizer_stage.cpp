#include "engine/optimizer_stage.h"

#include <algorithm>
#include <cstring>
#include <set>

#include "engine/core/log.h"
#include "engine/engine_plan.h"

namespace strata::engine_internal {

StatusOr<std::unique_ptr<OptimizerStage>> OptimizerStage::create(const OptimizerStageContext& context, OptimizerStageHooks hooks) {
  auto stage = std::make_unique<OptimizerStage>(context, std::move(hooks));
  const EngineOptions& o = *context.options;
  CpuAdamOptions adam_options;
  adam_options.threads = o.optimizer_threads > 0 ? o.optimizer_threads : std::max(1, available_cpu_count() / std::max(1, o.world_size));
  STRATA_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::create(adam_options));
  stage->adam_.emplace(std::move(adam));
  if (o.optimizer_tier == Tier::kNvme) {
    std::vector<size_t> shards;
    for (const auto& g : *context.groups) shards.push_back(g->layout.trainable ? g->layout.shard_numel : 0);  // frozen: no state
    STRATA_ASSIGN_OR_RETURN(stage->nvme_state_, NvmeAdamState::create(*context.nvme, *context.arena, std::move(shards),
                                                                      state_ring_options(o, *context.plan)));
  }
  return stage;
}

OptimizerStage::~OptimizerStage() { stop(); }

Status OptimizerStage::start() {
  return sync_.start("strata:optimizer", [this] { loop(); });
}

void OptimizerStage::stop() { sync_.stop(); }

void OptimizerStage::submit(OptimizerJob job) {
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    jobs_.push_back(std::move(job));
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
        if (!batch.empty() && (!nvme_state_ || !disjoint)) break;
        groups.insert(job.order.begin(), job.order.end());
        batch.push_back(job);
      }
    }
    Status status = run_jobs(batch);
    {
      std::lock_guard<std::mutex> lock(sync_.mutex);
      for (size_t i = 0; i < batch.size(); ++i) jobs_.pop_front();
    }
    unflushed += batch.size();
    // Idle now: the state write-backs are waited for before the jobs count as done (state
    // access and finish() wait for done jobs).
    if (status.ok() && queued() == 0 && nvme_state_) status = nvme_state_->flush();
    if (!status.ok()) {
      hooks_.failed(std::move(status).with_context("optimizer step " + std::to_string(batch.front().step_index)));
      return;
    }
    if (queued() == 0 || !nvme_state_) {
      for (; unflushed > 0; --unflushed) hooks_.job_done();
    }
  }
}

Status OptimizerStage::run_jobs(const std::vector<OptimizerJob>& jobs) {
  std::vector<const OptimizerJob*> nvme_jobs;
  for (const OptimizerJob& job : jobs) {
    if (!job.skip && nvme_state_) {
      nvme_jobs.push_back(&job);
      continue;
    }
    for (int g : job.order) {
      if (!job.skip) {
        Tracer::Scope scope(ctx_.tracer, Stage::kOptimizer, g, group(g).layout.name);
        STRATA_RETURN_IF_ERROR(ctx_.options->optimizer_tier == Tier::kDevice ? update_device_group(job, g) : update_host_group(job, g));
      }
      hooks_.group_updated(g, job.step_index + 1);
    }
  }
  if (!nvme_jobs.empty()) STRATA_RETURN_IF_ERROR(run_nvme_jobs(nvme_jobs));
  // Versions count steps, skipped ones included: every group of every job moves on.
  for (const OptimizerJob& job : jobs)
    for (int g : job.order) hooks_.group_updated(g, job.step_index + 1);
  return {};
}

int OptimizerStage::gradient_copy(int64_t version) const {
  return ctx_.options->overlap == OverlapMode::kDelayed ? static_cast<int>(version % 2) : 0;
}

std::vector<AdamPlanRun> OptimizerStage::plan_runs(const OptimizerJob& job, const GroupState& state) const {
  std::vector<AdamPlanRun> runs;
  for (const DecayRun& run : state.decay_runs) runs.push_back({run.begin, run.end, run.decay ? &job.decay_plan : &job.no_decay_plan});
  return runs;
}

const void* OptimizerStage::host_gradient(const GroupState& state, int64_t step_index, DType* type) const {
  const EngineOptions& o = *ctx_.options;
  const size_t copy = static_cast<size_t>(gradient_copy(step_index));
  if (o.gradient_accumulation_steps > 1) {
    *type = DType::kFloat32;
    return state.grad_accum.empty() ? nullptr : state.grad_accum[copy].data();
  }
  *type = o.grad_transfer_dtype;
  return state.grad_landing.empty() ? nullptr : state.grad_landing[copy].data();
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
      GroupState& state = group(g);
      runs.push_back(plan_runs(*job, state));
      AdamGroupIo io;
      io.grad = host_gradient(state, job->step_index, &io.grad_type);
      io.stored_gradient_copy = static_cast<unsigned>(gradient_copy(job->step_index));
      io.param = ctx_.shards->host_copy(g, ctx_.shards->copy_of(g, job->step_index + 1));  // nullptr: staged, written out piece by piece
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
    hooks_.group_updated(static_cast<int>(g), job_of[current]->step_index + 1);
    ++current;
    return Status();
  };
  sinks.stepped = [this](size_t g, TraceClock::time_point begin, TraceClock::time_point end) {
    ctx_.tracer->record(Stage::kOptimizer, static_cast<int>(g), begin, end, group(static_cast<int>(g)).layout.name);
  };
  // Reports may come after this call (write-backs left in flight): only `this` is captured.
  sinks.transfer_done = [this](size_t g, bool write, TraceClock::time_point begin, TraceClock::time_point end) {
    ctx_.tracer->record(write ? Stage::kNvmeWrite : Stage::kNvmeRead, static_cast<int>(g), begin, end,
                        group(static_cast<int>(g)).layout.name + " optimizer state");
  };
  return nvme_state_->step_groups(*adam_, steps, sinks);
}

// Host-resident state: CPU Adam on the group's buffers, the new parameters straight into
// the host copy (or staged out to the device or NVMe).
Status OptimizerStage::update_host_group(const OptimizerJob& job, int g) {
  const EngineOptions& o = *ctx_.options;
  GroupState& s = group(g);
  const int out_copy = ctx_.shards->copy_of(g, job.step_index + 1);
  kernels::AdamBuffers buffers;
  buffers.grad = host_gradient(s, job.step_index, &buffers.grad_type);
  buffers.master = s.master.as<float>();
  buffers.exp_avg = s.exp_avg.data();
  buffers.exp_avg_sq = s.exp_avg_sq.data();
  buffers.moment_type = DType::kFloat32;
  void* in_place = ctx_.shards->host_copy(g, out_copy);
  void* param_out = in_place != nullptr ? in_place : ctx_.param_out_stage->data();
  buffers.param = param_out;
  buffers.param_type = o.param_dtype;
  const size_t grad_size = dtype_size(buffers.grad_type);
  const size_t param_size = dtype_size(o.param_dtype);
  for (const AdamPlanRun& run : plan_runs(job, s)) {
    kernels::AdamBuffers part = buffers;
    part.grad = static_cast<const char*>(buffers.grad) + run.begin * grad_size;
    part.master = buffers.master + run.begin;
    part.exp_avg = static_cast<float*>(buffers.exp_avg) + run.begin;
    part.exp_avg_sq = static_cast<float*>(buffers.exp_avg_sq) + run.begin;
    part.param = static_cast<char*>(param_out) + run.begin * param_size;
    part.count = run.end - run.begin;
    STRATA_RETURN_IF_ERROR(adam_->step(part, *run.plan));
  }
  if (in_place != nullptr) return {};
  return ctx_.shards->write(g, out_copy, 0, s.layout.shard_numel, param_out, ctx_.param_out_stage->capacity());
}

// Device-resident state: the Adam kernel on the update stream, the new parameters written
// straight into the device shard (or staged out to the host tier).
Status OptimizerStage::update_device_group(const OptimizerJob& job, int g) {
  const EngineOptions& o = *ctx_.options;
  GroupState& s = group(g);
  const size_t shard = s.layout.shard_numel;
  const int out_copy = ctx_.shards->copy_of(g, job.step_index + 1);
  float* state = s.state_device.as<float>();
  void* on_device = ctx_.shards->device_copy(g, out_copy);
  void* param_out = on_device != nullptr ? on_device : ctx_.param_out_device->data();
  const size_t param_size = dtype_size(o.param_dtype);
  for (const AdamPlanRun& run : plan_runs(job, s)) {
    kernels::AdamBuffers part;
    part.grad = state + 3 * shard + run.begin;
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
  void* host = in_place != nullptr ? in_place : ctx_.param_out_stage->data();
  STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(host, param_out, shard * param_size, CopyKind::kDeviceToHost, *ctx_.update_stream));
  STRATA_RETURN_IF_ERROR(ctx_.update_stream->synchronize());
  if (in_place != nullptr) return {};
  return ctx_.shards->write(g, out_copy, 0, shard, host, ctx_.param_out_stage->capacity());
}

// ----------------------------------------------------------------------------- state

Status OptimizerStage::initialize_group(int g, const float* master) {
  const EngineOptions& o = *ctx_.options;
  GroupState& s = group(g);
  const size_t shard = s.layout.shard_numel;
  const std::string name = "group " + s.layout.name;
  switch (o.optimizer_tier) {
    case Tier::kDevice: {
      STRATA_ASSIGN_OR_RETURN(s.state_device, ctx_.device->allocate(shard * 16, name + " optimizer state"));
      STRATA_RETURN_IF_ERROR(ctx_.device->memset_async(s.state_device.data(), 0, shard * 16, *ctx_.update_stream));
      if (master != nullptr)
        STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(s.state_device.data(), master, shard * 4, CopyKind::kHostToDevice, *ctx_.update_stream));
      return ctx_.update_stream->synchronize();
    }
    case Tier::kNvme: {
      const std::vector<float> zeros(shard, 0.0f);
      return nvme_state_->store_group(static_cast<size_t>(g), master, zeros.data(), zeros.data());
    }
    case Tier::kPinned:
    case Tier::kHost: {
      STRATA_ASSIGN_OR_RETURN(s.master, ctx_.arena->allocate(shard * 4, name + " master"));
      STRATA_ASSIGN_OR_RETURN(s.exp_avg, ctx_.arena->allocate(shard * 4, name + " exp_avg"));
      STRATA_ASSIGN_OR_RETURN(s.exp_avg_sq, ctx_.arena->allocate(shard * 4, name + " exp_avg_sq"));
      if (master != nullptr) std::memcpy(s.master.data(), master, shard * 4);
      std::memset(s.exp_avg.data(), 0, shard * 4);
      std::memset(s.exp_avg_sq.data(), 0, shard * 4);
      return {};
    }
  }
  return InternalError("unknown optimizer tier");
}

Status OptimizerStage::read_state(int g, Engine::StateKind kind, std::span<float> out) {
  if (kind == Engine::StateKind::kStaleParams) return InternalError("the optimizer stage keeps no parameter copies");
  GroupState& s = group(g);
  const size_t shard = s.layout.shard_numel;
  const size_t k = static_cast<size_t>(kind);
  switch (ctx_.options->optimizer_tier) {
    case Tier::kNvme:
      return nvme_state_->load_group(static_cast<size_t>(g), k == 0 ? out.data() : nullptr, k == 1 ? out.data() : nullptr,
                                     k == 2 ? out.data() : nullptr);
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(out.data(), s.state_device.as<float>() + k * shard, shard * 4, CopyKind::kDeviceToHost,
                                                     *ctx_.update_stream));
      return ctx_.update_stream->synchronize();
    case Tier::kPinned:
    case Tier::kHost: {
      const PinnedBuffer& buffer = k == 0 ? s.master : k == 1 ? s.exp_avg : s.exp_avg_sq;
      std::memcpy(out.data(), buffer.data(), shard * 4);
      return {};
    }
  }
  return InternalError("unknown optimizer tier");
}

Status OptimizerStage::write_state(int g, Engine::StateKind kind, std::span<const float> in) {
  if (kind == Engine::StateKind::kStaleParams) return InternalError("the optimizer stage keeps no parameter copies");
  GroupState& s = group(g);
  const size_t shard = s.layout.shard_numel;
  const size_t k = static_cast<size_t>(kind);
  switch (ctx_.options->optimizer_tier) {
    case Tier::kNvme:
      return nvme_state_->store_group(static_cast<size_t>(g), k == 0 ? in.data() : nullptr, k == 1 ? in.data() : nullptr,
                                      k == 2 ? in.data() : nullptr);
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(s.state_device.as<float>() + k * shard, in.data(), shard * 4, CopyKind::kHostToDevice,
                                                     *ctx_.update_stream));
      return ctx_.update_stream->synchronize();
    case Tier::kPinned:
    case Tier::kHost: {
      PinnedBuffer& buffer = k == 0 ? s.master : k == 1 ? s.exp_avg : s.exp_avg_sq;
      std::memcpy(buffer.data(), in.data(), shard * 4);
      return {};
    }
  }
  return InternalError("unknown optimizer tier");
}

}  // namespace strata::engine_internal
