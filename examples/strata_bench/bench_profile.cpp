// strata-bench profile: measures this machine's rates, the ones a step's stages run at, with
// the other subcommands' measuring code, and writes them as one machine profile
// (examples/profile/machine_profile.h, docs/profile.md):
//   - NVMe write and read at the engine's shapes (1 MiB QD32, 128 KiB QD8, 4 MiB QD8),
//     O_DIRECT, checksums on, the data through a ring of queue-depth blocks (`nvme`);
//   - pinned host memory to and from the device (`copy`); on the CPU device a host memcpy;
//   - the fused CPU Adam step by thread count, fp32 and bf16 parameters (`adam`);
//   - the gradient path's landing pass (statistics, accumulation into fp32) on CPU Adam's
//     executor at the engine's thread count;
//   - the device's GEMMs, attention and memory-bound ops at the models' shapes (`kernels`);
//   - with --world N, the host communicator's all_gather and reduce_scatter among N thread
//     ranks of the CPU device (else the file says why the communicator was not measured);
//   - the host's free and lockable memory, CPU, ISA, GPU and the disk behind the path.
// The profile goes to --out and to the kept profile of this machine (unless --no-keep).
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <functional>
#include <thread>
#include <string>
#include <vector>

#include "engine/core/host_communicator.h"
#include "examples/profile/host_probe.h"
#include "examples/profile/machine_profile.h"
#include "examples/strata_bench/bench.h"
#include "offload/checksum.h"
#include "optim/cpu_adam.h"
#include "optim/gradient_ops.h"

namespace strata::bench {

const char* const kProfileUsage =
    "usage: strata-bench profile --nvme-path DIR [--device cpu|cuda] [--out FILE.json] [--quick] [--no-keep]\n"
    "                            [--scale S] [--notes TEXT] [--world N]\n"
    "  --nvme-path DIR  where the NVMe tier would live (a file is written and read there)\n"
    "  --device D       cpu (default) or cuda: where copies and kernels are measured\n"
    "  --out FILE.json  write the profile there (also kept for this machine unless --no-keep)\n"
    "  --quick          smaller sizes and fewer repetitions (well under a minute on a small host)\n"
    "  --no-keep        do not write the kept profile ($XDG_CACHE_HOME/strata/profile-<host>.json)\n"
    "  --scale S        the kernels' shapes divided by S (default 1 on cuda; 4 on cpu, 16 with --quick)\n"
    "  --notes TEXT     appended to the profile's notes (e.g. what else ran on the machine)\n"
    "  --world N        also measure the host communicator's all_gather and reduce_scatter among N thread\n"
    "                   ranks of the CPU device (default 1: not measured)";

namespace {

struct Config {
  std::string nvme_path;
  DeviceKind device = DeviceKind::kCpu;
  std::string out;
  bool quick = false;
  bool keep = true;
  size_t scale = 4;
  std::string notes;
  std::string command;
  int world = 1;  // thread ranks whose host communicator is measured (CPU device)
};

std::string command_line(int argc, char** argv) {
  std::string command = "strata-bench profile";
  for (int i = 0; i < argc; ++i) {
    const std::string arg = argv[i];
    const bool plain = arg.find_first_of(" \t'\"$\\") == std::string::npos && !arg.empty();
    command += " " + (plain ? arg : "'" + arg + "'");
  }
  return command;
}

StatusOr<Config> parse_config(int argc, char** argv) {
  STRATA_ASSIGN_OR_RETURN(Args args, Args::parse(argc, argv, {"nvme-path", "device", "out", "scale", "notes", "world"}, {"quick", "no-keep"}));
  Config c;
  c.nvme_path = args.get("nvme-path", "");
  if (c.nvme_path.empty()) return InvalidArgumentError("--nvme-path is required");
  STRATA_ASSIGN_OR_RETURN(c.device, parse_device_kind(args.get("device", "cpu")));
  c.out = args.get("out", "");
  c.quick = args.flag("quick");
  c.keep = !args.flag("no-keep");
  if (c.out.empty() && !c.keep) return InvalidArgumentError("--no-keep without --out would write the profile nowhere");
  const size_t default_scale = c.device == DeviceKind::kCuda ? 1 : (c.quick ? 16 : 4);
  STRATA_ASSIGN_OR_RETURN(c.scale, args.get_integer<size_t>("scale", default_scale, 1, 1024));
  c.notes = args.get("notes", "");
  STRATA_ASSIGN_OR_RETURN(c.world, args.get_integer<int>("world", 1, 1, 64));
  c.command = command_line(argc, argv);
  return c;
}

void progress(const char* what) {
  std::fprintf(stderr, "strata-bench profile: %s\n", what);
  std::fflush(stderr);
}

// The store's checksum on one thread: XXH64 over 256 MiB (beyond the last-level cache of
// most hosts), in blocks of `block` bytes, as a verifier meets the blocks a read left in memory.
// The median of three passes.
StatusOr<double> measure_checksum_rate(size_t block) {
  constexpr size_t kBytes = size_t{256} << 20;
  std::vector<uint64_t> data(kBytes / 8);
  for (size_t i = 0; i < data.size(); ++i) data[i] = i * 0x9E3779B97F4A7C15ull;
  const auto* bytes = reinterpret_cast<const char*>(data.data());
  std::vector<double> seconds;
  volatile uint64_t sink = 0;  // keeps the hashes from being optimized away
  for (int pass = 0; pass < 3; ++pass) {
    const auto begin = std::chrono::steady_clock::now();
    for (size_t at = 0; at < kBytes; at += block) sink = sink ^ xxhash64(bytes + at, std::min(block, kBytes - at));
    seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
  }
  std::sort(seconds.begin(), seconds.end());
  if (!(seconds[1] > 0)) return InternalError("checksum rate: a pass over 256 MiB took no time");
  return static_cast<double>(kBytes) / seconds[1];
}

// The engine's NVMe shapes: aio's default (1 MiB, QD32) and the two docs/benchmarks.md
// compares with fio (128 KiB QD8, 4 MiB QD8). The engine's shape is also measured with reads
// and writes at once, the traffic of a step whose state lives on NVMe.
StatusOr<std::vector<profile::NvmeRate>> measure_nvme(const Config& c) {
  struct Shape {
    size_t block;
    unsigned depth;
  };
  const Shape shapes[] = {{size_t{1} << 20, 32}, {size_t{128} << 10, 8}, {size_t{4} << 20, 8}};
  std::vector<profile::NvmeRate> rates;
  for (const Shape& shape : shapes) {
    StoreMeasurement m;
    m.nvme_path = c.nvme_path;
    // The engine's shape over 4 GiB: a step moves gigabytes, and a cloud disk's first
    // gigabyte can run faster than the rest.
    m.bytes = c.quick ? size_t{256} << 20 : (&shape == &shapes[0] ? size_t{4} << 30 : size_t{1} << 30);
    m.block_bytes = shape.block;
    m.queue_depth = shape.depth;
    m.checksums = true;
    m.footprint = StoreMeasurement::Footprint::kRing;  // the engine's NVMe rings reuse their blocks
    m.mixed = &shape == &shapes[0];                      // the engine's own shape: reads and writes at once too
    STRATA_ASSIGN_OR_RETURN(const StoreBandwidth b, measure_store_bandwidth(m));
    STRATA_ASSIGN_OR_RETURN(const double checksum, measure_checksum_rate(shape.block));
    rates.push_back({.block_bytes = shape.block, .queue_depth = static_cast<int>(shape.depth), .checksums = true,
                     .read_bytes_per_s = b.read_gbps * 1e9, .write_bytes_per_s = b.write_gbps * 1e9,
                     .mixed_bytes_per_s = m.mixed ? std::optional<double>(b.mixed_gbps * 1e9) : std::nullopt,
                     .checksum_bytes_per_s = checksum});
  }
  return rates;
}

StatusOr<profile::CopyRate> measure_copy(const Config& c, std::string& notes) {
  CopyMeasurement m;
  m.device = c.device;
  m.bytes = c.quick ? size_t{64} << 20 : size_t{256} << 20;
  m.repetitions = c.quick ? 3 : 7;
  STRATA_ASSIGN_OR_RETURN(const CopyBandwidth b, measure_copy_bandwidth(m));
  const bool host_copy = c.device == DeviceKind::kCpu;
  if (host_copy) notes += " copy: the CPU device's H2D/D2H is one host memcpy on a stream worker (both ends are host memory).";
  if (!b.locked) notes += " copy: the pinned buffer could not be page-locked (RLIMIT_MEMLOCK?), so its figures are pageable memory's.";
  return profile::CopyRate{.host_copy = host_copy, .pinned = b.locked, .h2d_bytes_per_s = b.h2d_pinned.median_gbps * 1e9,
                           .d2h_bytes_per_s = b.d2h_pinned.median_gbps * 1e9};
}

// 1, 2, 4, ... below the core count, and the core count.
std::vector<int> thread_counts(int cores) {
  std::vector<int> counts;
  for (int t = 1; t < cores; t *= 2) counts.push_back(t);
  counts.push_back(std::max(1, cores));
  return counts;
}

StatusOr<std::vector<profile::AdamRate>> measure_adam(const Config& c, int cores) {
  struct Types {
    DType grad;
    DType param;
  };
  // fp32 training (fp32 gradients and parameter copy) and bf16 training.
  const Types types[] = {{DType::kFloat32, DType::kFloat32}, {DType::kBFloat16, DType::kBFloat16}};
  std::vector<profile::AdamRate> rates;
  for (const Types& t : types) {
    for (int threads : thread_counts(cores)) {
      AdamMeasurement m{.params = c.quick ? int64_t{16} << 20 : int64_t{64} << 20, .threads = threads, .grad_type = t.grad,
                        .param_type = t.param, .steps = c.quick ? 3 : 5, .warmup = 1};
      STRATA_ASSIGN_OR_RETURN(const AdamThroughput a, measure_cpu_adam_rate(m));
      rates.push_back({.threads = a.threads, .grad_dtype = std::string(dtype_name(t.grad)),
                       .param_dtype = std::string(dtype_name(t.param)), .elements_per_s = a.params_per_s});
    }
  }
  return rates;
}

double median(std::vector<double> values) {
  if (values.empty()) return 0;
  std::sort(values.begin(), values.end());
  const size_t n = values.size();
  return n % 2 == 1 ? values[n / 2] : 0.5 * (values[n / 2 - 1] + values[n / 2]);
}

// The landing pass as the gradient path runs it (engine/gradient_path.cpp): GradientOps on
// the executor of a CpuAdam at the engine's default thread count (the cores), over a bf16
// shard. Bytes as the cost model counts them: statistics read 2 per element; accumulation
// with statistics reads 2 + 4 and writes 4. The buffers are touched before timing.
StatusOr<profile::LandingRate> measure_landing(const Config& c, int cores) {
  const size_t n = c.quick ? size_t{16} << 20 : size_t{64} << 20;
  const int repetitions = c.quick ? 3 : 7;
  STRATA_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::create({.threads = cores}));
  STRATA_ASSIGN_OR_RETURN(GradientOps ops, GradientOps::create(adam.executor()));
  std::vector<uint16_t> grad(n, 0x3c00);  // bf16 0.0078125: sums stay finite
  std::vector<float> accum(n, 0.0f);
  auto time_of = [&](const std::function<Status()>& pass) -> StatusOr<double> {
    STRATA_RETURN_IF_ERROR(pass());  // warm-up
    std::vector<double> seconds;
    for (int i = 0; i < repetitions; ++i) {
      const auto begin = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(pass());
      seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count());
    }
    return median(seconds);
  };
  STRATA_ASSIGN_OR_RETURN(const double stats_s, time_of([&] { return ops.stats(grad.data(), DType::kBFloat16, n).status(); }));
  STRATA_ASSIGN_OR_RETURN(const double accumulate_s, time_of([&] {
    return ops.accumulate_with_stats(accum.data(), grad.data(), DType::kBFloat16, n, AccumulateMode::kAdd).status();
  }));
  return profile::LandingRate{.threads = adam.threads(), .stats_bytes_per_s = 2.0 * double(n) / stats_s,
                              .accumulate_bytes_per_s = 10.0 * double(n) / accumulate_s};
}

StatusOr<profile::ComputeRate> measure_compute(const Config& c, std::string& description) {
  const bool gpu = c.device == DeviceKind::kCuda;
  KernelMeasurement m{.device = c.device, .dtype = gpu ? DType::kBFloat16 : DType::kFloat32, .scale = c.scale,
                      .repetitions = gpu ? (c.quick ? 5 : 20) : (c.quick ? 1 : 3)};
  STRATA_ASSIGN_OR_RETURN(const KernelTimings timings, measure_kernel_timings(m));
  description = timings.description;
  profile::ComputeRate out{.device = gpu ? "cuda" : "cpu", .dtype = std::string(dtype_name(m.dtype)), .scale = static_cast<int>(c.scale)};
  std::vector<double> gemm, attention, memory;
  for (const KernelTiming& t : timings.results) {
    const std::string kind = !t.flops ? "memory" : t.op.rfind("attention", 0) == 0 ? "attention" : "gemm";
    const double rate = t.amount / t.seconds;
    (kind == "gemm" ? gemm : kind == "attention" ? attention : memory).push_back(rate);
    out.kernels.push_back({.model = t.model, .op = t.op, .shape = t.shape, .kind = kind, .rate_per_s = rate});
  }
  out.gemm_flops_per_s = median(gemm);
  out.attention_flops_per_s = median(attention);
  out.memory_bytes_per_s = median(memory);
  return out;
}

// One collective, `repetitions` times after a warm-up, on every rank's thread at once; the
// median of rank 0's times (each collective waits for every rank, so rank 0's time is the
// collective's). A rank that fails aborts the group, so the others do not wait for it.
StatusOr<double> time_collective(HostCommunicatorGroup& group, int repetitions, const std::function<Status(int rank)>& run_once) {
  const int world = group.world_size();
  std::vector<Status> statuses(world);
  std::vector<double> seconds;
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world; ++rank) {
    threads.emplace_back([&, rank] {
      for (int i = 0; i <= repetitions; ++i) {
        const auto start = std::chrono::steady_clock::now();
        statuses[rank] = run_once(rank);
        if (!statuses[rank].ok()) {
          group.abort(statuses[rank].to_string());
          return;
        }
        if (rank == 0 && i > 0) seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
      }
    });
  }
  for (std::thread& thread : threads) thread.join();
  for (const Status& status : statuses) STRATA_RETURN_IF_ERROR(status);
  return median(seconds);
}

// The host communicator among `world` thread ranks of the CPU device, each with its own
// device and stream: all_gather of a `shard`-byte fp32 shard per rank and reduce_scatter
// of `world` shards, each rate the full (gathered, or scattered) bytes per second.
StatusOr<profile::CommunicatorRate> measure_communicator(const Config& c) {
  if (c.world == 1) {
    return profile::CommunicatorRate{.world = 1, .why_none = "world size 1: a collective needs two or more ranks (--world N measures "
                                                             "the host communicator among N thread ranks)"};
  }
  if (c.device != DeviceKind::kCpu) {
    return profile::CommunicatorRate{.world = c.world, .why_none = "--device cuda: NCCL's bandwidth is not measured by strata-bench "
                                                                   "profile yet (--world measures the CPU device's host communicator)"};
  }
  const size_t shard = c.quick ? size_t{16} << 20 : size_t{64} << 20;
  const size_t full = shard * static_cast<size_t>(c.world);
  STRATA_ASSIGN_OR_RETURN(HostCommunicatorGroup group, HostCommunicatorGroup::create({.world_size = c.world}));
  struct Rank {
    std::unique_ptr<Device> device;
    std::unique_ptr<Stream> stream;
    std::unique_ptr<HostCommunicator> communicator;
    DeviceBuffer shard, full;
  };
  std::vector<Rank> ranks(c.world);
  for (int r = 0; r < c.world; ++r) {
    Rank& rank = ranks[r];
    STRATA_ASSIGN_OR_RETURN(rank.device, create_cpu_device({.ordinal = r, .budget_bytes = shard + full + (size_t{4} << 20), .compute = {.threads = 1}}));
    STRATA_ASSIGN_OR_RETURN(rank.stream, rank.device->create_stream("profile collectives"));
    STRATA_ASSIGN_OR_RETURN(rank.communicator, group.communicator(r, *rank.device));
    STRATA_ASSIGN_OR_RETURN(rank.shard, rank.device->allocate(shard, "profile shard"));
    STRATA_ASSIGN_OR_RETURN(rank.full, rank.device->allocate(full, "profile gathered"));
    std::memset(rank.shard.data(), 0, shard);  // zeros: the sums stay finite
    std::memset(rank.full.data(), 0, full);
  }
  const int repetitions = c.quick ? 3 : 7;
  const size_t count = shard / sizeof(float);
  STRATA_ASSIGN_OR_RETURN(const double gather_seconds, time_collective(group, repetitions, [&](int r) -> Status {
    STRATA_RETURN_IF_ERROR(ranks[r].communicator->all_gather(ranks[r].shard.data(), ranks[r].full.data(), count, DType::kFloat32, *ranks[r].stream));
    return ranks[r].stream->synchronize();
  }));
  STRATA_ASSIGN_OR_RETURN(const double scatter_seconds, time_collective(group, repetitions, [&](int r) -> Status {
    STRATA_RETURN_IF_ERROR(ranks[r].communicator->reduce_scatter(ranks[r].full.data(), ranks[r].shard.data(), count, DType::kFloat32,
                                                                 ReduceOptions{}, *ranks[r].stream));
    return ranks[r].stream->synchronize();
  }));
  return profile::CommunicatorRate{.world = c.world, .all_gather_bytes_per_s = static_cast<double>(full) / gather_seconds,
                                   .reduce_scatter_bytes_per_s = static_cast<double>(full) / scatter_seconds};
}

void print_summary(const profile::MachineProfile& p) {
  std::printf("strata-bench profile: %s, %s (%d cores), GPU %s\n", p.host.hostname.c_str(), p.host.cpu_model.c_str(), p.host.cores,
              p.host.gpu.c_str());
  std::printf("  isa %s%s; memory %.2f GiB available of %.2f GiB\n", p.host.isa.c_str(), p.host.avx512_bf16 ? " (+avx512_bf16)" : "",
              double(p.host.memory_available_bytes) / double(1 << 30), double(p.host.memory_total_bytes) / double(1 << 30));
  std::printf("  disk %s: %s on %s (%s)\n", p.disk.path.c_str(), p.disk.filesystem.c_str(), p.disk.block_device.c_str(),
              p.disk.model.c_str());
  for (const profile::NvmeRate& n : p.nvme) {
    std::printf("  nvme %5zu KiB QD%-2d   read %7.3f GB/s  write %7.3f GB/s  (checksums on)\n", size_t(n.block_bytes >> 10),
                n.queue_depth, n.read_bytes_per_s / 1e9, n.write_bytes_per_s / 1e9);
    if (n.mixed_bytes_per_s)
      std::printf("  nvme %5zu KiB QD%-2d   reads and writes at once %7.3f GB/s (both directions)\n", size_t(n.block_bytes >> 10),
                  n.queue_depth, *n.mixed_bytes_per_s / 1e9);
    if (n.checksum_bytes_per_s)
      std::printf("  nvme %5zu KiB QD%-2d   checksums (XXH64, one thread, data not in cache) %7.3f GB/s\n", size_t(n.block_bytes >> 10),
                  n.queue_depth, *n.checksum_bytes_per_s / 1e9);
  }
  std::printf("  copy %s  h2d %7.3f GB/s  d2h %7.3f GB/s\n", p.copy.host_copy ? "(host memcpy)" : "(pinned)", p.copy.h2d_bytes_per_s / 1e9,
              p.copy.d2h_bytes_per_s / 1e9);
  for (const profile::AdamRate& a : p.cpu_adam) {
    std::printf("  cpu adam %2d threads grad %s param %s: %7.3f G elements/s\n", a.threads, a.grad_dtype.c_str(), a.param_dtype.c_str(),
                a.elements_per_s / 1e9);
  }
  if (p.landing) {
    std::printf("  landing %2d threads: statistics %.2f GB/s, accumulation %.2f GB/s (bytes read and written)\n", p.landing->threads,
                p.landing->stats_bytes_per_s / 1e9, p.landing->accumulate_bytes_per_s / 1e9);
  }
  std::printf("  compute (%s %s, scale %d): gemm %.3f TFLOP/s, attention %.3f TFLOP/s, memory-bound %.2f GB/s (medians)\n",
              p.compute.device.c_str(), p.compute.dtype.c_str(), p.compute.scale, p.compute.gemm_flops_per_s / 1e12,
              p.compute.attention_flops_per_s / 1e12, p.compute.memory_bytes_per_s / 1e9);
  if (p.compute.weight_stream_bytes_per_s) {
    std::printf("  compute: weights read from memory beyond the products' FLOPs at %.2f GB/s\n", *p.compute.weight_stream_bytes_per_s / 1e9);
  }
  if (p.communicator.all_gather_bytes_per_s) {
    std::printf("  communicator (%d thread ranks): all_gather %.3f GB/s, reduce_scatter %.3f GB/s (gathered bytes per second)\n",
                p.communicator.world, *p.communicator.all_gather_bytes_per_s / 1e9, *p.communicator.reduce_scatter_bytes_per_s / 1e9);
  } else {
    std::printf("  communicator: %s\n", p.communicator.why_none.c_str());
  }
}

StatusOr<profile::MachineProfile> measure(const Config& c) {
  profile::MachineProfile p;
  p.source = profile::ProfileSource::kMeasured;
  p.command = c.command;
  p.quick = c.quick;
  STRATA_ASSIGN_OR_RETURN(p.host, profile::probe_host());
  std::error_code error;  // the NVMe path is created when missing, as everywhere
  std::filesystem::create_directories(c.nvme_path, error);
  if (error) return InvalidArgumentError("--nvme-path '" + c.nvme_path + "' cannot be created: " + error.message());
  STRATA_ASSIGN_OR_RETURN(p.disk, profile::probe_disk(c.nvme_path));
  std::string notes = "Medians of repeated runs on a host that may be shared.";
  progress("NVMe write and read (1 MiB QD32, 128 KiB QD8, 4 MiB QD8; checksums on)");
  STRATA_ASSIGN_OR_RETURN(p.nvme, measure_nvme(c));
  progress("pinned host <-> device copies");
  STRATA_ASSIGN_OR_RETURN(p.copy, measure_copy(c, notes));
  progress("CPU Adam by thread count, fp32 and bf16 parameters");
  STRATA_ASSIGN_OR_RETURN(p.cpu_adam, measure_adam(c, p.host.cores));
  progress("the gradients' landing pass (statistics, accumulation) on CPU Adam's executor");
  STRATA_ASSIGN_OR_RETURN(p.landing, measure_landing(c, p.host.cores));
  progress("the device's kernels at the models' shapes");
  std::string description;
  STRATA_ASSIGN_OR_RETURN(p.compute, measure_compute(c, description));
  if (c.device == DeviceKind::kCuda) p.host.gpu = description;
  if (c.device == DeviceKind::kCpu) {
    notes += " compute: the CPU device's kernels (fp32 twins) at the models' shapes divided by " + std::to_string(c.scale) + ".";
    progress("the host's products reading weights from memory (not from cache)");
    STRATA_ASSIGN_OR_RETURN(p.compute.weight_stream_bytes_per_s, measure_weight_streaming(c.quick ? 3 : 5));
  }
  progress("the communicator");
  STRATA_ASSIGN_OR_RETURN(p.communicator, measure_communicator(c));
  if (p.communicator.all_gather_bytes_per_s) notes += " communicator: the host communicator among thread ranks of the CPU device.";
  p.date = profile::utc_now_iso8601();  // when the measurements ended
  p.notes = notes + (c.notes.empty() ? "" : " " + c.notes);
  return p;
}

Status run(const Config& c) {
  const auto start = std::chrono::steady_clock::now();
  STRATA_ASSIGN_OR_RETURN(const profile::MachineProfile p, measure(c));
  print_summary(p);
  if (!c.out.empty()) {
    STRATA_RETURN_IF_ERROR(profile::write_machine_profile(p, c.out));
    std::printf("  written to %s\n", c.out.c_str());
  }
  if (c.keep) {
    STRATA_ASSIGN_OR_RETURN(const std::string kept, profile::kept_profile_path());
    STRATA_RETURN_IF_ERROR(profile::write_machine_profile(p, kept).with_context("keeping the profile for this machine"));
    std::printf("  kept as %s\n", kept.c_str());
  }
  std::printf("  measured in %.1f s\n", std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
  std::fflush(stdout);
  return {};
}

}  // namespace

int run_profile(int argc, char** argv) {
  StatusOr<Config> config = parse_config(argc, argv);
  if (!config.ok()) {
    std::fprintf(stderr, "%s\n", kProfileUsage);
    return report_failure("profile", config.status());
  }
  const Status status = run(*config);
  return status.ok() ? 0 : report_failure("profile", status);
}

}  // namespace strata::bench
