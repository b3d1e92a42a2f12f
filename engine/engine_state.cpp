// State access (model thread): read and write one kind of a group's state shard (for
// checkpoints), the stale parameter copy of delayed mode, refresh_parameters().
#include <string>
#include <vector>

#include "engine/engine_impl.h"

namespace strata::engine_internal {

// State access (model thread), once no update of the group is pending: the optimizer
// stage reads or writes one kind of the group's state wherever it lives.
Status EngineImpl::wait_for_state_access(int g, size_t first, size_t elements, const char* call) {
  STRATA_RETURN_IF_ERROR(check_group(g, call));
  GroupState& state = group(g);
  const size_t shard = state.layout.shard_numel;
  if (first > shard || elements > shard - first)
    return InvalidArgumentError(std::string(call) + ": group " + state.layout.name + " has " + std::to_string(shard) +
                                " elements per shard, the range is [" + std::to_string(first) + ", " + std::to_string(first + elements) + ")");
  if (first % kStateRangeAlignment != 0 || ((first + elements) % kStateRangeAlignment != 0 && first + elements != shard))
    return InvalidArgumentError(std::string(call) + ": the range [" + std::to_string(first) + ", " + std::to_string(first + elements) +
                                ") of group " + state.layout.name + " must start on a multiple of " + std::to_string(kStateRangeAlignment) +
                                " elements and end on one or at the shard's end (" + std::to_string(shard) + ")");
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

// The whole-shard calls: a span of exactly shard_numel elements.
Status EngineImpl::check_whole_shard(int g, size_t elements, const char* call) {
  STRATA_RETURN_IF_ERROR(check_group(g, call));
  const GroupLayout& layout = group(g).layout;
  if (elements == layout.shard_numel) return {};
  return InvalidArgumentError(std::string(call) + ": group " + layout.name + " has " + std::to_string(layout.shard_numel) +
                              " elements per shard, the span has " + std::to_string(elements));
}

Status EngineImpl::read_state_shard(int g, StateKind kind, std::span<float> out) {
  STRATA_RETURN_IF_ERROR(check_whole_shard(g, out.size(), "read_state_shard"));
  return read_state_part(g, kind, 0, out, "read_state_shard");
}

Status EngineImpl::write_state_shard(int g, StateKind kind, std::span<const float> in) {
  STRATA_RETURN_IF_ERROR(check_whole_shard(g, in.size(), "write_state_shard"));
  return write_state_part(g, kind, 0, in, "write_state_shard");
}

// A frozen group's only state is its parameter copy, which stands in for its master.
Status EngineImpl::read_state_range(int g, StateKind kind, size_t first, std::span<float> out) {
  return read_state_part(g, kind, first, out, "read_state_range");
}

Status EngineImpl::write_state_range(int g, StateKind kind, size_t first, std::span<const float> in) {
  return write_state_part(g, kind, first, in, "write_state_range");
}

Status EngineImpl::read_state_part(int g, StateKind kind, size_t first, std::span<float> out, const char* call) {
  STRATA_RETURN_IF_ERROR(wait_for_state_access(g, first, out.size(), call));
  if (!group(g).layout.trainable) {
    if (kind != StateKind::kMaster)
      return check_trainable(g, std::string(call) + "(" + std::to_string(g) + ", " + state_kind_name(kind) + ")");
    return shards_->load_values(g, 0, first, out);
  }
  if (kind != StateKind::kStaleParams) return optimizer_stage_->read_state(g, kind, first, out);
  if (!has_stale_parameters())
    return FailedPreconditionError(std::string(call) + "(" + std::to_string(g) + ", stale parameters): there is no stale copy (" +
                                   (options_.overlap == OverlapMode::kExact ? "exact overlap mode" : "no step taken yet") +
                                   "); ask has_stale_parameters() first");
  // Between steps: the copy the next step reads, one version behind the masters.
  return shards_->load_values(g, shards_->copy_of(g, uses_->step_version(step_index_)), first, out);
}

Status EngineImpl::write_state_part(int g, StateKind kind, size_t first, std::span<const float> in, const char* call) {
  STRATA_RETURN_IF_ERROR(wait_for_state_access(g, first, in.size(), call));
  if (!group(g).layout.trainable) {
    if (kind != StateKind::kMaster)
      return check_trainable(g, std::string(call) + "(" + std::to_string(g) + ", " + state_kind_name(kind) + ")");
    return write_frozen_parameters(g, first, in, call);
  }
  if (kind == StateKind::kStaleParams) return write_stale_parameters(g, first, in, call);
  return optimizer_stage_->write_state(g, kind, first, in);
}

// As refresh_parameters() for one group, whose new values come from the caller.
Status EngineImpl::write_frozen_parameters(int g, size_t first, std::span<const float> in, const char* call) {
  if (micro_ >= 0 || forward_only_)
    return FailedPreconditionError(std::string(call) + "(" + std::to_string(g) + ", master) of frozen group '" + group(g).layout.name +
                                   "' inside a step or a forward-only pass");
  // Fetches planned ahead would carry the old values: let them finish, then forget them.
  uses_->restart(step_index_);
  STRATA_RETURN_IF_ERROR(drain());
  STRATA_RETURN_IF_ERROR(shards_->store_values(g, 0, first, in));
  fetcher_->forget_persistent_fetches();
  return {};
}

Status EngineImpl::write_stale_parameters(int g, size_t first, std::span<const float> in, const char* call) {
  if (options_.overlap != OverlapMode::kDelayed)
    return FailedPreconditionError(std::string(call) + "(" + std::to_string(g) +
                                   ", stale parameters): exact overlap mode computes with the masters and keeps no stale copy");
  if (micro_ >= 0 || forward_only_) return FailedPreconditionError(std::string(call) + "(stale parameters) inside a step or a forward-only pass");
  if (step_index_ == 0) STRATA_RETURN_IF_ERROR(enter_stale_position());
  // The next step reads version step_index_ - 1; the masters' version step_index_ is in the
  // other copy (refresh_parameters() wrote it).
  STRATA_RETURN_IF_ERROR(shards_->store_values(g, shards_->copy_of(g, uses_->step_version(step_index_)), first, in));
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
  // A chunk at a time, so that a large group's shard never lies whole in host memory.
  std::vector<float> master(std::min(kStateChunkElements, plan_.max_shard_elements));
  for (auto& gp : groups_) {
    GroupState& g = *gp;
    if (!g.layout.trainable) continue;  // its parameters are its state: nothing to refresh from
    const size_t shard = g.layout.shard_numel;
    for (size_t first = 0; first < shard; first += kStateChunkElements) {
      const std::span<float> chunk(master.data(), std::min(kStateChunkElements, shard - first));
      STRATA_RETURN_IF_ERROR(read_state_range(g.layout.id, StateKind::kMaster, first, chunk));
      // Every copy gets the same values: the next fetch reads whichever its version picks.
      for (int c = 0; c < shards_->copies(g.layout.id); ++c) STRATA_RETURN_IF_ERROR(shards_->store_values(g.layout.id, c, first, chunk));
    }
  }
  fetcher_->forget_persistent_fetches();
  return {};
}

}  // namespace strata::engine_internal
