// A machine profile: the rates of one machine that a step's stages run at (NVMe read and
// write, host<->device copies, CPU Adam, the device's compute, the communicator), the
// memory it has, and what it is (CPU, ISA, GPU, disk). `strata-bench profile` measures one
// and writes it as JSON; one can also be written by hand from data sheets. The plan's cost
// model reads it to predict each stage's busy time. docs/profile.md describes the format.
//
// Every rate is in units per second (bytes/s, FLOP/s, elements/s), never GB/s, so a cost
// model divides bytes or FLOPs by it without a conversion.
#pragma once

#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/status.h"

namespace strata::profile {

// The file format's name and version, written in "format" and "version".
inline constexpr const char* kMachineProfileFormat = "strata-machine-profile";
inline constexpr int kMachineProfileVersion = 1;

// Where the figures came from.
enum class ProfileSource : uint8_t {
  kMeasured,   // "measured": strata-bench profile on the machine itself
  kDatasheet,  // "datasheet": written by hand from vendors' figures
};

struct HostInfo {
  std::string hostname;
  std::string cpu_model;                     // /proc/cpuinfo's "model name"
  int cores = 0;                             // the cores this process may use
  std::string isa;                           // the CPU Adam ISA: "avx512" | "avx2" | "scalar"
  bool avx512_bf16 = false;                  // AVX512-BF16 conversions present
  std::string gpu;                           // the GPU's description, or "none"
  uint64_t memory_total_bytes = 0;           // MemTotal
  uint64_t memory_available_bytes = 0;       // MemAvailable when profiled
  std::optional<uint64_t> memlock_limit_bytes;  // RLIMIT_MEMLOCK's soft limit; unset = unlimited
};

struct DiskInfo {
  std::string path;          // the NVMe path profiled
  std::string filesystem;    // from statfs, e.g. "ext4", "xfs", "tmpfs"
  std::string block_device;  // the device behind the path (/sys/dev/block), e.g. "nvme0n1p1"; "none" without one
  std::string model;         // the drive's model from /sys, or "unknown"
  std::optional<bool> rotational;  // queue/rotational where /sys says
  uint64_t free_bytes = 0;   // statvfs: bytes available to this user
};

// One NVMe shape: `block_bytes` requests kept `queue_depth` deep, O_DIRECT.
struct NvmeRate {
  uint64_t block_bytes = 0;
  int queue_depth = 0;
  bool checksums = true;        // computed on write and verified on read, as the engine runs
  double read_bytes_per_s = 0;
  double write_bytes_per_s = 0;
  // Reads and writes at once (each direction queue_depth deep, from its own thread): both
  // directions' bytes per second. Unset where not measured; the cost model then times a
  // step's reads and writes one after the other at the rates above.
  std::optional<double> mixed_bytes_per_s;
  // With checksums: XXH64 over blocks of block_bytes not in cache (as a read leaves them), on
  // one host thread. The checksums' share of the host's cores; unset where not measured.
  std::optional<double> checksum_bytes_per_s;
};

// Pinned host memory <-> device memory. On the CPU device both ends are host memory and a
// copy is one memcpy on a stream's worker: `host_copy` is true then.
struct CopyRate {
  bool host_copy = false;
  bool pinned = true;           // the host buffer was page-locked
  double h2d_bytes_per_s = 0;
  double d2h_bytes_per_s = 0;
};

// The fused CPU Adam step (one call per group, fanned out over `threads` workers).
struct AdamRate {
  int threads = 0;
  std::string grad_dtype;       // "fp32" | "bf16" | "fp16"
  std::string param_dtype;      // the parameter copy written: "fp32" | "bf16" | "fp16"
  double elements_per_s = 0;
};

// The gradient path's landing pass on the host (optim/gradient_ops.h), on the executor CPU
// Adam shares with it: in bytes as the cost model counts them. `stats` reads a bf16 shard
// (2 bytes an element: one micro-batch); `accumulate` adds a bf16 shard into an fp32
// accumulator with its statistics (2 read + 4 read + 4 written: micro-batches).
struct LandingRate {
  int threads = 0;
  double stats_bytes_per_s = 0;
  double accumulate_bytes_per_s = 0;
};

// One op of `strata-bench kernels`: FLOP/s for GEMMs and attention, bytes/s for the rest.
struct KernelRate {
  std::string model;            // e.g. "GPT-2 XL"
  std::string op;               // e.g. "matmul fwd c_fc", "attention bwd", "layernorm fwd"
  std::string shape;            // as strata-bench kernels prints it
  std::string kind;             // "gemm" | "attention" | "memory"
  double rate_per_s = 0;        // FLOP/s (gemm, attention) or bytes/s (memory)
};

struct ComputeRate {
  std::string device;           // "cpu" | "cuda"
  std::string dtype;            // the kernels' dtype: "bf16" | "fp32"
  int scale = 1;                // every dimension but head_dim divided by this (1 = full shapes)
  double gemm_flops_per_s = 0;       // the median over the GEMM ops
  double attention_flops_per_s = 0;  // the median over the attention ops
  double memory_bytes_per_s = 0;     // the median over the memory-bound ops
  std::vector<KernelRate> kernels;   // each op (may be empty in a datasheet profile)
  // The CPU device: weight bytes per second its products read from memory beyond their
  // FLOPs when the weights are not in cache, as in a step. Unset: not measured (a GPU, an
  // older profile); the cost model then takes the host copy's rate.
  std::optional<double> weight_stream_bytes_per_s;
};

// The collectives at the profiled world size; without figures, why not.
struct CommunicatorRate {
  int world = 1;
  // The full buffer's bytes (world x shard) per second: a collective over B bytes takes B / rate.
  std::optional<double> all_gather_bytes_per_s;
  std::optional<double> reduce_scatter_bytes_per_s;
  std::string why_none;                              // set exactly when there are no figures
};

struct MachineProfile {
  ProfileSource source = ProfileSource::kMeasured;
  std::string date;             // ISO 8601, UTC
  std::string command;          // the command line that measured it, or "" by hand
  std::string notes;            // assumptions and caveats (a datasheet's sources, a noisy host)
  bool quick = false;           // measured with --quick (smaller sizes, fewer repetitions)
  HostInfo host;
  DiskInfo disk;
  std::vector<NvmeRate> nvme;   // at least one shape
  CopyRate copy;
  std::vector<AdamRate> cpu_adam;  // at least one configuration
  // Unset where not measured (older or hand-written profiles): the cost model then takes
  // twice the copy's D2H rate, which on a GPU is the bus's rate, not the host memory's.
  std::optional<LandingRate> landing;
  ComputeRate compute;
  CommunicatorRate communicator;
};

std::string_view profile_source_name(ProfileSource source);  // "measured" | "datasheet"

// The JSON the file holds (keys in a fixed order).
nlohmann::ordered_json machine_profile_to_json(const MachineProfile& profile);
// Checks every field as the loader does; `origin` names the file in the errors.
Status validate_machine_profile(const MachineProfile& profile, const std::string& origin);
// Writes the profile to `path` through a temporary file and a rename, so a reader never
// sees half a file. Creates the parent folder when it is missing.
Status write_machine_profile(const MachineProfile& profile, const std::string& path);

// Parses and validates: unknown keys are rejected, missing required keys named, rates must
// be positive; every error names the key (as a path, e.g. "nvme[1].read_bytes_per_s") and
// `origin`.
StatusOr<MachineProfile> parse_machine_profile(const std::string& text, const std::string& origin);
StatusOr<MachineProfile> load_machine_profile(const std::string& path);

// Where a profile is kept between runs on this machine:
// $XDG_CACHE_HOME/strata/profile-<hostname>.json, or ~/.cache/strata/profile-<hostname>.json
// without XDG_CACHE_HOME. Fails only when neither XDG_CACHE_HOME nor HOME is set.
StatusOr<std::string> kept_profile_path();
// The kept profile's path when one exists there; nullopt when none was kept.
std::optional<std::string> find_kept_profile();

// The machine profile a run predicts its step with (the trainer, strata-bench step).
struct RunProfile {
  std::optional<MachineProfile> profile;
  std::string origin;    // the file it was read from
  std::string why_none;  // set exactly when there is no profile
};
// `path` (--profile FILE): that file, or an error naming it when it is missing or damaged;
// empty: the profile kept on this host (find_kept_profile), or none. A kept profile that
// does not load is reported (a warning) and not used.
StatusOr<RunProfile> resolve_run_profile(const std::string& path);

}  // namespace strata::profile
