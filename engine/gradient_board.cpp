#include "engine/gradient_board.h"

namespace strata::engine_internal {

GradientBoard::GradientBoard(size_t groups) : groups_(groups), steps_(new std::atomic<int64_t>[groups]) {
  for (size_t g = 0; g < groups; ++g) steps_[g].store(-1, std::memory_order_relaxed);
}

void GradientBoard::place(int g, int parity, const GradientView& view) {
  Group& group = groups_[static_cast<size_t>(g)];
  group.places[static_cast<size_t>(parity)] = view;
  if (parity == 1) group.two_parities = true;
}

void GradientBoard::publish(int g, int64_t step) { steps_[static_cast<size_t>(g)].store(step, std::memory_order_release); }

int64_t GradientBoard::landed_step(int g) const { return steps_[static_cast<size_t>(g)].load(std::memory_order_acquire); }

StatusOr<GradientView> GradientBoard::landed(int g, int64_t step) const {
  if (g < 0 || static_cast<size_t>(g) >= groups_.size())
    return InternalError("gradient board: no group " + std::to_string(g));
  const int64_t landed = landed_step(g);
  if (landed < step)
    return InternalError("gradient board: group " + std::to_string(g) + "'s gradient of step " + std::to_string(step) +
                         " has not landed (last landed: " + std::to_string(landed) + ")");
  const Group& group = groups_[static_cast<size_t>(g)];
  return group.places[group.two_parities ? static_cast<size_t>(step % 2) : 0];
}

}  // namespace strata::engine_internal
