// State access (model thread): read and write one kind of a group's state shard (for
// checkpoints), the stale parameter copy of delayed mode, refresh_parameters().
#include <string>
#include <vector>

#include "engine/engine_impl.h"

namespace strata::engine_internal {

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

}  // namespace strata::engine_internal
