// The engine as the Python front end drives it: one rank of one process, built from a
// DeepSpeed-vocabulary config, with the groups the front end found in a PyTorch model.
//
// A Session owns everything a rank needs (its LocalCluster — device and communicators —,
// the Engine, the learning-rate schedule and the checkpoint saver) and speaks in plain
// C++ types: the binding (module.cpp) turns its Status into Python exceptions and its
// memory into DLPack tensors (tensor_bridge.h). It holds no Python objects, so it is
// testable and usable without an interpreter.
//
// Life of a session:
//   Session::create(config)  ->  register_group() per group  ->  start()
//   ->  use_caller_stream() on CUDA (again whenever the caller's stream changes)
//   ->  write_group() per group (the model's initial values)  ->  refresh()
//   ->  per step: begin_micro_batch() (begin_step at the first), gather/release,
//       gradient_buffer/grads_ready, step()
//   ->  save_checkpoint()/load_checkpoint()/export_hf()/load_hf() between steps
//   ->  close().
//
// More than one process (one rank each): read_group(), save_checkpoint(),
// load_checkpoint() and export_hf() are collective — every rank calls them, with the same
// arguments, in the same order (session_ranks.cpp). Whole groups are all-gathered over the
// engine's gather communicator once the engine is settled (no fetch of its own in flight);
// checkpoints and outcomes travel through the launcher's rendezvous. A failure on one rank
// becomes an error on every rank, naming it, rather than a wait: the collectives' timeout
// (STRATA_COLLECTIVE_TIMEOUT_S) bounds only a rank that is lost or stuck.
#pragma once

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/core/config.h"
#include "engine/core/status.h"
#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "examples/hf/hf_export.h"
#include "examples/hf/hf_weights.h"
#include "examples/run_config/run_config.h"
#include "optim/lr_schedule.h"
#include "python/src/packing.h"
#include "python/src/session_placement.h"
#include "python/src/stream_join.h"

namespace strata::python {

// One parameter of a group as the front end registers it.
struct TensorEntry {
  std::string name;            // the model's qualified parameter name
  std::vector<int64_t> shape;
  bool weight_decay = true;
};

// A device region the binding hands to Python: `numel` elements of `dtype` at `data`, in
// the memory of the session's device (host memory for the CPU device).
struct Region {
  void* data = nullptr;
  size_t numel = 0;
  DType dtype = DType::kFloat32;
  DeviceKind device = DeviceKind::kCpu;
  int ordinal = 0;
};

// One HF tensor of an export or load: checkpoint name <-> engine (group, tensor). An engine
// tensor is the checkpoint tensor whole, or a contiguous row range of it (a piece of a
// vocabulary-sized embedding).
struct HfTensorName {
  std::string name;  // in the checkpoint; empty: not in it (a load keeps the tensor's values; an export skips it)
  int group = 0;
  int tensor = 0;    // index within the group's registration order
  uint64_t element_offset = 0;     // the engine tensor's first element within the checkpoint tensor
  std::vector<int64_t> full_shape; // the checkpoint tensor's shape
};

// strata.placement "auto"'s choice and what was logged of it.
struct ChosenPlacement {
  profile::Placement placement;
  std::string text;  // the choice, its prediction and the runner-up
};

class Session {
 public:
  // `config_text` is JSON in Strata's config vocabulary; `source` names it in messages.
  // The launcher's environment (torchrun, strata-launch, Slurm) makes this process one rank
  // of a multi-process world; without one, a world of one.
  static StatusOr<std::unique_ptr<Session>> create(const std::string& config_text, const std::string& source);
  ~Session();

  int rank() const { return rank_; }
  int world_size() const { return world_size_; }
  DType param_dtype() const { return options_.param_dtype; }
  int gradient_accumulation_steps() const { return options_.gradient_accumulation_steps; }
  const StrataConfig& config() const { return config_; }

  // Before start().
  // A frozen group (trainable false) gets parameter storage and gathers only, in `dtype`
  // (the tensors' own) when that is narrower than param_dtype() (packing.h); a trainable
  // group is stored in param_dtype().
  StatusOr<int> register_group(const std::string& name, const std::vector<TensorEntry>& tensors, bool trainable,
                               DType dtype);
  // Before start(): the most gradient buffers the model keeps between uses of their groups
  // (a group shared by two units keeps its buffer from the first unit's backward to the second's).
  Status declare_held_gradients(int count);
  // Before start(), for strata.placement "auto" (session_placement.h): what a step of the
  // model computes. The search runs in start(), over the groups registered by then.
  void declare_work(const SessionWork& work) { work_ = work; }
  bool placement_auto() const { return placement_ == PlacementMode::kAuto; }
  // After start() with strata.placement "auto": the choice, its prediction and the
  // runner-up (what was logged); empty otherwise.
  const std::string& placement_text() const { return placement_text_; }
  // Plans, checks the budgets and allocates. Every group is declared loaded: the caller
  // writes its values (write_group, or load_hf) before the first step.
  Status start();
  const EnginePlan& plan() const { return engine_->plan(); }
  // The group in its elements (a packed group's logical layout).
  const GroupLayout& layout(int group) const;
  // The dtype of the group's elements: param_dtype(), or a packed group's own.
  DType group_dtype(int group) const;
  int group_count() const { return engine_->group_count(); }

  // The group's full unpadded values as fp32 (layout().numel): this rank keeps its shard.
  Status write_group(int group, std::span<const float> full);
  // After every write_group: the parameter copies from the masters.
  Status refresh() { return engine_->refresh_parameters(); }
  // The group's full unpadded master values as fp32 into `full`. With more than one
  // process, collective: this rank's shard all-gathered with every other rank's.
  Status read_group(int group, std::span<float> full);

  // The device the engine computes on, and where gather() and gradient_buffer() regions live.
  DeviceKind device_kind() const { return cluster_->device(rank_).kind(); }
  int device_ordinal() const { return cluster_->device(rank_).ordinal(); }
  // On a device with streams (CUDA): the caller's current stream, as its native handle
  // (torch.cuda.current_stream().cuda_stream), which the caller's kernels run on. A
  // gathered group or gradient buffer is ready in that stream's order, and release() and
  // grads_ready() wait (on the device, not the host) for the work enqueued on it so far
  // (stream_join.h). Given before the first gather of each pass; an error on the CPU
  // device, where the caller computes on its own thread and gather() waits for the data.
  Status use_caller_stream(uintptr_t native_handle);

  // A step: begin_micro_batch() starts the step at its first micro-batch (with the
  // schedule's rate); the last micro-batch's step() applies the update.
  Status begin_micro_batch();
  bool in_micro_batch() const { return micro_open_; }
  StatusOr<Region> gather(int group);
  Status release(int group);
  // Unzeroed (GradientStart::kUnwritten): the caller writes every element, padding
  // included, before grads_ready().
  StatusOr<Region> gradient_buffer(int group);
  Status grads_ready(int group);
  float loss_scale() const { return engine_->loss_scale(); }
  // Ends the micro-batch; at the accumulation boundary runs the engine's step and returns
  // its report, else nullopt.
  StatusOr<std::optional<StepReport>> end_micro_batch(double loss);
  double learning_rate() const { return schedule_->current_lr(); }
  int64_t steps_taken() const { return engine_->steps_taken(); }

  // Forward-only passes between steps (evaluation, generation).
  Status begin_forward() {
    settled_ = false;  // the pass gathers: the engine's fetches run again
    return engine_->begin_forward();
  }
  Status end_forward() { return engine_->end_forward(); }

  // Checkpoints: D/step-<N> holding the engine's state (every rank's shards) and rank 0's
  // `client_state` (JSON text) beside the schedule's; load returns the client state. With
  // more than one process a save returns once rank 0 has committed the step with every
  // rank's files in; a load reads the checkpoint rank 0 picks (any saved world size).
  Status save_checkpoint(const std::string& dir, const std::string& client_state);
  StatusOr<std::string> load_checkpoint(const std::string& dir);

  // Hugging Face directories: the named tensors out of (export) or into (load) the
  // engine's master weights. `config_json` is written as config.json. With more than one
  // process rank 0 writes the export, and every rank returns once it is complete.
  Status export_hf(const std::string& dir, const std::string& config_json, const std::vector<HfTensorName>& names,
                   const std::string& tokenizer_dir, uint64_t shard_bytes, const std::string& dtype);
  Status load_hf(const std::string& dir, const std::vector<HfTensorName>& names);

  // Waits for all work (the last update included); the session is unusable after. Inside
  // a step the step is abandoned: its micro-batches are dropped and no update runs.
  Status close();
  bool closed() const { return closed_; }

 private:
  Session() = default;
  Status check_open(std::string_view call) const;
  Region region(void* data, size_t numel, DType dtype) const;
  // The joins of the caller's stream with the engine's compute stream (none on the CPU device).
  Status caller_after_engine(std::string_view call);
  Status engine_after_caller(std::string_view call);
  const PackedGroup* packed(int group) const;
  // Rank `rank_`'s shard of the group in elements (layout().shard_numel) <-> its tier.
  Status read_shard(int group, std::span<float> shard);
  Status write_shard(int group, std::span<const float> shard);
  std::vector<GroupLayout> layouts() const;
  // The saver for D (made on the first save to it, or to another directory).
  Status open_saver(const std::string& dir);
  // What trainer_state.json holds: the client state (JSON text, checked) and the schedule's.
  StatusOr<std::string> trainer_state_text(const std::string& client_state) const;
  // The checkpoint a load of `dir` reads: `dir` itself when it is one (D/step-<N>), else
  // D's newest complete one.
  static StatusOr<std::string> checkpoint_to_load(const std::string& dir);
  // Loads the checkpoint at `path` into this rank's engine and the schedule; returns the client state.
  StatusOr<std::string> load_checkpoint_at(const std::string& path);

  // More than one process (session_ranks.cpp).
  // The engine settled for an exchange on its gather communicator: finished (no fetch in
  // flight, none planned until the next micro-batch or forward pass).
  Status settle_for_exchange();
  Status all_gather_group(int group, std::span<float> full);
  Status all_gather_floats(std::span<const float> send, std::span<float> all);
  Status save_across_processes(const std::string& dir, const std::string& client_state);
  StatusOr<std::string> load_across_processes(const std::string& dir);
  Status export_across_processes(const std::string& dir, const nlohmann::json& config, std::span<const GroupLayout> layouts,
                                 const hf::HfNameMap& map, hf::SafetensorsDType dtype, const hf::HfExportOptions& options);
  // Every rank's `mine` (a JSON object), by rank, through the rendezvous.
  StatusOr<std::vector<nlohmann::json>> exchange(const nlohmann::json& mine, std::string_view what);
  // Every rank's outcome of `what`: `mine` when it failed, else the first other rank's failure, else OK.
  Status agree(Status mine, std::string_view what);
  // The same from outcomes already exchanged (status fields of `all`, by rank).
  Status first_failure(const std::vector<nlohmann::json>& all, Status mine, std::string_view what) const;

  Status create_engine();
  // strata.placement "auto": the search (rank 0's, with more than one process), its
  // choice written into the config, and the engine made again with it and the groups
  // registered so far.
  Status place_automatically();
  StatusOr<ChosenPlacement> search_placement();
  // Collective: rank 0 searches and every rank gets its choice, or its error.
  StatusOr<ChosenPlacement> placement_of_rank_0();

  StrataConfig config_;
  EngineOptions options_;
  std::unique_ptr<LocalCluster> cluster_;
  std::unique_ptr<Engine> engine_;
  std::optional<LrSchedule> schedule_;
  std::unique_ptr<CheckpointSaver> saver_;
  // Per registered group: its element shapes when packed (logical layouts made at start()).
  std::vector<std::vector<std::vector<int64_t>>> packed_shapes_;
  std::vector<DType> packed_dtypes_;
  std::vector<std::optional<PackedGroup>> packed_;
  StreamJoin caller_;  // the caller's stream, on a device with streams
  std::unique_ptr<Stream> exchange_stream_;  // all_gather_group's collectives (more than one process)
  bool settled_ = false;       // the engine is finished and nothing was gathered since
  std::vector<GroupSpec> specs_;  // as registered, for an engine made again by the placement search
  int held_gradients_ = -1;       // declared; -1: none
  PlacementMode placement_ = PlacementMode::kConfig;
  std::string profile_path_;      // strata.profile
  std::optional<SessionWork> work_;
  std::string placement_text_;
  int rank_ = 0;
  int world_size_ = 1;
  int micro_ = 0;              // micro-batches finished in the current step
  bool micro_open_ = false;
  bool started_ = false;
  bool closed_ = false;
};

}  // namespace strata::python
