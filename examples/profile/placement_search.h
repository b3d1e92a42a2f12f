// --placement auto: the search over placements. Every candidate of a space (parameter tier,
// optimizer tier, prefetch depth, micro-batch size with the batch per rank kept, activation
// checkpointing, optimizer overlap) is planned and checked by the caller's evaluator; those
// whose plan fails its checks are dropped, and the one with the most predicted tokens per
// second wins (ties: the one that needs less device, then host memory). The choice says
// what it is, its prediction, the runner-up (the best placement that differs in a tier,
// checkpointing or overlap) and why the runner-up lost.
//
// The search knows no model and no engine: the trainer and strata-bench step each pass an
// evaluator that plans a candidate the way their run would (examples/train/plan_preview.h,
// examples/strata_bench/bench_step.cpp).
#pragma once

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/overlap_mode.h"
#include "engine/core/status.h"
#include "examples/lm/causal_lm.h"
#include "examples/profile/step_cost.h"
#include "offload/tier.h"

namespace strata::profile {

struct Placement {
  Tier params = Tier::kPinned;
  Tier optimizer = Tier::kPinned;
  int prefetch_depth = 1;
  int64_t micro_batch = 1;   // sequences (or rows) per micro-batch on each rank
  int accumulation = 1;      // micro-batches per step
  lm::ActivationCheckpointing checkpointing = lm::ActivationCheckpointing::kDevice;
  OverlapMode overlap = OverlapMode::kExact;
};
// "params cpu, optimizer nvme, prefetch depth 2, micro-batch 4 x 2, checkpointing device, overlap exact".
std::string placement_text(const Placement& placement);

struct PlacementSpace {
  std::vector<Tier> params;
  std::vector<Tier> optimizer;
  std::vector<int> prefetch_depths;
  std::vector<std::pair<int64_t, int>> batches;  // (micro-batch, accumulation)
  std::vector<lm::ActivationCheckpointing> checkpointing;
  std::vector<OverlapMode> overlaps;
};

// The dimensions every caller searches alike, from the config: parameter and optimizer
// tiers (device, cpu — pinned, or pageable when either pin_memory is false —, and nvme when
// strata.nvme_path is set), prefetch depth 0, 1, 2 or 4, and optimizer overlap exact or
// delayed (only the configured one when strata.optimizer_overlap was given, or with fp16
// loss scaling). The batches and checkpointing are left to the caller.
PlacementSpace config_space(const StrataConfig& config);

// The (micro-batch, accumulation) pairs whose product is `per_rank_batch`: every power of
// two that divides it, and the batch itself.
std::vector<std::pair<int64_t, int>> batch_splits(int64_t per_rank_batch);

// What the evaluator found for one candidate.
struct PlacementOutcome {
  Placement placement;
  Status checks;                              // the plan's checks (ok: it fits)
  std::optional<StepPrediction> prediction;   // set when the checks passed
  double tokens_per_step = 0;                 // this rank's tokens (or rows) per step
  double device_bytes = 0;
  double host_bytes = 0;
  double tokens_per_s() const { return prediction && prediction->step_seconds > 0 ? tokens_per_step / prediction->step_seconds : 0.0; }
};
// Plans one candidate; an error stops the search (a failed check is not an error).
using PlacementEvaluator = std::function<StatusOr<PlacementOutcome>(const Placement&)>;

struct PlacementChoice {
  PlacementOutcome best;
  // The best other placement (another tier, checkpointing or overlap); when every fitting
  // candidate shares the choice's, the best other tuning (prefetch depth, micro-batch).
  std::optional<PlacementOutcome> runner_up;
  int candidates = 0;
  int rejected = 0;                           // dropped: their plan failed its checks
};

// Fails (ResourceExhausted) when no candidate fits, quoting the checks of the one that came
// closest (the least device memory).
StatusOr<PlacementChoice> search_placements(const PlacementSpace& space, const PlacementEvaluator& evaluate);

// The room for `rank`'s NVMe file under `nvme_path` (NvmeStore::room_bytes: free space,
// plus the file a finished run left, which is reused); nullopt when nothing can be asked.
// A candidate whose NVMe file does not fit there is dropped.
std::optional<double> nvme_room_bytes(const std::string& nvme_path, int rank);
// A candidate's NVMe file against that free space (nullopt: not known, not checked).
Status check_nvme_room(size_t nvme_bytes, const std::string& nvme_path, std::optional<double> nvme_free);

// The lines printed before the plan: the choice, its prediction, the runner-up and why it lost.
std::string placement_choice_text(const PlacementChoice& choice);

}  // namespace strata::profile
