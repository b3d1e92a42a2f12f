#include "examples/profile/placement_search.h"

#include <cstdio>
#include <filesystem>
#include <sstream>

#include "engine/engine_plan.h"

namespace strata::profile {

namespace {

// The command line's word for a tier: pinned and pageable host memory are both "cpu".
std::string placement_word(Tier tier) {
  if (tier == Tier::kPinned || tier == Tier::kHost) return "cpu";
  return std::string(tier_name(tier));
}

bool pinned_checkpoints(const PlacementOutcome& o) { return o.placement.checkpointing == lm::ActivationCheckpointing::kPinnedHost; }

// True when `a` beats `b`: more predicted tokens/s. Between equal predictions, what the model
// leaves out decides: block inputs kept on the device rather than copied out to pinned
// memory and back (the model prices the copies, not the waits for them: measured 25-40%
// slower on GPT-2 XL, docs/benchmarks.md), then the deeper prefetch (latency the model does
// not count is hidden behind it); then less device memory, then less host.
bool better(const PlacementOutcome& a, const PlacementOutcome& b) {
  if (a.tokens_per_s() != b.tokens_per_s()) return a.tokens_per_s() > b.tokens_per_s();
  if (pinned_checkpoints(a) != pinned_checkpoints(b)) return !pinned_checkpoints(a);
  if (a.placement.prefetch_depth != b.placement.prefetch_depth) return a.placement.prefetch_depth > b.placement.prefetch_depth;
  if (a.device_bytes != b.device_bytes) return a.device_bytes < b.device_bytes;
  return a.host_bytes < b.host_bytes;
}

// The same tiers, checkpointing and overlap: at most a different tuning.
bool same_placement(const Placement& a, const Placement& b) {
  return a.params == b.params && a.optimizer == b.optimizer && a.checkpointing == b.checkpointing && a.overlap == b.overlap;
}

Status check_space(const PlacementSpace& s) {
  if (s.params.empty() || s.optimizer.empty() || s.prefetch_depths.empty() || s.batches.empty() || s.checkpointing.empty() ||
      s.overlaps.empty())
    return InvalidArgumentError("placement search: every dimension of the space needs at least one value");
  return {};
}

// Every candidate of the space, in a fixed order.
std::vector<Placement> candidates(const PlacementSpace& s) {
  std::vector<Placement> out;
  for (Tier params : s.params)
    for (Tier optimizer : s.optimizer)
      for (int depth : s.prefetch_depths)
        for (const auto& [micro, accumulation] : s.batches)
          for (lm::ActivationCheckpointing checkpointing : s.checkpointing)
            for (OverlapMode overlap : s.overlaps)
              out.push_back({params, optimizer, depth, micro, accumulation, checkpointing, overlap});
  return out;
}

std::string seconds_text(double seconds) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4f s", seconds);
  return text;
}

std::string rate_text(double per_s) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.4g", per_s);
  return text;
}

// Why `loser` lost to `winner`, in words.
std::string why_lost(const PlacementOutcome& winner, const PlacementOutcome& loser) {
  const double w = winner.tokens_per_s(), l = loser.tokens_per_s();
  std::ostringstream text;
  if (w != l) {
    char percent[32];
    std::snprintf(percent, sizeof(percent), "%.1f%%", w > 0 ? 100.0 * (w - l) / w : 0.0);
    text << percent << " fewer predicted tokens/s; its step is bound by " << loser.prediction->bound;
  } else if (pinned_checkpoints(winner) != pinned_checkpoints(loser)) {
    text << "as fast, but copies its block inputs out to pinned memory and back";
  } else if (winner.placement.prefetch_depth != loser.placement.prefetch_depth) {
    text << "as fast, but prefetches " << loser.placement.prefetch_depth << " deep against " << winner.placement.prefetch_depth;
  } else if (winner.device_bytes != loser.device_bytes) {
    text << "as fast, but needs more device memory (" << rate_text(loser.device_bytes / 1048576.0) << " MiB against "
         << rate_text(winner.device_bytes / 1048576.0) << " MiB)";
  } else {
    text << "as fast, but needs more host memory";
  }
  return text.str();
}

}  // namespace

std::string placement_text(const Placement& p) {
  std::ostringstream text;
  text << "params " << placement_word(p.params) << ", optimizer " << placement_word(p.optimizer) << ", prefetch depth " << p.prefetch_depth
       << ", micro-batch " << p.micro_batch << " x " << p.accumulation << ", checkpointing " << lm::activation_checkpointing_name(p.checkpointing)
       << ", overlap " << overlap_mode_name(p.overlap);
  return text.str();
}

std::vector<std::pair<int64_t, int>> batch_splits(int64_t per_rank_batch) {
  std::vector<std::pair<int64_t, int>> out;
  if (per_rank_batch < 1) return out;
  for (int64_t micro = 1; micro < per_rank_batch; micro *= 2)
    if (per_rank_batch % micro == 0) out.emplace_back(micro, static_cast<int>(per_rank_batch / micro));
  out.emplace_back(per_rank_batch, 1);
  return out;
}

StatusOr<PlacementChoice> search_placements(const PlacementSpace& space, const PlacementEvaluator& evaluate) {
  STRATA_RETURN_IF_ERROR(check_space(space));
  PlacementChoice choice;
  std::vector<PlacementOutcome> fitting;
  std::optional<PlacementOutcome> closest;  // of the rejected: the least device memory
  for (const Placement& candidate : candidates(space)) {
    ++choice.candidates;
    STRATA_ASSIGN_OR_RETURN(PlacementOutcome outcome, evaluate(candidate));
    if (!outcome.checks.ok() || !outcome.prediction) {
      ++choice.rejected;
      if (!closest || outcome.device_bytes < closest->device_bytes) closest = outcome;
      continue;
    }
    fitting.push_back(std::move(outcome));
  }
  if (fitting.empty()) {
    std::string message = "--placement auto: none of the " + std::to_string(choice.candidates) + " placements fits";
    if (closest) {
      message += "; the closest (" + placement_text(closest->placement) + "): " +
                 (closest->checks.ok() ? std::string("no prediction") : closest->checks.message());
    }
    return ResourceExhaustedError(message + "; raise the device or pinned budget, or give an NVMe path (--nvme-path)");
  }
  size_t best = 0;
  for (size_t i = 1; i < fitting.size(); ++i)
    if (better(fitting[i], fitting[best])) best = i;
  choice.best = fitting[best];
  // The runner-up is the best other placement (another tier, checkpointing or overlap);
  // only when there is none, the best other tuning (prefetch depth, micro-batch) of this one.
  std::optional<PlacementOutcome> other_tuning;
  for (size_t i = 0; i < fitting.size(); ++i) {
    if (i == best) continue;
    std::optional<PlacementOutcome>& slot = same_placement(fitting[i].placement, choice.best.placement) ? other_tuning : choice.runner_up;
    if (!slot || better(fitting[i], *slot)) slot = fitting[i];
  }
  if (!choice.runner_up) choice.runner_up = std::move(other_tuning);
  return choice;
}

std::optional<double> nvme_room_bytes(const std::string& nvme_path, int rank) {
  StatusOr<size_t> room = NvmeStore::room_bytes(nvme_path, rank);
  if (!room.ok()) return std::nullopt;
  return static_cast<double>(*room);
}

PlacementSpace config_space(const StrataConfig& config) {
  const bool pinned = config.zero.offload_param.pin_memory && config.zero.offload_optimizer.pin_memory;
  const Tier host = pinned ? Tier::kPinned : Tier::kHost;
  PlacementSpace space;
  space.params = {Tier::kDevice, host};
  space.optimizer = {Tier::kDevice, host};
  if (!config.strata.nvme_path.empty()) {
    space.params.push_back(Tier::kNvme);
    space.optimizer.push_back(Tier::kNvme);
  }
  space.prefetch_depths = {0, 1, 2, 4};
  if (config.was_given("strata.optimizer_overlap") || config.fp16.enabled)
    space.overlaps = {config.strata.optimizer_overlap};
  else
    space.overlaps = {OverlapMode::kExact, OverlapMode::kDelayed};
  return space;
}

Status check_nvme_room(size_t nvme_bytes, const std::string& nvme_path, std::optional<double> nvme_free) {
  if (nvme_bytes == 0 || !nvme_free || static_cast<double>(nvme_bytes) <= *nvme_free) return {};
  return ResourceExhaustedError("nvme_path " + nvme_path + " has " + engine_internal::format_bytes(static_cast<size_t>(*nvme_free)) +
                                " free but the plan needs " + engine_internal::format_bytes(nvme_bytes));
}

std::string placement_choice_text(const PlacementChoice& c) {
  std::ostringstream text;
  text << "placement auto: " << c.candidates << " candidates, " << c.rejected << " dropped (their plan fails its checks)\n"
       << "  chosen: " << placement_text(c.best.placement) << "\n"
       << "    predicted step " << seconds_text(c.best.prediction->step_seconds) << " (bound by " << c.best.prediction->bound << "), "
       << rate_text(c.best.tokens_per_s()) << " tokens/s per rank\n";
  if (c.runner_up) {
    text << "  runner-up: " << placement_text(c.runner_up->placement) << "\n"
         << "    predicted step " << seconds_text(c.runner_up->prediction->step_seconds) << ", " << rate_text(c.runner_up->tokens_per_s())
         << " tokens/s per rank: lost: " << why_lost(c.best, *c.runner_up) << "\n";
  } else {
    text << "  runner-up: none (no other candidate fits)\n";
  }
  return text.str();
}

}  // namespace strata::profile
