// A plain one-rank dense trainer for the linear-stack model (examples/models): the
// whole model in host memory, straightforward loops, the same initialization and data,
// AdamW through the scalar reference. The engine's results are compared with it.
#pragma once

#include <vector>

#include "engine/partition.h"
#include "examples/models/linear_stack.h"
#include "kernels/adam.h"

namespace strata::testing {

class DenseLinearStack {
 public:
  DenseLinearStack(const models::LinearStackConfig& config, uint64_t seed, const kernels::AdamHyperparams& hyper,
                   float gradient_clipping);
  // One step over `micro_batches` micro-batches of config.global_rows rows; returns the mean loss.
  double step(int64_t step, int micro_batches, double learning_rate);
  // Group g's parameters, flat in the group layout (numel elements).
  const std::vector<float>& params(int group) const { return params_[static_cast<size_t>(group)]; }
  const GroupLayout& layout(int group) const { return layouts_[static_cast<size_t>(group)]; }

 private:
  models::LinearStackConfig config_;
  kernels::AdamHyperparams hyper_;
  float clipping_;
  int64_t applied_ = 0;
  std::vector<GroupLayout> layouts_;
  std::vector<std::vector<float>> params_, exp_avg_, exp_avg_sq_, grads_;
};

// ||a - b|| / ||b|| over the first n elements.
double relative_error(const float* a, const float* b, size_t n);

}  // namespace strata::testing
