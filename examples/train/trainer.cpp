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
#include "examples/train/plan_preview.h"
#include "examples/train/run_setup.h"
#include "examples/train/step_agreement.h"
#include "optim/lr_schedule.h"

namespace strata::train {

using data::DataLoader;
using data::DataLoaderOptions;
using data::DataSplit;
using data::TokenDataset;

namespace {

using namespace internal;

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
  std::vector<GroupLayout> layouts;
  for (int g = 0; g < engine_->group_count(); ++g) layouts.push_back(engine_->layout(g));
  STRATA_ASSIGN_OR_RETURN(const std::optional<profile::StepPrediction> prediction,
                          predict_plan_step(run_.model, engine_options_, plan, layouts, model_options_, options.profile));
  if (prediction) {
    run_.result.predicted_step_seconds = prediction->step_seconds;
    run_.result.predicted_busy = prediction->in_flight;
    engine_->set_trace_prediction({.step_seconds = prediction->step_seconds, .busy_seconds = prediction->in_flight});
  }
  if (options.out) {
    *options.out << "model: " << run_.model.family() << ", " << run_.model.describe() << "\n"
                 << "data: " << run_.sources.dataset->describe() << "; " << shape.world << " rank(s) x " << shape.micro << " sequence(s) x "
                 << shape.seq_len << " tokens x " << shape.accumulation << " micro-batch(es) = " << shape.global_tokens_per_step
                 << " tokens per step\n"
                 << plan.text << "\n"
                 << prediction_text(prediction, options.profile) << "\n"
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
  std::vector<float> chunk;  // a large group's shard streams through it
  for (int g = 0; g < engine_->group_count(); ++g) {
    const GroupLayout& layout = engine_->layout(g);
    for (size_t first = 0; first < layout.shard_numel; first += kStateChunkElements) {
      chunk.resize(std::min(kStateChunkElements, layout.shard_numel - first));
      STRATA_RETURN_IF_ERROR(engine_->read_state_range(g, Engine::StateKind::kMaster, first, chunk));
      part += master_checksum_part(layout, rank_, chunk, first);
      for (const float w : chunk) square_sum += double(w) * double(w);
    }
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

namespace {

nlohmann::json stage_seconds_json(const StageSeconds& seconds) {
  nlohmann::json out = nlohmann::json::object();
  for (size_t s = 0; s < kStageCount; ++s) out[std::string(stage_name(static_cast<Stage>(s)))] = seconds[s];
  return out;
}

// The median step after the first (the first warms up; with one step, that one) and its
// busy seconds per stage, beside the plan's prediction (null without a profile).
void add_step_figures(const TrainerResult& r, nlohmann::json& j) {
  std::vector<const StepRecord*> counted;
  for (size_t i = r.steps.size() > 1 ? 1 : 0; i < r.steps.size(); ++i) counted.push_back(&r.steps[i]);
  std::sort(counted.begin(), counted.end(), [](const StepRecord* a, const StepRecord* b) { return a->seconds < b->seconds; });
  const StepRecord* median = counted.empty() ? nullptr : counted[counted.size() / 2];
  j["step_s"] = median ? nlohmann::json(median->seconds) : nlohmann::json(nullptr);
  j["busy_s"] = median ? stage_seconds_json(median->busy) : nlohmann::json(nullptr);
  j["predicted_step_s"] = r.predicted_step_seconds ? nlohmann::json(*r.predicted_step_seconds) : nlohmann::json(nullptr);
  j["predicted_busy_s"] = r.predicted_busy ? stage_seconds_json(*r.predicted_busy) : nlohmann::json(nullptr);
}

}  // namespace

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
  add_step_figures(r, j);
  return j.dump();
}

}  // namespace strata::train
