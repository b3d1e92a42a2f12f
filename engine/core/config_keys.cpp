// The config's keys: one line per key, grouped by DeepSpeed section, then Strata's own
// (a table of data; docs/config.md lists the same keys for users).
#include <initializer_list>
#include <limits>
#include <string>
#include <utility>
#include <vector>

#include "engine/core/config_schema.h"
#include "engine/core/device.h"
#include "engine/core/dtype.h"

namespace strata::config_detail {

namespace {

#define FIELD(member) [](StrataConfig& c) -> auto& { return c.member; }

IntCodec positive() { return IntCodec{.min = 1}; }
IntCodec non_negative() { return IntCodec{.min = 0}; }
// For counts the engine holds in an `int`: larger values are refused here, never narrowed later.
IntCodec positive_int() { return IntCodec{.min = 1, .max = std::numeric_limits<int>::max()}; }
IntCodec non_negative_int() { return IntCodec{.min = 0, .max = std::numeric_limits<int>::max()}; }
DoubleCodec non_negative_number() { return DoubleCodec{.min = 0.0}; }
DoubleCodec positive_number() { return DoubleCodec{.min = 0.0, .min_exclusive = true}; }
template <class C>
OptionalCodec<C> optional_of(C inner) { return OptionalCodec<C>{.inner = std::move(inner)}; }

// "cpu" reads as kPinned; finalize() makes it kHost when pin_memory is false, and the
// alias lets to_json() write kHost back as "cpu" (decoding stops at the names first).
EnumCodec<Tier> placement_codec() {
  return EnumCodec<Tier>{
      .names = {{"none", Tier::kDevice}, {"cpu", Tier::kPinned}, {"nvme", Tier::kNvme}},
      .aliases = {{"device", Tier::kDevice}, {"cpu", Tier::kHost}},
      .not_implemented = {"hpu"}};
}

// Names from the enum's own name function, so the config and the code spell them alike.
template <class E, class NameOf>
EnumCodec<E> named_codec(std::initializer_list<E> values, NameOf name_of) {
  EnumCodec<E> codec;
  for (E value : values) codec.names.emplace_back(std::string(name_of(value)), value);
  return codec;
}

EnumCodec<DType> dtype_codec(bool allow_fp16) {
  EnumCodec<DType> codec;
  codec.names = {{"bf16", DType::kBFloat16}};
  if (allow_fp16) codec.names.push_back({"fp16", DType::kFloat16});
  codec.names.push_back({"fp32", DType::kFloat32});
  codec.aliases = {{"bfloat16", DType::kBFloat16}, {"float32", DType::kFloat32}, {"float", DType::kFloat32}};
  if (allow_fp16) {
    codec.aliases.push_back({"float16", DType::kFloat16});
    codec.aliases.push_back({"half", DType::kFloat16});
  }
  return codec;
}

EnumCodec<WarmupType> warmup_type_codec() {
  return EnumCodec<WarmupType>{.names = {{"log", WarmupType::kLog}, {"linear", WarmupType::kLinear}}};
}

// Reasons shown with the warning for a DeepSpeed key Strata does not act on.
constexpr const char* kMonitoring = "DeepSpeed's monitoring; Strata writes strata.metrics and strata.trace instead";
constexpr const char* kCommTuning = "Strata schedules its own collectives (per parameter group); this knob does not apply";
constexpr const char* kAlwaysOverlapped = "Strata always overlaps communication and copies with compute";
constexpr const char* kNotImplemented = "a DeepSpeed feature Strata does not implement";
constexpr const char* kCheckpointing = "Strata's checkpoints are written by its own checkpoint code";
constexpr const char* kPythonOnly = "applies to DeepSpeed's PyTorch integration only";
constexpr const char* kIoEngine = "Strata's I/O engine is set by strata.io_engine, aio.block_size and aio.queue_depth";
constexpr const char* kQuantized = "Strata does not quantize weights or gradients";

// DeepSpeed: batch size, logging, clipping.
void add_training_loop_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("train_batch_size", FIELD(train_batch_size), optional_of(positive())));
  add(value_key("train_micro_batch_size_per_gpu", FIELD(train_micro_batch_size_per_gpu), optional_of(positive())));
  add(value_key("gradient_accumulation_steps", FIELD(gradient_accumulation_steps), optional_of(positive_int())));
  add(value_key("steps_per_print", FIELD(steps_per_print), non_negative_int()));
  add(value_key("wall_clock_breakdown", FIELD(wall_clock_breakdown), BoolCodec{}));
  add(value_key("gradient_clipping", FIELD(gradient_clipping), non_negative_number()));
}

// DeepSpeed: zero_optimization.
void add_zero_optimization_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("zero_optimization.stage", FIELD(zero.stage), SmallIntCodec{IntCodec{.min = 0, .max = 3}}));
  add(value_key("zero_optimization.offload_param.device", FIELD(zero.offload_param.device), placement_codec()));
  add(alias_key("zero_optimization.offload_param.nvme_path", "strata.nvme_path"));
  add(value_key("zero_optimization.offload_param.pin_memory", FIELD(zero.offload_param.pin_memory), BoolCodec{}));
  add(value_key("zero_optimization.offload_param.buffer_count", FIELD(zero.offload_param.buffer_count), optional_of(positive_int())));
  add(ignored_key("zero_optimization.offload_param.buffer_size",
                  "Strata sizes each parameter staging buffer by the largest group shard it must hold"));
  add(ignored_key("zero_optimization.offload_param.max_in_cpu", "host memory is bounded by strata.pinned_budget_mib"));
  add(value_key("zero_optimization.offload_optimizer.device", FIELD(zero.offload_optimizer.device), placement_codec()));
  add(alias_key("zero_optimization.offload_optimizer.nvme_path", "strata.nvme_path"));
  add(value_key("zero_optimization.offload_optimizer.pin_memory", FIELD(zero.offload_optimizer.pin_memory), BoolCodec{}));
  add(value_key("zero_optimization.offload_optimizer.buffer_count", FIELD(zero.offload_optimizer.buffer_count),
                optional_of(IntCodec{.min = 3, .max = std::numeric_limits<int>::max()})));
  add(ignored_key("zero_optimization.offload_optimizer.ratio", "all of the optimizer state goes where offload_optimizer.device says"));
  add(ignored_key("zero_optimization.offload_optimizer.pipeline_read", "Strata's optimizer-state pipeline always overlaps NVMe reads with the optimizer"));
  add(ignored_key("zero_optimization.offload_optimizer.pipeline_write", "Strata's optimizer-state pipeline always overlaps NVMe writes with the optimizer"));
  add(ignored_key("zero_optimization.offload_optimizer.pipeline", "Strata always pipelines the optimizer-state streams"));
  add(ignored_key("zero_optimization.offload_optimizer.fast_init", "Strata has no separate fast-initialization path"));
  add(value_key("zero_optimization.stage3_prefetch_bucket_size", FIELD(zero.prefetch_bucket_size), non_negative()));
  add(value_key("zero_optimization.stage3_max_live_parameters", FIELD(zero.max_live_parameters), non_negative()));
  add(value_key("zero_optimization.stage3_param_persistence_threshold", FIELD(zero.param_persistence_threshold), non_negative()));
  add(value_key("zero_optimization.reduce_bucket_size", FIELD(zero.reduce_bucket_size), optional_of(positive())));
  add(value_key("zero_optimization.sub_group_size", FIELD(zero.sub_group_size), optional_of(positive())));
  add(deprecated_cpu_offload_key("zero_optimization.cpu_offload", "zero_optimization.offload_optimizer.device"));
  add(deprecated_cpu_offload_key("zero_optimization.cpu_offload_param", "zero_optimization.offload_param.device"));
  add(ignored_key("zero_optimization.cpu_offload_use_pin_memory", "deprecated in DeepSpeed; set pin_memory in offload_param or offload_optimizer"));
  for (const char* key : {"allgather_partitions", "allgather_bucket_size", "reduce_scatter", "use_multi_rank_bucket_allreduce",
                          "stage3_use_all_reduce_for_fetch_params"}) {
    add(ignored_key(std::string("zero_optimization.") + key, kCommTuning));
  }
  add(ignored_key("zero_optimization.overlap_comm", kAlwaysOverlapped));
  add(ignored_key("zero_optimization.contiguous_gradients", "Strata's gradient shards are always contiguous per parameter group"));
  add(ignored_key("zero_optimization.stage3_max_reuse_distance", "Strata releases gathered groups by its recorded schedule, not by reuse distance"));
  add(ignored_key("zero_optimization.stage3_model_persistence_threshold", "Strata bounds unpartitioned tensors with stage3_param_persistence_threshold only"));
  add(ignored_key("zero_optimization.stage3_module_granularity_threshold", "Strata gathers whole parameter groups (layers)"));
  add(ignored_key("zero_optimization.stage3_gather_16bit_weights_on_model_save", kCheckpointing));
  add(ignored_key("zero_optimization.stage3_gather_fp16_weights_on_model_save", kCheckpointing));
  add(ignored_key("zero_optimization.gather_16bit_weights_on_model_save", kCheckpointing));
  add(ignored_key("zero_optimization.load_from_fp32_weights", kCheckpointing));
  add(ignored_key("zero_optimization.elastic_checkpoint", kCheckpointing));
  add(ignored_key("zero_optimization.pipeline_loading_checkpoint", kCheckpointing));
  add(ignored_key("zero_optimization.ignore_unused_parameters", kPythonOnly));
  add(ignored_key("zero_optimization.memory_efficient_linear", kPythonOnly));
  add(ignored_key("zero_optimization.override_module_apply", kPythonOnly));
  add(ignored_key("zero_optimization.log_trace_cache_warnings", kPythonOnly));
  add(ignored_key("zero_optimization.legacy_stage1", "Strata implements stage 3 only"));
  add(ignored_key("zero_optimization.round_robin_gradients", "a stage 1/2 option; Strata implements stage 3"));
  add(ignored_key("zero_optimization.parameter_alignment", "a stage 1/2 option; Strata aligns its own group buffers"));
  add(ignored_key("zero_optimization.compute_grad_norm", "a stage 1/2 option; Strata computes the norm when clipping needs it"));
  add(ignored_key("zero_optimization.zero_hpz_partition_size", kNotImplemented));
  add(ignored_key("zero_optimization.zero_quantized_weights", kQuantized));
  add(ignored_key("zero_optimization.zero_quantized_nontrainable_weights", kQuantized));
  add(ignored_key("zero_optimization.zero_quantized_gradients", kQuantized));
  add(ignored_key("zero_optimization.zeropp_loco_param", kQuantized));
  add(ignored_key("zero_optimization.mics_shard_size", kNotImplemented));
  add(ignored_key("zero_optimization.mics_hierarchical_params_gather", kNotImplemented));
  add(ignored_key("zero_optimization.save_muon_momentum_buffer_in_memory", "Strata implements Adam and AdamW only"));
  add(ignored_key("zero_optimization.zenflow", kNotImplemented));
}

// DeepSpeed: aio.
void add_aio_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("aio.block_size", FIELD(aio.block_size), IntCodec{.min = 4096, .multiple_of = 4096}));
  add(value_key("aio.queue_depth", FIELD(aio.queue_depth), IntCodec{.min = 1, .max = 32768}));
  add(ignored_key("aio.thread_count", kIoEngine));
  add(ignored_key("aio.single_submit", "Strata's I/O engine decides how it batches submissions"));
  add(ignored_key("aio.overlap_events", "Strata keeps up to aio.queue_depth requests in flight"));
  add(ignored_key("aio.use_gds", "Strata does not use GPUDirect Storage"));
  add(ignored_key("aio.intra_op_parallelism", kIoEngine));
}

// DeepSpeed: precision.
void add_precision_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("bf16.enabled", FIELD(bf16.enabled), BoolCodec{}));
  add(alias_key("bfloat16.enabled", "bf16.enabled"));  // DeepSpeed's older name for the section
  for (const char* section : {"bf16", "bfloat16"}) {
    add(ignored_key(std::string(section) + ".bf16_master_weights_and_grads", "Strata keeps fp32 master weights and gradients"));
    add(ignored_key(std::string(section) + ".bf16_optimizer_states", "Strata keeps fp32 optimizer state"));
  }
  add(value_key("fp16.enabled", FIELD(fp16.enabled), BoolCodec{}));
  add(value_key("fp16.loss_scale", FIELD(fp16.loss_scale), non_negative_number()));
  add(value_key("fp16.initial_scale_power", FIELD(fp16.initial_scale_power), IntCodec{.min = 0, .max = 64}));
  add(value_key("fp16.loss_scale_window", FIELD(fp16.loss_scale_window), positive_int()));
  add(value_key("fp16.hysteresis", FIELD(fp16.hysteresis), positive_int()));
  add(value_key("fp16.min_loss_scale", FIELD(fp16.min_loss_scale), positive_number()));
  add(ignored_key("fp16.auto_cast", "Strata has no input auto-casting"));
  add(ignored_key("fp16.consecutive_hysteresis", "not configurable in Strata"));
  add(ignored_key("fp16.fp16_master_weights_and_grads", "Strata keeps fp32 master weights and gradients"));
}

// DeepSpeed: optimizer.
void add_optimizer_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("optimizer.type", FIELD(optimizer.type),
                EnumCodec<OptimizerType>{
                    .names = {{"Adam", OptimizerType::kAdam}, {"AdamW", OptimizerType::kAdamW}},
                    .not_implemented = {"Lamb", "OneBitAdam", "ZeroOneAdam", "OneBitLamb", "Adagrad", "Lion", "Muon",
                                        "MuAdam", "MuAdamW", "MuSGD", "SGD", "FusedLamb"},
                    .case_insensitive = true}));
  add(value_key("optimizer.params.lr", FIELD(optimizer.lr), non_negative_number()));
  add(value_key("optimizer.params.betas", FIELD(optimizer.betas), BetasCodec{}));
  add(value_key("optimizer.params.eps", FIELD(optimizer.eps), positive_number()));
  add(value_key("optimizer.params.weight_decay", FIELD(optimizer.weight_decay), non_negative_number()));
  add(value_key("optimizer.params.adam_w_mode", FIELD(optimizer.adam_w_mode), BoolCodec{}));
  add(restricted_key("optimizer.params.bias_correction", true, "Strata's Adam always corrects the moments' bias"));
  add(restricted_key("optimizer.params.amsgrad", false, "Strata's Adam does not implement AMSGrad"));
  add(restricted_key("optimizer.params.maximize", false, "Strata's Adam minimizes"));
  add(ignored_key("optimizer.params.torch_adam", "Strata always uses its own Adam"));
  add(ignored_key("optimizer.params.max_grad_norm", "use gradient_clipping, as DeepSpeed asks too"));
  for (const char* key : {"fused", "foreach", "capturable", "differentiable", "set_grad_none"}) {
    add(ignored_key(std::string("optimizer.params.") + key, "a PyTorch implementation choice"));
  }
  add(ignored_key("optimizer.legacy_fusion", kPythonOnly));
}

// DeepSpeed: scheduler.
void add_scheduler_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("scheduler.type", FIELD(scheduler.type),
                EnumCodec<SchedulerType>{.names = {{"WarmupLR", SchedulerType::kWarmupLR},
                                                   {"WarmupDecayLR", SchedulerType::kWarmupDecayLR},
                                                   {"WarmupCosineLR", SchedulerType::kWarmupCosineLR}},
                                         .not_implemented = {"OneCycle", "LRRangeTest"},
                                         .case_insensitive = true}));
  add(value_key("scheduler.params.warmup_min_lr", FIELD(scheduler.warmup_min_lr), optional_of(non_negative_number())));
  add(value_key("scheduler.params.warmup_max_lr", FIELD(scheduler.warmup_max_lr), optional_of(non_negative_number())));
  add(value_key("scheduler.params.warmup_num_steps", FIELD(scheduler.warmup_num_steps), optional_of(positive())));
  add(value_key("scheduler.params.warmup_type", FIELD(scheduler.warmup_type), optional_of(warmup_type_codec())));
  add(value_key("scheduler.params.total_num_steps", FIELD(scheduler.total_num_steps), optional_of(positive())));
  add(value_key("scheduler.params.warmup_min_ratio", FIELD(scheduler.warmup_min_ratio), optional_of(DoubleCodec{.min = 0.0, .max = 1.0})));
  add(value_key("scheduler.params.cos_min_ratio", FIELD(scheduler.cos_min_ratio), optional_of(DoubleCodec{.min = 0.0, .max = 1.0})));
  add(ignored_key("scheduler.params.last_batch_iteration", "Strata resumes the schedule from the checkpoint's step"));
}

// DeepSpeed: everything else Strata knows and does not act on.
void add_unused_deepspeed_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(ignored_key("activation_checkpointing", "use strata.model.activation_checkpointing"));
  for (const char* key : {"flops_profiler", "tensorboard", "wandb", "comet", "csv_monitor", "comms_logger", "memory_breakdown", "dump_state", "timers"}) {
    add(ignored_key(key, kMonitoring));
  }
  for (const char* key : {"communication_data_type", "seq_parallel_communication_data_type", "prescale_gradients",
                          "gradient_predivide_factor", "gradient_allreduce_op", "fp32_allreduce", "disable_allgather"}) {
    add(ignored_key(key, kCommTuning));
  }
  add(ignored_key("zero_allow_untested_optimizer", "Strata runs only its own Adam and AdamW"));
  add(ignored_key("zero_force_ds_cpu_optimizer", "Strata always uses its own CPU Adam for offloaded state"));
  add(ignored_key("sparse_gradients", "Strata's gradients are dense"));
  add(ignored_key("amp", "Apex AMP; use bf16 or fp16"));
  add(ignored_key("torch_autocast", "use bf16 or fp16"));
  add(ignored_key("data_types", "Strata accumulates gradients in fp32; see strata.grad_wire_dtype"));
  add(ignored_key("checkpoint", kCheckpointing));
  add(ignored_key("nebula", kCheckpointing));
  add(ignored_key("datastates", kCheckpointing));
  add(ignored_key("dataloader_drop_last", "strata.data decides how samples are batched"));
  add(ignored_key("vocabulary_size", "use strata.model.vocab_size"));
  for (const char* key : {"sparse_attention", "pipeline", "progressive_layer_drop", "curriculum_learning", "data_efficiency",
                          "quantize_training", "compression_training", "weight_quantization", "eigenvalue", "elasticity",
                          "autotuning", "tensor_parallel", "expert_parallel", "hybrid_engine", "compile", "graph_harvesting",
                          "use_data_before_expert_parallel_", "sequence_parallel_size"}) {
    add(ignored_key(key, kNotImplemented));
  }
  add(ignored_key("managed_gradient_accumulation", "Strata's step loop always manages accumulation"));
  add(ignored_key("disable_python_gc", kPythonOnly));
  add(ignored_key("log_level", "use the STRATA_LOG_LEVEL environment variable"));
}

// Strata's own.
void add_strata_keys(std::vector<KeySpec>& s) {
  auto add = [&s](KeySpec spec) { s.push_back(std::move(spec)); };
  add(value_key("strata.device", FIELD(strata.device),
                OptionalCodec<EnumCodec<DeviceKind>>{
                    .inner = {.names = {{"cpu", DeviceKind::kCpu}, {"cuda", DeviceKind::kCuda}}, .aliases = {{"gpu", DeviceKind::kCuda}}},
                    .unset_name = "auto"}));
  add(value_key("strata.world_size", FIELD(strata.world_size), IntCodec{.min = 1, .max = 1 << 20}));
  add(value_key("strata.device_budget_mib", FIELD(strata.device_budget_mib), non_negative()));
  add(value_key("strata.pinned_budget_mib", FIELD(strata.pinned_budget_mib), non_negative()));
  add(value_key("strata.compute_threads", FIELD(strata.compute_threads), IntCodec{.min = 0, .max = 4096}));
  add(value_key("strata.device_thread_nice", FIELD(strata.device_thread_nice), IntCodec{.min = 0, .max = 19}));
  add(value_key("strata.matmul_precision", FIELD(strata.matmul_precision),
                named_codec({MatmulPrecision::kFp32, MatmulPrecision::kTf32, MatmulPrecision::kBf16}, matmul_precision_name)));
  add(value_key("strata.optimizer_threads", FIELD(strata.optimizer_threads), IntCodec{.min = 0, .max = 4096}));
  add(value_key("strata.optimizer_overlap", FIELD(strata.optimizer_overlap),
                named_codec({OverlapMode::kExact, OverlapMode::kDelayed}, overlap_mode_name)));
  add(value_key("strata.grad_wire_dtype", FIELD(strata.grad_wire_dtype), dtype_codec(/*allow_fp16=*/false)));
  add(value_key("strata.param_dtype", FIELD(strata.param_dtype), optional_of(dtype_codec(/*allow_fp16=*/true))));
  add(alias_key("strata.persistence_threshold", "zero_optimization.stage3_param_persistence_threshold"));
  add(value_key("strata.prefetch_depth", FIELD(strata.prefetch_depth),
                OptionalCodec<IntCodec>{.inner = {.min = 0, .max = 64}, .unset_name = "auto"}));
  add(value_key("strata.nvme_path", FIELD(strata.nvme_path), StringCodec{}));
  add(value_key("strata.nvme_checksum", FIELD(strata.nvme_checksum), BoolCodec{}));
  add(value_key("strata.io_engine", FIELD(strata.io_engine),
                named_codec({IoEngineKind::kAuto, IoEngineKind::kIoUring, IoEngineKind::kPsync}, io_engine_kind_name)));
  add(value_key("strata.metrics", FIELD(strata.metrics), StringCodec{}));
  add(value_key("strata.trace", FIELD(strata.trace), StringCodec{}));
  add(value_key("strata.seed", FIELD(strata.seed), non_negative()));
  add(value_key("strata.checkpoint.on_save_failure", FIELD(strata.on_save_failure),
                named_codec({SaveFailurePolicy::kStop, SaveFailurePolicy::kContinue}, save_failure_policy_name)));
  add(value_key("strata.max_nonfinite_steps", FIELD(strata.max_nonfinite_steps), non_negative()));
}

}  // namespace

std::vector<KeySpec> build_schema() {
  std::vector<KeySpec> s;
  add_training_loop_keys(s);
  add_zero_optimization_keys(s);
  add_aio_keys(s);
  add_precision_keys(s);
  add_optimizer_keys(s);
  add_scheduler_keys(s);
  add_unused_deepspeed_keys(s);
  add_strata_keys(s);
  return s;
}

#undef FIELD

}  // namespace strata::config_detail
