// How the trainer's ranks agree on each step (examples/train/trainer.h): a barrier of the
// ranks (threads, or processes through the rendezvous), the board each rank posts its
// numbers on and the last to post prints the progress line from, the judge of a
// non-finite loss or gradient norm, and the line a run stopped by a signal prints.
// Internal to examples/train.
#pragma once

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
#include "examples/train/trainer.h"
#include "optim/lr_schedule.h"

namespace strata::train {

using data::DataLoader;
using data::DataLoaderOptions;
using data::DataSplit;
using data::TokenDataset;

namespace internal {

constexpr size_t kMiB = size_t{1} << 20;

std::string bytes_text(double bytes);

std::string rate_text(double per_second);

// "12.3 TFLOPS", "45.6 GFLOPS" (a tiny model on the CPU), "7.8 MFLOPS".
std::string flops_rate_text(double tflops);

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
    record.busy = lead.busy;
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
std::string step_numbers_text(const RankStep& n);

StatusOr<RankStep> step_numbers_from_text(const std::string& text, int rank);

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
                         const lm::ActivationPlan& activations);

// The line a run stopped by a signal prints: when, and where its checkpoint went.
std::string stopped_line(const TrainerOptions& options, const TrainerResult& result, int stop_signal, int64_t end_step);

}  // namespace internal
}  // namespace strata::train
