// strata-bench step: a synthetic stack of square linear layers (GELU between them)
// trained through the full engine, reporting where a step's time goes.
//
//   strata-bench step --layers L --width W --batch B --micro-batches K --steps S
//                     --world-size N --device cpu|cuda --device-budget-mib M
//                     --offload-param device|cpu|nvme --offload-optimizer device|cpu|nvme
//                     --param-dtype bf16|fp32 --nvme-path D [--prefetch-depth P]
//                     [--pinned-budget-mib M] [--store-gbps READ,WRITE]
//                     [--matmul-precision fp32|tf32|bf16] [--overlap exact|delayed]
//                     [--profile FILE] [--placement auto|config] [--plan-only] [--json]
//
// --batch is rows per micro-batch on each rank. The figures are rank 0's, for the median
// step after a warm-up step: the step time, each stage's busy time (the union of the
// intervals in which the stage had work in flight), and the overlap figure — the slowest
// stage's busy time over the step time (1.0 = the step costs no more than its slowest
// stage). nvme_bytes_read and nvme_bytes_written are that step's; "steps" lists every
// step after the warm-up the same way.
//
// Disk efficiency: the time the step's NVMe bytes take at the store's own bandwidth,
// (read bytes / read GB/s + written bytes / write GB/s), over the step time (1.0 = the
// step runs at the disk's speed). The bandwidths are measured on --nvme-path before
// training, as `strata-bench nvme --size-mib 256 --block-kib 1024 --queue-depth 32` does
// (--store-measure-mib sets the size), or given with --store-gbps.
//
// Model TFLOPS: the step's model FLOPs (examples/lm/model_flops.h: 6 per weight per row,
// 4 for the input projection, whose input is the data) over its wall time; on CUDA also
// the fraction of the H200's dense peak (times the ranks, one GPU each) for the GEMMs'
// precision (the model multiplies in fp32, which --matmul-precision runs as exact fp32,
// TF32 or bf16 on the tensor cores).
//
// The prediction (docs/profile.md): with a machine profile (--profile FILE, else the one
// kept for this host) the plan is printed with its predicted step, and the figures carry
// predicted_step_s beside step_s and predicted_busy_s beside busy_s (null without one).
// --plan-only prints the plan and its prediction and exits (nothing is created under
// --nvme-path); --placement auto chooses the tiers, prefetch depth, rows per micro-batch
// (the rows per step kept) and overlap by the predicted rows per second
// (examples/profile/placement_search.h).
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "examples/lm/model_flops.h"
#include "engine/engine_plan.h"
#include "examples/models/linear_stack.h"
#include "examples/profile/placement_search.h"
#include "examples/profile/step_work.h"
#include "examples/strata_bench/bench.h"
#include "kernels/blas_context.h"

namespace strata::bench {

const char* const kStepUsage =
    "usage: strata-bench step --layers L --width W --batch B --micro-batches K --steps S --world-size N\n"
    "                         --device cpu|cuda --device-budget-mib M --offload-param device|cpu|nvme\n"
    "                         --offload-optimizer device|cpu|nvme --param-dtype bf16|fp32 --nvme-path D\n"
    "                         [--prefetch-depth P (default: the deepest that fits)] [--pinned-budget-mib M (0 = what the plan needs)] [--seed S]\n"
    "                         [--store-gbps READ,WRITE | --store-measure-mib M=256] [--matmul-precision fp32|tf32|bf16 (cuda)]\n"
    "                         [--compute kernels|none (none: the engine's protocol alone, the host stages at the pace of a device that computes in no time)]\n"
    "                         [--device-thread-nice N (cpu: the device's threads' nice value, 0-19; default 19: the host stages run first)]\n"
    "                         [--clip-grad-norm X (0 = off: Adam(g) starts as g's gradients land; on: after backward, as training with clipping does)]\n"
    "                         [--trace PATH (Chrome trace of every stage's intervals, written at the end)]\n"
    "                         [--overlap exact|delayed (the optimizer's overlap; default exact)]\n"
    "                         [--profile FILE (the machine profile the step is predicted with; default: the one kept for this host)]\n"
    "                         [--placement auto|config (auto: tiers, prefetch depth, rows per micro-batch and overlap chosen\n"
    "                          for the most predicted rows/s within the budgets; needs a profile)]\n"
    "                         [--plan-only (print the plan and its prediction, then exit; nothing under --nvme-path is made)]\n"
    "                         [--json]";

namespace {

struct StepBenchOptions {
  models::LinearStackConfig model;
  int micro_batches = 1;
  int steps = 5;
  int world = 1;
  // Process ranks (the launcher's WORLD_SIZE > 1): this process's place; `world` is then theirs.
  std::optional<RendezvousOptions> process_group;
  DeviceKind device = DeviceKind::kCpu;
  size_t budget_bytes = size_t{1} << 30;
  int device_thread_nice = kCpuDeviceThreadNice;  // cpu: the device's threads
  Tier params = Tier::kPinned;
  Tier optimizer = Tier::kPinned;
  DType param_dtype = DType::kBFloat16;
  MatmulPrecision matmul_precision = MatmulPrecision::kFp32;  // how the device runs the model's fp32 GEMMs
  std::string nvme_path;
  int prefetch_depth = EngineOptions::kAutoDepth;  // --prefetch-depth; unset = the deepest that fits
  size_t pinned_budget_bytes = 0;  // EngineOptions::pinned_budget_bytes
  std::optional<StoreBandwidth> store_bandwidth;  // --store-gbps; else measured when a tier is NVMe
  size_t store_measure_bytes = size_t{256} << 20;
  uint64_t seed = 1234;
  double clip_grad_norm = 0.0;  // EngineOptions::gradient_clipping
  std::string trace_path;       // EngineOptions::trace_path
  OverlapMode overlap = OverlapMode::kExact;  // EngineOptions::overlap
  bool overlap_given = false;   // --overlap was given: --placement auto keeps it
  std::string profile_path;     // --profile
  bool auto_placement = false;  // --placement auto
  bool plan_only = false;
  bool json = false;
};

// "READ,WRITE" in GB/s, both positive.
StatusOr<StoreBandwidth> parse_store_gbps(const std::string& text) {
  const size_t comma = text.find(',');
  char* end = nullptr;
  StoreBandwidth bandwidth;
  if (comma != std::string::npos) {
    const std::string read = text.substr(0, comma), write = text.substr(comma + 1);
    bandwidth.read_gbps = std::strtod(read.c_str(), &end);
    const bool read_ok = end != read.c_str() && *end == '\0';
    bandwidth.write_gbps = std::strtod(write.c_str(), &end);
    const bool write_ok = end != write.c_str() && *end == '\0';
    if (read_ok && write_ok && bandwidth.read_gbps > 0 && bandwidth.write_gbps > 0) {
      bandwidth.engine_name = "given";
      return bandwidth;
    }
  }
  return InvalidArgumentError("--store-gbps expects READ,WRITE in GB/s (two positive numbers), got '" + text + "'");
}

StatusOr<MatmulPrecision> parse_matmul_precision(const std::string& text) {
  for (const MatmulPrecision p : {MatmulPrecision::kFp32, MatmulPrecision::kTf32, MatmulPrecision::kBf16})
    if (text == matmul_precision_name(p)) return p;
  return InvalidArgumentError("--matmul-precision takes fp32, tf32 or bf16, got '" + text + "'");
}

// --overlap, --profile, --placement, --plan-only.
Status parse_plan_flags(const Args& args, StepBenchOptions& o) {
  o.overlap_given = args.has("overlap");
  STRATA_ASSIGN_OR_RETURN(o.overlap, parse_overlap_mode(args.get("overlap", "exact")));
  o.profile_path = args.get("profile", "");
  const std::string placement = args.get("placement", "config");
  if (placement != "auto" && placement != "config") return InvalidArgumentError("--placement takes auto or config, got '" + placement + "'");
  o.auto_placement = placement == "auto";
  o.plan_only = args.flag("plan-only");
  return {};
}

StatusOr<StepBenchOptions> parse(int argc, char** argv) {
  STRATA_ASSIGN_OR_RETURN(Args args, Args::parse(argc, argv,
                                                 {"layers", "width", "batch", "micro-batches", "steps", "world-size", "device",
                                                  "device-budget-mib", "offload-param", "offload-optimizer", "param-dtype",
                                                  "nvme-path", "prefetch-depth", "seed", "pinned-budget-mib", "store-gbps",
                                                  "store-measure-mib", "matmul-precision", "compute", "device-thread-nice", "clip-grad-norm", "trace",
                                                  "overlap", "profile", "placement"},
                                                 {"json", "plan-only"}));
  StepBenchOptions o;
  STRATA_ASSIGN_OR_RETURN(const int layers, args.get_integer<int>("layers", 8));
  STRATA_ASSIGN_OR_RETURN(const int width, args.get_integer<int>("width", 1024));
  STRATA_ASSIGN_OR_RETURN(const int batch, args.get_integer<int>("batch", 64));
  STRATA_ASSIGN_OR_RETURN(const int micro, args.get_integer<int>("micro-batches", 1));
  STRATA_ASSIGN_OR_RETURN(const int steps, args.get_integer<int>("steps", 5));
  STRATA_ASSIGN_OR_RETURN(int world, args.get_integer<int>("world-size", 1));
  STRATA_ASSIGN_OR_RETURN(o.process_group, LocalCluster::process_group_from_env());
  if (o.process_group) {
    const int launched = o.process_group->world_size;
    if (args.has("world-size") && world != launched)
      return InvalidArgumentError("--world-size " + std::to_string(world) + " disagrees with the launcher's WORLD_SIZE=" +
                                  std::to_string(launched) + "; drop --world-size or make them agree");
    world = launched;
  }
  STRATA_ASSIGN_OR_RETURN(int64_t budget_mib, args.get_int("device-budget-mib", 1024));
  STRATA_ASSIGN_OR_RETURN(const int depth, args.get_integer<int>("prefetch-depth", EngineOptions::kAutoDepth));
  STRATA_ASSIGN_OR_RETURN(int64_t seed, args.get_int("seed", 1234));
  STRATA_ASSIGN_OR_RETURN(int64_t pinned_budget_mib, args.get_int("pinned-budget-mib", 0));
  STRATA_ASSIGN_OR_RETURN(int64_t store_measure_mib, args.get_int("store-measure-mib", 256));
  if (pinned_budget_mib < 0 || store_measure_mib < 1)
    return InvalidArgumentError("need --pinned-budget-mib >= 0 (0 = what the plan needs) and --store-measure-mib >= 1");
  o.pinned_budget_bytes = static_cast<size_t>(pinned_budget_mib) << 20;
  o.store_measure_bytes = static_cast<size_t>(store_measure_mib) << 20;
  if (args.has("store-gbps")) {
    STRATA_ASSIGN_OR_RETURN(o.store_bandwidth, parse_store_gbps(args.get("store-gbps", "")));
  }
  if (layers < 1 || width < 2 || batch < 1 || micro < 1 || steps < 2 || world < 1 || budget_mib < 1 || (depth < 0 && depth != EngineOptions::kAutoDepth))
    return InvalidArgumentError("need --layers >= 1, --width >= 2, --batch >= 1, --micro-batches >= 1, --steps >= 2 "
                                "(one is the warm-up), --world-size >= 1, --device-budget-mib >= 1, --prefetch-depth >= 0");
  o.model.layers = static_cast<int>(layers);
  o.model.width = static_cast<int>(width);
  o.model.features = static_cast<int>(width);  // square everywhere, the tied projection too
  if (static_cast<int64_t>(batch) * world > std::numeric_limits<int>::max())
    return InvalidArgumentError("--batch x --world-size must fit an int, got " + std::to_string(int64_t{batch} * world));
  o.model.global_rows = batch * world;
  o.micro_batches = static_cast<int>(micro);
  o.steps = static_cast<int>(steps);
  o.world = static_cast<int>(world);
  o.budget_bytes = static_cast<size_t>(budget_mib) << 20;
  o.prefetch_depth = static_cast<int>(depth);
  o.seed = static_cast<uint64_t>(seed);
  STRATA_ASSIGN_OR_RETURN(o.device, parse_device_kind(args.get("device", "cpu")));
  STRATA_ASSIGN_OR_RETURN(o.params, parse_placement(args.get("offload-param", "cpu")));
  STRATA_ASSIGN_OR_RETURN(o.optimizer, parse_placement(args.get("offload-optimizer", "cpu")));
  STRATA_ASSIGN_OR_RETURN(o.param_dtype, parse_dtype(args.get("param-dtype", "bf16")));
  if (o.param_dtype == DType::kFloat16) return InvalidArgumentError("--param-dtype takes bf16 or fp32");
  STRATA_ASSIGN_OR_RETURN(o.matmul_precision, parse_matmul_precision(args.get("matmul-precision", "fp32")));
  const std::string compute = args.get("compute", "kernels");
  if (compute != "kernels" && compute != "none") return InvalidArgumentError("--compute takes kernels or none, got '" + compute + "'");
  o.model.compute = compute == "none" ? models::StackCompute::kNone : models::StackCompute::kKernels;
  STRATA_ASSIGN_OR_RETURN(o.device_thread_nice, args.get_integer<int>("device-thread-nice", o.device_thread_nice));
  if (o.device_thread_nice < 0 || o.device_thread_nice > 19)
    return InvalidArgumentError("--device-thread-nice takes a nice value 0-19, got " + std::to_string(o.device_thread_nice));
  STRATA_ASSIGN_OR_RETURN(o.clip_grad_norm, args.get_double("clip-grad-norm", 0.0));
  if (!(o.clip_grad_norm >= 0.0)) return InvalidArgumentError("--clip-grad-norm takes a norm >= 0 (0 = off)");
  o.trace_path = args.get("trace", "");
  if (!o.trace_path.empty()) {
    // Checked now: the engine writes the trace after the last step, and a run should not be
    // lost to a mistyped folder.
    const std::filesystem::path folder = std::filesystem::absolute(o.trace_path).parent_path();
    std::error_code error;
    if (!std::filesystem::is_directory(folder, error))
      return InvalidArgumentError("--trace " + o.trace_path + ": the folder " + folder.string() + " does not exist");
  }
  STRATA_RETURN_IF_ERROR(parse_plan_flags(args, o));
  o.nvme_path = args.get("nvme-path", "");
  if ((o.params == Tier::kNvme || o.optimizer == Tier::kNvme) && o.nvme_path.empty())
    return InvalidArgumentError("--offload-param/--offload-optimizer nvme needs --nvme-path");
  o.json = args.flag("json");
  return o;
}

// What training through the engine produced on rank 0.
struct TrainingRun {
  std::vector<StepReport> reports;  // one per step, the warm-up first
  size_t state_bytes = 0;           // Engine::plan()
  size_t pinned_bytes = 0;
  size_t host_bytes = 0;
  EnginePlan plan;                  // rank 0's
  EngineOptions engine_options;     // rank 0's
  std::vector<GroupLayout> layouts;
  size_t shard_elements = 0;        // rank 0's shard of every group: what its optimizer steps
};

EngineOptions bench_engine_options(const StepBenchOptions& o, int rank) {
  EngineOptions options;
  options.rank = rank;
  options.world_size = o.world;
  options.seed = o.seed;
  options.param_dtype = o.param_dtype;
  options.grad_wire_dtype = o.param_dtype;
  options.grad_transfer_dtype = o.param_dtype;
  options.param_tier = o.params;
  options.optimizer_tier = o.optimizer;
  options.nvme_path = o.nvme_path;
  options.prefetch_depth = o.prefetch_depth;
  options.pinned_budget_bytes = o.pinned_budget_bytes;
  options.gradient_accumulation_steps = o.micro_batches;
  options.activation_bytes = models::linear_stack_activation_bytes(o.model, o.model.global_rows / o.world, o.param_dtype) +
                             (o.device == DeviceKind::kCuda ? kernels::BlasOptions{}.cuda_workspace_bytes : 0);  // the model's cuBLAS workspace
  options.adam.lr = 1e-3;
  options.gradient_clipping = o.clip_grad_norm;
  options.trace_path = o.trace_path;
  options.overlap = o.overlap;
  return options;
}

StatusOr<TrainingRun> train(const StepBenchOptions& o, LocalCluster& cluster) {
  TrainingRun run;
  std::mutex mutex;
  STRATA_RETURN_IF_ERROR(cluster.run([&](int rank) -> Status {
    const EngineOptions options = bench_engine_options(o, rank);
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(options, cluster.device(rank), cluster.gather_communicator(rank),
                                                        cluster.reduce_communicator(rank)));
    STRATA_ASSIGN_OR_RETURN(auto model, models::LinearStackModel::create(*engine, o.model, rank, o.world, /*declare_schedule=*/true));
    STRATA_RETURN_IF_ERROR(engine->start());
    STRATA_RETURN_IF_ERROR(model->allocate());
    for (int s = 0; s < o.steps; ++s) {
      STRATA_ASSIGN_OR_RETURN(StepReport report, model->train_step(s, o.micro_batches, 1e-3));
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(mutex);
        run.reports.push_back(report);
      }
    }
    STRATA_RETURN_IF_ERROR(engine->finish());
    if (rank == 0) {
      const EnginePlan& plan = engine->plan();
      run.state_bytes = plan.state_bytes;
      run.pinned_bytes = plan.pinned_bytes;
      run.host_bytes = plan.host_bytes;
      run.plan = plan;
      run.engine_options = options;
      for (int g = 0; g < engine->group_count(); ++g) {
        run.shard_elements += engine->layout(g).shard_numel;
        run.layouts.push_back(engine->layout(g));
      }
    }
    return {};
  }));
  return run;
}

// The work of one step for the model-TFLOPS figures.
struct StepWork {
  double model_flops = 0;            // all ranks, all micro-batches (examples/lm/model_flops.h)
  std::optional<double> peak_flops;  // CUDA only: one H200's dense peak for the GEMM precision x the ranks (a GPU each)
};

// One step's figures: its own NVMe traffic (StepReport counts since start), its busy
// seconds per stage by name, its model TFLOPS (and fraction of peak on CUDA), and the
// disk efficiency where the store's bandwidth is known.
nlohmann::ordered_json step_figures(const std::vector<StepReport>& reports, size_t i, const StepWork& work,
                                    const std::optional<StoreBandwidth>& store) {
  const StepReport& r = reports[i];
  const uint64_t read = r.nvme_bytes_read - reports[i - 1].nvme_bytes_read;
  const uint64_t written = r.nvme_bytes_written - reports[i - 1].nvme_bytes_written;
  nlohmann::ordered_json busy;
  for (size_t s = 0; s < kStageCount; ++s) busy[std::string(stage_name(static_cast<Stage>(s)))] = r.busy[s];
  nlohmann::ordered_json figures = {{"step", r.step}, {"step_s", r.step_seconds}, {"busy_s", busy},
                                    {"nvme_bytes_read", read}, {"nvme_bytes_written", written}};
  const double achieved = lm::tflops(work.model_flops, r.step_seconds);
  figures["model_tflops"] = achieved;
  if (work.peak_flops) figures["peak_fraction"] = achieved * 1e12 / *work.peak_flops;
  if (store) {
    const double disk_seconds = static_cast<double>(read) / (store->read_gbps * 1e9) + static_cast<double>(written) / (store->write_gbps * 1e9);
    figures["disk_s"] = disk_seconds;
    figures["disk_efficiency"] = r.step_seconds > 0 ? disk_seconds / r.step_seconds : 0.0;
  }
  return figures;
}

// The store's bandwidth for the disk-efficiency figure: given, measured on the NVMe path
// before training, or none when no tier is on NVMe.
StatusOr<std::optional<StoreBandwidth>> store_bandwidth(const StepBenchOptions& o) {
  if (o.store_bandwidth) return o.store_bandwidth;
  if (o.params != Tier::kNvme && o.optimizer != Tier::kNvme) return std::optional<StoreBandwidth>();
  STRATA_ASSIGN_OR_RETURN(StoreBandwidth measured,
                          measure_store_bandwidth({.nvme_path = o.nvme_path, .bytes = o.store_measure_bytes}));
  return std::optional<StoreBandwidth>(measured);
}

void print_table(const TrainingRun& run, const StepReport& r, const nlohmann::ordered_json& median,
                 size_t steps_counted, size_t peak, const std::string& prediction) {
  std::printf("%s\n%s\n\n", run.plan.text.c_str(), prediction.c_str());
  std::printf("step (median of %zu after a warm-up): %.4f s\n", steps_counted, r.step_seconds);
  std::printf("%-16s %10s %8s\n", "stage", "busy (s)", "of step");
  for (size_t s = 0; s < kStageCount; ++s)
    std::printf("%-16s %10.4f %7.1f%%\n", std::string(stage_name(static_cast<Stage>(s))).c_str(), r.busy[s],
                r.step_seconds > 0 ? 100.0 * r.busy[s] / r.step_seconds : 0.0);
  std::printf("model FLOPs %.4g per step: %.4g TFLOPS", median["model_flops"].get<double>(), median["model_tflops"].get<double>());
  if (median.contains("peak_fraction"))
    std::printf(", %.1f%% of the H200s' dense %s peak (%.1f TFLOPS)", 100 * median["peak_fraction"].get<double>(),
                median["matmul_precision"].get<std::string>().c_str(), median["peak_tflops"].get<double>());
  std::printf("\n");
  std::printf("overlap (slowest stage %s / step): %.3f\n", median["slowest_stage"].get<std::string>().c_str(),
              median["overlap"].get<double>());
  std::printf("optimizer stage: %.3g params/s over its busy time (clip-grad-norm %g)\n",
              median["optimizer_params_per_s"].get<double>(), median["clip_grad_norm"].get<double>());
  std::printf("device peak %.1f MiB of a %.1f MiB budget; training state %.1f MiB; host %.1f MiB pinned + %.1f MiB pageable\n",
              peak / 1048576.0, r.device_budget_bytes / 1048576.0, run.state_bytes / 1048576.0, run.pinned_bytes / 1048576.0,
              run.host_bytes / 1048576.0);
  std::printf("NVMe per step: %.1f MiB read, %.1f MiB written", median["nvme_bytes_read"].get<double>() / 1048576.0,
              median["nvme_bytes_written"].get<double>() / 1048576.0);
  if (median.contains("disk_efficiency")) {
    std::printf("; at the store's %.2f GB/s read, %.2f GB/s write (%s) that is %.3f s: disk efficiency %.3f",
                median["store_read_gbps"].get<double>(), median["store_write_gbps"].get<double>(),
                median["store_gbps_source"].get<std::string>().c_str(), median["disk_s"].get<double>(),
                median["disk_efficiency"].get<double>());
  }
  std::printf("\n");
}

// ---- the plan before the run, its prediction, --placement auto

// Rank 0's plan as Engine::start() makes it, from the stack's groups and schedule alone
// (no engine, device or NVMe file).
struct BenchPlan {
  EngineOptions options;
  std::vector<GroupLayout> layouts;
  EnginePlan plan;
};
StatusOr<BenchPlan> preview_bench_plan(const StepBenchOptions& o) {
  BenchPlan out;
  out.options = bench_engine_options(o, 0);
  const std::vector<GroupSpec> specs = models::linear_stack_groups(o.model);
  for (size_t g = 0; g < specs.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(specs[g], static_cast<int>(g), o.world));
    out.layouts.push_back(std::move(layout));
  }
  const std::vector<int> schedule = models::linear_stack_schedule(o.model);
  engine_internal::PlanInputs inputs;
  inputs.options = &out.options;
  inputs.layouts = out.layouts;
  inputs.schedule = schedule;
  inputs.device_budget_bytes = o.budget_bytes;
  STRATA_ASSIGN_OR_RETURN(out.plan, engine_internal::make_engine_plan(inputs));
  return out;
}

// Rank 0's predicted step; nullopt without a profile.
StatusOr<std::optional<profile::StepPrediction>> predict_bench_step(const StepBenchOptions& o, const EngineOptions& options,
                                                                    const EnginePlan& plan, std::span<const GroupLayout> layouts,
                                                                    const profile::RunProfile& run_profile) {
  if (!run_profile.profile) return std::optional<profile::StepPrediction>();
  const std::vector<int> schedule = models::linear_stack_schedule(o.model);
  profile::PlannedStepInputs inputs;
  inputs.options = &options;
  inputs.plan = &plan;
  inputs.layouts = layouts;
  inputs.schedule = schedule;
  inputs.model.flops = models::linear_stack_flop_shape(o.model);
  inputs.model.seq_len = 1;  // rows, no attention
  inputs.model.tokens = o.model.compute == models::StackCompute::kKernels ? o.model.global_rows / o.world : 0;
  STRATA_ASSIGN_OR_RETURN(const profile::PlannedStep step, profile::planned_step(inputs));
  STRATA_ASSIGN_OR_RETURN(profile::StepPrediction prediction, profile::predict_step(step.work, step.shape, *run_profile.profile));
  return std::optional<profile::StepPrediction>(std::move(prediction));
}

// predicted_step_s and predicted_busy_s (null without a prediction).
void add_prediction(const std::optional<profile::StepPrediction>& prediction, nlohmann::ordered_json& out) {
  out["predicted_step_s"] = prediction ? nlohmann::ordered_json(prediction->step_seconds) : nlohmann::ordered_json(nullptr);
  out["predicted_busy_s"] = prediction ? profile::predicted_busy_json(*prediction) : nlohmann::ordered_json(nullptr);
}

std::string bench_prediction_text(const std::optional<profile::StepPrediction>& prediction, const profile::RunProfile& run_profile) {
  if (!prediction) return "  predicted step: none (" + run_profile.why_none + ")";
  return profile::format_prediction(*prediction, run_profile.origin);
}

void apply_bench_placement(const profile::Placement& p, StepBenchOptions& o) {
  o.params = p.params;
  o.optimizer = p.optimizer;
  o.prefetch_depth = p.prefetch_depth;
  o.model.global_rows = static_cast<int>(p.micro_batch) * o.world;
  o.micro_batches = p.accumulation;
  o.overlap = p.overlap;
}

// --placement auto: the stack has no activation checkpointing; the rows per step are kept.
StatusOr<profile::PlacementChoice> choose_bench_placement(const StepBenchOptions& o, const profile::RunProfile& run_profile) {
  if (!run_profile.profile)
    return FailedPreconditionError("--placement auto chooses by the predicted step and needs a machine profile: " + run_profile.why_none);
  profile::PlacementSpace space;
  space.params = {Tier::kDevice, Tier::kPinned};
  space.optimizer = {Tier::kDevice, Tier::kPinned};
  if (!o.nvme_path.empty()) {
    space.params.push_back(Tier::kNvme);
    space.optimizer.push_back(Tier::kNvme);
  }
  space.prefetch_depths = {0, 1, 2, 4};
  const int64_t rows_per_step = int64_t{o.model.global_rows / o.world} * o.micro_batches;
  space.batches = profile::batch_splits(rows_per_step);
  space.checkpointing = {lm::ActivationCheckpointing::kOff};
  space.overlaps = o.overlap_given ? std::vector<OverlapMode>{o.overlap} : std::vector<OverlapMode>{OverlapMode::kExact, OverlapMode::kDelayed};
  const std::optional<double> nvme_free = o.nvme_path.empty() ? std::nullopt : profile::nvme_room_bytes(o.nvme_path, 0);
  StepBenchOptions candidate = o;
  auto evaluate = [&](const profile::Placement& p) -> StatusOr<profile::PlacementOutcome> {
    apply_bench_placement(p, candidate);
    profile::PlacementOutcome outcome;
    outcome.placement = p;
    outcome.tokens_per_step = static_cast<double>(rows_per_step);
    STRATA_ASSIGN_OR_RETURN(const BenchPlan preview, preview_bench_plan(candidate));
    outcome.device_bytes = static_cast<double>(preview.plan.device_bytes);
    outcome.host_bytes = static_cast<double>(preview.plan.pinned_bytes + preview.plan.host_bytes);
    outcome.checks = engine_internal::check_plan_budgets(preview.plan, preview.options);
    if (outcome.checks.ok() && preview.plan.nvme_bytes > 0 && nvme_free && static_cast<double>(preview.plan.nvme_bytes) > *nvme_free)
      outcome.checks = ResourceExhaustedError("--nvme-path " + o.nvme_path + " has too little free space for the plan's NVMe file");
    if (!outcome.checks.ok()) return outcome;
    STRATA_ASSIGN_OR_RETURN(outcome.prediction, predict_bench_step(candidate, preview.options, preview.plan, preview.layouts, run_profile));
    return outcome;
  };
  return profile::search_placements(space, evaluate);
}

// --placement auto: the choice printed (on stderr with --json, so the last line of stdout
// stays the one JSON object) and written into `o`.
Status place_bench(StepBenchOptions& o, const profile::RunProfile& run_profile) {
  if (!o.auto_placement) return {};
  STRATA_ASSIGN_OR_RETURN(const profile::PlacementChoice choice, choose_bench_placement(o, run_profile));
  std::fprintf(o.json ? stderr : stdout, "%s", profile::placement_choice_text(choice).c_str());
  apply_bench_placement(choice.best.placement, o);
  return {};
}

// --plan-only: the plan, its prediction and the budget checks, then one JSON line; exit 1
// when the checks fail.
int run_plan_only(const StepBenchOptions& o, const profile::RunProfile& run_profile) {
  auto preview = preview_bench_plan(o);
  if (!preview.ok()) return report_failure("step", preview.status());
  auto prediction = predict_bench_step(o, preview->options, preview->plan, preview->layouts, run_profile);
  if (!prediction.ok()) return report_failure("step", prediction.status());
  const Status checks = engine_internal::check_plan_budgets(preview->plan, preview->options);
  if (!o.json)
    std::printf("%s\n%s\nplan checks (device, pinned and host memory; --nvme-path not touched): %s\n", preview->plan.text.c_str(),
                bench_prediction_text(*prediction, run_profile).c_str(), checks.ok() ? "ok" : checks.message().c_str());
  nlohmann::ordered_json out = {{"bench", "step"},
                                {"plan_only", true},
                                {"checks", checks.ok() ? std::string("ok") : checks.message()},
                                {"device_bytes", preview->plan.device_bytes},
                                {"pinned_bytes", preview->plan.pinned_bytes},
                                {"host_bytes", preview->plan.host_bytes},
                                {"nvme_file_bytes", preview->plan.nvme_bytes}};
  add_prediction(*prediction, out);
  std::printf("%s\n", out.dump().c_str());
  return checks.ok() ? 0 : 1;
}

// The run's summary at its median step `chosen` (the figures every run reports), and every
// step after the warm-up one under "steps".
nlohmann::ordered_json step_summary(const StepBenchOptions& o, const TrainingRun& run, LocalCluster& cluster, size_t chosen,
                                    const std::optional<StoreBandwidth>& store) {
  const std::vector<StepReport>& reports = run.reports;
  const StepReport& r = reports[chosen];
  nlohmann::ordered_json out = {{"bench", "step"}};
  const int64_t rows_per_step = int64_t{o.model.global_rows} * o.micro_batches;
  StepWork work;
  const bool computes = o.model.compute == models::StackCompute::kKernels;
  work.model_flops = computes ? lm::training_step_flops(models::linear_stack_flop_shape(o.model), /*seq_len=*/1, rows_per_step) : 0.0;
  const MatmulPrecision precision = cluster.device(cluster.first_rank()).matmul_precision();
  if (o.device == DeviceKind::kCuda) work.peak_flops = h200_dense_peak_flops(precision) * o.world;
  const nlohmann::ordered_json median = step_figures(reports, chosen, work, store);
  out.update(median);
  out.erase("step");  // the top level describes the median step; "steps" numbers them all
  out["device_budget_bytes"] = r.device_budget_bytes;
  out["state_bytes"] = run.state_bytes;
  out["pinned_bytes"] = run.pinned_bytes;
  out["host_bytes"] = run.host_bytes;
  out["pinned_budget_bytes"] = o.pinned_budget_bytes;
  out["compute"] = computes ? "kernels" : "none";
  out["model_flops"] = work.model_flops;
  out["matmul_precision"] = std::string(matmul_precision_name(precision));
  if (work.peak_flops) out["peak_tflops"] = *work.peak_flops / 1e12;  // all ranks' GPUs
  out["clip_grad_norm"] = o.clip_grad_norm;
  // The optimizer stage's rate over its busy time: rank 0's shard elements per second of
  // Adam, to set beside `strata-bench adam` at the same count.
  const double optimizer_busy = r.busy[static_cast<size_t>(Stage::kOptimizer)];
  out["optimizer_params_per_s"] = optimizer_busy > 0 ? static_cast<double>(run.shard_elements) / optimizer_busy : 0.0;
  if (store) {
    out["store_read_gbps"] = store->read_gbps;
    out["store_write_gbps"] = store->write_gbps;
    out["store_gbps_source"] = o.store_bandwidth ? "given" : "measured";
  }
  nlohmann::ordered_json steps = nlohmann::ordered_json::array();
  for (size_t i = 1; i < reports.size(); ++i) steps.push_back(step_figures(reports, i, work, store));
  out["steps"] = steps;
  return out;
}

}  // namespace

int run_step(int argc, char** argv) {
  auto parsed = parse(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", kStepUsage);
    return report_failure("step", parsed.status());
  }
  StepBenchOptions o = *parsed;
  auto run_profile = profile::resolve_run_profile(o.profile_path);
  if (!run_profile.ok()) return report_failure("step", run_profile.status());
  if (Status placed = place_bench(o, *run_profile); !placed.ok()) return report_failure("step", placed);
  if (o.plan_only) return run_plan_only(o, *run_profile);
  auto store = store_bandwidth(o);
  if (!store.ok()) return report_failure("step", Status(store.status()).with_context("measuring the store's bandwidth on --nvme-path"));
  LocalClusterOptions cluster_options;
  cluster_options.world_size = o.world;
  cluster_options.device = o.device;
  cluster_options.device_budget_bytes = o.budget_bytes;
  cluster_options.process_group = o.process_group;
  cluster_options.matmul_precision = o.matmul_precision;
  cluster_options.device_thread_nice = o.device_thread_nice;
  auto cluster = LocalCluster::create(cluster_options);
  if (!cluster.ok()) return report_failure("step", cluster.status());
  auto run = train(o, **cluster);
  if (!run.ok()) return report_failure("step", run.status());
  // Process ranks: rank 0 alone measures and reports (its device; the others' are alike).
  if ((*cluster)->first_rank() != 0) return 0;
  const std::vector<StepReport>& reports = run->reports;

  // The median step after the warm-up step.
  std::vector<size_t> order;
  for (size_t i = 1; i < reports.size(); ++i) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return reports[a].step_seconds < reports[b].step_seconds; });
  const size_t chosen = order[order.size() / 2];
  const StepReport& r = reports[chosen];
  size_t slowest_stage = 0;
  for (size_t s = 1; s < kStageCount; ++s) {
    if (r.busy[s] > r.busy[slowest_stage]) slowest_stage = s;
  }
  const double overlap = r.step_seconds > 0 ? r.busy[slowest_stage] / r.step_seconds : 0.0;
  size_t peak = 0;
  for (int rank = 0; rank < (*cluster)->local_ranks(); ++rank) peak = std::max(peak, (*cluster)->device((*cluster)->first_rank() + rank).memory_stats().high_water_bytes);

  nlohmann::ordered_json out = step_summary(o, *run, **cluster, chosen, *store);
  out["overlap"] = overlap;
  out["slowest_stage"] = std::string(stage_name(static_cast<Stage>(slowest_stage)));
  out["device_peak_bytes"] = peak;
  auto prediction = predict_bench_step(o, run->engine_options, run->plan, run->layouts, *run_profile);
  if (!prediction.ok()) return report_failure("step", prediction.status());
  add_prediction(*prediction, out);
  if (o.json) {
    std::printf("%s\n", out.dump().c_str());
  } else {
    print_table(*run, r, out, order.size(), peak, bench_prediction_text(*prediction, *run_profile));
  }
  return 0;
}

}  // namespace strata::bench
