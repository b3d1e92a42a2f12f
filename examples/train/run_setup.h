// What the trainer (examples/train/trainer.h) sets up before its ranks start and settles
// after they end: the run's shape, its data and starting weights, the cluster, the
// checkpoint saver, the state every rank shares, --eval-only's windows, and the node
// lines of a multi-process run. Internal to examples/train.
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/engine_plan.h"
#include "engine/local_cluster.h"
#include "examples/train/step_agreement.h"
#include "examples/train/trainer.h"

namespace strata::train {
namespace internal {

// --eval-only needs a file with the windows it names: count windows of T + 1 tokens, T apart.
Status check_eval_windows(const TokenDataset& data, int64_t count, int64_t seq_len);

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
                                            const TokenDataset& data, const WindowPlan& plan);

// Tests only (tests/examples/kill_resume_test.cpp): STRATA_TEST_CHECKPOINT_PAUSE_MS=N makes
// the saver announce each point of a save on stderr ("strata-test: checkpoint <point> step
// <S>") and pause there N ms, so a test can SIGKILL the process inside a save. Unset (the
// normal case): no hook.
std::function<Status(std::string_view, int64_t)> checkpoint_pause_hook_from_env();

// Process ranks: what this process planned and what its node has, for rank 0's summary of
// every node (the per-rank checks ran in Engine::create; this shows them side by side).
nlohmann::json node_startup_json(const RendezvousOptions& process, const EnginePlan& plan, const EngineOptions& engine_options);

// Rank 0's summary: one line per node (its host, ranks, pinned planned / host memory
// available, NVMe planned / free under its nvme_path after its files were made).
StatusOr<std::string> node_summary_text(const std::vector<std::string>& gathered);

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

StatusOr<RunShape> run_shape(const TrainerOptions& options);

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
int64_t evaluation_sequences(const TrainerOptions& options, const RunShape& shape);

// --resume: the newest complete checkpoint under `directory`, and its trainer state, which
// must be train_gpt's and hold the same model.
Status open_resume(const std::string& directory, const lm::Architecture& model, RunSources& sources);

StatusOr<RunSources> open_sources(const TrainerOptions& options, const RunShape& shape);

StatusOr<std::unique_ptr<LocalCluster>> make_cluster(const TrainerOptions& options, const RunShape& shape);

StatusOr<std::unique_ptr<CheckpointSaver>> make_saver(const TrainerOptions& options, const RunShape& shape, const LocalCluster& cluster);

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

// The saver's last word: a failed final save fails the run (naming the last good
// checkpoint) unless strata.checkpoint.on_save_failure is continue.
Status finish_saving(const TrainerOptions& options, CheckpointSaver& saver, Status status, TrainerResult& result);

}  // namespace internal
}  // namespace strata::train
