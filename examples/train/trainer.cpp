#include "examples/train/trainer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <functional>
#include <iomanip>
#include <map>
#include <mutex>
#include <optional>
#include <sstream>
#include <thread>

#include <sys/statvfs.h>
#include <unistd.h>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/core/log.h"
#include "engine/engine_config.h"
#include "engine/engine_plan.h"
#include "engine/local_cluster.h"
#include "examples/hf/hf_checkpoint.h"
#include "examples/train/param_checksum.h"
#include "optim/lr_schedule.h"

namespace strata::train {

using data::DataLoader;
using data::DataLoaderOptions;
using data::DataSplit;
using data::TokenDataset;

namespace {

constexpr size_t kMiB = size_t{1} << 20;

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

// "12.3 TFLOPS", "45.6 GFLOPS" (a tiny model on the CPU), "7.8 MFLOPS".
std::string flops_rate_text(double tflops) {
  std::ostringstream out;
  out << std::fixed << std::setprecision(1);
  if (tflops >= 1.0) out << tflops << " TFLOPS";
  else if (tflops >= 1e-3) out << tflops * 1e3 << " GFLOPS";
  else out << tflops * 1e6 << " MFLOPS";
  return out.str();
}

// A barrier for the rank threads of one process that a failing rank can break, so the
// others return an error instead of waiting forever.
class RankSync {
 public:
  // `rendezvous` (process ranks): this process's one rank meets the other processes there.
  RankSync(int local_ranks, Rendezvous* rendezvous) : world_(local_ranks), rendezvous_(rendezvous) {}
  Status arrive_and_wait() {
    if (rendezvous_ != nullptr) return rendezvous_->barrier();
    std::unique_lock<std::mutex> lock(mutex_);
    if (aborted_) return CancelledError("another rank failed: " + reason_);
    const uint64_t generation = generation_;
    if (++arrived_ == world_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return {};
    }
    cv_.wait(lock, [&] { return generation_ != generation || aborted_; });
    if (generation_ == generation) return CancelledError("another rank failed: " + reason_);
    return {};
  }
  void abort(const std::string& reason) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!aborted_) reason_ = reason;
    aborted_ = true;
    cv_.notify_all();
  }

 private:
  const int world_;
  Rendezvous* const rendezvous_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  uint64_t generation_ = 0;
  bool aborted_ = false;
  std::string reason_;
};

// What one rank contributes to a step's line.
struct RankStep {
  double loss_sum = 0.0;
  int64_t tokens = 0;
  bool evaluated = false;
  double eval_sum = 0.0;
  int64_t eval_tokens = 0;
  StepReport report;
  uint64_t nvme_read_delta = 0;
  uint64_t nvme_written_delta = 0;
};

// Collects every rank's numbers for a step; the last rank to post prints the line.
class StepBoard {
 public:
  // step_flops: the model FLOPs of one step (all ranks, examples/lm/model_flops.h).
  StepBoard(const TrainerOptions& options, int world, int64_t total_steps, double step_flops, std::string traffic_note)
      : options_(options), world_(world), total_steps_(total_steps), step_flops_(step_flops), traffic_note_(std::move(traffic_note)) {}

  void post(int64_t step_index, int rank, const RankStep& numbers, double learning_rate) {
    std::lock_guard<std::mutex> lock(mutex_);
    Pending& pending = pending_[step_index];
    pending.ranks[rank] = numbers;
    if (rank == 0) pending.learning_rate = learning_rate;
    if (static_cast<int>(pending.ranks.size()) < world_) return;
    StepRecord record;
    record.step = step_index + 1;
    double loss_sum = 0.0, eval_sum = 0.0;
    int64_t tokens = 0, eval_tokens = 0;
    bool evaluated = false;
    for (const auto& [r, n] : pending.ranks) {  // rank order: a fixed summation order
      loss_sum += n.loss_sum;
      tokens += n.tokens;
      eval_sum += n.eval_sum;
      eval_tokens += n.eval_tokens;
      evaluated = evaluated || n.evaluated;
      record.device_high_water_bytes = std::max(record.device_high_water_bytes, n.report.device_high_water_bytes);
      record.nvme_bytes_read += n.nvme_read_delta;
      record.nvme_bytes_written += n.nvme_written_delta;
    }
    const StepReport& lead = pending.ranks.at(0).report;
    record.loss = tokens > 0 ? loss_sum / double(tokens) : 0.0;
    if (evaluated && eval_tokens > 0) {
      record.eval_loss = eval_sum / double(eval_tokens);
      record.eval_at_step = step_index;
    }
    record.learning_rate = pending.learning_rate;
    record.seconds = lead.step_seconds;
    record.tokens_per_s = lead.step_seconds > 0 ? double(tokens) / lead.step_seconds : 0.0;
    record.model_tflops = lm::tflops(step_flops_, lead.step_seconds);
    record.grad_norm = lead.grad_norm;
    budget_ = lead.device_budget_bytes;
    pending_.erase(step_index);
    print(record);
    records_.push_back(record);
  }

  void finish_output() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (options_.out && options_.live_bar && bar_shown_) {
      *options_.out << "\r\033[K" << std::flush;
      bar_shown_ = false;
    }
  }

  std::vector<StepRecord> records() {
    std::lock_guard<std::mutex> lock(mutex_);
    std::sort(records_.begin(), records_.end(), [](const StepRecord& a, const StepRecord& b) { return a.step < b.step; });
    return records_;
  }

 private:
  struct Pending {
    std::map<int, RankStep> ranks;
    double learning_rate = 0.0;
  };

  void print(const StepRecord& r) {
    if (options_.out == nullptr) return;
    std::ostream& out = *options_.out;
    if (options_.live_bar && bar_shown_) out << "\r\033[K";
    std::ostringstream line;
    line << "step " << std::setw(static_cast<int>(std::to_string(total_steps_).size())) << r.step << "/" << total_steps_ << " | loss "
         << std::fixed << std::setprecision(4) << r.loss;
    if (r.eval_loss) line << " | eval " << std::setprecision(4) << *r.eval_loss << " (at step " << r.eval_at_step << ")";
    line << " | lr " << std::scientific << std::setprecision(2) << r.learning_rate << std::fixed << " | " << rate_text(r.tokens_per_s)
         << " tok/s | model " << flops_rate_text(r.model_tflops) << " | " << std::setprecision(3) << r.seconds << " s | " << traffic_note_ << " nvme r "
         << bytes_text(double(r.nvme_bytes_read)) << " w " << bytes_text(double(r.nvme_bytes_written)) << " | device peak "
         << bytes_text(double(r.device_high_water_bytes)) << " of " << bytes_text(double(budget_));
    out << line.str() << "\n";
    if (options_.live_bar) {
      const int width = 30;
      const int filled = total_steps_ > 0 ? static_cast<int>(width * r.step / total_steps_) : width;
      const double remaining = r.seconds * double(total_steps_ - r.step);
      out << "[" << std::string(static_cast<size_t>(filled), '#') << std::string(static_cast<size_t>(width - filled), '.') << "] "
          << r.step << "/" << total_steps_ << "  eta " << static_cast<int64_t>(std::ceil(remaining)) << " s";
      bar_shown_ = true;
    }
    out << std::flush;
  }

  const TrainerOptions& options_;
  const int world_;
  const int64_t total_steps_;
  const double step_flops_;
  const std::string traffic_note_;
  std::mutex mutex_;
  std::map<int64_t, Pending> pending_;
  std::vector<StepRecord> records_;
  size_t budget_ = 0;
  bool bar_shown_ = false;
};

// What one rank knows of a step's health.
struct RankHealth {
  double loss_sum = 0.0;
  int64_t tokens = 0;
  double grad_norm = 0.0;
  bool skipped = false;  // the engine left the weights untouched
};

// What every rank does after a step, decided once (by rank 0, between two barriers).
struct StepOutcome {
  bool non_finite = false;  // a NaN/inf loss or gradient norm (not an fp16 overflow): the step is not saved as good
  Status stop;              // divergence, or a failed save under on_save_failure=stop: every rank returns it
  int stop_signal = 0;      // a stop request: end the loop after this step
};

// Rank 0's side of the per-step agreement: divergence, save failures and stop requests.
class StepJudge {
 public:
  StepJudge(const TrainerOptions& options, CheckpointSaver* saver, bool loss_scaling, std::string resumed_from)
      : options_(options), saver_(saver), loss_scaling_(loss_scaling), resumed_from_(std::move(resumed_from)) {}

  StepOutcome judge(int64_t step_index, const std::vector<RankHealth>& ranks) {
    StepOutcome outcome;
    double loss_sum = 0.0;
    int64_t tokens = 0;
    for (const RankHealth& r : ranks) {
      loss_sum += r.loss_sum;
      tokens += r.tokens;
    }
    const double loss = tokens > 0 ? loss_sum / double(tokens) : 0.0;
    const RankHealth& lead = ranks.front();  // the gradient norm is global: every rank has it
    // With fp16 loss scaling a non-finite norm is an overflow the scaler already skipped.
    outcome.non_finite = !std::isfinite(loss) || (!std::isfinite(lead.grad_norm) && !loss_scaling_);
    if (saver_) {
      Status saved = saver_->poll();
      if (!saved.ok()) outcome.stop = on_save_failure(step_index, std::move(saved));
    }
    if (outcome.non_finite && outcome.stop.ok()) outcome.stop = on_non_finite(step_index, loss, lead);
    if (options_.stop_requested) outcome.stop_signal = options_.stop_requested();
    return outcome;
  }

  int64_t skipped_steps() const { return skipped_; }

  // The newest checkpoint that holds a state this run trusts, after pending saves settle.
  std::string last_good_checkpoint() {
    std::string note;
    if (saver_) {
      Status pending = saver_->wait();
      if (!pending.ok()) note = " (a later save failed: " + pending.message() + ")";
      if (saver_->last_committed_step() >= 0) return checkpoint_path(options_.save_dir, saver_->last_committed_step()) + note;
    }
    if (!resumed_from_.empty()) return resumed_from_ + " (resumed from)" + note;
    return "none (no checkpoint was saved" + std::string(options_.save_dir.empty() ? "; no --save-dir" : "") + ")" + note;
  }

 private:
  Status on_save_failure(int64_t step_index, Status failure) {
    const int64_t step = step_index + 1;
    if (options_.config.strata.on_save_failure == SaveFailurePolicy::kContinue) {
      STRATA_LOG(kWarn) << "after step " << step << ": " << failure.to_string()
                        << "\n  training goes on (strata.checkpoint.on_save_failure=continue); the next save tries again";
      return {};
    }
    return failure.with_context("after step " + std::to_string(step) + ": stopping the run (strata.checkpoint.on_save_failure=stop); " +
                                "the last good checkpoint is " + last_good_checkpoint());
  }

  Status on_non_finite(int64_t step_index, double loss, const RankHealth& lead) {
    const int64_t step = step_index + 1;
    std::ostringstream what;
    what << "step " << step << ": the loss is " << loss << " and the gradient norm " << lead.grad_norm;
    const int64_t allowed = options_.config.strata.max_nonfinite_steps;
    if (!lead.skipped) {
      if (allowed > 0)
        what << "; the engine applied the update (a non-finite loss with a finite gradient norm), so the step cannot be skipped";
    } else if (skipped_ < allowed) {
      ++skipped_;
      STRATA_LOG(kWarn) << what.str() << ": step skipped, weights unchanged (" << skipped_ << " of strata.max_nonfinite_steps="
                        << allowed << ")";
      return {};
    }
    what << ": training diverged; stopped without saving this state (" << skipped_ << " step(s) skipped before, strata.max_nonfinite_steps="
         << allowed << "). The last good checkpoint is " << last_good_checkpoint()
         << ". Lower the learning rate, check the data and the initial weights, or raise strata.max_nonfinite_steps to skip such steps";
    return FailedPreconditionError(what.str());
  }

  const TrainerOptions& options_;
  CheckpointSaver* saver_;
  const bool loss_scaling_;
  const std::string resumed_from_;
  int64_t skipped_ = 0;
};

// Process ranks: what a rank's step numbers carry to rank 0 (the fields the board and
// the judge read), and the outcome back. JSON keeps doubles exact (shortest round trip).
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
                        {"nvme_written_delta", n.nvme_written_delta}}
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
  return n;
}

// The ranks' per-step agreement: each posts its numbers and health, rank 0 judges, all
// read the outcome. Thread ranks: two barriers of the trainer's RankSync (so a failing
// rank breaks it) around shared memory. Process ranks: the numbers travel to every
// process through the rendezvous, rank 0 posts them to its board and judges, and
// broadcasts the outcome.
class StepAgreement {
 public:
  StepAgreement(int world, RankSync& sync, Rendezvous* rendezvous)
      : sync_(sync), rendezvous_(rendezvous), health_(static_cast<size_t>(world)) {}

  // `board` is the shared board (thread ranks) or rank 0's (process ranks; nullptr elsewhere).
  StatusOr<StepOutcome> agree(int64_t step_index, int rank, const RankStep& mine, double learning_rate, StepBoard* board,
                              StepJudge& judge) {
    if (rendezvous_ != nullptr) return agree_across_processes(step_index, rank, mine, learning_rate, board, judge);
    board->post(step_index, rank, mine, learning_rate);
    health_[static_cast<size_t>(rank)] = health_of(mine);
    STRATA_RETURN_IF_ERROR(sync_.arrive_and_wait());  // every rank's health is in
    if (rank == 0) outcome_ = judge.judge(step_index, health_);
    STRATA_RETURN_IF_ERROR(sync_.arrive_and_wait());  // the outcome is out
    return outcome_;  // rank 0 writes the next one only after every rank arrives again
  }

 private:
  static RankHealth health_of(const RankStep& n) { return {n.loss_sum, n.tokens, n.report.grad_norm, n.report.skipped}; }

  StatusOr<StepOutcome> agree_across_processes(int64_t step_index, int rank, const RankStep& mine, double learning_rate,
                                               StepBoard* board, StepJudge& judge) {
    const std::string what = "step " + std::to_string(step_index + 1) + ": agreeing on the outcome across processes";
    StatusOr<std::vector<std::string>> all = rendezvous_->all_gather_strings(step_numbers_text(mine));
    if (!all.ok()) return std::move(all).status().with_context(what);
    std::string decided;
    if (rank == 0) {
      for (int r = 0; r < static_cast<int>(all->size()); ++r) {
        STRATA_ASSIGN_OR_RETURN(const RankStep numbers, step_numbers_from_text((*all)[static_cast<size_t>(r)], r));
        if (board != nullptr) board->post(step_index, r, numbers, learning_rate);
        health_[static_cast<size_t>(r)] = health_of(numbers);
      }
      const StepOutcome outcome = judge.judge(step_index, health_);
      decided = nlohmann::json{{"non_finite", outcome.non_finite},
                               {"stop_signal", outcome.stop_signal},
                               {"stop_code", static_cast<int>(outcome.stop.code())},
                               {"stop_message", outcome.stop.message()}}
                    .dump();
    }
    StatusOr<std::string> shared = rendezvous_->broadcast_string(decided, 0);
    if (!shared.ok()) return std::move(shared).status().with_context(what);
    const nlohmann::json j = nlohmann::json::parse(*shared, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("stop_code")) return DataLossError(what + ": rank 0 sent an outcome that is not JSON");
    StepOutcome outcome;
    outcome.non_finite = j["non_finite"].get<bool>();
    outcome.stop_signal = j["stop_signal"].get<int>();
    const auto code = static_cast<StatusCode>(j["stop_code"].get<int>());
    if (code != StatusCode::kOk) outcome.stop = Status(code, j["stop_message"].get<std::string>());
    return outcome;
  }

  RankSync& sync_;
  Rendezvous* const rendezvous_;
  std::vector<RankHealth> health_;
  StepOutcome outcome_;
};

// Per-rank bytes one step moves between host and device, from the plan (the engine
// reports NVMe traffic, not copies): every gather of a group whose parameters live off
// the device brings this rank's shard (all of it at world size 1) over, every group's
// gradient shard comes back once per micro-batch, and pinned activation checkpoints go
// out and back.
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

// The line a run stopped by a signal prints: when, and where its checkpoint went.
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

// --eval-only needs a file with the windows it names: count windows of T + 1 tokens, T apart.
Status check_eval_windows(const TokenDataset& data, int64_t count, int64_t seq_len) {
  if (count <= 0) return InvalidArgumentError("--eval-only needs --eval-sequences N > 0 (the windows to evaluate)");
  const std::optional<uint64_t> tokens = data.total_tokens();
  if (!tokens) return FailedPreconditionError("--eval-only evaluates a token or text file (--data FILE), not " + data.describe());
  const uint64_t needed = static_cast<uint64_t>(count) * static_cast<uint64_t>(seq_len) + 1;
  if (*tokens < needed)
    return InvalidArgumentError("--eval-only: " + std::to_string(count) + " windows of " + std::to_string(seq_len) + " tokens need " +
                                std::to_string(needed) + " tokens, " + data.describe() + " has " + std::to_string(*tokens) +
                                " (lower --eval-sequences or --seq-len)");
  return {};
}

struct WindowPlan {
  int rank = 0;
  int world = 1;
  int64_t per_pass = 1;  // sequences per forward on each rank
  int64_t seq_len = 0;
  int64_t count = 0;     // windows in all
};

// --eval-only's forward passes. Each round covers per_pass x world windows, rank r taking
// the r-th block of per_pass; rows past the last window are masked (targets -1) so every
// rank runs the same passes and gathers the same groups.
StatusOr<MicroBatchLosses> evaluate_windows(Engine& engine, lm::CausalLm& model, const lm::Architecture& architecture,
                                            const TokenDataset& data, const WindowPlan& plan) {
  const size_t T = static_cast<size_t>(plan.seq_len);
  std::vector<int32_t> inputs(static_cast<size_t>(plan.per_pass) * T), targets(inputs.size()), window(T + 1);
  MicroBatchLosses total;
  for (int64_t round = 0; round < plan.count; round += plan.per_pass * plan.world) {
    for (int64_t j = 0; j < plan.per_pass; ++j) {
      const int64_t w = round + plan.rank * plan.per_pass + j;
      int32_t* in = inputs.data() + static_cast<size_t>(j) * T;
      int32_t* out = targets.data() + static_cast<size_t>(j) * T;
      if (w >= plan.count) {
        std::fill(in, in + T, 0);
        std::fill(out, out + T, -1);
        continue;
      }
      STRATA_RETURN_IF_ERROR(data.tokens_at(static_cast<uint64_t>(w) * T, window));
      std::copy(window.begin(), window.end() - 1, in);
      std::copy(window.begin() + 1, window.end(), out);
    }
    const TokenBatch batch{inputs.data(), targets.data(), plan.per_pass};
    STRATA_RETURN_IF_ERROR(engine.begin_forward(architecture.forward_order()));
    STRATA_ASSIGN_OR_RETURN(MicroBatchLosses pass, model.run_micro_batch(nullptr, &batch, 0.0f));
    STRATA_RETURN_IF_ERROR(engine.end_forward());
    total.eval_loss_sum += pass.eval_loss_sum;
    total.eval_tokens += pass.eval_tokens;
  }
  return total;
}

// Tests only (tests/examples/kill_resume_test.cpp): STRATA_TEST_CHECKPOINT_PAUSE_MS=N makes
// the saver announce each point of a save on stderr ("strata-test: checkpoint <point> step
// <S>") and pause there N ms, so a test can SIGKILL the process inside a save. Unset (the
// normal case): no hook.
std::function<Status(std::string_view, int64_t)> checkpoint_pause_hook_from_env() {
  const char* text = std::getenv("STRATA_TEST_CHECKPOINT_PAUSE_MS");
  if (text == nullptr || *text == '\0') return nullptr;
  const long pause_ms = std::clamp(std::strtol(text, nullptr, 10), 0L, 10'000L);
  return [pause_ms](std::string_view point, int64_t step) -> Status {
    const std::string line = "strata-test: checkpoint " + std::string(point) + " step " + std::to_string(step) + "\n";
    // One write(2): the line arrives whole even as other threads log.
    if (::write(STDERR_FILENO, line.data(), line.size()) < 0) return Status::FromErrno(errno, "write(stderr)");
    std::this_thread::sleep_for(std::chrono::milliseconds(pause_ms));
    return Status::Ok();
  };
}

// Process ranks: what this process planned and what its node has, for rank 0's summary of
// every node (the per-rank checks ran in Engine::create; this shows them side by side).
nlohmann::json node_startup_json(const RendezvousOptions& process, const EnginePlan& plan, const EngineOptions& engine_options) {
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
  uint64_t nvme_free = 0;
  struct statvfs fs {};
  if (plan.nvme_bytes > 0 && ::statvfs(engine_options.nvme_path.c_str(), &fs) == 0)
    nvme_free = static_cast<uint64_t>(fs.f_bavail) * static_cast<uint64_t>(fs.f_frsize);
  const uint64_t host_available = static_cast<uint64_t>(::sysconf(_SC_AVPHYS_PAGES)) * static_cast<uint64_t>(::sysconf(_SC_PAGESIZE));
  return {{"node", process.node_rank},       {"host", host},
          {"rank", process.rank},            {"pinned_bytes", plan.pinned_bytes},
          {"host_available_bytes", host_available}, {"nvme_path", plan.nvme_bytes > 0 ? engine_options.nvme_path : std::string()},
          {"nvme_bytes", plan.nvme_bytes},   {"nvme_free_bytes", nvme_free}};
}

// Rank 0's summary: one line per node (its host, ranks, pinned planned / host memory
// available, NVMe planned / free under its nvme_path after its files were made).
StatusOr<std::string> node_summary_text(const std::vector<std::string>& gathered) {
  std::map<int, std::vector<nlohmann::json>> nodes;
  for (size_t r = 0; r < gathered.size(); ++r) {
    nlohmann::json j = nlohmann::json::parse(gathered[r], nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("node")) return DataLossError("rank " + std::to_string(r) + " sent a start-up summary that is not JSON");
    nodes[j["node"].get<int>()].push_back(std::move(j));
  }
  std::string text = "nodes: " + std::to_string(nodes.size()) + "\n";
  for (const auto& [node, ranks] : nodes) {
    uint64_t pinned = 0, nvme = 0;
    std::string rank_list;
    for (const nlohmann::json& j : ranks) {
      pinned += j["pinned_bytes"].get<uint64_t>();
      nvme += j["nvme_bytes"].get<uint64_t>();
      if (!rank_list.empty()) rank_list += ',';
      rank_list += std::to_string(j["rank"].get<int>());
    }
    const nlohmann::json& first = ranks.front();
    text += "  node " + std::to_string(node) + " (" + first["host"].get<std::string>() + "): ranks " + rank_list + "; pinned " +
            engine_internal::format_bytes(pinned) + " planned, host memory " +
            engine_internal::format_bytes(first["host_available_bytes"].get<uint64_t>()) + " available";
    if (nvme > 0)
      text += "; nvme " + engine_internal::format_bytes(nvme) + " planned under " + first["nvme_path"].get<std::string>() + ", " +
              engine_internal::format_bytes(first["nvme_free_bytes"].get<uint64_t>()) + " free after its files";
    text += "\n";
  }
  return text;
}

// ------------------------------------------------------------------------------ one run

// The run's shape, from the config: what every rank agrees on before anything is opened.
struct RunShape {
  int world = 1;
  int accumulation = 1;  // micro-batches per step
  int64_t micro = 1;     // sequences per micro-batch and rank
  int64_t seq_len = 0;
  int64_t total_steps = 0;
  DeviceKind device_kind = DeviceKind::kCpu;
  int64_t global_tokens_per_step = 0;
};

StatusOr<RunShape> run_shape(const TrainerOptions& options) {
  const StrataConfig& config = options.config;
  if (options.model == nullptr) return InvalidArgumentError("the trainer was given no model architecture");
  const lm::Architecture& model = *options.model;
  RunShape shape;
  shape.world = static_cast<int>(config.strata.world_size);
  shape.accumulation = static_cast<int>(config.gradient_accumulation_steps.value_or(1));
  shape.micro = config.train_micro_batch_size_per_gpu.value_or(1);
  shape.seq_len = config.strata.data.seq_len > 0 ? config.strata.data.seq_len : model.context_length();
  shape.total_steps = options.eval_only ? 0 : config.strata.steps;
  shape.device_kind = resolve_device(config);
  if (shape.seq_len > model.context_length())
    return InvalidArgumentError("strata.data.seq_len (" + std::to_string(shape.seq_len) + ") is longer than the model's context (" +
                                std::to_string(model.context_length()) + ")");
  shape.global_tokens_per_step = shape.micro * shape.world * shape.seq_len * shape.accumulation;
  return shape;
}

// The data and the starting weights, opened once and shared by the ranks.
struct RunSources {
  std::shared_ptr<const TokenDataset> dataset;
  int64_t eval_sequences = 0;                      // the evaluation batch of all ranks together (0 = none)
  std::unique_ptr<CheckpointReader> resume;        // --resume: the newest complete checkpoint
  nlohmann::json trainer_state;                    // ... and the trainer state saved with it
  std::unique_ptr<lm::WeightSource> init_weights;  // --init-from, when not resuming
  int64_t start_step() const { return resume ? trainer_state.at("step").get<int64_t>() : 0; }
};

// The evaluation batch over all ranks: --eval-sequences rounded up to a multiple of the
// world size, none where the data has no evaluation split.
int64_t evaluation_sequences(const TrainerOptions& options, const RunShape& shape) {
  const StrataConfig& config = options.config;
  int64_t eval_sequences = options.eval_only ? 0 : options.eval_sequences;
  if (eval_sequences > 0 && eval_sequences % shape.world != 0) eval_sequences = (eval_sequences + shape.world - 1) / shape.world * shape.world;
  if (eval_sequences > 0 && config.strata.data.kind != DataKind::kSynthetic && config.strata.data.eval_fraction <= 0.0) {
    STRATA_LOG(kWarn) << "no evaluation: strata.data.eval_fraction is 0 for " << config.strata.data.path;
    eval_sequences = 0;
  }
  const lm::Architecture& model = *options.model;
  if (eval_sequences > 0 && options.eval_every > 0 && !model.evaluates_while_training())
    STRATA_LOG(kInfo) << "the " << model.family() << " model evaluates in forward-only passes: the evaluation batch is measured after the last "
                      << "step (--eval-every " << options.eval_every << " does not apply)";
  return eval_sequences;
}

// --resume: the newest complete checkpoint under `directory`, and its trainer state, which
// must be train_gpt's and hold the same model.
Status open_resume(const std::string& directory, const lm::Architecture& model, RunSources& sources) {
  STRATA_ASSIGN_OR_RETURN(CheckpointRef latest, latest_complete(directory));
  STRATA_ASSIGN_OR_RETURN(sources.resume, CheckpointReader::open(latest.path));
  nlohmann::json& state = sources.trainer_state;
  state = nlohmann::json::parse(sources.resume->trainer_state(), nullptr, /*allow_exceptions=*/false);
  if (state.is_discarded() || !state.is_object() || !state.contains("step") || !state["step"].is_number_integer() ||
      state["step"].get<int64_t>() < 0)
    return DataLossError("the trainer state of " + latest.path + " is not the JSON object train_gpt writes");
  const std::string saved_model = state.value("model", nlohmann::json::object()).dump();
  if (saved_model != model.model_json())
    return InvalidArgumentError("checkpoint " + latest.path + " holds a model " + saved_model + " but this run's model is " + model.model_json());
  STRATA_LOG(kInfo) << "resuming from " << latest.path << " (step " << latest.step << ", saved with " << sources.resume->world_size() << " ranks)";
  return {};
}

StatusOr<RunSources> open_sources(const TrainerOptions& options, const RunShape& shape) {
  const lm::Architecture& model = *options.model;
  RunSources sources;
  SyntheticLanguageOptions synthetic = options.synthetic;
  synthetic.vocab_size = model.vocab_size();
  STRATA_ASSIGN_OR_RETURN(sources.dataset, TokenDataset::open(options.config.strata.data, synthetic));
  if (sources.dataset->vocab_size() > model.vocab_size())
    return InvalidArgumentError("the data's vocabulary (" + std::to_string(sources.dataset->vocab_size()) + " tokens, " +
                                sources.dataset->describe() + ") is larger than the model's vocab_size (" +
                                std::to_string(model.vocab_size()) + ")");
  if (options.eval_only) STRATA_RETURN_IF_ERROR(check_eval_windows(*sources.dataset, options.eval_sequences, shape.seq_len));
  sources.eval_sequences = evaluation_sequences(options, shape);
  if (!options.resume_dir.empty()) STRATA_RETURN_IF_ERROR(open_resume(options.resume_dir, model, sources));
  if (!options.init_from.empty() && !sources.resume) {
    STRATA_ASSIGN_OR_RETURN(sources.init_weights, model.open_weights(options.init_from));
  }
  return sources;
}

StatusOr<std::unique_ptr<LocalCluster>> make_cluster(const TrainerOptions& options, const RunShape& shape) {
  const StrataConfig& config = options.config;
  LocalClusterOptions cluster_options;
  cluster_options.world_size = shape.world;
  cluster_options.device = shape.device_kind;
  cluster_options.device_budget_bytes = config.strata.device_budget_mib > 0 ? static_cast<size_t>(config.strata.device_budget_mib) * kMiB
                                        : shape.device_kind == DeviceKind::kCpu ? size_t{1} << 30
                                                                                : 0;
  cluster_options.compute_threads = static_cast<int>(config.strata.compute_threads);
  cluster_options.device_thread_nice = static_cast<int>(config.strata.device_thread_nice);
  if (shape.device_kind != DeviceKind::kCpu && (config.strata.compute_threads != 0 || config.strata.device_thread_nice != kCpuDeviceThreadNice))
    STRATA_LOG(kWarn) << "strata.compute_threads and strata.device_thread_nice shape the CPU device's threads; this run computes on "
                      << device_kind_name(shape.device_kind) << ", so they are ignored";
  cluster_options.matmul_precision = config.strata.matmul_precision;
  cluster_options.process_group = options.process_group;
  if (options.process_group) {
    if (options.process_group->world_size != shape.world)
      return InvalidArgumentError("strata.world_size (--world-size) is " + std::to_string(shape.world) + " but the launcher's WORLD_SIZE is " +
                                  std::to_string(options.process_group->world_size) + "; drop --world-size or make them agree");
    // Not yet across processes: the export gathers whole groups through one process's memory.
    if (!options.export_dir.empty()) return UnimplementedError("--export-dir with process ranks is not supported yet; export with thread ranks");
  }
  return LocalCluster::create(cluster_options);
}

StatusOr<std::unique_ptr<CheckpointSaver>> make_saver(const TrainerOptions& options, const RunShape& shape, const LocalCluster& cluster) {
  CheckpointSaverOptions saver_options;
  saver_options.directory = options.save_dir;
  saver_options.world_size = shape.world;
  saver_options.first_rank = cluster.first_rank();  // process ranks: each process writes its own rank's file
  saver_options.local_ranks = cluster.local_ranks();
  saver_options.keep_last = options.keep_checkpoints;
  for (const auto& spec : options.model->group_specs()) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(spec, 0, shape.world));
    saver_options.checkpoint_elements += layout.padded_numel;
  }
  // Delayed overlap saves the stale parameter copy as a fourth segment.
  if (options.config.strata.optimizer_overlap == OverlapMode::kDelayed) saver_options.state_segments = kCheckpointStateKinds + 1;
  // Rotation keeps the newest checkpoint whose step ended with a finite loss.
  saver_options.is_healthy = [](std::string_view state) {
    const auto parsed = nlohmann::json::parse(state, nullptr, /*allow_exceptions=*/false);
    return parsed.is_object() && parsed.value("loss_finite", true);
  };
  saver_options.fault_hook = checkpoint_pause_hook_from_env();
  return CheckpointSaver::create(saver_options);
}

// What the ranks of one run share: the inputs above, the ranks' barrier and agreement, and
// what each rank adds to the result.
struct SharedRun {
  SharedRun(const TrainerOptions& options_in, const RunShape& shape_in, const RunSources& sources_in, LocalCluster& cluster_in,
            CheckpointSaver* saver_in)
      : options(options_in),
        model(*options_in.model),
        shape(shape_in),
        sources(sources_in),
        cluster(cluster_in),
        processes(cluster_in.rendezvous()),
        saver(saver_in),
        sync(cluster_in.local_ranks(), processes),
        agreement(shape_in.world, sync, processes),
        judge(options_in, saver_in, options_in.config.fp16.enabled, sources_in.resume ? sources_in.resume->path() : std::string()),
        start_step(sources_in.start_step()),
        end_step(shape_in.total_steps),
        square_sums(static_cast<size_t>(shape_in.world), 0.0) {}

  // The model's run options, the export's exchange buffer and the result's fixed fields.
  Status prepare();
  // The result once every rank has returned.
  TrainerResult summarize();

  const TrainerOptions& options;
  const lm::Architecture& model;
  const RunShape& shape;
  const RunSources& sources;
  LocalCluster& cluster;
  Rendezvous* const processes;  // process ranks only
  CheckpointSaver* const saver;  // null without --save-dir
  RankSync sync;
  StepAgreement agreement;
  StepJudge judge;
  const int64_t start_step;
  lm::ModelRunOptions model_options;
  int64_t model_flops_per_token = 0;
  std::vector<float> exchange;  // export: one full group at a time

  std::mutex mutex;                  // guards what follows, but for the atomic
  std::unique_ptr<StepBoard> board;  // rank 0 makes it before the ranks' first barrier
  TrainerResult result;
  int64_t end_step;  // the step the loop ends after (earlier when stopped)
  int stop_signal = 0;
  std::atomic<uint64_t> checksum{0};
  // Per rank, summed in rank order at the end: param_norm is a number runs with different
  // world sizes can compare within a tolerance (the checksum is a hash: equal or not).
  std::vector<double> square_sums;
  double eval_sum = 0.0;
  int64_t eval_tokens = 0;
};

Status SharedRun::prepare() {
  model_options.batch = shape.micro;
  model_options.seq_len = shape.seq_len;
  model_options.eval_batch = options.eval_only ? shape.micro : sources.eval_sequences / shape.world;
  model_options.checkpointing = options.checkpointing;
  model_options.head_chunk_rows = options.head_chunk_rows;
  if (!options.export_dir.empty()) {
    size_t largest = 0;
    for (const auto& spec : model.group_specs()) {
      STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(spec, 0, shape.world));
      largest = std::max(largest, layout.padded_numel);
    }
    exchange.assign(largest, 0.0f);
  }
  // Every position of every sequence is computed (ignored targets too), so all count.
  model_flops_per_token = lm::training_flops_per_token(model.flop_shape(), shape.seq_len);
  result.total_steps = shape.total_steps;
  result.vocab_size = model.vocab_size();
  result.entropy_floor = sources.dataset->entropy_floor();
  result.parameters = model.parameter_count();
  result.world_size = shape.world;
  result.device = std::string(device_kind_name(shape.device_kind));
  result.resumed_from_step = start_step;
  result.model_flops_per_token = model_flops_per_token;
  return {};
}

TrainerResult SharedRun::summarize() {
  result.stopped_by_signal = stop_signal;
  result.nonfinite_steps = judge.skipped_steps();
  if (stop_signal != 0 && options.out) *options.out << stopped_line(options, result, stop_signal, end_step) << "\n" << std::flush;
  result.steps = board ? board->records() : std::vector<StepRecord>{};
  if (!result.steps.empty()) result.final_loss = result.steps.back().loss;
  if (eval_tokens > 0) result.eval_loss = eval_sum / double(eval_tokens);
  result.param_checksum = checksum.load();
  double square_sum = 0.0;
  for (const double part : square_sums) square_sum += part;
  result.param_norm = std::sqrt(square_sum);
  const double tokens = double(shape.global_tokens_per_step) * double(end_step - start_step);
  result.tokens_per_s = result.train_seconds > 0 ? tokens / result.train_seconds : 0.0;
  result.model_tflops = lm::tflops(tokens * double(model_flops_per_token), result.train_seconds);
  return result;
}

// The saver's last word: a failed final save fails the run (naming the last good
// checkpoint) unless strata.checkpoint.on_save_failure is continue.
Status finish_saving(const TrainerOptions& options, CheckpointSaver& saver, Status status, TrainerResult& result) {
  Status saved = saver.finish();
  if (!saved.ok() && status.ok()) {
    if (options.config.strata.on_save_failure == SaveFailurePolicy::kContinue)
      STRATA_LOG(kWarn) << saved.to_string() << "\n  (strata.checkpoint.on_save_failure=continue: the run still succeeds)";
    else
      status = std::move(saved).with_context("the last good checkpoint is " + (saver.last_committed_step() >= 0
                                                                                    ? checkpoint_path(options.save_dir, saver.last_committed_step())
                                                                                    : std::string("none")));
  }
  if (saver.last_committed_step() >= 0) result.last_checkpoint = checkpoint_path(options.save_dir, saver.last_committed_step());
  return status;
}

// One rank's part of the run: its engine and model, its data, the steps, then the weights'
// checksum, the export and the final evaluation.
class RankRun {
 public:
  RankRun(SharedRun& run, int rank) : run_(run), rank_(rank) {}
  Status run();

 private:
  Status start_engine();
  Status announce();
  Status open_loaders();
  Status restore();
  Status evaluate_windows_only();
  Status train();
  // One step; sets `stop` when the ranks agreed to stop after it.
  Status train_step(int64_t s, bool* stop);
  Status save(int64_t steps_done, bool loss_finite);
  Status submit_trainer_state(int64_t steps_done, bool loss_finite);
  Status settle_state();
  Status add_checksum();
  Status export_weights();
  Status evaluate_after_training();
  Status gather_evaluation();
  void report();
  // Process ranks: a start-up check that fails (pinned budget, NVMe room) names the node,
  // so that a multi-node job's error points at the machine and the path.
  Status on_node(Status status) const;

  SharedRun& run_;
  const int rank_;
  EngineOptions engine_options_;
  lm::ModelRunOptions model_options_;
  lm::ActivationPlan activations_;
  std::unique_ptr<Engine> engine_;
  std::unique_ptr<lm::CausalLm> model_;  // after engine_: destroyed first
  std::optional<LrSchedule> schedule_;
  std::optional<DataLoader> loader_;
  std::vector<int32_t> inputs_, targets_, positions_;  // one micro-batch of training tokens
  std::optional<DataLoader> eval_loader_;
  std::vector<int32_t> eval_inputs_, eval_targets_, eval_positions_;
  TokenBatch eval_batch_;
  uint64_t nvme_read_ = 0, nvme_written_ = 0;  // the engine's totals at the last step
  int64_t last_saved_ = -1;
  bool last_loss_finite_ = true;
  double train_seconds_ = 0.0;
};

Status RankRun::run() {
  const TrainerOptions& options = run_.options;
  STRATA_RETURN_IF_ERROR(start_engine());
  STRATA_RETURN_IF_ERROR(announce());
  STRATA_RETURN_IF_ERROR(run_.sync.arrive_and_wait());  // the board exists
  STRATA_RETURN_IF_ERROR(open_loaders());
  STRATA_RETURN_IF_ERROR(restore());
  if (options.eval_only) STRATA_RETURN_IF_ERROR(evaluate_windows_only());
  STRATA_RETURN_IF_ERROR(train());
  STRATA_RETURN_IF_ERROR(run_.sync.arrive_and_wait());  // rank 0 has set end_step
  if (run_.saver && run_.end_step > run_.start_step && last_saved_ != run_.end_step)
    STRATA_RETURN_IF_ERROR(save(run_.end_step, last_loss_finite_));
  STRATA_RETURN_IF_ERROR(add_checksum());
  if (!options.export_dir.empty() && run_.stop_signal == 0) STRATA_RETURN_IF_ERROR(export_weights());
  if (eval_loader_ && run_.stop_signal == 0) STRATA_RETURN_IF_ERROR(evaluate_after_training());
  STRATA_RETURN_IF_ERROR(engine_->finish());
  model_.reset();
  if (run_.processes != nullptr && (options.eval_only || eval_loader_)) STRATA_RETURN_IF_ERROR(gather_evaluation());
  report();
  return {};
}

Status RankRun::on_node(Status status) const {
  const TrainerOptions& options = run_.options;
  if (status.ok() || !options.process_group) return status;
  char host[256] = {};
  if (::gethostname(host, sizeof(host) - 1) != 0) std::snprintf(host, sizeof(host), "?");
  return std::move(status).with_context("start-up checks of rank " + std::to_string(rank_) + " on node " +
                                        std::to_string(options.process_group->node_rank) + " (host " + host + ", nvme_path " +
                                        engine_options_.nvme_path + "), before step 1");
}

Status RankRun::start_engine() {
  STRATA_ASSIGN_OR_RETURN(engine_options_, engine_options_from_config(run_.options.config, rank_));
  model_options_ = run_.model_options;
  model_options_.param_dtype = engine_options_.param_dtype;
  STRATA_ASSIGN_OR_RETURN(activations_, run_.model.plan_activations(model_options_, run_.shape.device_kind));
  engine_options_.activation_bytes = activations_.device_bytes;
  StatusOr<std::unique_ptr<Engine>> created = Engine::create(engine_options_, run_.cluster.device(rank_), run_.cluster.gather_communicator(rank_),
                                                             run_.cluster.reduce_communicator(rank_));
  if (!created.ok()) return on_node(created.status());
  engine_ = std::move(created).value();
  STRATA_ASSIGN_OR_RETURN(model_, run_.model.create(*engine_, model_options_));
  // A fine-tune's load writes every group (the Hugging Face loader refuses a file that
  // leaves any engine tensor out), so start() writes no random initial values it would
  // overwrite (a 1B model on NVMe: ~19 GB of writes).
  const lm::WeightSource* init_weights = run_.sources.init_weights.get();
  if (!run_.sources.resume && init_weights != nullptr)
    for (int g = 0; g < engine_->group_count(); ++g) STRATA_RETURN_IF_ERROR(engine_->declare_loaded(g));
  STRATA_RETURN_IF_ERROR(on_node(engine_->start()));
  if (rank_ == 0 && init_weights != nullptr && !run_.sources.resume)
    STRATA_LOG(kInfo) << "initial values drawn for " << engine_->initialized_group_count() << " of " << engine_->group_count()
                      << " groups; the others come from " << init_weights->describe();
  return model_->allocate();
}

// The plan's bytes into the result; process ranks gather every node's start-up summary;
// rank 0 makes the step board and prints the start-up text.
Status RankRun::announce() {
  const EnginePlan& plan = engine_->plan();
  {
    std::lock_guard<std::mutex> lock(run_.mutex);
    run_.result.pinned_bytes += plan.pinned_bytes;
    run_.result.host_bytes += plan.host_bytes;
    run_.result.nvme_file_bytes += plan.nvme_bytes;
  }
  std::string nodes_text;
  if (run_.processes != nullptr) {
    STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> startups,
                            run_.processes->all_gather_strings(node_startup_json(*run_.options.process_group, plan, engine_options_).dump()));
    if (rank_ == 0) {
      STRATA_ASSIGN_OR_RETURN(nodes_text, node_summary_text(startups));
    }
  }
  if (rank_ != 0) return {};
  const TrainerOptions& options = run_.options;
  const RunShape& shape = run_.shape;
  std::lock_guard<std::mutex> lock(run_.mutex);
  const double step_flops = double(run_.model_flops_per_token) * double(shape.global_tokens_per_step);
  run_.board = std::make_unique<StepBoard>(options, shape.world, shape.total_steps, step_flops,
                                           traffic_note(options, engine_options_, model_options_, activations_));
  run_.result.state_bytes = plan.state_bytes;
  run_.result.device_budget_bytes = plan.device_budget_bytes;
  run_.result.activation_bytes = activations_.device_bytes;
  if (options.out) {
    *options.out << "model: " << run_.model.family() << ", " << run_.model.describe() << "\n"
                 << "data: " << run_.sources.dataset->describe() << "; " << shape.world << " rank(s) x " << shape.micro << " sequence(s) x "
                 << shape.seq_len << " tokens x " << shape.accumulation << " micro-batch(es) = " << shape.global_tokens_per_step
                 << " tokens per step\n"
                 << plan.text << "\n"
                 << nodes_text << activations_.text << "activation checkpointing: " << activation_checkpointing_name(options.checkpointing)
                 << "\n"
                 << std::flush;
  }
  return {};
}

// The schedule, the training loader and, with an evaluation batch, its (fixed) batch.
Status RankRun::open_loaders() {
  const RunShape& shape = run_.shape;
  const StrataConfig& config = run_.options.config;
  STRATA_ASSIGN_OR_RETURN(LrSchedule schedule, LrSchedule::create(config.scheduler, config.optimizer.lr));
  schedule_.emplace(std::move(schedule));
  DataLoaderOptions loader_options;
  loader_options.global_batch = shape.micro * shape.world;
  loader_options.seq_len = shape.seq_len;
  loader_options.micro_batches = shape.accumulation;
  loader_options.rank = rank_;
  loader_options.world_size = shape.world;
  loader_options.seed = run_.options.data_seed;
  loader_options.split = DataSplit::kTrain;
  STRATA_ASSIGN_OR_RETURN(DataLoader loader, DataLoader::create(run_.sources.dataset, loader_options));
  loader_.emplace(std::move(loader));
  inputs_.resize(loader_->batch_elements());
  targets_.resize(loader_->batch_elements());
  positions_.resize(loader_->batch_elements());
  if (run_.sources.eval_sequences > 0) {
    DataLoaderOptions eval_options = loader_options;
    eval_options.global_batch = run_.sources.eval_sequences;
    eval_options.micro_batches = 1;
    eval_options.split = DataSplit::kEval;
    STRATA_ASSIGN_OR_RETURN(DataLoader eval, DataLoader::create(run_.sources.dataset, eval_options));
    eval_inputs_.resize(eval.batch_elements());
    eval_targets_.resize(eval.batch_elements());
    eval_positions_.resize(eval.batch_elements());
    STRATA_RETURN_IF_ERROR(eval.batch_at(0, eval_inputs_, eval_targets_, eval_positions_));
    eval_loader_.emplace(std::move(eval));
  }
  eval_batch_ = TokenBatch{eval_inputs_.data(), eval_targets_.data(), model_options_.eval_batch, eval_positions_.data()};
  return {};
}

// The starting point: the checkpoint resumed from (state, schedule, data position), or the
// weights fine-tuned from, or the engine's own initial values.
Status RankRun::restore() {
  const RunSources& sources = run_.sources;
  if (sources.resume) {
    STRATA_RETURN_IF_ERROR(load_engine_state(*engine_, rank_, *sources.resume)
                               .with_context("resuming from " + sources.resume->path() +
                                             " (when the groups differ: checkpoints saved before wte/embed_tokens were split into "
                                             "vocabulary-chunk groups padded to a multiple of 128 rows do not resume; export the "
                                             "weights with the build that saved them and start from the export with --model or --init-from)"));
    STRATA_RETURN_IF_ERROR(schedule_->restore_json(sources.trainer_state.value("schedule", nlohmann::json()).dump()));
    return loader_->restore_json(sources.trainer_state.value("data", nlohmann::json()).dump());
  }
  if (!sources.init_weights) return {};
  const auto load_begin = std::chrono::steady_clock::now();
  STRATA_RETURN_IF_ERROR(run_.model.load_weights(*engine_, rank_, *sources.init_weights));
  if (rank_ == 0)
    STRATA_LOG(kInfo) << "loaded " << sources.init_weights->describe() << " into rank 0's shards in "
                      << std::chrono::duration<double>(std::chrono::steady_clock::now() - load_begin).count() << " s";
  return {};
}

Status RankRun::evaluate_windows_only() {
  const RunShape& shape = run_.shape;
  STRATA_ASSIGN_OR_RETURN(const MicroBatchLosses windows,
                          evaluate_windows(*engine_, *model_, run_.model, *run_.sources.dataset,
                                           {rank_, shape.world, shape.micro, shape.seq_len, run_.options.eval_sequences}));
  std::lock_guard<std::mutex> lock(run_.mutex);
  run_.eval_sum += windows.eval_loss_sum;
  run_.eval_tokens += windows.eval_tokens;
  return {};
}

// read_state_shard() waits for a group's update but, with optimizer state on NVMe, not for
// its write-back (the engine marks the group updated when the write is submitted), so a
// read can meet an extent still being written. finish() waits for the write-backs.
Status RankRun::settle_state() {
  if (engine_options_.optimizer_tier != Tier::kNvme) return {};
  return engine_->finish();
}

Status RankRun::submit_trainer_state(int64_t steps_done, bool loss_finite) {
  loader_->set_position(static_cast<uint64_t>(steps_done) * static_cast<uint64_t>(run_.shape.accumulation));
  nlohmann::json state = {{"format", "strata-gpt-trainer/1"},
                          {"step", steps_done},
                          {"model", nlohmann::json::parse(run_.model.model_json())},
                          {"schedule", nlohmann::json::parse(schedule_->state_json())},
                          {"data", nlohmann::json::parse(loader_->state_json())},
                          {"world_size", run_.shape.world},
                          {"data_seed", run_.options.data_seed},
                          {"loss_finite", loss_finite}};  // the loss scaler is in the manifest
  return run_.saver->submit_trainer_state(steps_done, state.dump());
}

Status RankRun::save(int64_t steps_done, bool loss_finite) {
  STRATA_RETURN_IF_ERROR(settle_state());
  STRATA_ASSIGN_OR_RETURN(RankSnapshot snapshot, snapshot_engine_state(*engine_, rank_));
  STRATA_RETURN_IF_ERROR(run_.saver->submit(steps_done, std::move(snapshot)));
  if (rank_ == 0) STRATA_RETURN_IF_ERROR(submit_trainer_state(steps_done, loss_finite));
  if (run_.processes == nullptr) return {};
  // Process ranks: every process's shards are durable, then rank 0 commits with their records.
  STRATA_ASSIGN_OR_RETURN(const std::string mine, run_.saver->local_files(steps_done));
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> all, run_.processes->all_gather_strings(mine));
  if (rank_ == 0) STRATA_RETURN_IF_ERROR(run_.saver->add_peer_files(steps_done, all));
  return {};
}

Status RankRun::train() {
  const auto train_begin = std::chrono::steady_clock::now();
  for (int64_t s = run_.start_step; s < run_.shape.total_steps; ++s) {
    bool stop = false;
    STRATA_RETURN_IF_ERROR(train_step(s, &stop));
    if (stop) break;
  }
  train_seconds_ = std::chrono::duration<double>(std::chrono::steady_clock::now() - train_begin).count();
  return {};
}

Status RankRun::train_step(int64_t s, bool* stop) {
  const TrainerOptions& options = run_.options;
  const RunShape& shape = run_.shape;
  const double lr = schedule_->current_lr();
  STRATA_RETURN_IF_ERROR(engine_->begin_step(lr));
  const bool evaluate = eval_loader_ && options.eval_every > 0 && run_.model.evaluates_while_training() && s % options.eval_every == 0;
  // The step's micro-batches are enqueued back to back; their losses are read after the
  // last (each waits for its own head only), so the device never drains between them.
  const float loss_scale_base = 1.0f / static_cast<float>(shape.global_tokens_per_step);
  std::vector<QueuedMicroBatch> queued;
  for (int m = 0; m < shape.accumulation; ++m) {
    if (m > 0) STRATA_RETURN_IF_ERROR(engine_->begin_micro_batch());
    STRATA_RETURN_IF_ERROR(loader_->batch(s, m, inputs_, targets_, positions_));
    const TokenBatch train{inputs_.data(), targets_.data(), shape.micro, positions_.data()};
    const bool with_eval = evaluate && m == 0;
    STRATA_ASSIGN_OR_RETURN(QueuedMicroBatch q,
                            model_->queue_micro_batch(&train, with_eval ? &eval_batch_ : nullptr, engine_->loss_scale() * loss_scale_base));
    queued.push_back(q);
  }
  RankStep numbers;
  for (const QueuedMicroBatch& q : queued) {
    STRATA_ASSIGN_OR_RETURN(MicroBatchLosses losses, model_->collect(q));
    numbers.loss_sum += losses.train_loss_sum;
    numbers.tokens += losses.train_tokens;
    if (q.eval_loss.serial != 0) {
      numbers.evaluated = true;
      numbers.eval_sum = losses.eval_loss_sum;
      numbers.eval_tokens = losses.eval_tokens;
    }
  }
  const double local_loss = numbers.tokens > 0 ? numbers.loss_sum / double(numbers.tokens) : 0.0;
  STRATA_ASSIGN_OR_RETURN(StepReport report, engine_->step(local_loss));
  if (!report.skipped) schedule_->step();
  numbers.report = report;
  numbers.nvme_read_delta = report.nvme_bytes_read - nvme_read_;
  numbers.nvme_written_delta = report.nvme_bytes_written - nvme_written_;
  nvme_read_ = report.nvme_bytes_read;
  nvme_written_ = report.nvme_bytes_written;
  STRATA_ASSIGN_OR_RETURN(const StepOutcome outcome, run_.agreement.agree(s, rank_, numbers, lr, run_.board.get(), run_.judge));
  STRATA_RETURN_IF_ERROR(outcome.stop);
  last_loss_finite_ = !outcome.non_finite;
  if (run_.saver && options.save_every > 0 && (s + 1) % options.save_every == 0) {
    STRATA_RETURN_IF_ERROR(save(s + 1, last_loss_finite_));
    last_saved_ = s + 1;
  }
  if (outcome.stop_signal == 0) return {};
  if (rank_ == 0 || run_.processes != nullptr) {  // every process keeps its own
    std::lock_guard<std::mutex> lock(run_.mutex);
    run_.end_step = s + 1;
    run_.stop_signal = outcome.stop_signal;
  }
  *stop = true;
  return {};
}

// The weights' checksum and sum of squares, from this rank's master shards (process ranks:
// every process's parts, so that each reports the whole).
Status RankRun::add_checksum() {
  STRATA_RETURN_IF_ERROR(settle_state());
  uint64_t part = 0;
  double square_sum = 0.0;  // this rank's shards; padding is zero
  std::vector<float> shard;
  for (int g = 0; g < engine_->group_count(); ++g) {
    const GroupLayout& layout = engine_->layout(g);
    shard.resize(layout.shard_numel);
    STRATA_RETURN_IF_ERROR(engine_->read_state_shard(g, Engine::StateKind::kMaster, shard));
    part += master_checksum_part(layout, rank_, shard);
    for (const float w : shard) square_sum += double(w) * double(w);
  }
  if (run_.processes == nullptr) {
    run_.square_sums[static_cast<size_t>(rank_)] = square_sum;
    run_.checksum.fetch_add(part);
    return {};
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> parts,
                          run_.processes->all_gather_strings(nlohmann::json{{"checksum", part}, {"square_sum", square_sum}}.dump()));
  part = 0;
  for (size_t r = 0; r < parts.size(); ++r) {
    const nlohmann::json j = nlohmann::json::parse(parts[r], nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("checksum") || !j.contains("square_sum"))
      return DataLossError("rank " + std::to_string(r) + " sent a weight checksum that is not JSON: " + parts[r]);
    part += j["checksum"].get<uint64_t>();
    run_.square_sums[r] = j["square_sum"].get<double>();
  }
  run_.checksum.fetch_add(part);
  return {};
}

// Export: every rank puts its shard of a group into one host buffer, rank 0 writes it.
Status RankRun::export_weights() {
  const TrainerOptions& options = run_.options;
  std::vector<float> shard;
  auto contribute = [&](int g) -> Status {
    const GroupLayout& layout = engine_->layout(g);
    shard.resize(layout.shard_numel);
    STRATA_RETURN_IF_ERROR(engine_->read_state_shard(g, Engine::StateKind::kMaster, shard));
    const size_t begin = layout.shard_begin(rank_);
    const size_t count = begin < layout.numel ? std::min(layout.shard_numel, layout.numel - begin) : 0;
    std::copy(shard.begin(), shard.begin() + static_cast<std::ptrdiff_t>(count), run_.exchange.begin() + static_cast<std::ptrdiff_t>(begin));
    return run_.sync.arrive_and_wait();  // every part is in
  };
  if (rank_ != 0) {
    STRATA_ASSIGN_OR_RETURN(const std::vector<int> order, run_.model.export_group_order());
    for (int g : order) {
      STRATA_RETURN_IF_ERROR(contribute(g));
      STRATA_RETURN_IF_ERROR(run_.sync.arrive_and_wait());
    }
    return {};
  }
  const lm::WeightSource* init_weights = run_.sources.init_weights.get();
  lm::ExportSettings settings;
  settings.dtype = options.export_dtype.value_or(init_weights != nullptr ? init_weights->stored_dtype() : DType::kFloat32);
  settings.shard_bytes = options.export_shard_bytes;
  settings.metadata["strata_model"] = run_.model.model_json();
  settings.metadata["strata_steps"] = std::to_string(run_.shape.total_steps);
  // Tokenizer files beside the starting weights travel with the export.
  if (!options.init_from.empty())
    settings.source_dir = std::filesystem::is_directory(options.init_from) ? options.init_from
                                                                           : std::filesystem::path(options.init_from).parent_path().string();
  STRATA_RETURN_IF_ERROR(run_.model.export_weights(
      options.export_dir,
      [&](int g, std::span<float> out) -> Status {
        STRATA_RETURN_IF_ERROR(contribute(g));
        std::copy(run_.exchange.begin(), run_.exchange.begin() + static_cast<std::ptrdiff_t>(out.size()), out.begin());
        return run_.sync.arrive_and_wait();  // the buffer may be reused
      },
      settings));
  STRATA_LOG(kInfo) << "exported " << options.export_dir;
  return {};
}

// Evaluation after the last step: a forward-only pass with the final weights.
Status RankRun::evaluate_after_training() {
  STRATA_RETURN_IF_ERROR(engine_->begin_forward(run_.model.forward_order()));
  STRATA_ASSIGN_OR_RETURN(MicroBatchLosses eval_losses, model_->run_micro_batch(nullptr, &eval_batch_, 0.0f));
  STRATA_RETURN_IF_ERROR(engine_->end_forward());
  std::lock_guard<std::mutex> lock(run_.mutex);
  run_.eval_sum += eval_losses.eval_loss_sum;
  run_.eval_tokens += eval_losses.eval_tokens;
  return {};
}

// Process ranks: the evaluation sums over every process's rows, in rank order.
Status RankRun::gather_evaluation() {
  double sum = 0.0;
  int64_t tokens = 0;
  {
    std::lock_guard<std::mutex> lock(run_.mutex);
    sum = run_.eval_sum;
    tokens = run_.eval_tokens;
  }
  STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> sums,
                          run_.processes->all_gather_strings(nlohmann::json{{"sum", sum}, {"tokens", tokens}}.dump()));
  sum = 0.0;
  tokens = 0;
  for (const std::string& text : sums) {
    const nlohmann::json j = nlohmann::json::parse(text, nullptr, /*allow_exceptions=*/false);
    if (!j.is_object() || !j.contains("sum")) return DataLossError("a process sent evaluation sums that are not JSON: " + text);
    sum += j["sum"].get<double>();
    tokens += j["tokens"].get<int64_t>();
  }
  std::lock_guard<std::mutex> lock(run_.mutex);
  run_.eval_sum = sum;
  run_.eval_tokens = tokens;
  return {};
}

void RankRun::report() {
  std::lock_guard<std::mutex> lock(run_.mutex);
  TrainerResult& result = run_.result;
  result.device_peak_bytes = std::max(result.device_peak_bytes, run_.cluster.device(rank_).memory_stats().high_water_bytes);
  result.nvme_bytes_read += nvme_read_;
  result.nvme_bytes_written += nvme_written_;
  if (rank_ == 0) result.train_seconds = train_seconds_;
}

}  // namespace

StatusOr<TrainerResult> run_training(const TrainerOptions& options) {
  STRATA_ASSIGN_OR_RETURN(const RunShape shape, run_shape(options));
  STRATA_ASSIGN_OR_RETURN(const RunSources sources, open_sources(options, shape));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<LocalCluster> cluster, make_cluster(options, shape));
  std::unique_ptr<CheckpointSaver> saver;
  if (!options.save_dir.empty()) {
    STRATA_ASSIGN_OR_RETURN(saver, make_saver(options, shape, *cluster));
  }
  SharedRun run(options, shape, sources, *cluster, saver.get());
  STRATA_RETURN_IF_ERROR(run.prepare());
  Status status = cluster->run([&](int rank) -> Status {
    // The rank's engine is gone before the others hear of a failure.
    Status s = RankRun(run, rank).run();
    if (!s.ok()) run.sync.abort("rank " + std::to_string(rank) + ": " + s.message());
    return s;
  });
  if (run.board) run.board->finish_output();
  if (saver) status = finish_saving(options, *saver, std::move(status), run.result);
  STRATA_RETURN_IF_ERROR(status);
  return run.summarize();
}

std::string summary_json(const TrainerResult& r) {
  nlohmann::json j;
  auto optional = [](const std::optional<double>& v) { return v ? nlohmann::json(*v) : nlohmann::json(nullptr); };
  j["final_loss"] = optional(r.final_loss);
  j["eval_loss"] = optional(r.eval_loss);
  j["entropy_floor"] = optional(r.entropy_floor);
  j["vocab_size"] = r.vocab_size;
  j["ln_vocab_size"] = std::log(double(r.vocab_size));
  j["steps"] = r.total_steps;
  j["resumed_from_step"] = r.resumed_from_step;
  j["tokens_per_s"] = r.tokens_per_s;
  j["model_tflops"] = r.model_tflops;
  j["model_flops_per_token"] = r.model_flops_per_token;
  j["train_seconds"] = r.train_seconds;
  j["device_peak_bytes"] = r.device_peak_bytes;
  j["device_budget_bytes"] = r.device_budget_bytes;
  j["state_bytes"] = r.state_bytes;
  j["activation_bytes"] = r.activation_bytes;
  j["pinned_bytes"] = r.pinned_bytes;
  j["host_bytes"] = r.host_bytes;
  j["nvme_file_bytes"] = r.nvme_file_bytes;
  j["nvme_bytes_read"] = r.nvme_bytes_read;
  j["nvme_bytes_written"] = r.nvme_bytes_written;
  j["param_checksum"] = checksum_hex(r.param_checksum);
  j["param_norm"] = r.param_norm;
  j["parameters"] = r.parameters;
  j["world_size"] = r.world_size;
  j["device"] = r.device;
  nlohmann::json losses = nlohmann::json::array();
  for (const auto& s : r.steps) losses.push_back(s.loss);
  j["first_step"] = r.steps.empty() ? r.resumed_from_step : r.steps.front().step;
  j["losses"] = losses;
  if (!r.last_checkpoint.empty()) j["checkpoint"] = r.last_checkpoint;
  if (r.stopped_by_signal != 0) j["stopped_by_signal"] = r.stopped_by_signal;
  if (r.nonfinite_steps != 0) j["nonfinite_steps"] = r.nonfinite_steps;
  return j.dump();
}

}  // namespace strata::train
