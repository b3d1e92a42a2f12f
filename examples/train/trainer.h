// The training loop behind strata-train (and train_gpt), for any model family: ranks, engine, model, data, learning-rate
// schedule, evaluation, checkpoints, fine-tuning and export, with one progress line per
// step and a summary at the end.
//
// Each rank runs on its own thread (LocalCluster). Per step:
//
//   lr = schedule.current_lr();  engine.begin_step(lr)
//   for each micro-batch m: [begin_micro_batch]; model.run_micro_batch(train batch (step, m),
//                           the evaluation batch when it is due and m == 0, grad_scale)
//   report = engine.step(loss);  schedule.step() unless the update was skipped
//   the ranks agree on the step's outcome: a non-finite loss or gradient norm (not an
//     fp16 overflow) stops the run naming the step, the value and the last good
//     checkpoint, or is skipped while strata.max_nonfinite_steps allows; a checkpoint
//     save that failed (after its retry) stops the run under
//     strata.checkpoint.on_save_failure=stop; a stop request (SIGTERM/SIGINT, through
//     stop_requested) ends the loop after this step
//   every save_every steps: snapshot the rank's state into the checkpoint saver
//
// The save directory is checked and locked before step 1 (CheckpointSaver). A stopped
// run saves a checkpoint of the step it stopped after (when save_dir is set) and skips
// the final evaluation and the export.
//
// An evaluation "at step s" (the weights after s updates) rides along the first forward
// of step s + 1, with the same gathered parameters; the one after the last step is a
// forward-only pass. The evaluation batch is fixed (the eval split's first global batch),
// so evaluations are comparable across the run and across world sizes.
//
// Ranks agree on one progress line per step: each posts its numbers and the last to post
// prints the line (losses are summed over all ranks' tokens, so they are the global means
// and do not depend on the world size).
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "engine/core/config.h"
#include "engine/core/rendezvous.h"
#include "engine/core/status.h"
#include "engine/engine.h"
#include "examples/data/token_data.h"
#include "examples/run_config/run_config.h"
#include "examples/lm/causal_lm.h"
#include "examples/profile/machine_profile.h"

namespace strata::train {

using data::SyntheticLanguageOptions;
using lm::ActivationCheckpointing;
using lm::MicroBatchLosses;
using lm::QueuedMicroBatch;
using lm::TokenBatch;

using profile::RunProfile;

struct TrainerOptions {
  StrataConfig config;  // finalized; device, placement, optimizer, schedule
  DataConfig data;      // strata.data
  int64_t steps = 0;    // strata.steps: optimizer steps to run
  std::shared_ptr<const lm::Architecture> model;  // the resolved architecture (any family)
  ActivationCheckpointing checkpointing = ActivationCheckpointing::kDevice;
  int64_t head_chunk_rows = 0;
  SyntheticLanguageOptions synthetic;  // vocab_size is set from the model
  uint64_t data_seed = 0;
  int64_t eval_sequences = 0;  // over all ranks; 0 = no evaluation
  int64_t eval_every = 0;      // steps between evaluations (0 = only after the last step)
  // No training: the mean next-token loss over the data file's first eval_sequences windows
  // of seq_len T, window i being tokens [i*T, i*T + T] (llm.c's stride: T + 1 tokens, the
  // last only predicted), reported as eval_loss. Deterministic, for comparing with other tools.
  bool eval_only = false;

  std::string save_dir;        // checkpoints (D/step-<N>); empty = none
  int64_t save_every = 0;      // steps between saves; 0 = only at the end (when save_dir is set)
  int keep_checkpoints = 0;    // newest kept; 0 = all
  std::string resume_dir;      // resume from the latest complete checkpoint in it
  std::string init_from;       // weights to start from, in the family's form (open_weights)
  std::string export_dir;      // write the weights in the family's Hugging Face form here at the end
  std::optional<DType> export_dtype;  // unset: the dtype init_from's weights are stored in, else fp32
  uint64_t export_shard_bytes = 0;    // largest export file; 0 = the family's default

  // Polled between steps: a signal number asks the run to stop after the current step
  // (preemption_requested(), installed by the program), 0 to go on. Unset: never stops.
  std::function<int()> stop_requested;

  // Process ranks: this process's place in a multi-process world (LocalCluster's process
  // mode; from LocalCluster::process_group_from_env()). nullopt: config.strata.world_size
  // thread ranks in this process.
  std::optional<RendezvousOptions> process_group;

  // The profile the plan's prediction uses (--profile, else the kept one); none: no prediction.
  RunProfile profile;

  std::ostream* out = nullptr;  // plan and progress lines (nullptr: none)
  bool live_bar = false;        // redraw a progress bar under the lines (a terminal)
};

struct StepRecord {
  int64_t step = 0;              // updates done, including this one (1-based)
  double loss = 0.0;             // mean training loss over every rank's tokens
  std::optional<double> eval_loss;
  int64_t eval_at_step = -1;     // the weights eval_loss was measured on (updates done)
  double learning_rate = 0.0;
  double seconds = 0.0;          // wall time of the step (rank 0's engine report)
  double tokens_per_s = 0.0;
  double model_tflops = 0.0;     // the step's model FLOPs (examples/lm/model_flops.h) / seconds, in 1e12 FLOP/s
  double grad_norm = 0.0;
  size_t device_high_water_bytes = 0;  // max over ranks
  uint64_t nvme_bytes_read = 0;        // all ranks, this step
  uint64_t nvme_bytes_written = 0;
  StageSeconds busy{};                 // rank 0's busy seconds per engine stage
};

struct TrainerResult {
  std::vector<StepRecord> steps;  // the steps this run made
  int64_t total_steps = 0;
  int64_t resumed_from_step = 0;
  std::optional<double> final_loss;
  std::optional<double> eval_loss;  // after the last step
  std::optional<double> entropy_floor;
  int64_t vocab_size = 0;
  double tokens_per_s = 0.0;        // training tokens of all ranks / training wall time
  double model_tflops = 0.0;        // tokens_per_s x model_flops_per_token / 1e12
  int64_t model_flops_per_token = 0;  // forward + backward, recomputation not counted (examples/lm/model_flops.h)
  double train_seconds = 0.0;
  size_t device_peak_bytes = 0;     // max over ranks, the whole run
  size_t device_budget_bytes = 0;
  size_t state_bytes = 0;
  size_t activation_bytes = 0;      // per rank, declared to the engine
  size_t pinned_bytes = 0;          // the engines' pinned arenas, all ranks
  size_t host_bytes = 0;            // the engines' pageable host memory, all ranks
  size_t nvme_file_bytes = 0;       // the engines' NVMe swap files, all ranks
  uint64_t nvme_bytes_read = 0;     // all ranks, the whole run
  uint64_t nvme_bytes_written = 0;
  uint64_t param_checksum = 0;
  double param_norm = 0.0;          // L2 norm of the fp32 master weights (sum of squares in double, rank order)
  int64_t parameters = 0;
  int world_size = 1;
  std::string device;               // "cpu" | "cuda"
  std::string last_checkpoint;      // the newest checkpoint this run wrote
  int stopped_by_signal = 0;        // the signal that stopped the run early (0: ran every step)
  int64_t nonfinite_steps = 0;      // steps skipped for a non-finite loss or gradient norm
  // Rank 0's predicted step and busy seconds per stage (examples/profile/step_cost.h);
  // unset without a profile.
  std::optional<double> predicted_step_seconds;
  std::optional<StageSeconds> predicted_busy;
};

StatusOr<TrainerResult> run_training(const TrainerOptions& options);

// The one-line JSON summary (the last line train_gpt prints).
std::string summary_json(const TrainerResult& result);

}  // namespace strata::train
