// The JSON config: DeepSpeed's vocabulary where the meaning is the same, Strata's own
// settings under "strata".
//
// Every key falls in one of three kinds (docs/config.md lists them all):
//   - implemented: parsed, validated and stored in StrataConfig;
//   - known to DeepSpeed but without effect in Strata: one WARNING line naming the key
//     and why it does not apply; the value (and anything below it) is not inspected;
//   - unknown or ill-typed: an error naming the full dotted key, the file and what was
//     expected ("did you mean ...?" for a near miss).
// All problems in one file are reported together in one Status.
//
// Use:
//   STRATA_ASSIGN_OR_RETURN(StrataConfig config, load_config_file(path));
//   STRATA_RETURN_IF_ERROR(apply_override(config, "strata.device_budget_mib", "4096"));
//   STRATA_RETURN_IF_ERROR(finalize(config, world_size));   // batch sizes, cross-field checks
//   write to_json(config) next to the checkpoint.
//   engine/engine_config.h maps the finalized config to the engine's EngineOptions.
//
// The schema is a table in config_keys.cpp: adding a key is one line there plus a field
// here and a row in docs/config.md. A layer above the engine adds its own keys to the same
// file through a ConfigExtension (examples/run_config: strata-train's strata.model.*,
// strata.data.* and strata.steps); without one, those keys are unknown keys.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/io_engine_kind.h"
#include "engine/core/overlap_mode.h"
#include "engine/core/scheduler_config.h"
#include "engine/core/status.h"
#include "engine/core/tier_kind.h"

namespace strata {

// What the trainer does when a checkpoint save fails twice (the save and its one retry).
enum class SaveFailurePolicy : uint8_t {
  kStop,      // stop the run with an error (the last good checkpoint stays)
  kContinue,  // warn and keep training; the next save tries again
};
std::string_view save_failure_policy_name(SaveFailurePolicy policy);  // "stop" | "continue"

enum class OptimizerType : uint8_t { kAdam, kAdamW };

std::string_view optimizer_type_name(OptimizerType type);        // "Adam" | "AdamW"

// zero_optimization.offload_param: where the compute-dtype parameter shards live.
struct OffloadParamConfig {
  Tier device = Tier::kDevice;            // "none"/"device" | "cpu" (kPinned or kHost) | "nvme"
  bool pin_memory = true;                 // host memory pinned (true) or pageable; see finalize()
  // NVMe -> host staging buffers for parameter shards (>= 1); unset = the engine's choice
  // (one per gather slot).
  std::optional<int64_t> buffer_count;
};

// zero_optimization.offload_optimizer: where the fp32 master, exp_avg and exp_avg_sq
// shards live. The optimizer math runs on the CPU whenever this is not kDevice.
struct OffloadOptimizerConfig {
  Tier device = Tier::kDevice;
  bool pin_memory = true;
  // Chunks in the ring that streams NVMe optimizer state (>= 3: read ahead, step, write
  // back); unset = the engine's choice.
  std::optional<int64_t> buffer_count;
};

struct ZeroConfig {
  // Strata implements stage 3. 0, 1 and 2 are accepted and run as stage 3 (same
  // results, less memory per rank); finalize() warns once and sets 3.
  int stage = 3;
  OffloadParamConfig offload_param;
  OffloadOptimizerConfig offload_optimizer;
  int64_t prefetch_bucket_size = 50'000'000;        // stage3_prefetch_bucket_size: elements fetched ahead of use
  int64_t max_live_parameters = 1'000'000'000;      // stage3_max_live_parameters: gathered elements resident at once
  int64_t param_persistence_threshold = 100'000;    // groups with at most this many elements stay gathered
  // Elements per reduce-scatter call (a group's gradient goes in pieces of at most this
  // many); unset = a whole group per call.
  std::optional<int64_t> reduce_bucket_size;
  // sub_group_size: elements per chunk of optimizer state streamed from NVMe; unset = the
  // largest chunk the pinned budget allows.
  std::optional<int64_t> sub_group_size;
};

// aio: the NVMe I/O engine.
struct AioConfig {
  int64_t block_size = 1'048'576;  // bytes per I/O request (a multiple of 4096)
  int64_t queue_depth = 8;         // requests kept in flight per ring
};

struct Bf16Config {
  bool enabled = false;
};

// fp16 with loss scaling (DeepSpeed's semantics and defaults).
struct Fp16Config {
  bool enabled = false;
  double loss_scale = 0.0;            // 0 = dynamic loss scaling, otherwise a fixed scale
  int64_t initial_scale_power = 16;   // dynamic: the first scale is 2^initial_scale_power
  int64_t loss_scale_window = 1000;   // dynamic: steps without overflow before the scale doubles
  int64_t hysteresis = 2;             // dynamic: overflows tolerated before the scale halves
  double min_loss_scale = 1.0;        // dynamic: the scale never goes below this
};

struct OptimizerConfig {
  OptimizerType type = OptimizerType::kAdam;
  double lr = 1e-3;
  std::array<double, 2> betas = {0.9, 0.999};
  double eps = 1e-8;
  double weight_decay = 0.0;
  // DeepSpeed: "Adam" applies decoupled (AdamW) weight decay unless adam_w_mode is
  // false; "AdamW" always does. Use decoupled_weight_decay() rather than this field.
  bool adam_w_mode = true;
};
// True when weight decay is decoupled (AdamW), with DeepSpeed's rule above.
bool decoupled_weight_decay(const OptimizerConfig& optimizer);


// The "strata" section.
struct StrataSection {
  std::optional<DeviceKind> device;   // where compute runs; unset = "auto" (see resolve_device)
  int64_t world_size = 1;             // data-parallel ranks
  int64_t device_budget_mib = 0;      // hard cap on device memory per rank; 0 = the device's own limit
  int64_t pinned_budget_mib = 0;      // cap on the engine's host memory per rank (pinned or pageable), MiB; 0 = what the plan needs
  int64_t compute_threads = 0;        // CPU device compute threads; 0 = all hardware threads
  int64_t device_thread_nice = kCpuDeviceThreadNice;// CPU device: the nice value of its threads (the host stages run first)
  MatmulPrecision matmul_precision = MatmulPrecision::kFp32;  // fp32 GEMMs on the GPU: fp32 | tf32 | bf16 (CPU: fp32 only)
  int64_t optimizer_threads = 0;      // CPU Adam threads; 0 = all hardware threads
  OverlapMode optimizer_overlap = OverlapMode::kExact;
  DType grad_wire_dtype = DType::kBFloat16;  // dtype of gradient shards copied device -> host (bf16 | fp32)
  std::optional<DType> param_dtype;   // compute dtype of parameters; unset = from bf16/fp16.enabled
  std::optional<int64_t> prefetch_depth;  // group uses fetched ahead of compute; unset ("auto") = the deepest that fits the budgets
  std::string nvme_path;              // directory of the NVMe tier (also zero_optimization.offload_*.nvme_path)
  bool nvme_checksum = true;          // checksum every NVMe extent, verified on read
  IoEngineKind io_engine = IoEngineKind::kAuto;
  std::string metrics;                // metrics file (JSON lines); empty = none
  std::string trace;                  // trace file (Chrome trace JSON); empty = none
  int64_t seed = 1234;
  SaveFailurePolicy on_save_failure = SaveFailurePolicy::kStop;  // strata.checkpoint.on_save_failure
  int64_t max_nonfinite_steps = 0;    // steps with a non-finite loss or gradient norm skipped before the run stops; 0 = stop at the first
};

struct StrataConfig {
  // DeepSpeed's batch keys. Unset ones are derived by finalize().
  std::optional<int64_t> train_batch_size;
  std::optional<int64_t> train_micro_batch_size_per_gpu;
  std::optional<int64_t> gradient_accumulation_steps;
  ZeroConfig zero;
  AioConfig aio;
  Bf16Config bf16;
  Fp16Config fp16;
  double gradient_clipping = 0.0;  // max global gradient norm; 0 = off
  OptimizerConfig optimizer;
  SchedulerConfig scheduler;
  int64_t steps_per_print = 10;       // the engine logs a progress line every N steps; 0 = never
  bool wall_clock_breakdown = false;  // that progress line carries every stage's busy seconds
  StrataSection strata;

  // Where the config came from ("/path/cfg.json", or "<defaults>"), for messages.
  std::string source = "<defaults>";
  // Keys (canonical dotted paths) that were given explicitly, and where each came from:
  // the file name or "command line". Not written by to_json.
  std::map<std::string, std::string, std::less<>> given;

  bool was_given(std::string_view key) const { return given.find(key) != given.end(); }
};

// Keys a layer above the engine adds to the file, bound to that layer's settings, with its
// cross-field checks (engine/core/config_schema.h builds one). Where a function below takes
// one, its keys are parsed, overridden, suggested, checked, written and described with the
// engine's own and in the same messages; `given` records them too.
struct ConfigExtension;

// Reads and parses a config file (JSON; // and /* */ comments allowed, as DeepSpeed's
// hjson loader does). Errors name the file.
StatusOr<StrataConfig> load_config_file(const std::string& path, const ConfigExtension* extension = nullptr);

// Parses config text; `source_name` is used in every message (usually the file path).
StatusOr<StrataConfig> parse_config_json(std::string_view text, std::string_view source_name,
                                         const ConfigExtension* extension = nullptr);

// Sets one key from text, as a command-line flag does, with the same validation as the
// file: `dotted_key` is any implemented key or alias ("zero_optimization.offload_param.device",
// "strata.nvme_path", ...); `value` is parsed for the key's type (numbers, true/false,
// names; betas as "0.9,0.95"). Apply overrides before finalize().
Status apply_override(StrataConfig& config, std::string_view dotted_key, std::string_view value,
                      const ConfigExtension* extension = nullptr);

// The config key a trainer flag sets, for the flags every program that reads a config shares:
// --device, --world-size, --device-budget-mib, --pinned-budget-mib, --offload-param,
// --offload-optimizer, --nvme-path, --metrics, --trace, --seed, --io-engine,
// --micro-batch, --grad-accum, --batch-size, --lr ... and "--<key>" for any top-level
// key of the strata section (the engine's or the extension's: --steps) with '-' for '_'.
// nullopt for a flag that sets no key.
std::optional<std::string> config_key_for_flag(std::string_view flag, const ConfigExtension* extension = nullptr);

// Use the world size this value to resolve and check the config; 0 means "use
// strata.world_size as configured".
inline constexpr int kConfiguredWorldSize = 0;

// Resolves what depends on the whole config and checks cross-field consistency:
//   - world size: `world_size` > 0 is the number of ranks actually running; it must
//     agree with strata.world_size when that was given explicitly;
//   - batch sizes, with DeepSpeed's rule train_batch_size = micro * accumulation *
//     world_size, deriving whichever are missing (micro defaults to 1 and accumulation
//     to 1 when neither determines them);
//   - precision: fp16 and bf16 not both enabled; strata.param_dtype agrees with them;
//   - NVMe placement requires nvme_path;
//   - host placements: kPinned when both sections' pin_memory are true, else kHost (the
//     engine keeps all host buffers in one arena, pinned or not; one warning when the two
//     disagree);
//   - scheduler parameters belong to the scheduler type; its defaults are filled;
//   - ZeRO stage 0-2 runs as 3 (one warning);
//   - then the extension's own checks, when there is one.
// Idempotent: finalizing a finalized config changes nothing.
Status finalize(StrataConfig& config, int world_size, const ConfigExtension* extension = nullptr);

// The resolved config as JSON in the file's own vocabulary (DeepSpeed keys plus the
// "strata" section, the extension's keys after the engine's), pretty-printed.
// parse_config_json(to_json(c)) gives back c (with the same extension).
std::string to_json(const StrataConfig& config, const ConfigExtension* extension = nullptr);

// The schema, for help text and for the test that keeps docs/config.md complete.
enum class ConfigKeyKind : uint8_t {
  kImplemented,  // parsed and stored
  kAlias,        // another name for an implemented key
  kIgnored,      // a DeepSpeed key without effect in Strata (warned about)
  kRestricted,   // a DeepSpeed key Strata accepts at one value only
};
struct ConfigKeyInfo {
  std::string path;  // dotted, e.g. "zero_optimization.offload_param.device"
  ConfigKeyKind kind;
  std::string note;  // kAlias: the key it stands for; kIgnored/kRestricted: why
};
std::vector<ConfigKeyInfo> describe_config_keys(const ConfigExtension* extension = nullptr);

// strata.device resolved: the configured device, or cuda when a GPU is usable and cpu
// otherwise when it was left at "auto".
DeviceKind resolve_device(const StrataConfig& config);

}  // namespace strata
