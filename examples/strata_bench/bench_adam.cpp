// strata-bench adam: the fused CPU Adam step as the engine runs it (one call per
// parameter group, each fanned out over the optimizer's workers), against the memory
// ceiling of shared/tools/adam_stream_limit.cpp.
//
//   strata-bench adam --params N --threads T --grad-dtype bf16|fp16|fp32
//                     --param-dtype bf16|fp16|fp32|none [--moment-dtype fp32|bf16]
//                     [--state memory|nvme --nvme-path D] [--isa avx512|avx2|scalar]
//                     [--group-params G] [--steps S] [--warmup W] [--json]
//
// Before any figure, the first step is recomputed on a sample of elements (both ends,
// group and chunk boundaries, an even spread) with the scalar reference
// kernels::adam_step_cpu_range and compared bit for bit; a mismatch fails the run.
//
// --state nvme keeps master weights and moments in an NvmeStore under --nvme-path and
// streams them through the NvmeAdamState pipeline (--pinned-budget bytes of staging in
// --slots slots); gradients and parameter copies stay in host memory.
#include <sys/mman.h>

#include <algorithm>
#include <bit>
#include <chrono>
#include <cinttypes>
#include <cstdio>
#include <cstring>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "examples/strata_bench/bench.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "kernels/adam.h"
#include "optim/cpu_adam.h"
#include "optim/nvme_adam_state.h"

namespace strata::bench {

const char* const kAdamUsage =
    "usage: strata-bench adam [--params N] [--threads T (0 = all cores)] [--grad-dtype bf16|fp16|fp32] [--param-dtype bf16|fp16|fp32|none]\n"
    "                         [--moment-dtype fp32|bf16] [--state memory|nvme] [--nvme-path DIR] [--isa avx512|avx2|scalar]\n"
    "                         [--group-params G] [--steps S] [--warmup W] [--chunk-elements C] [--stagger-bytes B]\n"
    "                         [--param-stores streaming|cached] [--state-stores cached|streaming] [--no-avx512-bf16]\n"
    "                         [--pinned-budget BYTES] [--slots K] [--queue-depth Q] [--no-checksums] [--json]";

namespace {

// Anonymous memory for the benchmark's state, 2 MiB aligned and advised onto transparent
// huge pages, as the pinned arena holds it.
class HostArray {
 public:
  HostArray() = default;
  HostArray(const HostArray&) = delete;
  HostArray& operator=(const HostArray&) = delete;
  HostArray(HostArray&& other) noexcept : data_(std::exchange(other.data_, nullptr)), bytes_(std::exchange(other.bytes_, 0)) {}
  HostArray& operator=(HostArray&& other) noexcept {
    std::swap(data_, other.data_);
    std::swap(bytes_, other.bytes_);
    return *this;
  }
  ~HostArray() {
    if (data_ != nullptr) munmap(data_, bytes_);
  }
  static StatusOr<HostArray> allocate(size_t bytes, const char* what) {
    HostArray array;
    array.bytes_ = std::max(kHugePageBytes, round_up(bytes, kHugePageBytes));
    // Over-map by one huge page so the usable start can sit on a 2 MiB boundary: the
    // staggers below are then offsets from a known alignment, not from wherever mmap landed.
    void* data = mmap(nullptr, array.bytes_ + kHugePageBytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (data == MAP_FAILED) return Status::FromErrno(errno, std::string("mmap of ") + std::to_string(array.bytes_) + " bytes for " + what);
    const auto address = reinterpret_cast<uintptr_t>(data);
    const size_t head = round_up(address, kHugePageBytes) - address;
    if (head > 0) munmap(data, head);
    if (head < kHugePageBytes) munmap(static_cast<char*>(data) + head + array.bytes_, kHugePageBytes - head);
    array.data_ = static_cast<char*>(data) + head;
    (void)madvise(array.data_, array.bytes_, MADV_HUGEPAGE);  // advice only: small pages work too
    return array;
  }
  void* data() const { return data_; }
  size_t size() const { return bytes_; }

  static constexpr size_t kHugePageBytes = size_t{2} << 20;

 private:
  static size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

  void* data_ = nullptr;
  size_t bytes_ = 0;
};

// The arrays of a fused step (gradient, master, exp_avg, exp_avg_sq, parameter copy; or
// with --state nvme the two that stay in host memory) in one mapping. Array i starts on a
// 2 MiB boundary plus i x `stagger`, so with a stagger under 512 KiB no two of the five
// start at addresses congruent modulo 2 MiB, let alone modulo the 2^k spacing that 2^k-byte
// arrays packed back to back would have. With stagger 0 they are congruent modulo 2 MiB,
// and modulo 2^k when their sizes are 2^k: the layout that made the five streams collide
// (docs/benchmarks.md, "Buffer placement").
class StateLayout {
 public:
  static StatusOr<StateLayout> allocate(const std::vector<size_t>& array_bytes, size_t stagger) {
    StateLayout layout;
    size_t offset = 0;
    std::vector<size_t> offsets;
    for (size_t i = 0; i < array_bytes.size(); ++i) {
      offset = (offset + HostArray::kHugePageBytes - 1) / HostArray::kHugePageBytes * HostArray::kHugePageBytes;
      offsets.push_back(offset + i * stagger);
      offset += i * stagger + array_bytes[i];
    }
    STRATA_ASSIGN_OR_RETURN(layout.memory_, HostArray::allocate(offset, "the benchmark's arrays"));
    for (size_t o : offsets) layout.arrays_.push_back(static_cast<char*>(layout.memory_.data()) + o);
    return layout;
  }
  void* array(size_t i) const { return arrays_.at(i); }

 private:
  HostArray memory_;
  std::vector<void*> arrays_;
};

// The default stagger: 4 KiB apart in the bits that index the caches' sets and the DRAM
// banks, plus one cache line so the streams also differ modulo 4 KiB (where the core's
// load/store address check compares addresses). docs/benchmarks.md has the measurement.
constexpr int64_t kDefaultStaggerBytes = 4096 + 64;

struct Config {
  int64_t params = int64_t{64} << 20;
  int threads = 0;  // 0 = every core this process may use
  DType grad_type = DType::kBFloat16;
  bool write_param = true;
  DType param_type = DType::kBFloat16;
  DType moment_type = DType::kFloat32;
  std::string state = "memory";
  std::string nvme_path;
  std::optional<CpuIsa> isa;
  int64_t group_params = int64_t{8} << 20;
  int steps = 9;
  int warmup = 2;
  int64_t chunk_elements = int64_t{1} << 16;
  int64_t stagger_bytes = kDefaultStaggerBytes;  // host array i starts i * this past a 2 MiB boundary
  AdamSpanStores stores;
  bool use_avx512_bf16 = true;
  int64_t pinned_budget = int64_t{192} << 20;
  int slots = 3;
  int queue_depth = 32;
  bool checksums = true;
  bool json = false;
};

StatusOr<StoreKind> parse_store_kind(const std::string& text, const char* flag) {
  if (text == "streaming") return StoreKind::kStreaming;
  if (text == "cached") return StoreKind::kCached;
  return InvalidArgumentError(std::string("--") + flag + " expects streaming or cached, got '" + text + "'");
}

StatusOr<Config> parse_config(int argc, char** argv) {
  STRATA_ASSIGN_OR_RETURN(
      Args args, Args::parse(argc, argv,
                             {"params", "threads", "grad-dtype", "param-dtype", "moment-dtype", "state", "nvme-path", "isa", "group-params",
                              "steps", "warmup", "chunk-elements", "stagger-bytes", "param-stores", "state-stores", "pinned-budget", "slots", "queue-depth"},
                             {"json", "no-avx512-bf16", "no-checksums"}));
  Config c;
  STRATA_ASSIGN_OR_RETURN(c.params, args.get_int("params", c.params));
  STRATA_ASSIGN_OR_RETURN(c.threads, args.get_integer<int>("threads", c.threads));
  STRATA_ASSIGN_OR_RETURN(c.grad_type, parse_dtype(args.get("grad-dtype", "bf16")));
  const std::string param = args.get("param-dtype", "bf16");
  if (param == "none") {
    c.write_param = false;
  } else {
    STRATA_ASSIGN_OR_RETURN(c.param_type, parse_dtype(param));
  }
  STRATA_ASSIGN_OR_RETURN(c.moment_type, parse_dtype(args.get("moment-dtype", "fp32")));
  c.state = args.get("state", "memory");
  c.nvme_path = args.get("nvme-path", "");
  if (args.has("isa")) {
    STRATA_ASSIGN_OR_RETURN(c.isa, parse_cpu_isa(args.get("isa", "")));
  }
  STRATA_ASSIGN_OR_RETURN(c.group_params, args.get_int("group-params", c.group_params));
  STRATA_ASSIGN_OR_RETURN(c.steps, args.get_integer<int>("steps", c.steps));
  STRATA_ASSIGN_OR_RETURN(c.warmup, args.get_integer<int>("warmup", c.warmup));
  STRATA_ASSIGN_OR_RETURN(c.chunk_elements, args.get_int("chunk-elements", c.chunk_elements));
  STRATA_ASSIGN_OR_RETURN(c.stagger_bytes, args.get_int("stagger-bytes", c.stagger_bytes));
  STRATA_ASSIGN_OR_RETURN(c.stores.param, parse_store_kind(args.get("param-stores", "streaming"), "param-stores"));
  STRATA_ASSIGN_OR_RETURN(c.stores.state, parse_store_kind(args.get("state-stores", "cached"), "state-stores"));
  c.use_avx512_bf16 = !args.flag("no-avx512-bf16");
  STRATA_ASSIGN_OR_RETURN(c.pinned_budget, args.get_int("pinned-budget", c.pinned_budget));
  STRATA_ASSIGN_OR_RETURN(c.slots, args.get_integer<int>("slots", c.slots));
  STRATA_ASSIGN_OR_RETURN(c.queue_depth, args.get_integer<int>("queue-depth", c.queue_depth));
  c.checksums = !args.flag("no-checksums");
  c.json = args.flag("json");
  if (c.params < 1) return InvalidArgumentError("--params must be >= 1");
  if (c.threads < 0) return InvalidArgumentError("--threads must be >= 0 (0 = every core)");
  if (c.group_params < 1) return InvalidArgumentError("--group-params must be >= 1");
  if (c.steps < 1 || c.warmup < 0) return InvalidArgumentError("--steps must be >= 1 and --warmup >= 0");
  // Whole cache lines keep every array as aligned as the kernel's streaming stores need.
  if (c.stagger_bytes < 0 || c.stagger_bytes % 64 != 0) return InvalidArgumentError("--stagger-bytes must be a multiple of 64 (a cache line)");
  if (c.moment_type == DType::kFloat16) return InvalidArgumentError("--moment-dtype must be fp32 or bf16");
  if (c.state != "memory" && c.state != "nvme") return InvalidArgumentError("--state expects memory or nvme, got '" + c.state + "'");
  if (c.state == "nvme" && c.nvme_path.empty()) return InvalidArgumentError("--state nvme needs --nvme-path DIR");
  if (c.pinned_budget < 1 || c.slots < 1 || c.queue_depth < 1) return InvalidArgumentError("--pinned-budget, --slots and --queue-depth must be >= 1");
  return c;
}

// A cheap deterministic value in [-1, 1) for element i of array `salt`.
float pattern(uint64_t i, uint64_t salt) {
  uint64_t x = (i + 1) * 0x9e3779b97f4a7c15ull ^ (salt * 0xbf58476d1ce4e5b9ull);
  x ^= x >> 31;
  x *= 0x94d049bb133111ebull;
  x ^= x >> 29;
  return static_cast<float>(static_cast<int64_t>(x >> 40) - (int64_t{1} << 23)) / static_cast<float>(int64_t{1} << 23);
}

// The initial state of element i, the same in every path: the bench's first step starts from it.
struct InitialElement {
  float grad;
  float master;
};
InitialElement initial_element(size_t i) { return {pattern(i, 1) * 1e-2f, pattern(i, 2)}; }

// What the first step left behind, as the bench can see it: optimizer state for elements
// [0, state_count) (all of them in memory; the first group read back from NVMe) and the
// parameter copy for every element (nullptr without one).
struct FirstStepResult {
  const float* master = nullptr;
  const void* exp_avg = nullptr;
  const void* exp_avg_sq = nullptr;
  size_t state_count = 0;
  const void* param = nullptr;
};

// The elements the reference recomputes: both ends, both sides of every group and chunk
// boundary, and an even spread (at an odd stride, so it lands at every vector lane) in between.
std::vector<size_t> reference_sample(const Config& c) {
  const size_t n = static_cast<size_t>(c.params);
  std::vector<size_t> sample;
  auto add_boundary = [&](size_t at) {
    for (size_t i = at == 0 ? 0 : at - 1; i <= at + 1 && i < n; ++i) sample.push_back(i);
  };
  add_boundary(0);
  add_boundary(n - 1);
  for (size_t at = static_cast<size_t>(c.group_params); at < n; at += static_cast<size_t>(c.group_params)) add_boundary(at);
  for (size_t at = static_cast<size_t>(c.chunk_elements); at < n && sample.size() < 4096; at += static_cast<size_t>(c.chunk_elements)) {
    add_boundary(at);
  }
  const size_t stride = std::max<size_t>(1, n / 4096) | 1;
  for (size_t i = 7; i < n; i += stride) sample.push_back(i);
  std::sort(sample.begin(), sample.end());
  sample.erase(std::unique(sample.begin(), sample.end()), sample.end());
  return sample;
}

// Enough digits to tell two floats apart.
std::string exact_text(float value) {
  char text[32];
  std::snprintf(text, sizeof(text), "%.9g", static_cast<double>(value));
  return text;
}

// The element's bytes in a buffer of `type`, for bitwise comparison.
uint32_t element_bits(const void* data, DType type, size_t index) {
  if (dtype_size(type) == 4) return std::bit_cast<uint32_t>(static_cast<const float*>(data)[index]);
  return static_cast<const uint16_t*>(data)[index];
}

// Recomputes the first step on a sample of elements with the scalar reference
// (kernels::adam_step_cpu_range) and compares bit for bit: every SIMD path is specified to
// match it exactly (optim/adam_span.h), so any difference is a wrong result, and a fast
// wrong kernel must not produce a figure.
Status check_first_step(const Config& c, const kernels::AdamStepScalars& scalars, const FirstStepResult& got) {
  const std::vector<size_t> sample = reference_sample(c);
  const size_t k = sample.size();
  const size_t moment_width = dtype_size(c.moment_type);
  std::vector<char> grad(k * dtype_size(c.grad_type)), exp_avg(k * moment_width), exp_avg_sq(k * moment_width);
  std::vector<char> param(k * dtype_size(c.param_type));
  std::vector<float> master(k);
  for (size_t j = 0; j < k; ++j) {
    const InitialElement e = initial_element(sample[j]);
    store_from_float(grad.data(), c.grad_type, j, e.grad);
    master[j] = e.master;
    store_from_float(exp_avg.data(), c.moment_type, j, 0.0f);
    store_from_float(exp_avg_sq.data(), c.moment_type, j, 0.0f);
  }
  kernels::AdamBuffers want{.grad = grad.data(), .grad_type = c.grad_type, .master = master.data(), .exp_avg = exp_avg.data(),
                            .exp_avg_sq = exp_avg_sq.data(), .moment_type = c.moment_type,
                            .param = got.param != nullptr ? param.data() : nullptr, .param_type = c.param_type, .count = k};
  kernels::adam_step_cpu_range(want, scalars, 0, k);

  auto mismatch = [&](const char* array, size_t i, DType type, const void* got_data, size_t got_index, const void* want_data,
                      size_t j) -> Status {
    return InternalError(std::string("the first step disagrees with the scalar reference (kernels::adam_step_cpu_range): ") + array +
                         "[" + std::to_string(i) + "] is " + exact_text(load_as_float(got_data, type, got_index)) + ", the reference " +
                         exact_text(load_as_float(want_data, type, j)) + "; no figure is reported for a wrong kernel");
  };
  for (size_t j = 0; j < k; ++j) {
    const size_t i = sample[j];
    if (i < got.state_count) {
      if (element_bits(got.master, DType::kFloat32, i) != element_bits(master.data(), DType::kFloat32, j)) {
        return mismatch("master", i, DType::kFloat32, got.master, i, master.data(), j);
      }
      if (element_bits(got.exp_avg, c.moment_type, i) != element_bits(exp_avg.data(), c.moment_type, j)) {
        return mismatch("exp_avg", i, c.moment_type, got.exp_avg, i, exp_avg.data(), j);
      }
      if (element_bits(got.exp_avg_sq, c.moment_type, i) != element_bits(exp_avg_sq.data(), c.moment_type, j)) {
        return mismatch("exp_avg_sq", i, c.moment_type, got.exp_avg_sq, i, exp_avg_sq.data(), j);
      }
    }
    if (got.param != nullptr && element_bits(got.param, c.param_type, i) != element_bits(param.data(), c.param_type, j)) {
      return mismatch("param", i, c.param_type, got.param, i, param.data(), j);
    }
  }
  return {};
}

struct Result {
  double seconds_per_step = 0;
  double params_per_s = 0;
  double best_params_per_s = 0;  // the fastest step: comparable with adam_stream_limit, which reports its best pass
  size_t bytes_per_param = 0;
  std::vector<double> step_seconds;
  std::optional<NvmeAdamStateStats> nvme;  // --state nvme: the pipeline's counters over all steps
  size_t piece_elements = 0;
  std::string io_engine;
};

void finish(Result& result, size_t params) {
  std::vector<double> sorted = result.step_seconds;
  std::sort(sorted.begin(), sorted.end());
  result.seconds_per_step = sorted[sorted.size() / 2];
  result.params_per_s = static_cast<double>(params) / result.seconds_per_step;
  result.best_params_per_s = static_cast<double>(params) / sorted.front();
}

StatusOr<Result> run_memory(const Config& c, CpuAdam& adam) {
  const size_t n = static_cast<size_t>(c.params);
  const size_t moment_width = dtype_size(c.moment_type);
  const size_t param_bytes = c.write_param ? n * dtype_size(c.param_type) : 0;
  STRATA_ASSIGN_OR_RETURN(
      StateLayout layout,
      StateLayout::allocate({n * dtype_size(c.grad_type), n * 4, n * moment_width, n * moment_width, param_bytes},
                            static_cast<size_t>(c.stagger_bytes)));
  kernels::AdamBuffers all;
  all.grad = layout.array(0);
  all.grad_type = c.grad_type;
  all.master = static_cast<float*>(layout.array(1));
  all.exp_avg = layout.array(2);
  all.exp_avg_sq = layout.array(3);
  all.moment_type = c.moment_type;
  all.param = c.write_param ? layout.array(4) : nullptr;
  all.param_type = c.param_type;
  all.count = n;
  // First touch on the workers that stream the arrays later, in the same chunks.
  adam.executor().parallel_for(0, n, static_cast<size_t>(c.chunk_elements), [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      store_from_float(layout.array(0), c.grad_type, i, initial_element(i).grad);
      all.master[i] = initial_element(i).master;
      store_from_float(all.exp_avg, c.moment_type, i, 0.0f);
      store_from_float(all.exp_avg_sq, c.moment_type, i, 0.0f);
      if (c.write_param) store_from_float(all.param, c.param_type, i, 0.0f);
    }
  });

  const kernels::AdamHyperparams hyper{.lr = 1e-3, .weight_decay = 0.01};
  Result result;
  result.bytes_per_param = kernels::adam_bytes_per_element(all);
  const size_t group = static_cast<size_t>(c.group_params);
  for (int step = 1; step <= c.warmup + c.steps; ++step) {
    STRATA_ASSIGN_OR_RETURN(const kernels::AdamStepScalars scalars, kernels::adam_step_scalars(hyper, step));
    const auto start = std::chrono::steady_clock::now();
    for (size_t begin = 0; begin < n; begin += group) {
      STRATA_RETURN_IF_ERROR(adam.step(adam_buffers_slice(all, begin, std::min(n, begin + group)), scalars));
    }
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (step > c.warmup) result.step_seconds.push_back(seconds);
    if (step == 1) {
      STRATA_RETURN_IF_ERROR(check_first_step(c, scalars, {.master = all.master, .exp_avg = all.exp_avg, .exp_avg_sq = all.exp_avg_sq,
                                                           .state_count = n, .param = all.param}));
    }
  }
  finish(result, n);
  return result;
}

// check_first_step for --state nvme: the first group's state read back from the store.
Status check_first_nvme_step(const Config& c, NvmeAdamState& state, const kernels::AdamStepScalars& scalars, const void* param) {
  const size_t first_group = static_cast<size_t>(std::min(c.group_params, c.params));
  const size_t moment_width = dtype_size(c.moment_type);
  std::vector<float> master(first_group);
  std::vector<char> exp_avg(first_group * moment_width), exp_avg_sq(first_group * moment_width);
  STRATA_RETURN_IF_ERROR(state.load_group(0, master.data(), exp_avg.data(), exp_avg_sq.data()));
  return check_first_step(c, scalars, {.master = master.data(), .exp_avg = exp_avg.data(), .exp_avg_sq = exp_avg_sq.data(),
                                       .state_count = first_group, .param = c.write_param ? param : nullptr});
}

// Master weights and moments on NVMe, streamed through the NvmeAdamState pipeline.
StatusOr<Result> run_nvme(const Config& c, CpuAdam& adam) {
  const size_t n = static_cast<size_t>(c.params);
  const size_t group = static_cast<size_t>(c.group_params);
  std::vector<size_t> group_elements;
  for (size_t begin = 0; begin < n; begin += group) group_elements.push_back(std::min(group, n - begin));

  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<PinnedArena> arena,
                          PinnedArena::create({.bytes = static_cast<size_t>(c.pinned_budget) + (size_t{4} << 20)}));
  NvmeStoreOptions store_options;
  store_options.nvme_path = c.nvme_path;
  store_options.checksums = c.checksums;
  store_options.initial_bytes = n * (4 + 2 * dtype_size(c.moment_type)) + (size_t{64} << 20);
  store_options.io.queue_depth = static_cast<unsigned>(c.queue_depth);
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NvmeStore> store, NvmeStore::open(store_options));
  (void)store->io_engine().register_buffers(*arena);  // fixed buffers where the kernel allows; plain transfers otherwise
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<NvmeAdamState> state,
                          NvmeAdamState::create(*store, *arena, group_elements,
                                                {.key_prefix = "bench-adam", .moment_type = c.moment_type,
                                                 .pinned_budget_bytes = static_cast<size_t>(c.pinned_budget),
                                                 .slots = static_cast<unsigned>(c.slots)}));

  // Gradients and parameter copies in host memory, staggered as in --state memory.
  STRATA_ASSIGN_OR_RETURN(StateLayout host, StateLayout::allocate({n * dtype_size(c.grad_type), c.write_param ? n * dtype_size(c.param_type) : 0},
                                                                  static_cast<size_t>(c.stagger_bytes)));
  void* const grad = host.array(0);
  void* const param = c.write_param ? host.array(1) : nullptr;
  {
    // Initial state, one group at a time through a host staging array.
    const size_t moment_width = dtype_size(c.moment_type);
    STRATA_ASSIGN_OR_RETURN(HostArray staging, HostArray::allocate(group * (4 + 2 * moment_width), "initial state staging"));
    auto* master = static_cast<float*>(staging.data());
    char* exp_avg = static_cast<char*>(staging.data()) + group * 4;
    char* exp_avg_sq = exp_avg + group * moment_width;
    size_t begin = 0;
    for (size_t g = 0; g < group_elements.size(); ++g) {
      adam.executor().parallel_for(0, group_elements[g], static_cast<size_t>(c.chunk_elements), [&](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) {
          master[i] = initial_element(begin + i).master;
          store_from_float(exp_avg, c.moment_type, i, 0.0f);
          store_from_float(exp_avg_sq, c.moment_type, i, 0.0f);
          store_from_float(grad, c.grad_type, begin + i, initial_element(begin + i).grad);
          if (c.write_param) store_from_float(param, c.param_type, begin + i, 0.0f);
        }
      });
      STRATA_RETURN_IF_ERROR(state->store_group(g, master, exp_avg, exp_avg_sq));
      begin += group_elements[g];
    }
  }
  std::vector<AdamGroupIo> io;
  for (size_t g = 0, begin = 0; g < group_elements.size(); begin += group_elements[g], ++g) {
    io.push_back({static_cast<const char*>(grad) + begin * dtype_size(c.grad_type), c.grad_type,
                  c.write_param ? static_cast<char*>(param) + begin * dtype_size(c.param_type) : nullptr, c.param_type});
  }

  const kernels::AdamHyperparams hyper{.lr = 1e-3, .weight_decay = 0.01};
  Result result;
  kernels::AdamBuffers shape;
  shape.grad_type = c.grad_type;
  shape.moment_type = c.moment_type;
  shape.param = param;
  shape.param_type = c.param_type;
  result.bytes_per_param = kernels::adam_bytes_per_element(shape);
  for (int step = 1; step <= c.warmup + c.steps; ++step) {
    STRATA_ASSIGN_OR_RETURN(AdamStepPlan plan, plan_adam_step(hyper, step, {}, {}));
    const auto start = std::chrono::steady_clock::now();
    STRATA_RETURN_IF_ERROR(state->step(adam, io, plan));
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    if (step > c.warmup) result.step_seconds.push_back(seconds);
    if (step == 1) STRATA_RETURN_IF_ERROR(check_first_nvme_step(c, *state, plan.scalars, param));
  }
  finish(result, n);
  result.nvme = state->stats();
  result.piece_elements = state->piece_elements();
  result.io_engine = std::string(store->io_engine().name()) + (store->direct_io() ? ", O_DIRECT" : ", buffered") +
                     (store->checksums() ? ", checksums" : "");
  return result;
}

}  // namespace

StatusOr<AdamThroughput> measure_cpu_adam_rate(const AdamMeasurement& m) {
  Config c;  // the subcommand's defaults for everything the measurement does not name
  c.params = m.params;
  c.threads = m.threads;
  c.grad_type = m.grad_type;
  c.param_type = m.param_type;
  c.steps = m.steps;
  c.warmup = m.warmup;
  c.group_params = std::min(c.group_params, c.params);
  if (c.params < 1 || c.threads < 0 || c.steps < 1 || c.warmup < 0) {
    return InvalidArgumentError("an Adam measurement needs params >= 1, threads >= 0, steps >= 1 and warmup >= 0");
  }
  STRATA_ASSIGN_OR_RETURN(CpuAdam adam, CpuAdam::create({.threads = c.threads, .chunk_elements = static_cast<size_t>(c.chunk_elements)}));
  STRATA_ASSIGN_OR_RETURN(const Result result, run_memory(c, adam));
  return AdamThroughput{.params_per_s = result.params_per_s, .threads = adam.threads(), .isa = std::string(cpu_isa_name(adam.isa()))};
}

int run_adam(int argc, char** argv) {
  auto parsed = parse_config(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", kAdamUsage);
    return report_failure("adam", parsed.status());
  }
  const Config& c = *parsed;
  CpuAdamOptions options;
  options.threads = c.threads;
  options.isa = c.isa;
  options.span.use_avx512_bf16 = c.use_avx512_bf16;
  options.chunk_elements = static_cast<size_t>(c.chunk_elements);
  options.stores = c.stores;
  auto adam = CpuAdam::create(options);
  if (!adam.ok()) return report_failure("adam", adam.status());

  StatusOr<Result> result = c.state == "memory" ? run_memory(c, *adam) : run_nvme(c, *adam);
  if (!result.ok()) return report_failure("adam", result.status());

  const std::string param_name = c.write_param ? std::string(dtype_name(c.param_type)) : "none";
  const std::string isa_name(cpu_isa_name(adam->isa()));
  if (c.json) {
    std::printf(
        "{\"bench\":\"adam\",\"params\":%" PRId64 ",\"threads\":%d,\"grad_dtype\":\"%s\",\"param_dtype\":\"%s\",\"state\":\"%s\","
        "\"isa\":\"%s\",\"seconds_per_step\":%.6g,\"params_per_s\":%.6g,\"best_params_per_s\":%.6g,\"bytes_per_param\":%zu}\n",
        c.params, adam->threads(), std::string(dtype_name(c.grad_type)).c_str(), param_name.c_str(), c.state.c_str(), isa_name.c_str(),
        result->seconds_per_step, result->params_per_s, result->best_params_per_s, result->bytes_per_param);
  } else {
    std::printf("strata-bench adam: fused AdamW step, one call per group of %" PRId64 " params\n", c.group_params);
    std::printf("  %-18s %" PRId64 "\n", "params", c.params);
    std::printf("  %-18s %d (%s executor)\n", "threads", adam->threads(), std::string(adam->executor().name()).c_str());
    std::printf("  %-18s %s / %s / %s\n", "grad/param/moment", std::string(dtype_name(c.grad_type)).c_str(), param_name.c_str(),
                std::string(dtype_name(c.moment_type)).c_str());
    std::printf("  %-18s %s%s\n", "isa", isa_name.c_str(), adam->native_bf16() ? " (+avx512_bf16)" : "");
    std::printf("  %-18s %s\n", "state", c.state.c_str());
    if (result->nvme) {
      const NvmeAdamStateStats& s = *result->nvme;
      const double steps = static_cast<double>(s.steps);
      std::printf("  %-18s %s, pinned budget %" PRId64 " B in %d slots, pieces of %zu params\n", "nvme", result->io_engine.c_str(),
                  c.pinned_budget, c.slots, result->piece_elements);
      std::printf("  %-18s read wait %.1f ms, slot wait %.1f ms, compute %.1f ms; %.2f GB/s read + %.2f GB/s written\n",
                  "per step (mean)", s.read_wait_seconds / steps * 1e3, s.slot_wait_seconds / steps * 1e3, s.compute_seconds / steps * 1e3,
                  static_cast<double>(s.bytes_read) / steps / result->seconds_per_step / 1e9,
                  static_cast<double>(s.bytes_written) / steps / result->seconds_per_step / 1e9);
    }
    std::printf("  %-18s %.3f ms (median of %d after %d warm-up)\n", "step", result->seconds_per_step * 1e3, c.steps, c.warmup);
    std::printf("  %-18s %.3f G params/s (fastest step %.3f)\n", "throughput", result->params_per_s / 1e9, result->best_params_per_s / 1e9);
    std::printf("  %-18s %zu B/param, %.1f GB/s\n", "memory traffic", result->bytes_per_param,
                result->params_per_s * static_cast<double>(result->bytes_per_param) / 1e9);
  }
  return 0;
}

}  // namespace strata::bench
