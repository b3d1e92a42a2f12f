#include "engine/checkpoint.h"

#include <string>
#include <utility>
#include <vector>

#include "engine/checkpoint_format.h"
#include "engine/core/log.h"

namespace strata {

namespace fs = std::filesystem;
using namespace checkpoint_format;

StatusOr<RankSnapshot> snapshot_engine_state(Engine& engine, int rank) {
  std::vector<GroupLayout> layouts;
  for (int g = 0; g < engine.group_count(); ++g) layouts.push_back(engine.layout(g));
  const StaleParameters stale = engine.has_stale_parameters() ? StaleParameters::kPresent : StaleParameters::kAbsent;
  STRATA_ASSIGN_OR_RETURN(RankSnapshot snapshot, RankSnapshot::allocate(std::move(layouts), rank, engine.steps_taken(), stale));
  snapshot.set_loss_scaler(engine.loss_scaler_state());
  for (int g = 0; g < snapshot.group_count(); ++g) {
    if (!snapshot.layouts()[static_cast<size_t>(g)].trainable) continue;  // frozen: not saved
    for (int k = 0; k < snapshot.kinds(); ++k) {
      const CheckpointStateKind kind = kSegmentKinds[static_cast<size_t>(k)];
      STRATA_RETURN_IF_ERROR_CTX(engine.read_state_shard(g, kind, snapshot.shard(g, kind)),
                                 "checkpoint snapshot: group '" + snapshot.layouts()[static_cast<size_t>(g)].name + "' " +
                                     std::string(checkpoint_state_kind_name(kind)));
    }
  }
  return snapshot;
}

namespace {

// After refresh_parameters(): the delayed-mode stale copy, where both sides have one.
Status load_stale_parameters(Engine& engine, int rank, const CheckpointReader& reader) {
  const bool delayed = engine.overlap_mode() == OverlapMode::kDelayed;
  if (reader.has_stale_parameters() && !delayed) {
    if (rank == 0)
      STRATA_LOG(kInfo) << "checkpoint " << reader.path() << " was saved in delayed overlap mode; this run is exact and "
                      << "computes with the masters (the saved stale parameters are not used)";
    return Status::Ok();
  }
  if (!reader.has_stale_parameters()) {
    if (delayed && rank == 0) {
      STRATA_LOG(kInfo) << "checkpoint " << reader.path() << " has no stale parameters (saved in exact mode, or before "
                        << "the first step): this delayed-mode run starts from the masters";
    }
    return Status::Ok();
  }
  std::vector<float> shard;
  for (int g = 0; g < engine.group_count(); ++g) {
    const GroupLayout& layout = engine.layout(g);
    if (!layout.trainable) continue;
    shard.resize(layout.shard_numel);
    STRATA_RETURN_IF_ERROR(reader.load_shard(g, CheckpointStateKind::kStaleParams, rank, layout.world_size, shard));
    STRATA_RETURN_IF_ERROR_CTX(engine.write_state_shard(g, CheckpointStateKind::kStaleParams, shard),
                               "loading checkpoint " + reader.path() + " into group '" + layout.name + "'");
  }
  return Status::Ok();
}

}  // namespace

Status load_engine_state(Engine& engine, int rank, const CheckpointReader& reader) {
  if (static_cast<size_t>(engine.group_count()) != reader.groups().size()) {
    return InvalidArgumentError("checkpoint " + reader.path() + " has " + std::to_string(reader.groups().size()) +
                                " groups, the model " + std::to_string(engine.group_count()));
  }
  std::vector<float> shard;
  for (int g = 0; g < engine.group_count(); ++g) {
    const GroupLayout& layout = engine.layout(g);
    STRATA_RETURN_IF_ERROR(reader.check_layout(layout));
    if (!layout.trainable) continue;  // frozen: its weights are the caller's to load
    shard.resize(layout.shard_numel);
    for (CheckpointStateKind kind : kAllKinds) {
      STRATA_RETURN_IF_ERROR(reader.load_shard(g, kind, rank, layout.world_size, shard));
      STRATA_RETURN_IF_ERROR_CTX(engine.write_state_shard(g, kind, shard),
                                 "loading checkpoint " + reader.path() + " into group '" + layout.name + "'");
    }
  }
  STRATA_RETURN_IF_ERROR_CTX(engine.refresh_parameters(), "loading checkpoint " + reader.path());
  STRATA_RETURN_IF_ERROR(load_stale_parameters(engine, rank, reader));
  engine.set_steps_taken(reader.engine_steps());
  engine.set_step_number(reader.step());
  if (reader.loss_scaler() && engine.loss_scaler_state()) {
    STRATA_RETURN_IF_ERROR_CTX(engine.restore_loss_scaler_state(*reader.loss_scaler()), "loading checkpoint " + reader.path());
  } else if (engine.loss_scaler_state()) {
    STRATA_LOG(kWarn) << "checkpoint " << reader.path() << " has no loss scaler state (saved without fp16 loss scaling): "
                      << "the loss scale starts at its initial value";
  }
  return Status::Ok();
}

}  // namespace strata
