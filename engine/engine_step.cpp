// The model-facing step API (model thread): steps and micro-batches, gather/release,
// gradients, step() and its report, finish, forward-only passes.
#include <algorithm>
#include <cmath>
#include <set>
#include <string>

#include "engine/core/log.h"
#include "engine/engine_impl.h"

namespace strata::engine_internal {

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

// The direct view was written by the update gather() waited for on this thread; a fetched
// use is in memory once its own fetch is (gather() made only the compute stream wait).
Status EngineImpl::wait_gathered(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "wait_gathered"));
  auto it = active_uses_.find(g);
  if (it == active_uses_.end())
    return FailedPreconditionError("wait_gathered(" + std::to_string(g) + ") of a group that is not gathered");
  if (direct_view(group(g))) return {};
  return fetcher_->wait_taken(g, it->second.position);
}

Status EngineImpl::release(int g) {
  STRATA_RETURN_IF_ERROR(check_group(g, "release"));
  auto it = active_uses_.find(g);
  if (it == active_uses_.end()) return FailedPreconditionError("release(" + std::to_string(g) + ") of a group that is not gathered");
  const ActiveUse use = it->second;
  active_uses_.erase(it);
  GroupState& state = group(g);
  STRATA_RETURN_IF_ERROR(close_compute_trace(state));
  if (direct_view(state)) return {};
  return fetcher_->release(g, use.position);
}

// The gathered groups' compute intervals end while the model's thread waits in the
// gradient path (nothing new reaches the compute stream meanwhile) and start again after.
// A resumed interval is labelled so: each use keeps one interval under the group's name.
Status EngineImpl::close_compute_trace(GroupState& state) {
  std::string label = state.compute_resumed ? state.layout.name + " (after a wait for its gradient buffer)" : state.layout.name;
  state.compute_resumed = false;
  return stream_trace_->close(std::move(state.compute_trace), Stage::kCompute, state.layout.id, std::move(label));
}

Status EngineImpl::pause_compute_traces() {
  for (const auto& active : active_uses_) STRATA_RETURN_IF_ERROR(close_compute_trace(group(active.first)));
  return {};
}

Status EngineImpl::resume_compute_traces() {
  for (const auto& active : active_uses_) {
    GroupState& state = group(active.first);
    STRATA_ASSIGN_OR_RETURN(state.compute_trace, stream_trace_->open(*compute_stream_));
    state.compute_resumed = true;
  }
  return {};
}

StatusOr<GroupView> EngineImpl::gradient_buffer(int g, GradientStart start) {
  STRATA_RETURN_IF_ERROR(check_group(g, "gradient_buffer"));
  STRATA_RETURN_IF_ERROR(check_trainable(g, "gradient_buffer(" + std::to_string(g) + ")"));
  if (micro_ < 0) return FailedPreconditionError("gradient_buffer() outside a step");
  if (forward_only_) return FailedPreconditionError("gradient_buffer() in a forward-only pass");
  STRATA_ASSIGN_OR_RETURN(float* buffer, gradient_path_->buffer(g, step_index_, start));
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

}  // namespace strata::engine_internal
