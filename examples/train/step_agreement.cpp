#include "examples/train/step_agreement.h"

namespace strata::train::internal {

std::string bytes_text(double bytes) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (bytes >= double(size_t{1} << 30)) out << bytes / double(size_t{1} << 30) << " GiB";
  else if (bytes >= double(kMiB)) out << bytes / double(kMiB) << " MiB";
  else if (bytes >= 1024.0) out << bytes / 1024.0 << " KiB";
  else out << bytes << " B";
  return out.str();
}

std::string rate_text(double per_second) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (per_second >= 1e6) out << per_second / 1e6 << "M";
  else if (per_second >= 1e3) out << per_second / 1e3 << "k";
  else out << per_second;
  return out.str();
}

std::string flops_rate_text(double tflops) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (tflops >= 1.0) out << tflops << " TFLOPS";
  else if (tflops >= 1e-3) out << tflops * 1e3 << " GFLOPS";
  else out << tflops * 1e6 << " MFLOPS";
  return out.str();
}

std::string step_numbers_text(const RankStep& n) {
  return nlohmann::json{{"loss_sum", n.loss_sum},
                        {"tokens", n.tokens},
                        {"evaluated", n.evaluated},
                        {"eval_sum", n.eval_sum},
                        {"eval_tokens", n.eval_tokens},
                        {"step_seconds", n.report.step_seconds},
                        {"grad_norm", n.report.grad_norm},
                        {"skipped", n.report.skipped},
                        {"device_high_water_bytes", n.report.device_high_water_bytes},
                        {"device_budget_bytes", n.report.device_budget_bytes},
                        {"nvme_read_delta", n.nvme_read_delta},
                        {"nvme_written_delta", n.nvme_written_delta},
                        {"busy", n.report.busy}}
      .dump();
}

StatusOr<RankStep> step_numbers_from_text(const std::string& text, int rank) {
  const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (!j.is_object() || !j.contains("loss_sum") || !j.contains("nvme_written_delta"))
    return DataLossError("rank " + std::to_string(rank) + " sent step numbers that are not the trainer's JSON: " + text.substr(0, 200));
  RankStep n;
  n.loss_sum = j["loss_sum"].get<double>();
  n.tokens = j["tokens"].get<int64_t>();
  n.evaluated = j["evaluated"].get<bool>();
  n.eval_sum = j["eval_sum"].get<double>();
  n.eval_tokens = j["eval_tokens"].get<int64_t>();
  n.report.step_seconds = j["step_seconds"].get<double>();
  n.report.grad_norm = j["grad_norm"].get<double>();
  n.report.skipped = j["skipped"].get<bool>();
  n.report.device_high_water_bytes = j["device_high_water_bytes"].get<size_t>();
  n.report.device_budget_bytes = j["device_budget_bytes"].get<size_t>();
  n.nvme_read_delta = j["nvme_read_delta"].get<uint64_t>();
  n.nvme_written_delta = j["nvme_written_delta"].get<uint64_t>();
  if (j.contains("busy") && j["busy"].is_array() && j["busy"].size() == kStageCount) n.report.busy = j["busy"].get<StageSeconds>();
  return n;
}

std::string traffic_note(const TrainerOptions& options, const EngineOptions& engine_options, const lm::ModelRunOptions& model_options,
                         const lm::ActivationPlan& activations) {
  const lm::Architecture& model = *options.model;
  const auto specs = model.group_specs();
  std::vector<GroupLayout> layouts;
  for (size_t g = 0; g < specs.size(); ++g) {
    auto layout = layout_group(specs[g], static_cast<int>(g), engine_options.world_size);
    if (!layout.ok()) return "";
    layouts.push_back(*layout);
  }
  const int accumulation = engine_options.gradient_accumulation_steps;
  double h2d = 0.0, d2h = 0.0;
  if (engine_options.param_tier != Tier::kDevice) {
    for (int g : model.schedule()) {
      const GroupLayout& l = layouts[static_cast<size_t>(g)];
      if (l.padded_numel <= engine_options.persistence_threshold) continue;
      h2d += double(l.shard_numel * dtype_size(engine_options.param_dtype));
    }
  }
  if (engine_options.optimizer_tier != Tier::kDevice)
    for (const auto& l : layouts) d2h += double(l.shard_numel * dtype_size(engine_options.grad_transfer_dtype));
  h2d *= accumulation;
  d2h *= accumulation;
  if (model_options.checkpointing == ActivationCheckpointing::kPinnedHost && model.layers() > 1) {
    const double per_block = double(model_options.batch * model_options.seq_len * model.hidden_size()) * double(dtype_size(activations.compute_dtype));
    h2d += per_block * double(model.layers() - 1) * accumulation;
    d2h += per_block * double(model.layers() - 1) * accumulation;
  }
  return "h2d " + bytes_text(h2d) + " d2h " + bytes_text(d2h) + " per rank |";
}

std::string stopped_line(const TrainerOptions& options, const TrainerResult& result, int stop_signal, int64_t end_step) {
  const std::string signal_name = stop_signal == SIGINT    ? "SIGINT"
                                  : stop_signal == SIGTERM ? "SIGTERM"
                                                           : "signal " + std::to_string(stop_signal);
  std::string line = "stopped by " + signal_name + " after step " + std::to_string(end_step) + " of " + std::to_string(result.total_steps) + "; ";
  if (options.save_dir.empty()) return line + "no --save-dir: nothing saved";
  if (result.last_checkpoint != checkpoint_path(options.save_dir, end_step))
    return line + "the checkpoint of step " + std::to_string(end_step) + " was not saved";
  return line + "checkpoint saved to " + result.last_checkpoint + " (continue with --resume " + options.save_dir + ")";
}

}  // namespace strata::train::internal
