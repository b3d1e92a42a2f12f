// Dynamic loss scaling for fp16 training (the DeepSpeed/Megatron rule): the loss is
// multiplied by `scale` before backward; a step whose gradients overflow is skipped and
// the scale shrinks by `backoff_factor` (after `hysteresis` consecutive overflows); after
// `growth_interval` clean steps it grows by `growth_factor`.
#pragma once

#include <cstdint>

#include "engine/core/status.h"

namespace strata {

struct LossScalerOptions {
  float initial_scale = 65536.0f;  // 2^16, DeepSpeed's default initial_scale_power
  float growth_factor = 2.0f;
  float backoff_factor = 0.5f;
  int growth_interval = 1000;      // clean steps before the scale grows (loss_scale_window)
  int hysteresis = 2;              // overflows tolerated before the scale shrinks
  float min_scale = 1.0f;
  bool dynamic = true;             // false: a fixed scale (static loss scaling)
};

class LossScaler {
 public:
  static StatusOr<LossScaler> create(const LossScalerOptions& options);

  float scale() const { return scale_; }
  // 1 / scale: what gradients are multiplied by before the optimizer uses them.
  float inverse_scale() const { return 1.0f / scale_; }
  // Records whether this step's gradients overflowed and updates the scale. Returns
  // true when the step must be skipped.
  bool update(bool overflowed);

  // State for checkpoints.
  struct State {
    float scale;
    int clean_steps;
    int remaining_hysteresis;
    uint64_t skipped_steps;
  };
  State state() const { return {scale_, clean_steps_, remaining_hysteresis_, skipped_steps_}; }
  void restore(const State& state);
  uint64_t skipped_steps() const { return skipped_steps_; }

 private:
  explicit LossScaler(const LossScalerOptions& options);
  LossScalerOptions options_;
  float scale_;
  int clean_steps_ = 0;
  int remaining_hysteresis_;
  uint64_t skipped_steps_ = 0;
};

}  // namespace strata
