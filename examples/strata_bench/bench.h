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
};
struct StoreBandwidth {
  double write_seconds = 0;  // first submission to last completion
  double read_seconds = 0;
  double write_gbps = 0;     // 1e9 bytes/s
  double read_gbps = 0;
  std::string engine_name;
  std::string file_path;
  bool registered = false;   // the transfers used fixed buffers
};
// The store's bandwidth as `strata-bench nvme` measures it (the data verified after the
// read, outside the timed part). Fails where the file system refuses O_DIRECT.
StatusOr<StoreBandwidth> measure_store_bandwidth(const StoreMeasurement& measurement);

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

// Each subcommand's usage, "usage: strata-bench <subcommand> ...", defined beside it.
extern const char* const kNvmeUsage;
extern const char* const kCopyUsage;
extern const char* const kAdamUsage;
extern const char* const kStepUsage;
extern const char* const kTokenScanUsage;
extern const char* const kKernelsUsage;

// Prints "strata-bench <subcommand>: <status>" to stderr and returns 1 (or 2 for usage errors).
int report_failure(const char* subcommand, const Status& status);

}  // namespace strata::bench
