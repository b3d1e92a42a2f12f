#include "engine/engine_config.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>

namespace strata {
namespace {

constexpr int kMiBShift = 20;

// A non-negative count from the config as a size_t; sizes the loader bounds only from
// below are checked against size_t here.
StatusOr<size_t> to_size(int64_t value, std::string_view key) {
  if (value < 0) return InvalidArgumentError(std::string(key) + " is negative (" + std::to_string(value) + ")");
  return static_cast<size_t>(value);
}

StatusOr<size_t> mib_to_bytes(int64_t mib, std::string_view key) {
  STRATA_ASSIGN_OR_RETURN(const size_t count, to_size(mib, key));
  if (count > (std::numeric_limits<size_t>::max() >> kMiBShift))
    return InvalidArgumentError(std::string(key) + " (" + std::to_string(mib) + " MiB) is more bytes than this machine can address");
  return count << kMiBShift;
}

// An int option from an int64 key (the loader bounds the keys that reach here to small ranges).
int to_int(int64_t value) {
  return static_cast<int>(std::clamp<int64_t>(value, std::numeric_limits<int>::min(), std::numeric_limits<int>::max()));
}

// Dtypes: finalize() has set strata.param_dtype from bf16/fp16.enabled when it was not given.
void set_precision(const StrataConfig& config, EngineOptions& o) {
  o.param_dtype = config.strata.param_dtype.value_or(DType::kFloat32);
  const bool full_precision = o.param_dtype == DType::kFloat32;
  // grad_wire_dtype's default (bf16) applies to 16-bit training; fp32 training keeps fp32
  // gradients end to end unless the key asks otherwise.
  o.grad_wire_dtype = config.was_given("strata.grad_wire_dtype") ? config.strata.grad_wire_dtype
                                                                  : (full_precision ? DType::kFloat32 : DType::kBFloat16);
  o.grad_transfer_dtype = full_precision ? DType::kFloat32 : DType::kBFloat16;
  o.fp16_loss_scaling = config.fp16.enabled;
  if (!config.fp16.enabled) return;
  const bool dynamic = config.fp16.loss_scale == 0.0;
  o.loss_scaler.dynamic = dynamic;
  o.loss_scaler.initial_scale = dynamic ? std::ldexp(1.0f, to_int(config.fp16.initial_scale_power))
                                        : static_cast<float>(config.fp16.loss_scale);
  o.loss_scaler.growth_interval = to_int(config.fp16.loss_scale_window);
  o.loss_scaler.hysteresis = to_int(config.fp16.hysteresis);
  o.loss_scaler.min_scale = static_cast<float>(config.fp16.min_loss_scale);
}

// Tiers, budgets and the depths of the pipelines between them. Keys left unset leave the
// engine's automatic choice (kAutoDepth, 0).
Status set_placement(const StrataConfig& config, EngineOptions& o) {
  const ZeroConfig& zero = config.zero;
  o.pin_memory = zero.offload_param.pin_memory && zero.offload_optimizer.pin_memory;
  o.param_tier = zero.offload_param.device;  // finalize() resolved cpu to kPinned or kHost
  o.optimizer_tier = zero.offload_optimizer.device;
  o.nvme_path = config.strata.nvme_path;
  STRATA_ASSIGN_OR_RETURN(o.persistence_threshold,
                          to_size(zero.param_persistence_threshold, "zero_optimization.stage3_param_persistence_threshold"));
  o.prefetch_depth = config.strata.prefetch_depth ? to_int(*config.strata.prefetch_depth) : EngineOptions::kAutoDepth;
  STRATA_ASSIGN_OR_RETURN(o.prefetch_bucket_elements, to_size(zero.prefetch_bucket_size, "zero_optimization.stage3_prefetch_bucket_size"));
  STRATA_ASSIGN_OR_RETURN(o.max_live_elements, to_size(zero.max_live_parameters, "zero_optimization.stage3_max_live_parameters"));
  STRATA_ASSIGN_OR_RETURN(o.pinned_budget_bytes, mib_to_bytes(config.strata.pinned_budget_mib, "strata.pinned_budget_mib"));
  if (zero.sub_group_size) {
    STRATA_ASSIGN_OR_RETURN(o.sub_group_elements, to_size(*zero.sub_group_size, "zero_optimization.sub_group_size"));
  }
  if (zero.reduce_bucket_size) {
    STRATA_ASSIGN_OR_RETURN(o.reduce_bucket_elements, to_size(*zero.reduce_bucket_size, "zero_optimization.reduce_bucket_size"));
  }
  if (zero.offload_optimizer.buffer_count) o.optimizer_buffer_count = to_int(*zero.offload_optimizer.buffer_count);
  if (zero.offload_param.buffer_count) o.param_buffer_count = to_int(*zero.offload_param.buffer_count);
  return {};
}

void set_optimizer(const StrataConfig& config, EngineOptions& o) {
  o.gradient_accumulation_steps = to_int(*config.gradient_accumulation_steps);
  o.overlap = config.strata.optimizer_overlap;
  o.gradient_clipping = static_cast<float>(config.gradient_clipping);
  o.skip_non_finite_updates = config.strata.max_nonfinite_steps > 0;
  o.adam.lr = config.optimizer.lr;
  o.adam.beta1 = config.optimizer.betas[0];
  o.adam.beta2 = config.optimizer.betas[1];
  o.adam.eps = config.optimizer.eps;
  o.adam.weight_decay = config.optimizer.weight_decay;
  o.adam.decay = decoupled_weight_decay(config.optimizer) ? kernels::AdamWeightDecay::kDecoupled : kernels::AdamWeightDecay::kL2;
  o.optimizer_threads = to_int(config.strata.optimizer_threads);
}

void set_io_and_reporting(const StrataConfig& config, EngineOptions& o) {
  o.nvme_block_bytes = static_cast<size_t>(config.aio.block_size);  // the loader keeps it >= 4096
  o.nvme_queue_depth = to_int(config.aio.queue_depth);
  o.nvme_checksum = config.strata.nvme_checksum;
  o.io_engine = config.strata.io_engine;
  o.metrics_path = config.strata.metrics;
  o.trace_path = config.strata.trace;
  o.steps_per_print = to_int(config.steps_per_print);
  o.wall_clock_breakdown = config.wall_clock_breakdown;
}

}  // namespace

StatusOr<EngineOptions> engine_options_from_config(const StrataConfig& config, int rank) {
  if (!config.gradient_accumulation_steps || !config.strata.param_dtype)
    return FailedPreconditionError("engine options from " + config.source + ": the config is not finalized (call finalize() first)");
  if (rank < 0 || rank >= config.strata.world_size)
    return InvalidArgumentError("engine options from " + config.source + ": rank " + std::to_string(rank) + " is outside world size " +
                                std::to_string(config.strata.world_size));
  EngineOptions o;
  o.rank = rank;
  o.world_size = to_int(config.strata.world_size);
  o.seed = static_cast<uint64_t>(config.strata.seed);
  set_precision(config, o);
  STRATA_RETURN_IF_ERROR(set_placement(config, o).with_context("engine options from " + config.source));
  set_optimizer(config, o);
  set_io_and_reporting(config, o);
  return o;
}

}  // namespace strata
