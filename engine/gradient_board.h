// The gradient board: the hand-off from the gradient path to the optimizer stage. The
// gradient path places, once at allocation, where each group's final gradient of a step
// lies (the landing buffer, the fp32 accumulator, the device accumulator, or the copy
// stored on NVMe beside the optimizer state; one place per step parity in delayed mode),
// and publishes each group's step once its final gradient is there. The optimizer asks
// landed(group, step) for a view of it: the one place the rule "where is the final
// gradient" is read from.
//
// Placement happens before the stages start; publish and landed may come from different
// threads (an atomic per group, no lock).
#pragma once

#include <array>
#include <atomic>
#include <cstdint>
#include <memory>
#include <string>

#include "engine/core/dtype.h"
#include "engine/core/status.h"

namespace strata::engine_internal {

// Where one final gradient shard lies.
struct GradientView {
  const void* data = nullptr;        // host memory, or device memory (on_device); nullptr: stored on NVMe
  DType dtype = DType::kFloat32;
  bool on_device = false;
  unsigned stored_copy = 0;          // on NVMe: the stored copy (step parity in delayed mode)
};

class GradientBoard {
 public:
  explicit GradientBoard(size_t groups);

  // Before the stages start: group g's final gradient of steps of parity `parity` (0, or 1
  // in delayed mode) is at `view`.
  void place(int g, int parity, const GradientView& view);
  // Group g's final gradient of `step` is in place (steps only grow).
  void publish(int g, int64_t step);
  // Where group g's final gradient of `step` is; an error when it has not landed.
  StatusOr<GradientView> landed(int g, int64_t step) const;
  // The last step published for group g (-1: none).
  int64_t landed_step(int g) const;

 private:
  struct Group {
    std::array<GradientView, 2> places{};  // by step parity (delayed mode uses both)
    bool two_parities = false;
  };
  std::vector<Group> groups_;
  std::unique_ptr<std::atomic<int64_t>[]> steps_;
};

}  // namespace strata::engine_internal
