// Step metrics: one JSON object per step in a JSONL file (rank 0), and a progress line in
// the log every `steps_per_print` steps, with every stage's busy seconds when
// `wall_clock_breakdown` asks for them (DeepSpeed's keys of the same names).
#pragma once

#include <fstream>
#include <string>

#include "engine/engine.h"

namespace strata::engine_internal {

struct StepMetricsOptions {
  std::string jsonl_path;         // empty = no file
  int steps_per_print = 0;        // 0 = no progress lines
  bool wall_clock_breakdown = false;
  int rank = 0;                   // only rank 0 writes or prints
};

class StepMetrics {
 public:
  Status open(const StepMetricsOptions& options);
  // `step_number` is what the run calls the step (a resumed run continues the numbering).
  Status record(int64_t step_number, const StepReport& report);

 private:
  StepMetricsOptions options_;
  std::ofstream file_;
};

}  // namespace strata::engine_internal
