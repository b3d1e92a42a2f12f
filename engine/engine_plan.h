// The plan: pure sizing from the options, the group layouts, the schedule and the
// budgets. One EnginePlan holds every number the stages allocate from and the text the
// engine prints, so what is printed is what is allocated. No threads, no allocation:
// unit-tested on its own.
//
// Automatic choices (no explicit setting): the prefetch depth is the deepest, up to
// kMaxAutomaticPrefetchDepth, whose gather slots fit the device budget and whose NVMe
// read staging fits the pinned budget; the NVMe optimizer-state chunk is the largest the
// pinned budget leaves room for (sub_group_size caps it). An explicit setting that does
// not fit is an error naming the settings that would.
#pragma once

#include <cstddef>
#include <span>
#include <vector>

#include "engine/engine_options.h"
#include "engine/engine_plan_types.h"
#include "engine/partition.h"
#include "optim/nvme_adam_state.h"

namespace strata::engine_internal {

inline constexpr int kMaxAutomaticPrefetchDepth = 4;
// The optimizer-state ring's default size when no pinned budget is set.
inline constexpr size_t kDefaultStateRingBytes = size_t{192} << 20;
// The store's transfer granularity the plan assumes (its checksum block; the O_DIRECT
// alignment without checksums): chunk offsets stay on it.
size_t planned_store_granularity(const EngineOptions& options);

// The host arena an engine maps for `plan_host_bytes` of planned pinned and host buffers:
// the plan's bytes and the slab allocator's slack (1/32 of them and 4 MiB, so a carve that
// fragments still fits). The pinned budget bounds the arena, slack included.
size_t host_arena_bytes(size_t plan_host_bytes);
// The most planned pinned and host bytes whose arena fits in `budget` bytes.
size_t plan_host_bytes_within(size_t budget);
inline constexpr size_t kPlannedStoreAlignment = 4096;

struct PlanInputs {
  const EngineOptions* options = nullptr;
  std::span<const GroupLayout> layouts;
  std::span<const int> schedule;        // declared group uses (empty: recorded later)
  int held_gradients = -1;              // Engine::declare_held_gradients; -1: inferred from the schedule
  size_t device_budget_bytes = 0;
  // The gradient buffers the model holds at once are known (declared, or counted from a
  // declared schedule), so one buffer beyond them suffices when two do not fit.
  bool schedule_known() const { return held_gradients >= 0 || !schedule.empty(); }
};

StatusOr<EnginePlan> make_engine_plan(const PlanInputs& inputs);

// The NVMe optimizer-state ring the plan sized (chunk, slots, budget, what each slot holds).
NvmeAdamStateOptions state_ring_options(const EngineOptions& options, const EnginePlan& plan);

// The plan against this machine: host memory available, the locked-memory limit, free
// space under nvme_path. Errors say what does not fit and what would.
Status check_plan_against_machine(const EnginePlan& plan, const EngineOptions& options);
// The checks of check_plan_against_machine that touch nothing: the device and pinned
// budgets and the host memory available (not the locked-memory limit or nvme_path).
Status check_plan_budgets(const EnginePlan& plan, const EngineOptions& options);

std::string format_bytes(size_t bytes);
size_t round_up_4k(size_t bytes);

}  // namespace strata::engine_internal
