#include "examples/profile/step_cost.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <sstream>

#include "examples/profile/kernel_ops.h"
#include "examples/profile/step_replay.h"
#include "offload/io_engine.h"

namespace strata::profile {

namespace {

std::string name_of(Stage stage) { return std::string(stage_name(stage)); }

// Builds the rows, one per kind of work that the step has.
class RowBuilder {
 public:
  explicit RowBuilder(StepPrediction& out) : out_(out) {}
  void add(Stage stage, std::string what, double amount, std::string unit, double rate, std::string source) {
    if (amount <= 0) return;
    CostRow row{name_of(stage), std::move(what), amount, std::move(unit), rate, std::move(source), std::nullopt};
    if (rate > 0) {
      row.seconds = amount / rate;
      out_.busy[static_cast<size_t>(stage)] += *row.seconds;
    } else {
      out_.unknown.push_back(row.stage + " (" + row.what + ")");
    }
    out_.rows.push_back(std::move(row));
  }

 private:
  StepPrediction& out_;
};

std::string nvme_source(const NvmeRate* rate, const char* direction) {
  if (rate == nullptr) return "none";
  return std::string("nvme ") + direction + " " + std::to_string(rate->block_bytes >> 10) + " KiB QD" + std::to_string(rate->queue_depth) +
         (rate->checksums ? " checksums on" : " checksums off");
}

// The landing pass's rate in bytes as StepWork counts them: the profile's measured pass
// (statistics alone with one micro-batch, accumulation with several), else twice a
// copy's rate (a copy reads and writes each byte), which is the host memory's only on the
// CPU device.
struct LandingFigure {
  double bytes_per_s = 0;
  std::string source;
};
LandingFigure landing_figure(const MachineProfile& p, const PipelineShape& shape) {
  if (p.landing) {
    const bool accumulate = shape.micro_batches > 1;
    return {accumulate ? p.landing->accumulate_bytes_per_s : p.landing->stats_bytes_per_s,
            std::string("landing ") + (accumulate ? "accumulation" : "statistics") + ", " + std::to_string(p.landing->threads) + " threads"};
  }
  const std::string copy = p.copy.host_copy ? "host copy" : (p.copy.pinned ? "pinned copy" : "pageable copy");
  return {2 * p.copy.d2h_bytes_per_s, copy + " d2h x 2 (host memory traffic)"};
}

void add_transfer_rows(RowBuilder& rows, const StepWork& w, const PipelineShape& shape, const MachineProfile& p, const NvmeRate* nvme) {
  const double read = nvme ? nvme->read_bytes_per_s : 0, write = nvme ? nvme->write_bytes_per_s : 0;
  rows.add(Stage::kNvmeRead, "parameter shards", w.param_read_bytes, "B", read, nvme_source(nvme, "read"));
  rows.add(Stage::kNvmeRead, "optimizer state", w.state_read_bytes, "B", read, nvme_source(nvme, "read"));
  rows.add(Stage::kNvmeWrite, "new parameters", w.param_write_bytes, "B", write, nvme_source(nvme, "write"));
  rows.add(Stage::kNvmeWrite, "optimizer state", w.state_write_bytes, "B", write, nvme_source(nvme, "write"));
  const std::string copy = p.copy.host_copy ? "host copy" : (p.copy.pinned ? "pinned copy" : "pageable copy");
  rows.add(Stage::kH2D, "parameter shards", w.h2d_bytes, "B", p.copy.h2d_bytes_per_s, copy + " h2d");
  // On the CPU device (a host copy) CPU Adam writes the device's parameters in place: no copy.
  if (!p.copy.host_copy) rows.add(Stage::kH2D, "new parameters", w.h2d_update_bytes, "B", p.copy.h2d_bytes_per_s, copy + " h2d");
  const CommunicatorRate& comm = p.communicator;
  const bool same_world = comm.world == shape.world;
  rows.add(Stage::kAllGather, "full groups", w.allgather_bytes, "B", same_world ? comm.all_gather_bytes_per_s.value_or(0) : 0,
           same_world ? "all_gather at world " + std::to_string(comm.world) : "none at world " + std::to_string(shape.world));
  rows.add(Stage::kReduceScatter, "full gradients", w.reduce_scatter_bytes, "B", same_world ? comm.reduce_scatter_bytes_per_s.value_or(0) : 0,
           same_world ? "reduce_scatter at world " + std::to_string(comm.world) : "none at world " + std::to_string(shape.world));
  const std::string cast_op = "grad cast to " + shape.grad_dtype;
  rows.add(Stage::kReduceScatter, "gradient cast to " + shape.grad_dtype, w.gradient_cast_bytes, "B", memory_op_rate(p, cast_op), cast_op);
  rows.add(Stage::kD2H, "gradient shards", w.d2h_bytes, "B", p.copy.d2h_bytes_per_s, copy + " d2h");
  const LandingFigure landing = landing_figure(p, shape);
  // A spilled gradient's write to NVMe counts in nvme_write (the store's stage; its bytes
  // are in state_write_bytes), as the engine traces it, not in the landing's host pass.
  rows.add(Stage::kLanding, "gradient shards (host memory)", w.landing_bytes, "B", landing.bytes_per_s, landing.source);
}

double compute_element_bytes(const MachineProfile& p) { return p.compute.dtype == "fp32" ? 4.0 : 2.0; }

// One row for a phase's memory-bound kernels: their bytes, each op at its own rate; the
// row's rate is the bytes over the summed seconds (0, so no seconds, when an op has none).
void add_memory_row(RowBuilder& rows, const std::string& what, const std::vector<MemoryPass>& passes, const MachineProfile& p,
                    const std::string& on) {
  double bytes = 0, seconds = 0;
  bool priced = true;
  for (const MemoryPass& pass : passes) {
    const double b = memory_op_accesses(pass.op).value_or(0.0) * pass.elements * compute_element_bytes(p);
    const double rate = memory_op_rate(p, pass.op);
    bytes += b;
    if (rate > 0) seconds += b / rate;
    else if (b > 0) priced = false;
  }
  rows.add(Stage::kCompute, what, bytes, "B", priced && seconds > 0 ? bytes / seconds : 0.0, "memory-bound ops, each at its rate" + on);
}

void add_compute_rows(RowBuilder& rows, const StepWork& w, const MachineProfile& p) {
  const double gemm = p.compute.gemm_flops_per_s, attention = p.compute.attention_flops_per_s;
  const std::string on = " (" + p.compute.device + " " + p.compute.dtype + ")";
  // The host's GEMMs stream each weight from memory into their packed panels, beside the
  // FLOPs that the profile's GEMM rate (weights in cache) leaves out: at the profile's
  // measured rate for that, else the host copy's (how much the streaming hides behind the
  // FLOPs differs between CPUs). A GPU's products read their weights at its memory's speed
  // within the measured rate: no row.
  const double streamed = !p.copy.host_copy ? 0.0 : p.compute.weight_stream_bytes_per_s.value_or(streaming_rate(p));
  const double element = compute_element_bytes(p);
  const std::string stream_source = p.compute.weight_stream_bytes_per_s ? "weights read from memory (measured)"
                                                                        : "host copy (weights streamed from memory)";
  rows.add(Stage::kCompute, "forward (GEMM)", w.forward_matmul_flops, "FLOP", gemm, "gemm" + on);
  rows.add(Stage::kCompute, "forward (attention)", w.forward_attention_flops, "FLOP", attention, "attention" + on);
  add_memory_row(rows, "forward (memory-bound ops)", w.forward_memory, p, on);
  if (streamed > 0) rows.add(Stage::kCompute, "forward (weights from memory)", w.forward_weight_elements * element, "B", streamed, stream_source);
  rows.add(Stage::kCompute, "recompute (GEMM)", w.recompute_matmul_flops, "FLOP", gemm, "gemm" + on);
  rows.add(Stage::kCompute, "recompute (attention)", w.recompute_attention_flops, "FLOP", attention, "attention" + on);
  add_memory_row(rows, "recompute (memory-bound ops)", w.recompute_memory, p, on);
  if (streamed > 0)
    rows.add(Stage::kCompute, "recompute (weights from memory)", w.recompute_weight_elements * element, "B", streamed, stream_source);
  rows.add(Stage::kCompute, "backward (GEMM)", w.backward_matmul_flops, "FLOP", gemm, "gemm" + on);
  rows.add(Stage::kCompute, "backward (attention)", w.backward_attention_flops, "FLOP", attention, "attention" + on);
  add_memory_row(rows, "backward (memory-bound ops)", w.backward_memory, p, on);
  if (streamed > 0) rows.add(Stage::kCompute, "backward (weights from memory)", w.backward_weight_elements * element, "B", streamed, stream_source);
  rows.add(Stage::kCompute, "backward (gradient buffers zeroed)", w.gradient_zero_bytes, "B", streaming_rate(p),
           p.copy.host_copy ? "host copy (a stream through memory)" : "memory-bound" + on);
}

void add_optimizer_row(RowBuilder& rows, const StepWork& w, const PipelineShape& shape, const MachineProfile& p) {
  if (shape.adam_on_device) {
    // fp32 master, moments and gradient read, master and moments written: 28 bytes per element.
    const double rate = p.compute.memory_bytes_per_s / 28.0;
    rows.add(Stage::kOptimizer, "Adam on the device", w.adam_elements, "elements", rate, "device memory / 28 B");
    return;
  }
  const AdamRate* adam = matching_adam_rate(p, shape.grad_dtype, shape.param_dtype);
  std::string source = "none";
  if (adam != nullptr)
    source = "cpu_adam " + adam->grad_dtype + "->" + adam->param_dtype + " x" + std::to_string(adam->threads) + " threads";
  rows.add(Stage::kOptimizer, "CPU Adam", w.adam_elements, "elements", adam ? adam->elements_per_s : 0, source);
}

double row_seconds(const StepPrediction& p, std::string_view what_prefix, Stage stage) {
  double total = 0;
  for (const CostRow& r : p.rows)
    if (r.stage == stage_name(stage) && r.what.rfind(what_prefix, 0) == 0 && r.seconds) total += *r.seconds;
  return total;
}

// The resources stages share: NVMe reads and writes take turns on one disk; on the CPU
// device (compute on the host's cores) compute, the copies, the cast, the landing and CPU
// Adam share the same cores; on a GPU the landing pass runs on CPU Adam's executor
// (engine/gradient_path.cpp), so the two take turns there. The disk and the executor bound
// the step by the sum of their stages' busy times, the cores by their core-seconds over
// the cores.
struct SharedBound {
  double seconds = 0;
  std::string name;
};
bool has_mixed_rate(const NvmeRate* nvme) { return nvme != nullptr && nvme->mixed_bytes_per_s && *nvme->mixed_bytes_per_s > 0; }

double together_seconds(double read, double write, const NvmeRate& nvme) {
  return disk_seconds(read, write, nvme.read_bytes_per_s, nvme.write_bytes_per_s, *nvme.mixed_bytes_per_s);
}

// The disk's time for the step's reads and writes: together where the profile has a mixed
// rate (a step reads and writes its state at once), else one after the other.
SharedBound disk_time(const StepPrediction& p, const StepWork& w, const NvmeRate* nvme) {
  const double read_busy = p.busy[static_cast<size_t>(Stage::kNvmeRead)], write_busy = p.busy[static_cast<size_t>(Stage::kNvmeWrite)];
  if (!has_mixed_rate(nvme)) return {read_busy + write_busy, "the disk (nvme_read + nvme_write)"};
  return {together_seconds(w.param_read_bytes + w.state_read_bytes, w.param_write_bytes + w.state_write_bytes, *nvme),
          "the disk (reads and writes at once)"};
}

// The store's checksum on one host thread, where the run's checksums are on and the profile
// measured it; 0 otherwise.
double checksum_rate(const PipelineShape& shape, const NvmeRate* nvme) {
  if (!shape.nvme_checksums || nvme == nullptr || !nvme->checksum_bytes_per_s || *nvme->checksum_bytes_per_s <= 0) return 0.0;
  return *nvme->checksum_bytes_per_s;
}

// The host's cores on the CPU device, and the cores each kind of its work keeps busy.
struct HostCores {
  int cores = 0;         // 0: not the CPU device (the host's cores are not the compute's)
  int adam_threads = 1;  // CPU Adam's, as its profile figure ran
  double checksum_bytes_per_s = 0;  // one thread's; 0: not priced
};
HostCores host_cores_of(const MachineProfile& profile, const PipelineShape& shape, const NvmeRate* nvme) {
  if (profile.compute.device != "cpu") return {};
  HostCores host{.cores = std::max(profile.host.cores, 1), .adam_threads = 1, .checksum_bytes_per_s = checksum_rate(shape, nvme)};
  const AdamRate* adam = matching_adam_rate(profile, shape.grad_dtype, shape.param_dtype);
  // Adam "on the device" is the CPU device's own kernel, on every core.
  host.adam_threads = shape.adam_on_device || adam == nullptr ? host.cores : std::clamp(adam->threads, 1, host.cores);
  return host;
}

// The CPU device's core-seconds over its cores: compute, the cast, the landing and the
// collectives keep every core busy, CPU Adam its threads, a copy one, and the store's
// checksums one per byte hashed at one thread's rate.
SharedBound host_cores_bound(const StepPrediction& p, const StepWork& w, const HostCores& host) {
  auto busy_of = [&](Stage s) { return p.busy[static_cast<size_t>(s)]; };
  const double all = host.cores;
  const double hashed = w.param_read_bytes + w.state_read_bytes + w.param_write_bytes + w.state_write_bytes;
  const double core_seconds =
      all * (busy_of(Stage::kCompute) + busy_of(Stage::kLanding) + busy_of(Stage::kAllGather) + busy_of(Stage::kReduceScatter)) +
      host.adam_threads * busy_of(Stage::kOptimizer) + busy_of(Stage::kH2D) + busy_of(Stage::kD2H) +
      (host.checksum_bytes_per_s > 0 ? hashed / host.checksum_bytes_per_s : 0.0);
  return {core_seconds / all, "the host's cores (compute, copies, cast, landing, optimizer, collectives and the store's checksums on the "
                              "CPU device, in core-seconds over the cores)"};
}

SharedBound shared_resources(const StepPrediction& p, const StepWork& w, const SharedBound& disk, const PipelineShape& shape,
                             const HostCores& host) {
  if (host.cores == 0) {
    if (shape.adam_on_device) return disk;  // the landing pass has the executor to itself
    const SharedBound executor{row_seconds(p, "gradient shards", Stage::kLanding) + p.busy[static_cast<size_t>(Stage::kOptimizer)],
                               "CPU Adam's executor (the landing pass and the optimizer)"};
    return executor.seconds > disk.seconds ? executor : disk;
  }
  const SharedBound cores = host_cores_bound(p, w, host);
  return cores.seconds > disk.seconds ? cores : disk;
}

// The chain the pipeline cannot overlap, and what it is made of; the step is the longest of
// it, the busiest stage and the shared resources.
void critical_path(StepPrediction& p, const StepWork& w, const PipelineShape& shape, const NvmeRate* nvme, const HostCores& host) {
  const double compute = p.busy[static_cast<size_t>(Stage::kCompute)];
  const double k = static_cast<double>(shape.micro_batches);
  const double forward_mb = row_seconds(p, "forward", Stage::kCompute) / k;
  const double backward_mb = (row_seconds(p, "backward", Stage::kCompute) + row_seconds(p, "recompute", Stage::kCompute)) / k;
  const double fetch = row_seconds(p, "parameter", Stage::kNvmeRead) + row_seconds(p, "parameter", Stage::kH2D) +
                       p.busy[static_cast<size_t>(Stage::kAllGather)];
  const double fill = shape.prefetch_depth == 0 ? fetch : (w.fetching_gathers > 0 ? fetch / w.fetching_gathers : 0.0);
  // The optimizer's time includes streaming its state when it lives on NVMe: its state ring
  // reads the next chunks while the last are written, so both directions at once where the
  // profile measured that.
  const double state_disk = has_mixed_rate(nvme) ? together_seconds(w.state_read_bytes, w.state_write_bytes, *nvme)
                                                 : row_seconds(p, "optimizer", Stage::kNvmeRead) + row_seconds(p, "optimizer", Stage::kNvmeWrite);
  const double optimizer = std::max(p.busy[static_cast<size_t>(Stage::kOptimizer)], state_disk);
  double waited = 0;
  if (shape.overlap == OverlapMode::kExact) {
    const double window = forward_mb + (shape.adam_during_backward ? backward_mb : 0.0);
    waited = std::max(0.0, optimizer - window);
  }
  const double gradients_out = shape.single_gradient_buffer ? p.busy[static_cast<size_t>(Stage::kReduceScatter)] +
                                                                   row_seconds(p, "gradient", Stage::kD2H)
                                                             : 0.0;
  p.chain_seconds = compute + fill + waited + gradients_out;
  std::string chain = "compute";
  if (fill > 0) chain += shape.prefetch_depth == 0 ? " + every parameter fetch (prefetch depth 0)" : " + the first fetch";
  if (waited > 0) chain += " + optimizer (exact overlap: forward(g) waits for Adam(g))";
  if (gradients_out > 0) chain += " + every group's gradients leaving (one gradient buffer)";
  size_t busiest = 0;
  for (size_t s = 1; s < kStageCount; ++s)
    if (p.busy[s] > p.busy[busiest]) busiest = s;
  p.pipeline_seconds = p.busy[busiest];
  std::string pipeline_bound = name_of(static_cast<Stage>(busiest));
  const SharedBound shared = shared_resources(p, w, disk_time(p, w, nvme), shape, host);
  if (shared.seconds > p.pipeline_seconds) {
    p.pipeline_seconds = shared.seconds;
    pipeline_bound = shared.name;
  }
  p.step_seconds = std::max(p.pipeline_seconds, p.chain_seconds);
  p.bound = p.pipeline_seconds >= p.chain_seconds ? pipeline_bound : "chain: " + chain;
}

// The replay's rates: the stages' rows' own figures, and the phases' predicted compute.
ReplayRates replay_rates(const StepPrediction& p, const PipelineShape& shape, const MachineProfile& profile, const NvmeRate* nvme,
                         const HostCores& host) {
  ReplayRates r;
  r.disk_read_bytes_per_s = nvme ? nvme->read_bytes_per_s : 0;
  r.disk_write_bytes_per_s = nvme ? nvme->write_bytes_per_s : 0;
  r.disk_mixed_bytes_per_s = has_mixed_rate(nvme) ? *nvme->mixed_bytes_per_s : 0;
  r.h2d_bytes_per_s = profile.copy.h2d_bytes_per_s;
  r.d2h_bytes_per_s = profile.copy.d2h_bytes_per_s;
  r.cast_bytes_per_s = memory_op_rate(profile, "grad cast to " + shape.grad_dtype);
  r.landing_bytes_per_s = landing_figure(profile, shape).bytes_per_s;
  if (shape.adam_on_device) {
    r.adam_elements_per_s = profile.compute.memory_bytes_per_s / 28.0;
  } else if (const AdamRate* adam = matching_adam_rate(profile, shape.grad_dtype, shape.param_dtype)) {
    r.adam_elements_per_s = adam->elements_per_s;
  }
  r.forward_seconds = row_seconds(p, "forward", Stage::kCompute);
  r.backward_seconds = row_seconds(p, "backward", Stage::kCompute) + row_seconds(p, "recompute", Stage::kCompute);
  r.host_cores = host.cores;
  r.adam_threads = host.adam_threads;
  r.checksum_bytes_per_s = host.checksum_bytes_per_s;
  r.checksum_threads = static_cast<int>(IoEngineOptions{}.verify_threads);  // the store's engine's verifier threads
  return r;
}

// Each stage's time in flight: the replay's, stretched by what shares the host's cores,
// plus the stage's rows it does not replay (the collectives, new parameters uploaded to a
// GPU). The disk's directions: the update's reads and writes (state, spilled gradients,
// new parameters) move together, each direction in flight the whole time; the parameter
// fetches' reads, and whatever one direction moves beyond the other, at their own rates.
void add_in_flight(StepPrediction& p, const StepWork& w, const NvmeRate* nvme, const ReplayResult& replay) {
  p.in_flight = p.busy;
  if (replay.step_seconds > 0) {
    for (const Stage s : {Stage::kCompute, Stage::kH2D, Stage::kD2H, Stage::kLanding, Stage::kOptimizer, Stage::kReduceScatter})
      p.in_flight[static_cast<size_t>(s)] = replay.in_flight[static_cast<size_t>(s)];
    p.in_flight[static_cast<size_t>(Stage::kH2D)] += row_seconds(p, "new parameters", Stage::kH2D);
    p.in_flight[static_cast<size_t>(Stage::kReduceScatter)] += row_seconds(p, "full gradients", Stage::kReduceScatter);
  }
  if (!has_mixed_rate(nvme)) return;
  auto seconds = [](double bytes, double rate) { return bytes > 0 && rate > 0 ? bytes / rate : 0.0; };
  const double reads = w.state_read_bytes, writes = w.state_write_bytes + w.param_write_bytes;
  const double both = std::min(reads, writes);
  const double together = seconds(2 * both, *nvme->mixed_bytes_per_s);
  p.in_flight[static_cast<size_t>(Stage::kNvmeRead)] =
      together + seconds(reads - both, nvme->read_bytes_per_s) + seconds(w.param_read_bytes, nvme->read_bytes_per_s);
  p.in_flight[static_cast<size_t>(Stage::kNvmeWrite)] = together + seconds(writes - both, nvme->write_bytes_per_s);
}

ReplayResult add_replay(StepPrediction& p, const StepWork& w, const PipelineShape& shape, const MachineProfile& profile,
                        const NvmeRate* nvme, const HostCores& host) {
  ReplayResult replay = replay_step(w, shape, replay_rates(p, shape, profile, nvme, host));
  p.replay_seconds = replay.step_seconds;
  if (p.replay_seconds > p.step_seconds) {
    p.step_seconds = p.replay_seconds;
    p.bound = "the schedule replayed group by group (fetches, compute and updates in the engine's order)";
  }
  return replay;
}

Status check_inputs(const StepWork& w, const PipelineShape& shape) {
  for (const double v : {w.param_read_bytes, w.state_read_bytes, w.param_write_bytes, w.state_write_bytes, w.h2d_bytes, w.h2d_update_bytes, w.allgather_bytes,
                         w.reduce_scatter_bytes, w.d2h_bytes, w.landing_bytes, w.forward_matmul_flops, w.forward_attention_flops,
                         w.backward_matmul_flops, w.backward_attention_flops, w.recompute_matmul_flops, w.recompute_attention_flops,
                         w.forward_weight_elements, w.recompute_weight_elements, w.backward_weight_elements, w.gradient_zero_bytes,
                         w.gradient_cast_bytes, w.adam_elements}) {
    if (!(v >= 0) || !std::isfinite(v)) return InvalidArgumentError("step work must be finite and >= 0");
  }
  for (const auto* passes : {&w.forward_memory, &w.recompute_memory, &w.backward_memory})
    for (const MemoryPass& pass : *passes)
      if (!(pass.elements >= 0) || !std::isfinite(pass.elements) || !memory_op_accesses(pass.op))
        return InvalidArgumentError("memory-bound op '" + pass.op + "': unknown, or its elements are not finite and >= 0");
  if (w.fetching_gathers < 0) return InvalidArgumentError("fetching gathers must be >= 0");
  if (shape.micro_batches < 1 || shape.world < 1 || shape.prefetch_depth < 0 || shape.nvme_queue_depth < 1 || shape.nvme_block_bytes == 0)
    return InvalidArgumentError("pipeline shape: micro-batches, world and NVMe queue depth >= 1, prefetch depth >= 0, block > 0");
  return {};
}

std::string amount_text(double amount, const std::string& unit) {
  char text[48];
  if (unit == "B") {
    if (amount >= 1e9) std::snprintf(text, sizeof(text), "%.2f GB", amount / 1e9);
    else std::snprintf(text, sizeof(text), "%.1f MB", amount / 1e6);
  } else if (unit == "FLOP") {
    std::snprintf(text, sizeof(text), "%.3g GFLOP", amount / 1e9);
  } else {
    std::snprintf(text, sizeof(text), "%.3g M elem", amount / 1e6);
  }
  return text;
}

std::string rate_text(double rate, const std::string& unit) {
  if (rate <= 0) return "-";
  char text[48];
  if (unit == "B") std::snprintf(text, sizeof(text), "%.2f GB/s", rate / 1e9);
  else if (unit == "FLOP") std::snprintf(text, sizeof(text), "%.3g GFLOP/s", rate / 1e9);
  else std::snprintf(text, sizeof(text), "%.3g M elem/s", rate / 1e6);
  return text;
}

}  // namespace

double disk_seconds(double read, double write, double read_rate, double write_rate, double mixed_rate) {
  auto seconds = [](double bytes, double rate) { return bytes > 0 ? bytes / rate : 0.0; };
  if (mixed_rate <= 0) return seconds(read, read_rate) + seconds(write, write_rate);
  const double both = std::min(read, write);
  return seconds(2 * both, mixed_rate) + seconds(read - both, read_rate) + seconds(write - both, write_rate);
}

const NvmeRate* nearest_nvme_rate(const MachineProfile& profile, uint64_t block_bytes, int queue_depth, bool checksums) {
  const NvmeRate* best = nullptr;
  double best_distance = 0;
  for (const NvmeRate& r : profile.nvme) {
    if (r.block_bytes == 0 || r.queue_depth < 1) continue;
    const double distance = (r.checksums == checksums ? 0.0 : 100.0) +
                            std::fabs(std::log2(double(r.block_bytes) / double(std::max<uint64_t>(block_bytes, 1)))) +
                            std::fabs(std::log2(double(r.queue_depth) / double(std::max(queue_depth, 1))));
    if (best == nullptr || distance < best_distance) {
      best = &r;
      best_distance = distance;
    }
  }
  return best;
}

const AdamRate* matching_adam_rate(const MachineProfile& profile, std::string_view grad_dtype, std::string_view param_dtype) {
  const AdamRate* best = nullptr;
  int best_score = -1;
  for (const AdamRate& r : profile.cpu_adam) {
    const int score = (r.grad_dtype == grad_dtype ? 2 : 0) + (r.param_dtype == param_dtype ? 1 : 0);
    if (score > best_score || (score == best_score && r.threads > best->threads)) {
      best = &r;
      best_score = score;
    }
  }
  return best;
}

StatusOr<StepPrediction> predict_step(const StepWork& work, const PipelineShape& shape, const MachineProfile& profile) {
  STRATA_RETURN_IF_ERROR(check_inputs(work, shape).with_context("predict_step"));
  StepPrediction prediction;
  RowBuilder rows(prediction);
  const NvmeRate* nvme = nearest_nvme_rate(profile, shape.nvme_block_bytes, shape.nvme_queue_depth, shape.nvme_checksums);
  add_transfer_rows(rows, work, shape, profile, nvme);
  add_compute_rows(rows, work, profile);
  add_optimizer_row(rows, work, shape, profile);
  const HostCores host = host_cores_of(profile, shape, nvme);
  critical_path(prediction, work, shape, nvme, host);
  const ReplayResult replay = add_replay(prediction, work, shape, profile, nvme, host);
  add_in_flight(prediction, work, nvme, replay);
  return prediction;
}

std::string format_prediction(const StepPrediction& prediction, std::string_view origin) {
  std::ostringstream text;
  text << "  predicted step (profile " << origin << "):\n";
  char line[256];
  std::snprintf(line, sizeof(line), "    %-15s %-31s %14s %16s %11s\n", "stage", "work", "amount", "rate", "seconds");
  text << line;
  for (const CostRow& r : prediction.rows) {
    const std::string seconds = r.seconds ? [&] {
      char s[32];
      std::snprintf(s, sizeof(s), "%.4f", *r.seconds);
      return std::string(s);
    }() : std::string("no rate");
    std::snprintf(line, sizeof(line), "    %-15s %-31s %14s %16s %11s\n", r.stage.c_str(), r.what.c_str(), amount_text(r.amount, r.unit).c_str(),
                  rate_text(r.rate, r.unit).c_str(), seconds.c_str());
    text << line;
  }
  std::snprintf(line, sizeof(line), "    busiest stage %.4f s, chain %.4f s, replay %.4f s: step %.4f s, bound by %s",
                prediction.pipeline_seconds, prediction.chain_seconds, prediction.replay_seconds, prediction.step_seconds,
                prediction.bound.c_str());
  text << line;
  if (!prediction.unknown.empty()) {
    text << "\n    left out (the profile has no rate): ";
    for (size_t i = 0; i < prediction.unknown.size(); ++i) text << (i ? ", " : "") << prediction.unknown[i];
  }
  return text.str();
}

nlohmann::ordered_json predicted_busy_json(const StepPrediction& prediction) {
  nlohmann::ordered_json busy;
  for (size_t s = 0; s < kStageCount; ++s) busy[name_of(static_cast<Stage>(s))] = prediction.in_flight[s];
  return busy;
}

}  // namespace strata::profile
