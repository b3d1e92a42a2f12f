// strata-bench copy: host<->device copy bandwidth through Device::copy_async, from
// pinned host memory (a PinnedArena buffer, as the offload pipeline uses) and from
// pageable host memory, each the median of several timed copies after a warm-up.
//
//   strata-bench copy [--bytes N] [--device cpu|cuda] [--repetitions R] [--warmup W] [--json]
//
// GB/s is 1e9 bytes per second. On the CPU device both sides are host memory and a copy
// is one memcpy on the stream's worker, so the figures are single-thread memcpy bandwidth.
#include <algorithm>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <memory>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/device.h"
#include "examples/strata_bench/bench.h"
#include "offload/pinned_arena.h"

namespace strata::bench {

const char* const kCopyUsage =
    "usage: strata-bench copy [--bytes N] [--device cpu|cuda] [--repetitions R] [--warmup W] [--json]\n"
    "  --bytes N        bytes per copy (default 268435456)\n"
    "  --device D       where the device buffer lives: cpu (default) or cuda\n"
    "  --repetitions R  timed copies per direction and host memory kind; the median is reported (default 7)\n"
    "  --warmup W       untimed copies before the timed ones (default 1)\n"
    "  --json           print one JSON object as the last line of stdout";

namespace {

struct Config {
  size_t bytes = size_t{256} << 20;
  DeviceKind device = DeviceKind::kCpu;
  int repetitions = 7;
  int warmup = 1;
  bool json = false;
};

StatusOr<Config> parse_config(int argc, char** argv) {
  STRATA_ASSIGN_OR_RETURN(Args args, Args::parse(argc, argv, {"bytes", "device", "repetitions", "warmup"}, {"json"}));
  Config config;
  STRATA_ASSIGN_OR_RETURN(int64_t bytes, args.get_int("bytes", static_cast<int64_t>(config.bytes)));
  if (bytes <= 0) return InvalidArgumentError("--bytes must be positive, got " + std::to_string(bytes));
  config.bytes = static_cast<size_t>(bytes);
  STRATA_ASSIGN_OR_RETURN(config.device, parse_device_kind(args.get("device", "cpu")));
  STRATA_ASSIGN_OR_RETURN(int64_t repetitions, args.get_int("repetitions", config.repetitions));
  if (repetitions < 1 || repetitions > 1000) return InvalidArgumentError("--repetitions must be in 1..1000, got " + std::to_string(repetitions));
  config.repetitions = static_cast<int>(repetitions);
  STRATA_ASSIGN_OR_RETURN(int64_t warmup, args.get_int("warmup", config.warmup));
  if (warmup < 0 || warmup > 1000) return InvalidArgumentError("--warmup must be in 0..1000, got " + std::to_string(warmup));
  config.warmup = static_cast<int>(warmup);
  config.json = args.flag("json");
  return config;
}

// Times `repetitions` copies of `bytes` (each enqueued and waited for on its own) after
// `warmup` untimed ones.
StatusOr<CopySpread> measure(Device& device, Stream& stream, void* dst, const void* src, size_t bytes, CopyKind kind,
                             const CopyMeasurement& config) {
  for (int i = 0; i < config.warmup; ++i) {
    STRATA_RETURN_IF_ERROR(device.copy_async(dst, src, bytes, kind, stream));
    STRATA_RETURN_IF_ERROR(stream.synchronize());
  }
  std::vector<double> gbps;
  gbps.reserve(config.repetitions);
  for (int i = 0; i < config.repetitions; ++i) {
    const auto start = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(device.copy_async(dst, src, bytes, kind, stream));
    STRATA_RETURN_IF_ERROR(stream.synchronize());
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    gbps.push_back(static_cast<double>(bytes) / seconds / 1e9);
  }
  std::sort(gbps.begin(), gbps.end());
  const size_t n = gbps.size();
  CopySpread m;
  m.median_gbps = n % 2 == 1 ? gbps[n / 2] : 0.5 * (gbps[n / 2 - 1] + gbps[n / 2]);
  m.min_gbps = gbps.front();
  m.max_gbps = gbps.back();
  return m;
}

std::string page_kind_text(PinnedPageKind kind) {
  switch (kind) {
    case PinnedPageKind::kSmall: return "4 KiB pages";
    case PinnedPageKind::kTransparent: return "transparent huge pages advised";
    case PinnedPageKind::kHugeTlb: return "2 MiB hugetlb pages";
  }
  return "?";
}

double round3(double value) { return static_cast<double>(static_cast<int64_t>(value * 1000.0 + 0.5)) / 1000.0; }

}  // namespace

StatusOr<CopyBandwidth> measure_copy_bandwidth(const CopyMeasurement& config) {
  std::unique_ptr<Device> device;
  if (config.device == DeviceKind::kCpu) {
    // Room for the one device buffer; the copies use no compute threads.
    STRATA_ASSIGN_OR_RETURN(device, create_cpu_device({.budget_bytes = config.bytes + (size_t{4} << 20), .compute = {.threads = 1}}));
  } else {
    STRATA_ASSIGN_OR_RETURN(device, create_cuda_device({}));
  }
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device->create_stream("copy-bench"));
  STRATA_ASSIGN_OR_RETURN(DeviceBuffer device_buffer, device->allocate(config.bytes, "copy bench device buffer"));

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena, PinnedArena::create({.bytes = config.bytes}));
  STRATA_ASSIGN_OR_RETURN(PinnedBuffer pinned, arena->allocate(config.bytes, "copy bench pinned host buffer"));
  std::vector<uint8_t> pageable(config.bytes);

  // Touch every page once so that no timed copy pays for first-touch faults.
  std::memset(pinned.data(), 0x11, config.bytes);
  std::memset(pageable.data(), 0x22, config.bytes);
  STRATA_RETURN_IF_ERROR(device->memset_async(device_buffer.data(), 0x33, config.bytes, *stream));
  STRATA_RETURN_IF_ERROR(stream->synchronize());

  CopyBandwidth out;
  STRATA_ASSIGN_OR_RETURN(out.h2d_pinned,
                          measure(*device, *stream, device_buffer.data(), pinned.data(), config.bytes, CopyKind::kHostToDevice, config));
  STRATA_ASSIGN_OR_RETURN(out.d2h_pinned,
                          measure(*device, *stream, pinned.data(), device_buffer.data(), config.bytes, CopyKind::kDeviceToHost, config));
  STRATA_ASSIGN_OR_RETURN(out.h2d_pageable, measure(*device, *stream, device_buffer.data(), pageable.data(), config.bytes,
                                                    CopyKind::kHostToDevice, config));
  STRATA_ASSIGN_OR_RETURN(out.d2h_pageable, measure(*device, *stream, pageable.data(), device_buffer.data(), config.bytes,
                                                    CopyKind::kDeviceToHost, config));
  STRATA_RETURN_IF_ERROR(device->synchronize());
  out.locked = arena->locked();
  out.pinned_locking = std::string(pinned_locking_name(arena->locking()));
  out.page_kind = page_kind_text(arena->page_kind());
  out.description = device->description();
  return out;
}

namespace {

Status run(const Config& config) {
  STRATA_ASSIGN_OR_RETURN(const CopyBandwidth measured,
                          measure_copy_bandwidth({.bytes = config.bytes, .device = config.device, .repetitions = config.repetitions,
                                                  .warmup = config.warmup}));
  if (!measured.locked) {
    std::fprintf(stderr, "strata-bench copy: warning: the pinned arena could not be page-locked; its figures are for pageable memory\n");
  }
  const CopySpread& h2d_pinned = measured.h2d_pinned;
  const CopySpread& d2h_pinned = measured.d2h_pinned;
  const CopySpread& h2d_pageable = measured.h2d_pageable;
  const CopySpread& d2h_pageable = measured.d2h_pageable;
  const std::string& locking = measured.pinned_locking;
  if (config.json) {
    const nlohmann::ordered_json result = {
        {"bench", "copy"},
        {"device", std::string(device_kind_name(config.device))},
        {"bytes", config.bytes},
        {"h2d_pinned_gbps", round3(h2d_pinned.median_gbps)},
        {"d2h_pinned_gbps", round3(d2h_pinned.median_gbps)},
        {"h2d_pageable_gbps", round3(h2d_pageable.median_gbps)},
        {"d2h_pageable_gbps", round3(d2h_pageable.median_gbps)},
        {"repetitions", config.repetitions},
        {"warmup", config.warmup},
        {"pinned_locking", locking},
        {"description", measured.description},
    };
    std::printf("%s\n", result.dump().c_str());
  } else {
    std::printf("strata-bench copy: %s\n", measured.description.c_str());
    std::printf("  %zu bytes per copy, median of %d after %d warm-up; GB/s = 1e9 B/s\n", config.bytes, config.repetitions,
                config.warmup);
    std::printf("  pinned host memory: PinnedArena, locking %s, %s\n", locking.c_str(), measured.page_kind.c_str());
    std::printf("  %-16s %-9s %10s %10s %10s\n", "direction", "host", "median", "min", "max");
    auto row = [](const char* direction, const char* host, const CopySpread& m) {
      std::printf("  %-16s %-9s %10.2f %10.2f %10.2f\n", direction, host, m.median_gbps, m.min_gbps, m.max_gbps);
    };
    row("host->device", "pinned", h2d_pinned);
    row("device->host", "pinned", d2h_pinned);
    row("host->device", "pageable", h2d_pageable);
    row("device->host", "pageable", d2h_pageable);
  }
  std::fflush(stdout);
  return {};
}

}  // namespace

int run_copy(int argc, char** argv) {
  auto config = parse_config(argc, argv);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", kCopyUsage);
    return report_failure("copy", config.status());
  }
  const Status status = run(*config);
  if (!status.ok()) return report_failure("copy", status);
  return 0;
}

}  // namespace strata::bench
