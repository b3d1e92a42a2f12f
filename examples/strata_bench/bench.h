// strata-bench: the offload benchmark tool. Each subcommand lives in its own file and
// prints a readable table, or with --json exactly one JSON object as the last line of
// stdout (logs go to stderr).
#pragma once

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "examples/flags/flags.h"
#include "offload/io_engine.h"

namespace strata::bench {

// A tiny flag parser: `--name value`, `--name=value` and boolean `--name`, over the
// tokenizer and number parsing train_gpt uses (examples/flags/flags.h).
class Args {
 public:
  // `boolean_flags` take no value. Unknown flags are an error naming the flag and the
  // subcommand's usage.
  static StatusOr<Args> parse(int argc, char** argv, const std::vector<std::string>& value_flags,
                              const std::vector<std::string>& boolean_flags);
  bool has(const std::string& name) const { return values_.count(name) != 0; }
  std::string get(const std::string& name, const std::string& fallback) const;
  StatusOr<int64_t> get_int(const std::string& name, int64_t fallback) const;
  // The value as a T in [min, max], parsed in T (flags::parse_flag_integer).
  template <std::integral T>
  StatusOr<T> get_integer(const std::string& name, T fallback, T min = std::numeric_limits<T>::min(),
                          T max = std::numeric_limits<T>::max()) const {
    auto it = values_.find(name);
    if (it == values_.end()) return fallback;
    return flags::parse_flag_integer<T>(name, it->second, min, max);
  }
  StatusOr<double> get_double(const std::string& name, double fallback) const;
  bool flag(const std::string& name) const { return has(name); }

 private:
  std::map<std::string, std::string> values_;
};

// What measure_store_bandwidth() moves: `bytes` written then read back through an
// NvmeStore under `nvme_path`, O_DIRECT, in `block_bytes` requests kept `queue_depth` deep.
struct StoreMeasurement {
  std::string nvme_path;
  size_t bytes = size_t{1} << 30;
  size_t block_bytes = size_t{1} << 20;
  unsigned queue_depth = 32;
  IoEngineKind engine = IoEngineKind::kIoUring;
  bool checksums = true;         // as in training: computed and verified on the hot path
  bool sqpoll = false;           // an io_uring kernel submission thread
  bool huge_pages = true;        // the data buffer on huge pages where granted
  bool register_buffers = true;  // io_uring fixed buffers where the kernel allows
  // The host memory the data moves through: `bytes` of distinct memory, or a ring of
  // `queue_depth` blocks reused as requests complete (fio's footprint: iodepth x bs, which
  // stays in cache; the engine's NVMe rings do the same).
  enum class Footprint : uint8_t { kWholeSize, kRing } footprint = Footprint::kWholeSize;
  // After the write and read phases, a third: the written data read again while as many
  // bytes are written to a second extent, each direction from its own thread with its own
  // `queue_depth` requests in flight (a training step's traffic: state read and written at once).
  bool mixed = false;
};
struct StoreBandwidth {
  double write_seconds = 0;  // first submission to last completion
  double read_seconds = 0;
  double write_gbps = 0;     // 1e9 bytes/s
  double read_gbps = 0;
  std::string engine_name;
  std::string file_path;
  bool registered = false;   // the transfers used fixed buffers
  double mixed_seconds = 0;  // with `mixed`: both directions' first submission to the last completion
  double mixed_gbps = 0;     // both directions' bytes over mixed_seconds
};
// The store's bandwidth as `strata-bench nvme` measures it (the data verified after the
// read, outside the timed part). Fails where the file system refuses O_DIRECT.
StatusOr<StoreBandwidth> measure_store_bandwidth(const StoreMeasurement& measurement);

// What measure_copy_bandwidth() moves: `bytes` per copy between a device buffer and pinned
// (then pageable) host memory through Device::copy_async, `repetitions` timed copies per
// direction after `warmup` untimed ones. On the CPU device a copy is one host memcpy.
struct CopyMeasurement {
  size_t bytes = size_t{256} << 20;
  DeviceKind device = DeviceKind::kCpu;
  int repetitions = 7;
  int warmup = 1;
};
// One direction's timed copies: the median and the spread, in 1e9 bytes/s.
struct CopySpread {
  double median_gbps = 0;
  double min_gbps = 0;
  double max_gbps = 0;
};
struct CopyBandwidth {
  CopySpread h2d_pinned, d2h_pinned, h2d_pageable, d2h_pageable;
  bool locked = false;         // the pinned arena is page-locked
  std::string pinned_locking;  // how it was locked (pinned_locking_name)
  std::string page_kind;       // its pages, in words
  std::string description;     // the device's
};
// The copy bandwidth as `strata-bench copy` measures it.
StatusOr<CopyBandwidth> measure_copy_bandwidth(const CopyMeasurement& measurement);

// What measure_cpu_adam_rate() runs: the fused CPU Adam step over `params` elements in host
// memory (groups of 8 Mi, as `strata-bench adam` does), fp32 master and moments, on
// `threads` workers (0 = every core), first step checked bit for bit against the reference.
struct AdamMeasurement {
  int64_t params = int64_t{64} << 20;
  int threads = 0;
  DType grad_type = DType::kBFloat16;
  DType param_type = DType::kBFloat16;  // the parameter copy written
  int steps = 9;
  int warmup = 2;
};
struct AdamThroughput {
  double params_per_s = 0;  // over the median step
  int threads = 0;          // the workers that ran
  std::string isa;
};
StatusOr<AdamThroughput> measure_cpu_adam_rate(const AdamMeasurement& measurement);

// What measure_kernel_timings() runs: every op of `strata-bench kernels` at GPT-2 XL,
// Llama-3.2-1B and head_dim-128 attention shapes, every dimension but head_dim divided by
// `scale`, the median of `repetitions` timed runs each.
struct KernelMeasurement {
  DeviceKind device = DeviceKind::kCuda;
  DType dtype = DType::kBFloat16;
  size_t scale = 1;
  int repetitions = 20;
};
struct KernelTiming {
  std::string model;
  std::string op;
  std::string shape;
  double seconds = 0;   // median
  bool flops = true;    // `amount` counts FLOPs (GEMMs, attention), else bytes
  double amount = 0;    // per run
};
struct KernelTimings {
  std::string description;  // the device's
  std::vector<KernelTiming> results;
};
StatusOr<KernelTimings> measure_kernel_timings(const KernelMeasurement& measurement);

// The rate, in weight bytes per second, at which the CPU device's products read weights
// that are not in cache, beyond their FLOPs (bench_kernels.cpp says how it is timed).
StatusOr<double> measure_weight_streaming(int repetitions);

// The NVIDIA H200 (SXM)'s peaks, from its datasheet (NVIDIA H200 Tensor Core GPU), dense:
// the datasheet quotes the tensor-core figures with 2:4 structured sparsity (TF32 989,
// BF16 1979 TFLOPS), which dense GEMMs get half of. Exact fp32 products run on the CUDA
// cores (67 TFLOPS). One table for every subcommand that reports a fraction of peak.
inline constexpr double kH200PeakBytesPerSecond = 4.8e12;  // HBM3e
constexpr double h200_dense_peak_flops(MatmulPrecision precision) {
  switch (precision) {
    case MatmulPrecision::kFp32: return 67e12;
    case MatmulPrecision::kTf32: return 494.5e12;
    case MatmulPrecision::kBf16: return 989e12;
  }
  return 67e12;
}

// Subcommands: each returns the process exit code. main.cpp answers `--help` for all of
// them alike, with the usage below, so none parses --help itself.
int run_nvme(int argc, char** argv);
int run_copy(int argc, char** argv);
int run_adam(int argc, char** argv);
int run_step(int argc, char** argv);
int run_token_scan(int argc, char** argv);
int run_kernels(int argc, char** argv);
int run_profile(int argc, char** argv);

// Each subcommand's usage, "usage: strata-bench <subcommand> ...", defined beside it.
extern const char* const kNvmeUsage;
extern const char* const kCopyUsage;
extern const char* const kAdamUsage;
extern const char* const kStepUsage;
extern const char* const kTokenScanUsage;
extern const char* const kKernelsUsage;
extern const char* const kProfileUsage;

// Prints "strata-bench <subcommand>: <status>" to stderr and returns 1 (or 2 for usage errors).
int report_failure(const char* subcommand, const Status& status);

}  // namespace strata::bench
