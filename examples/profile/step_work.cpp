#include "examples/profile/step_work.h"

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "examples/profile/kernel_ops.h"

namespace strata::profile {

namespace {

double rounded_4k(double bytes) { return static_cast<double>((static_cast<uint64_t>(bytes) + 4095) / 4096 * 4096); }

// Gathers: uses per micro-batch of each group (the schedule, else forward and backward).
std::map<int, int> uses_per_micro_batch(const PlannedStepInputs& in) {
  std::map<int, int> uses;
  if (in.schedule.empty()) {
    for (const GroupLayout& g : in.layouts) uses[g.id] = 2;
  } else {
    for (int g : in.schedule) ++uses[g];
  }
  return uses;
}

// Each group's size and residence, and the order of one micro-batch's uses, for the replay.
void describe_groups(const PlannedStepInputs& in, StepWork& w) {
  w.groups.assign(in.layouts.size(), GroupWork{});
  for (size_t i = 0; i < in.layouts.size(); ++i) {
    w.groups[i].numel = static_cast<double>(in.layouts[i].numel);
    w.groups[i].persistent = i < in.plan->persistent.size() && in.plan->persistent[i] != 0;
  }
  if (in.schedule.empty()) {
    for (const GroupLayout& g : in.layouts) w.uses.push_back(g.id);
    for (auto g = in.layouts.rbegin(); g != in.layouts.rend(); ++g) w.uses.push_back(g->id);
  } else {
    w.uses.assign(in.schedule.begin(), in.schedule.end());
  }
  std::erase_if(w.uses, [&](int g) { return g < 0 || static_cast<size_t>(g) >= in.layouts.size(); });
}

void add_parameter_fetch(const PlannedStepInputs& in, StepWork& w) {
  const EngineOptions& o = *in.options;
  const double psize = static_cast<double>(dtype_size(o.param_dtype));
  const double k = static_cast<double>(o.gradient_accumulation_steps);
  const bool direct_view = o.param_tier == Tier::kDevice && o.world_size == 1;
  if (direct_view) return;  // the shards are the full groups, on the device
  for (const auto& [id, count] : uses_per_micro_batch(in)) {
    if (id < 0 || static_cast<size_t>(id) >= in.layouts.size()) continue;
    const GroupLayout& g = in.layouts[static_cast<size_t>(id)];
    const bool persistent = static_cast<size_t>(id) < in.plan->persistent.size() && in.plan->persistent[static_cast<size_t>(id)] != 0;
    const double fetches = persistent ? 1.0 : k * count;
    const double shard = static_cast<double>(g.shard_numel) * psize;
    GroupWork& part = w.groups[static_cast<size_t>(id)];
    if (o.param_tier == Tier::kNvme) part.fetch_read_bytes = rounded_4k(shard);
    if (o.param_tier != Tier::kDevice) part.fetch_h2d_bytes = shard;
    w.param_read_bytes += fetches * part.fetch_read_bytes;
    w.h2d_bytes += fetches * part.fetch_h2d_bytes;
    if (o.world_size > 1) w.allgather_bytes += fetches * static_cast<double>(g.padded_numel) * psize;
    if (!persistent) w.fetching_gathers += static_cast<int>(fetches);
  }
}

void add_gradients_and_update(const PlannedStepInputs& in, StepWork& w) {
  const EngineOptions& o = *in.options;
  const EnginePlan& plan = *in.plan;
  const double k = static_cast<double>(o.gradient_accumulation_steps);
  const double psize = static_cast<double>(dtype_size(o.param_dtype));
  const double wire = static_cast<double>(dtype_size(o.grad_wire_dtype));
  const bool device_optimizer = o.optimizer_tier == Tier::kDevice;
  // The optimizer on the device sends the fp32 gradient's copy for the statistics.
  const double transfer = device_optimizer ? 4.0 : static_cast<double>(dtype_size(o.grad_transfer_dtype));
  const double stored = k > 1 ? 4.0 : transfer;  // a spilled gradient: fp32 when accumulated
  for (const GroupLayout& g : in.layouts) {
    if (!g.trainable || g.id < 0 || static_cast<size_t>(g.id) >= w.groups.size()) continue;
    GroupWork& part = w.groups[static_cast<size_t>(g.id)];
    const double shard = static_cast<double>(g.shard_numel);
    if (o.world_size > 1) w.reduce_scatter_bytes += k * static_cast<double>(g.padded_numel) * wire;
    part.trainable = true;
    part.gradient_out_bytes = shard * transfer;
    // Read what landed; with micro-batches, add it into the fp32 accumulator (read + write).
    part.landing_bytes = shard * transfer + (k > 1 ? shard * 8.0 : 0.0);
    part.adam_elements = shard;
    if (plan.gradients_spilled) {
      part.spill_bytes = rounded_4k(shard * stored);
      w.state_read_bytes += part.spill_bytes * (k - 1);  // accumulation reads the earlier micro-batches' back
      part.update_read_bytes += part.spill_bytes;       // Adam reads the last
    }
    const double state = o.optimizer_tier == Tier::kNvme ? 3 * rounded_4k(shard * 4) : 0.0;  // master weights and moments
    const double new_parameters = o.param_tier == Tier::kNvme ? rounded_4k(shard * psize) : 0.0;
    part.update_read_bytes += state;
    part.update_write_bytes = state + new_parameters;
    if (state > 0 && plan.state_piece_elements > 0)
      part.update_pieces = static_cast<int>(std::min<size_t>((g.shard_numel + plan.state_piece_elements - 1) / plan.state_piece_elements,
                                                             size_t{1} << 20));
    if (o.param_tier == Tier::kDevice && !device_optimizer) w.h2d_update_bytes += shard * psize;
    w.d2h_bytes += k * part.gradient_out_bytes;
    w.landing_bytes += k * part.landing_bytes;
    w.adam_elements += part.adam_elements;
    w.state_write_bytes += k * part.spill_bytes + state;
    w.param_write_bytes += new_parameters;
    w.state_read_bytes += part.update_read_bytes;
  }
}

void add_flops(const ModelWork& m, int micro_batches, StepWork& w) {
  if (m.tokens <= 0) return;
  const double tokens = static_cast<double>(m.tokens) * micro_batches;
  const double weights = static_cast<double>(m.flops.matmul_weights);
  const double data_weights = static_cast<double>(m.flops.data_input_weights);
  const double head = static_cast<double>(m.head_weights);
  const double attention = static_cast<double>(m.flops.attention_layers) * static_cast<double>(m.seq_len) *
                           static_cast<double>(m.flops.attention_width);
  // Weights made again in backward: the blocks' with checkpointing, the head's when its
  // logits are recomputed.
  const double recomputed = (m.recompute ? weights - head : 0.0) + (m.memory.head_logits_recomputed ? head : 0.0);
  w.forward_matmul_flops = 2 * weights * tokens;
  w.backward_matmul_flops = (4 * weights - 2 * data_weights) * tokens;
  w.forward_attention_flops = 4 * attention * tokens;
  w.backward_attention_flops = 8 * attention * tokens;
  w.recompute_matmul_flops = 2 * recomputed * tokens;
  if (m.recompute) w.recompute_attention_flops = w.forward_attention_flops;
  const double passes = static_cast<double>(micro_batches);
  w.forward_weight_elements = weights * passes;
  w.recompute_weight_elements = recomputed * passes;
  w.backward_weight_elements = (2 * weights - data_weights) * passes;
}

void add_memory_ops(std::vector<MemoryPass>& to, const std::vector<lm::MemoryOp>& ops, double tokens) {
  for (const lm::MemoryOp& op : ops) to.push_back({op.op, op.elements_per_token * tokens});
}

void add_memory_bound(const ModelWork& m, int micro_batches, StepWork& w) {
  if (m.tokens <= 0) return;
  const double tokens = static_cast<double>(m.tokens) * micro_batches;
  add_memory_ops(w.forward_memory, m.memory.block_forward, tokens);
  add_memory_ops(w.forward_memory, m.memory.head_forward, tokens);
  if (m.recompute) add_memory_ops(w.recompute_memory, m.memory.block_forward, tokens);
  add_memory_ops(w.backward_memory, m.memory.block_backward, tokens);
  add_memory_ops(w.backward_memory, m.memory.head_backward, tokens);
}

// The engine's own device passes over the gradients: zeroing each buffer it hands out, and
// casting each fp32 gradient to the transfer dtype before its copy to the host.
void add_gradient_passes(const PlannedStepInputs& in, StepWork& w) {
  const EngineOptions& o = *in.options;
  const double k = static_cast<double>(o.gradient_accumulation_steps);
  const bool cast = o.optimizer_tier != Tier::kDevice && o.grad_transfer_dtype != DType::kFloat32;
  for (const GroupLayout& g : in.layouts) {
    if (!g.trainable) continue;
    if (in.model.gradient_buffers_zeroed) w.gradient_zero_bytes += k * static_cast<double>(g.padded_numel) * 4.0;
    if (!cast) continue;
    const double bytes = static_cast<double>(g.shard_numel) * (4.0 + static_cast<double>(dtype_size(o.grad_transfer_dtype)));
    w.gradient_cast_bytes += k * bytes;
    if (g.id >= 0 && static_cast<size_t>(g.id) < w.groups.size()) w.groups[static_cast<size_t>(g.id)].gradient_cast_bytes = bytes;
  }
}

Status check_memory_ops(const lm::MemoryBoundWork& memory) {
  for (const auto* ops : {&memory.block_forward, &memory.block_backward, &memory.head_forward, &memory.head_backward})
    for (const lm::MemoryOp& op : *ops) {
      if (!memory_op_accesses(op.op)) return InvalidArgumentError("planned_step: the model declares an unknown memory-bound op '" + op.op + "'");
      if (!(op.elements_per_token >= 0)) return InvalidArgumentError("planned_step: memory-bound op '" + op.op + "' has a negative count");
    }
  return {};
}

}  // namespace

StatusOr<PlannedStep> planned_step(const PlannedStepInputs& in) {
  if (in.options == nullptr || in.plan == nullptr) return InvalidArgumentError("planned_step: no options or plan");
  const EngineOptions& o = *in.options;
  if (o.gradient_accumulation_steps < 1) return InvalidArgumentError("planned_step: gradient_accumulation_steps must be >= 1");
  if (in.model.head_weights > in.model.flops.matmul_weights || in.model.seq_len < 0)
    return InvalidArgumentError("planned_step: the head's weights exceed the model's, or a negative seq_len");
  STRATA_RETURN_IF_ERROR(check_memory_ops(in.model.memory));
  PlannedStep out;
  describe_groups(in, out.work);
  add_parameter_fetch(in, out.work);
  add_gradients_and_update(in, out.work);
  add_flops(in.model, o.gradient_accumulation_steps, out.work);
  add_memory_bound(in.model, o.gradient_accumulation_steps, out.work);
  add_gradient_passes(in, out.work);
  PipelineShape& s = out.shape;
  s.prefetch_depth = in.plan->prefetch_depth;
  s.single_gradient_buffer = in.plan->single_gradient_buffer;
  s.overlap = o.overlap;
  s.micro_batches = o.gradient_accumulation_steps;
  s.world = o.world_size;
  s.adam_during_backward = o.overlap == OverlapMode::kExact && o.gradient_clipping == 0.0f && !o.fp16_loss_scaling;
  s.adam_on_device = o.optimizer_tier == Tier::kDevice;
  s.grad_dtype = std::string(dtype_name(o.grad_transfer_dtype));
  s.param_dtype = std::string(dtype_name(o.param_dtype));
  s.nvme_block_bytes = o.nvme_block_bytes;
  s.nvme_queue_depth = o.nvme_queue_depth;
  s.nvme_checksums = o.nvme_checksum;
  if (in.plan->state_ring_slots > 0) s.state_ring_slots = in.plan->state_ring_slots;
  return out;
}

}  // namespace strata::profile
