#include "optim/gradient_stats.h"

#include <cmath>

namespace strata {

GradientStats& GradientStats::operator+=(const GradientStats& other) {
  sum_of_squares += other.sum_of_squares;
  non_finite = non_finite || other.non_finite;
  elements += other.elements;
  return *this;
}

namespace internal {

GradientStats gradient_stats_from_chunk_sums(size_t count, const std::vector<double>& chunk_sums) {
  double total = 0.0;
  for (double partial : chunk_sums) total += partial;
  GradientStats stats;
  stats.elements = count;
  stats.sum_of_squares = total;
  stats.non_finite = !std::isfinite(total);
  return stats;
}

}  // namespace internal

}  // namespace strata
