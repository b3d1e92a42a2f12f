// strata-bench step: a synthetic stack of square linear layers (GELU between them)
// trained through the full engine, reporting where a step's time goes.
//
//   strata-bench step --layers L --width W --batch B --micro-batches K --steps S
//                     --world-size N --device cpu|cuda --device-budget-mib M
//                     --offload-param device|cpu|nvme --offload-optimizer device|cpu|nvme
//                     --param-dtype bf16|fp32 --nvme-path D [--prefetch-depth P] [--json]
//
// --batch is rows per micro-batch on each rank. The figures are rank 0's, for the median
// step after a warm-up step: the step time, each stage's busy time (the union of the
// intervals in which the stage had work in flight), and the overlap figure — the slowest
// stage's busy time over the step time (1.0 = the step costs no more than its slowest
// stage). nvme_bytes_read is that step's.
#include <algorithm>
#include <cstdio>
#include <mutex>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "examples/models/linear_stack.h"
#include "examples/strata_bench/bench.h"

namespace strata::bench {
namespace {

constexpr const char* kUsage =
    "usage: strata-bench step --layers L --width W --batch B --micro-batches K --steps S --world-size N\n"
    "                         --device cpu|cuda --device-budget-mib M --offload-param device|cpu|nvme\n"
    "                         --offload-optimizer device|cpu|nvme --param-dtype bf16|fp32 --nvme-path D\n"
    "                         [--prefetch-depth P] [--seed S] [--json]";

struct StepBenchOptions {
  models::LinearStackConfig model;
  int micro_batches = 1;
  int steps = 5;
  int world = 1;
  DeviceKind device = DeviceKind::kCpu;
  size_t budget_bytes = size_t{1} << 30;
  Tier params = Tier::kPinned;
  Tier optimizer = Tier::kPinned;
  DType param_dtype = DType::kBFloat16;
  std::string nvme_path;
  int prefetch_depth = 2;
  uint64_t seed = 1234;
  bool json = false;
};

StatusOr<StepBenchOptions> parse(int argc, char** argv) {
  STRATA_ASSIGN_OR_RETURN(Args args, Args::parse(argc, argv,
                                                 {"layers", "width", "batch", "micro-batches", "steps", "world-size", "device",
                                                  "device-budget-mib", "offload-param", "offload-optimizer", "param-dtype",
                                                  "nvme-path", "prefetch-depth", "seed"},
                                                 {"json"}));
  StepBenchOptions o;
  STRATA_ASSIGN_OR_RETURN(int64_t layers, args.get_int("layers", 8));
  STRATA_ASSIGN_OR_RETURN(int64_t width, args.get_int("width", 1024));
  STRATA_ASSIGN_OR_RETURN(int64_t batch, args.get_int("batch", 64));
  STRATA_ASSIGN_OR_RETURN(int64_t micro, args.get_int("micro-batches", 1));
  STRATA_ASSIGN_OR_RETURN(int64_t steps, args.get_int("steps", 5));
  STRATA_ASSIGN_OR_RETURN(int64_t world, args.get_int("world-size", 1));
  STRATA_ASSIGN_OR_RETURN(int64_t budget_mib, args.get_int("device-budget-mib", 1024));
  STRATA_ASSIGN_OR_RETURN(int64_t depth, args.get_int("prefetch-depth", 2));
  STRATA_ASSIGN_OR_RETURN(int64_t seed, args.get_int("seed", 1234));
  if (layers < 1 || width < 2 || batch < 1 || micro < 1 || steps < 2 || world < 1 || budget_mib < 1 || depth < 0)
    return InvalidArgumentError("need --layers >= 1, --width >= 2, --batch >= 1, --micro-batches >= 1, --steps >= 2 "
                                "(one is the warm-up), --world-size >= 1, --device-budget-mib >= 1, --prefetch-depth >= 0");
  o.model.layers = static_cast<int>(layers);
  o.model.width = static_cast<int>(width);
  o.model.features = static_cast<int>(width);  // square everywhere, the tied projection too
  o.model.global_rows = static_cast<int>(batch * world);
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
  o.nvme_path = args.get("nvme-path", "");
  if ((o.params == Tier::kNvme || o.optimizer == Tier::kNvme) && o.nvme_path.empty())
    return InvalidArgumentError("--offload-param/--offload-optimizer nvme needs --nvme-path");
  o.json = args.flag("json");
  return o;
}

}  // namespace

int run_step(int argc, char** argv) {
  auto parsed = parse(argc, argv);
  if (!parsed.ok()) {
    std::fprintf(stderr, "%s\n", kUsage);
    return report_failure("step", parsed.status());
  }
  const StepBenchOptions& o = *parsed;
  LocalClusterOptions cluster_options;
  cluster_options.world_size = o.world;
  cluster_options.device = o.device;
  cluster_options.device_budget_bytes = o.budget_bytes;
  auto cluster = LocalCluster::create(cluster_options);
  if (!cluster.ok()) return report_failure("step", cluster.status());

  std::vector<StepReport> reports;
  size_t state_bytes = 0;
  std::string plan_text;
  std::mutex mutex;
  Status status = (*cluster)->run([&](int rank) -> Status {
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
    options.gradient_accumulation_steps = o.micro_batches;
    options.activation_bytes = models::linear_stack_activation_bytes(o.model, o.model.global_rows / o.world, o.param_dtype) +
                               (o.device == DeviceKind::kCuda ? (size_t{4} << 20) : 0);
    options.adam.lr = 1e-3;
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(options, (*cluster)->device(rank), (*cluster)->gather_communicator(rank),
                                                        (*cluster)->reduce_communicator(rank)));
    STRATA_ASSIGN_OR_RETURN(auto model, models::LinearStackModel::create(*engine, o.model, rank, o.world, /*declare_schedule=*/true));
    STRATA_RETURN_IF_ERROR(engine->start());
    STRATA_RETURN_IF_ERROR(model->allocate());
    for (int s = 0; s < o.steps; ++s) {
      STRATA_ASSIGN_OR_RETURN(StepReport report, model->train_step(s, o.micro_batches, 1e-3));
      if (rank == 0) {
        std::lock_guard<std::mutex> lock(mutex);
        reports.push_back(report);
      }
    }
    STRATA_RETURN_IF_ERROR(engine->finish());
    if (rank == 0) {
      state_bytes = engine->plan().state_bytes;
      plan_text = engine->plan().text;
    }
    return {};
  });
  if (!status.ok()) return report_failure("step", status);

  // The median step after the warm-up step.
  std::vector<size_t> order;
  for (size_t i = 1; i < reports.size(); ++i) order.push_back(i);
  std::sort(order.begin(), order.end(), [&](size_t a, size_t b) { return reports[a].step_seconds < reports[b].step_seconds; });
  const size_t chosen = order[order.size() / 2];
  const StepReport& r = reports[chosen];
  const uint64_t nvme_read = r.nvme_bytes_read - reports[chosen - 1].nvme_bytes_read;
  double slowest = 0.0;
  size_t slowest_stage = 0;
  for (size_t s = 0; s < kStageCount; ++s) {
    if (r.busy[s] > slowest) {
      slowest = r.busy[s];
      slowest_stage = s;
    }
  }
  const double overlap = r.step_seconds > 0 ? slowest / r.step_seconds : 0.0;
  size_t peak = 0;
  for (int rank = 0; rank < o.world; ++rank) peak = std::max(peak, (*cluster)->device(rank).memory_stats().high_water_bytes);

  if (!o.json) {
    std::printf("%s\n\n", plan_text.c_str());
    std::printf("step (median of %zu after a warm-up): %.4f s\n", order.size(), r.step_seconds);
    std::printf("%-16s %10s %8s\n", "stage", "busy (s)", "of step");
    for (size_t s = 0; s < kStageCount; ++s)
      std::printf("%-16s %10.4f %7.1f%%\n", std::string(stage_name(static_cast<Stage>(s))).c_str(), r.busy[s],
                  r.step_seconds > 0 ? 100.0 * r.busy[s] / r.step_seconds : 0.0);
    std::printf("overlap (slowest stage %s / step): %.3f\n", std::string(stage_name(static_cast<Stage>(slowest_stage))).c_str(), overlap);
    std::printf("device peak %.1f MiB of a %.1f MiB budget; training state %.1f MiB; NVMe read per step %.1f MiB\n",
                peak / 1048576.0, r.device_budget_bytes / 1048576.0, state_bytes / 1048576.0, nvme_read / 1048576.0);
  }
  nlohmann::json busy;
  for (size_t s = 0; s < kStageCount; ++s) busy[std::string(stage_name(static_cast<Stage>(s)))] = r.busy[s];
  nlohmann::json out = {{"bench", "step"},
                        {"step_s", r.step_seconds},
                        {"busy_s", busy},
                        {"overlap", overlap},
                        {"device_peak_bytes", peak},
                        {"device_budget_bytes", r.device_budget_bytes},
                        {"state_bytes", state_bytes},
                        {"nvme_bytes_read", nvme_read}};
  if (o.json) std::printf("%s\n", out.dump().c_str());
  return 0;
}

}  // namespace strata::bench
