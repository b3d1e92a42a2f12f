#include "engine/metrics.h"

#include <cerrno>
#include <cstdio>
#include <sstream>

#include <nlohmann/json.hpp>

#include "engine/core/log.h"

namespace strata::engine_internal {

Status StepMetrics::open(const StepMetricsOptions& options) {
  options_ = options;
  if (options_.jsonl_path.empty() || options_.rank != 0) return {};
  file_.open(options_.jsonl_path, std::ios::app);
  if (!file_) return Status::FromErrno(errno, "cannot open the metrics file " + options_.jsonl_path);
  return {};
}

namespace {

std::string progress_line(int64_t step_number, const StepReport& r, bool breakdown) {
  char head[256];
  std::snprintf(head, sizeof(head), "step %lld: loss %.5f, grad norm %.4g, %.3f s%s", static_cast<long long>(step_number), r.loss,
                r.grad_norm, r.step_seconds, r.skipped ? " (skipped: overflow)" : "");
  std::ostringstream text;
  text << head;
  if (breakdown) {
    text << "; busy s:";
    for (size_t s = 0; s < kStageCount; ++s) {
      char part[64];
      std::snprintf(part, sizeof(part), " %s %.3f", std::string(stage_name(static_cast<Stage>(s))).c_str(), r.busy[s]);
      text << part;
    }
  }
  return text.str();
}

}  // namespace

Status StepMetrics::record(int64_t step_number, const StepReport& r) {
  if (options_.rank != 0) return {};
  if (options_.steps_per_print > 0 && step_number % options_.steps_per_print == 0)
    STRATA_LOG(kInfo) << progress_line(step_number, r, options_.wall_clock_breakdown);
  if (!file_.is_open()) return {};
  nlohmann::json busy;
  for (size_t s = 0; s < kStageCount; ++s) busy[std::string(stage_name(static_cast<Stage>(s)))] = r.busy[s];
  const nlohmann::json line = {{"step", step_number},
                               {"applied_steps", r.step},
                               {"loss", r.loss},
                               {"step_seconds", r.step_seconds},
                               {"busy_seconds", busy},
                               {"grad_norm", r.grad_norm},
                               {"loss_scale", r.loss_scale},
                               {"skipped", r.skipped},
                               {"device_high_water_bytes", r.device_high_water_bytes},
                               {"device_budget_bytes", r.device_budget_bytes},
                               {"pinned_bytes", r.pinned_bytes},
                               {"nvme_bytes_read", r.nvme_bytes_read},
                               {"nvme_bytes_written", r.nvme_bytes_written}};
  file_ << line.dump() << '\n';
  file_.flush();
  if (!file_) return Status::FromErrno(errno, "writing the metrics file " + options_.jsonl_path);
  return {};
}

}  // namespace strata::engine_internal
