#include "optim/loss_scaler.h"

#include <algorithm>
#include <cmath>
#include <string>

namespace strata {

StatusOr<LossScaler> LossScaler::create(const LossScalerOptions& options) {
  if (!(options.initial_scale > 0.0f) || !std::isfinite(options.initial_scale))
    return InvalidArgumentError("loss scaler: initial scale must be a positive finite number, got " + std::to_string(options.initial_scale));
  if (!(options.growth_factor >= 1.0f)) return InvalidArgumentError("loss scaler: growth factor must be >= 1");
  if (!(options.backoff_factor > 0.0f && options.backoff_factor < 1.0f)) return InvalidArgumentError("loss scaler: backoff factor must be in (0, 1)");
  if (options.growth_interval < 1) return InvalidArgumentError("loss scaler: growth interval (loss_scale_window) must be >= 1");
  if (options.hysteresis < 1) return InvalidArgumentError("loss scaler: hysteresis must be >= 1");
  if (!(options.min_scale > 0.0f)) return InvalidArgumentError("loss scaler: min scale must be > 0");
  return LossScaler(options);
}

LossScaler::LossScaler(const LossScalerOptions& options)
    : options_(options), scale_(options.initial_scale), remaining_hysteresis_(options.hysteresis) {}

bool LossScaler::update(bool overflowed) {
  if (!overflowed) {
    if (options_.dynamic && ++clean_steps_ >= options_.growth_interval) {
      scale_ *= options_.growth_factor;
      clean_steps_ = 0;
      remaining_hysteresis_ = options_.hysteresis;
    }
    return false;
  }
  ++skipped_steps_;
  clean_steps_ = 0;
  if (options_.dynamic) {
    if (--remaining_hysteresis_ <= 0) {
      scale_ = std::max(options_.min_scale, scale_ * options_.backoff_factor);
      remaining_hysteresis_ = options_.hysteresis;
    }
  }
  return true;
}

void LossScaler::restore(const State& state) {
  scale_ = state.scale;
  clean_steps_ = state.clean_steps;
  remaining_hysteresis_ = state.remaining_hysteresis;
  skipped_steps_ = state.skipped_steps;
}

}  // namespace strata
