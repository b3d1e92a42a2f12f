#include "engine/gradient_path.h"

#include <algorithm>
#include <sstream>

#include "kernels/cast.h"
#include "kernels/transformer_ops.h"

namespace strata::engine_internal {

StatusOr<std::unique_ptr<GradientPath>> GradientPath::create(const GradientPathContext& context, GradientPathHooks hooks) {
  if (context.plan->gradients_spilled && context.spill == nullptr)
    return InternalError("gradient path: the plan spills gradients but there is no NVMe state to spill them to");
  if (context.board == nullptr) return InternalError("gradient path: no gradient board to publish the gradients on");
  auto path = std::make_unique<GradientPath>(context, std::move(hooks));
  if ((context.options->optimizer_tier == Tier::kDevice || path->lands_in_place()) && !path->hooks_.wait_for_update)
    return InternalError("gradient path: device-resident optimizer state and gradients landed in place need the wait for the previous update");
  STRATA_ASSIGN_OR_RETURN(GradientOps ops, GradientOps::create(*context.executor));
  path->ops_.emplace(std::move(ops));
  path->facts_.resize(context.layouts->size());
  path->buffers_.resize(context.layouts->size());
  return path;
}

GradientPath::~GradientPath() { stop(); }

Status GradientPath::allocate() {
  const EngineOptions& o = *ctx_.options;
  const EnginePlan& plan = *ctx_.plan;
  const size_t max_shard = plan.max_trainable_shard_elements;  // frozen groups take no gradients
  const size_t tsize = dtype_size(o.grad_transfer_dtype);
  const size_t world = static_cast<size_t>(o.world_size);
  slots_.resize(static_cast<size_t>(plan.gradient_slots));
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    const std::string name = "gradient slot " + std::to_string(i);
    slot.elements = plan.gradient_slot_elements[i];
    STRATA_ASSIGN_OR_RETURN(slot.full, ctx_.device->allocate(slot.elements * 4, name));
    if (world > 1) {
      STRATA_ASSIGN_OR_RETURN(slot.shard, ctx_.device->allocate(slot.elements / world * 4, name + " shard"));
    }
    if (plan.reduce_bucket_elements > 0) {
      STRATA_ASSIGN_OR_RETURN(slot.bucket, ctx_.device->allocate(plan.reduce_bucket_elements * 4 * static_cast<size_t>(o.world_size),
                                                                 name + " reduce bucket"));
    }
    STRATA_ASSIGN_OR_RETURN(slot.grads_done, ctx_.device->create_event());
    STRATA_ASSIGN_OR_RETURN(slot.reduced, ctx_.device->create_event());
    STRATA_ASSIGN_OR_RETURN(slot.copied, ctx_.device->create_event());
  }
  if (o.grad_transfer_dtype != DType::kFloat32 && o.optimizer_tier != Tier::kDevice && max_shard > 0) {
    STRATA_ASSIGN_OR_RETURN(cast_, ctx_.device->allocate(max_shard * tsize, "gradient transfer cast"));
    STRATA_ASSIGN_OR_RETURN(cast_free_, ctx_.device->create_event());
    STRATA_RETURN_IF_ERROR(ctx_.d2h->record(*cast_free_));
  }
  if (!plan.gradients_spilled) {
    for (const GroupLayout& layout : *ctx_.layouts) STRATA_RETURN_IF_ERROR(allocate_group_buffers(layout));
  } else {
    for (int i = 0; i < plan.landing_buffers; ++i) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer buffer, ctx_.arena->allocate(max_shard * tsize, "gradient landing ring " + std::to_string(i)));
      ring_.push_back(std::move(buffer));
    }
    ring_busy_.assign(ring_.size(), 0);
    if (o.gradient_accumulation_steps > 1) {
      STRATA_ASSIGN_OR_RETURN(scratch_, ctx_.arena->allocate(max_shard * 4, "gradient accumulation scratch"));
    }
  }
  for (const GroupLayout& layout : *ctx_.layouts) place_on_board(layout);
  return {};
}

// Not spilled: each group keeps its landing buffer (and fp32 accumulator), one per step
// parity in delayed mode, until the optimizer has read it; with device state, its device
// accumulator too.
Status GradientPath::allocate_group_buffers(const GroupLayout& layout) {
  if (!layout.trainable) return {};
  const EngineOptions& o = *ctx_.options;
  const size_t shard = layout.shard_numel;
  const size_t tsize = dtype_size(o.grad_transfer_dtype);
  const std::string name = "group " + layout.name;
  GroupBuffers& buffers = buffers_[static_cast<size_t>(layout.id)];
  const int copies = o.overlap == OverlapMode::kDelayed ? 2 : 1;
  if (lands_in_place()) {
    STRATA_ASSIGN_OR_RETURN(buffers.written, ctx_.device->create_event());
  }
  for (int c = 0; c < copies; ++c) {
    STRATA_ASSIGN_OR_RETURN(PinnedBuffer landing, ctx_.arena->allocate(shard * tsize, name + " gradient landing"));
    buffers.landing.push_back(std::move(landing));
    if (o.gradient_accumulation_steps > 1 && o.optimizer_tier != Tier::kDevice) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer accum, ctx_.arena->allocate(shard * 4, name + " gradient accumulator"));
      buffers.accum.push_back(std::move(accum));
    }
  }
  if (o.optimizer_tier != Tier::kDevice) return {};
  STRATA_ASSIGN_OR_RETURN(buffers.device_accum, ctx_.device->allocate(shard * 4, name + " device gradient accumulator"));
  STRATA_RETURN_IF_ERROR(ctx_.device->memset_async(buffers.device_accum.data(), 0, shard * 4, *ctx_.reduce));
  return ctx_.reduce->synchronize();
}

// The rule for where a step's final gradient lies: the device accumulator (device state,
// one for both parities: the next step's first write waits for the update that reads it),
// the copy stored on NVMe (spilled), the fp32 accumulator (micro-batches > 1), else the
// landing buffer.
void GradientPath::place_on_board(const GroupLayout& layout) {
  if (!layout.trainable) return;
  const EngineOptions& o = *ctx_.options;
  const GroupBuffers& buffers = buffers_[static_cast<size_t>(layout.id)];
  const DType host_type = o.gradient_accumulation_steps > 1 ? DType::kFloat32 : o.grad_transfer_dtype;
  if (o.optimizer_tier == Tier::kDevice) {
    ctx_.board->place(layout.id, 0, {buffers.device_accum.data(), DType::kFloat32, true, 0});
    return;
  }
  const int copies = o.overlap == OverlapMode::kDelayed ? 2 : 1;
  for (int c = 0; c < copies; ++c) {
    GradientView view{nullptr, host_type, false, static_cast<unsigned>(c)};
    if (!ctx_.plan->gradients_spilled) {
      const std::vector<PinnedBuffer>& final_copies = o.gradient_accumulation_steps > 1 ? buffers.accum : buffers.landing;
      view.data = final_copies[static_cast<size_t>(c)].data();
    }
    ctx_.board->place(layout.id, c, view);
  }
}

Status GradientPath::start() {
  return sync_.start("strata:gradient", [this] { loop(); });
}

void GradientPath::stop() { sync_.stop(); }

void GradientPath::abort(const Status& status) { sync_.abort(status); }

std::function<std::string()> GradientPath::describer() const {
  return [this] { return StageSync::with_engine(describe(), hooks_.describe_engine); };
}

std::string GradientPath::describe() const {
  std::lock_guard<std::mutex> lock(sync_.mutex);
  std::ostringstream text;
  text << "gradient path: landings " << done_ << "/" << queued_ << "; slots busy:";
  for (const Slot& slot : slots_) text << " " << slot.busy;
  if (!ring_busy_.empty()) {
    text << "; landing ring busy:";
    for (char busy : ring_busy_) text << " " << int(busy);
  }
  return text.str();
}

// ----------------------------------------------------------------------- model thread

void GradientPath::begin_micro_batch() {
  for (GroupFacts& facts : facts_) facts.active_slot = kNoSlot;
}

bool GradientPath::lands_in_place() const {
  const EngineOptions& o = *ctx_.options;
  return ctx_.device->kind() == DeviceKind::kCpu && o.world_size == 1 && o.grad_transfer_dtype == DType::kFloat32 &&
         o.optimizer_tier != Tier::kDevice && !ctx_.plan->gradients_spilled;
}

StatusOr<float*> GradientPath::buffer(int g, int64_t step, GradientStart start) {
  GroupFacts& facts = facts_[static_cast<size_t>(g)];
  if (facts.active_slot == kHandedOver)
    return FailedPreconditionError("gradient_buffer(" + std::to_string(g) + ") after grads_ready(" + std::to_string(g) +
                                   ") in the same micro-batch");
  const bool may_wait = facts.active_slot == kNoSlot;
  if (may_wait && hooks_.host_wait_begins) STRATA_RETURN_IF_ERROR(hooks_.host_wait_begins());
  if (may_wait && start == GradientStart::kUnwritten && lands_in_place()) {
    // With one micro-batch the landing buffer is what the update reads: the one of step - 1
    // (exact mode), or of step - 2 (delayed mode, a landing buffer per step parity), must
    // be done before the model overwrites it. Usually it is: the group's gather waited.
    if (ctx_.options->gradient_accumulation_steps == 1) {
      const int64_t version = ctx_.options->overlap == OverlapMode::kDelayed ? step - 1 : step;
      if (version > 0) STRATA_RETURN_IF_ERROR(hooks_.wait_for_update(g, version));
    }
    STRATA_ASSIGN_OR_RETURN(facts.in_place, own_landing_when_free(g, step));
    facts.active_slot = kInPlace;
    if (may_wait && hooks_.host_wait_ends) STRATA_RETURN_IF_ERROR(hooks_.host_wait_ends());
    return static_cast<float*>(facts.in_place);
  }
  if (facts.active_slot == kInPlace) return static_cast<float*>(facts.in_place);
  if (facts.active_slot == kNoSlot) {
    int chosen = -1;
    const size_t elements = group_layout(g).padded_numel;
    STRATA_RETURN_IF_ERROR(check_slot_can_free(g, elements));
    {
      std::unique_lock<std::mutex> lock(sync_.mutex);
      STRATA_RETURN_IF_ERROR(
          stage_wait(lock, sync_.cv, sync_.halt, [&] { return free_slot_for(elements) >= 0; }, "a free gradient buffer", describer()));
      chosen = free_slot_for(elements);
      slots_[static_cast<size_t>(chosen)].busy = true;
    }
    facts.active_slot = chosen;
    if (may_wait && hooks_.host_wait_ends) STRATA_RETURN_IF_ERROR(hooks_.host_wait_ends());
    if (start == GradientStart::kZeroed)
      STRATA_RETURN_IF_ERROR(ctx_.device->memset_async(slots_[static_cast<size_t>(chosen)].full.data(), 0,
                                                     group_layout(g).padded_numel * sizeof(float), *ctx_.compute));
  }
  return slots_[static_cast<size_t>(facts.active_slot)].full.as<float>();
}

// The reduce-scatter of the slot's full buffer into its shard, in pieces of at most
// reduce_bucket_size elements per rank (each piece's ranks' parts copied together first).
Status GradientPath::reduce(int g, Slot& slot) {
  const EngineOptions& o = *ctx_.options;
  const size_t shard = group_layout(g).shard_numel;
  ReduceOptions options;
  options.op = ReduceOp::kSum;
  options.wire_dtype = o.grad_wire_dtype;
  Communicator& comm = *ctx_.reduce_comm;
  Stream& stream = *ctx_.reduce;
  const size_t bucket = ctx_.plan->reduce_bucket_elements;
  return ctx_.stream_trace->traced(stream, Stage::kReduceScatter, g, group_layout(g).name, [&]() -> Status {
    if (bucket == 0 || bucket >= shard) return comm.reduce_scatter(slot.full.data(), slot.shard.data(), shard, DType::kFloat32, options, stream);
    for (size_t begin = 0; begin < shard; begin += bucket) {
      const size_t count = std::min(bucket, shard - begin);
      for (int r = 0; r < o.world_size; ++r)
        STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(slot.bucket.as<float>() + static_cast<size_t>(r) * count,
                                                       slot.full.as<float>() + static_cast<size_t>(r) * shard + begin, count * 4,
                                                       CopyKind::kDeviceToDevice, stream));
      STRATA_RETURN_IF_ERROR(comm.reduce_scatter(slot.bucket.data(), slot.shard.as<float>() + begin, count, DType::kFloat32, options, stream));
    }
    return {};
  });
}

// A wait for a slot ends only when the lander returns one; a slot the model still holds
// (its group's grads_ready has not come) is never returned. When every slot that fits is
// held so, the wait could not end: an error naming the holders, not a hang.
Status GradientPath::check_slot_can_free(int g, size_t elements) {
  std::vector<int> holders(slots_.size(), -1);
  for (size_t h = 0; h < facts_.size(); ++h)
    if (facts_[h].active_slot >= 0) holders[static_cast<size_t>(facts_[h].active_slot)] = static_cast<int>(h);
  std::string held;
  for (size_t i = 0; i < slots_.size(); ++i) {
    if (slots_[i].elements < elements) continue;
    if (holders[i] < 0) return {};
    held += (held.empty() ? "" : ", ") + group_layout(holders[i]).name;
  }
  return FailedPreconditionError("gradient_buffer(" + std::to_string(g) + ", '" + group_layout(g).name + "'): every gradient buffer that fits it (" +
                                 std::to_string(slots_.size()) + " in all) is held by a group whose grads_ready() has not come (" + held +
                                 "): the model keeps more gradient buffers at once than planned; declare them with declare_held_gradients()");
}

int GradientPath::free_slot_for(size_t elements) const {
  int best = -1;
  for (size_t i = 0; i < slots_.size(); ++i) {
    const Slot& slot = slots_[i];
    if (slot.busy || slot.elements < elements) continue;
    if (best < 0 || slot.elements < slots_[static_cast<size_t>(best)].elements) best = static_cast<int>(i);
  }
  return best;
}

StatusOr<void*> GradientPath::landing_target(int g, int64_t step, int* ring) {
  std::unique_lock<std::mutex> lock(sync_.mutex);
  if (ctx_.plan->gradients_spilled) {
    auto free_buffer = [&] {
      for (size_t i = 0; i < ring_busy_.size(); ++i)
        if (ring_busy_[i] == 0) return static_cast<int>(i);
      return -1;
    };
    STRATA_RETURN_IF_ERROR(stage_wait(lock, sync_.cv, sync_.halt, [&] { return free_buffer() >= 0; }, "a free gradient landing buffer", describer()));
    *ring = free_buffer();
    ring_busy_[static_cast<size_t>(*ring)] = 1;
    return ring_[static_cast<size_t>(*ring)].data();
  }
  lock.unlock();
  *ring = -1;
  return own_landing_when_free(g, step);
}

// The group's own buffer is read by the lander after each landing: the next write into it
// waits until that is done.
StatusOr<void*> GradientPath::own_landing_when_free(int g, int64_t step) {
  std::unique_lock<std::mutex> lock(sync_.mutex);
  GroupFacts& facts = facts_[static_cast<size_t>(g)];
  STRATA_RETURN_IF_ERROR(stage_wait(lock, sync_.cv, sync_.halt, [&] { return facts.processed == facts.sent; }, "the previous gradient landing", describer()));
  return buffers_[static_cast<size_t>(g)].landing[static_cast<size_t>(copy_of(step))].data();
}

Status GradientPath::enqueue_copy(int g, Slot& slot, const void* source, size_t bytes, void* landing) {
  STRATA_RETURN_IF_ERROR(ctx_.d2h->wait(*slot.reduced));
  STRATA_RETURN_IF_ERROR(ctx_.stream_trace->traced(*ctx_.d2h, Stage::kD2H, g, group_layout(g).name, [&] {
    return ctx_.device->copy_async(landing, source, bytes, CopyKind::kDeviceToHost, *ctx_.d2h);
  }));
  return ctx_.d2h->record(*slot.copied);
}

// Device-resident optimizer state: the reduced shard accumulates into the group's device
// gradient accumulator; after the last micro-batch its fp32 copy goes to the host for the
// statistics (the update itself reads the device copy).
//
// The previous step's update reads the accumulator on the update stream. In exact mode it
// is done before this step gathers the group; in delayed mode it runs beside this step's
// forward and backward, so the first write waits for it: the optimizer stage publishes
// the group's version once its device update has finished (it synchronizes the update
// stream), so a host wait orders the streams. A second accumulator per step parity would
// cost 4 bytes per parameter of device memory to spare a wait for a device update that
// is short next to a step's forward pass.
Status GradientPath::land_on_device(int g, Slot& slot, int64_t step, int micro, bool last, void** landing) {
  const size_t shard = group_layout(g).shard_numel;
  const float* reduced = ctx_.options->world_size > 1 ? slot.shard.as<float>() : slot.full.as<float>();
  float* accum = buffers_[static_cast<size_t>(g)].device_accum.as<float>();
  if (micro == 0) {
    STRATA_RETURN_IF_ERROR(hooks_.wait_for_update(g, step));
    STRATA_RETURN_IF_ERROR(ctx_.device->copy_async(accum, reduced, shard * 4, CopyKind::kDeviceToDevice, *ctx_.reduce));
  } else {
    STRATA_RETURN_IF_ERROR(kernels::residual_forward(*ctx_.reduce, DType::kFloat32, accum, reduced, accum, shard));
  }
  STRATA_RETURN_IF_ERROR(ctx_.reduce->record(*slot.reduced));
  if (!last) return ctx_.reduce->record(*slot.copied);
  int ring = -1;
  STRATA_ASSIGN_OR_RETURN(*landing, landing_target(g, step, &ring));
  return enqueue_copy(g, slot, accum, shard * 4, *landing);
}

Status GradientPath::hand_over(int g, int64_t step, int micro) {
  GroupFacts& facts = facts_[static_cast<size_t>(g)];
  if (facts.active_slot == kNoSlot || facts.active_slot == kHandedOver)
    return FailedPreconditionError("grads_ready(" + std::to_string(g) + ") without gradient_buffer(" + std::to_string(g) +
                                   ") in this micro-batch (or twice)");
  const int slot_index = facts.active_slot;
  facts.active_slot = kHandedOver;  // a second grads_ready this micro-batch is an error
  const EngineOptions& o = *ctx_.options;
  const bool last = micro + 1 == o.gradient_accumulation_steps;
  if (slot_index == kInPlace) return hand_over_in_place(g, step, micro, last);
  Slot& slot = slots_[static_cast<size_t>(slot_index)];
  const size_t shard = group_layout(g).shard_numel;
  STRATA_RETURN_IF_ERROR(ctx_.compute->record(*slot.grads_done));
  STRATA_RETURN_IF_ERROR(ctx_.reduce->wait(*slot.grads_done));
  if (o.world_size > 1) STRATA_RETURN_IF_ERROR(reduce(g, slot));
  int ring = -1;
  if (o.optimizer_tier == Tier::kDevice) {
    void* landing = nullptr;
    STRATA_RETURN_IF_ERROR(land_on_device(g, slot, step, micro, last, &landing));
  } else {
    const void* transfer = o.world_size > 1 ? slot.shard.data() : slot.full.data();
    if (o.grad_transfer_dtype != DType::kFloat32) {
      // The shared cast buffer: the previous copy out of it must be done.
      STRATA_RETURN_IF_ERROR(ctx_.reduce->wait(*cast_free_));
      // Traced with the reduce stream's other work (the reduce_scatter stage's track).
      STRATA_RETURN_IF_ERROR(ctx_.stream_trace->traced(*ctx_.reduce, Stage::kReduceScatter, g, group_layout(g).name + " cast", [&] {
        return kernels::cast(*ctx_.reduce, transfer, DType::kFloat32, cast_.data(), o.grad_transfer_dtype, shard);
      }));
      transfer = cast_.data();
    }
    STRATA_RETURN_IF_ERROR(ctx_.reduce->record(*slot.reduced));
    STRATA_ASSIGN_OR_RETURN(void* landing, landing_target(g, step, &ring));
    STRATA_RETURN_IF_ERROR(enqueue_copy(g, slot, transfer, shard * dtype_size(o.grad_transfer_dtype), landing));
    if (cast_free_) STRATA_RETURN_IF_ERROR(ctx_.d2h->record(*cast_free_));
  }
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    queue_.push_back({g, slot_index, step, micro, last, ring});
    ++queued_;
    ++facts.sent;
  }
  sync_.cv.notify_all();
  return {};
}

// The model wrote the landing buffer itself: the lander waits for what the compute stream
// holds of those writes (nothing, for a model writing on its own thread), then lands it.
Status GradientPath::hand_over_in_place(int g, int64_t step, int micro, bool last) {
  GroupFacts& facts = facts_[static_cast<size_t>(g)];
  STRATA_RETURN_IF_ERROR(ctx_.compute->record(*buffers_[static_cast<size_t>(g)].written));
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    queue_.push_back({g, -1, step, micro, last, -1});
    ++queued_;
    ++facts.sent;
  }
  sync_.cv.notify_all();
  return {};
}

StatusOr<GradientStats> GradientPath::wait_step_landed(int64_t step) {
  std::unique_lock<std::mutex> lock(sync_.mutex);
  STRATA_RETURN_IF_ERROR(stage_wait(lock, sync_.cv, sync_.halt, [&] {
    for (size_t g = 0; g < facts_.size(); ++g)
      if (facts_[g].landed_step < step && group_layout(static_cast<int>(g)).trainable) return false;
    return true;
  }, "every trainable group's gradients of this step", describer()));
  GradientStats total;
  for (const GroupFacts& facts : facts_) total += facts.stats;
  return total;
}

Status GradientPath::wait_drained() {
  std::unique_lock<std::mutex> lock(sync_.mutex);
  return stage_wait(lock, sync_.cv, sync_.halt, [&] { return done_ == queued_; }, "outstanding gradient landings", describer());
}

// ----------------------------------------------------------------------- the lander

void GradientPath::loop() {
  for (;;) {
    Landing item;
    {
      std::unique_lock<std::mutex> lock(sync_.mutex);
      sync_.cv.wait(lock, [&] { return sync_.halt.halted() || !queue_.empty(); });
      if (sync_.halt.halted()) return;
      item = queue_.front();
    }
    Status status = land(item);
    if (!status.ok()) {
      hooks_.failed(std::move(status).with_context("landing the gradients of group " + std::to_string(item.group)));
      return;
    }
    {
      std::lock_guard<std::mutex> lock(sync_.mutex);
      queue_.pop_front();
      ++done_;
      ++facts_[static_cast<size_t>(item.group)].processed;
    }
    sync_.cv.notify_all();
  }
}

Status GradientPath::land(const Landing& item) {
  if (item.slot < 0) {
    STRATA_RETURN_IF_ERROR(buffers_[static_cast<size_t>(item.group)].written->synchronize());
  } else {
    Slot& slot = slots_[static_cast<size_t>(item.slot)];
    STRATA_RETURN_IF_ERROR(slot.copied->synchronize());
    {
      std::lock_guard<std::mutex> lock(sync_.mutex);
      slot.busy = false;
    }
    sync_.cv.notify_all();
  }
  const EngineOptions& o = *ctx_.options;
  GradientStats stats;
  SpillPiece spill;
  {
    Tracer::Scope scope(ctx_.tracer, Stage::kLanding, item.group, group_layout(item.group).name);
    if (item.ring >= 0) {
      STRATA_ASSIGN_OR_RETURN(spill, accumulate_spilled(item, ring_[static_cast<size_t>(item.ring)].data()));
      stats = spill.stats;
    } else if (o.optimizer_tier == Tier::kDevice) {
      if (item.last_micro) {
        const GroupBuffers& buffers = buffers_[static_cast<size_t>(item.group)];
        STRATA_ASSIGN_OR_RETURN(stats, ops_->stats(buffers.landing[static_cast<size_t>(copy_of(item.step))].data(), DType::kFloat32,
                                                   group_layout(item.group).shard_numel));
      }
    } else {
      STRATA_ASSIGN_OR_RETURN(stats, accumulate_host(item, buffers_[static_cast<size_t>(item.group)].landing[static_cast<size_t>(copy_of(item.step))].data()));
    }
  }
  if (item.ring >= 0) STRATA_RETURN_IF_ERROR(store_spilled(item, spill));
  // The board has it before the engine hears of it, and the engine before step() can see
  // it: an update planned now still belongs to this step (its learning rate and step number).
  if (item.last_micro) {
    ctx_.board->publish(item.group, item.step);
    hooks_.landed(item.group, item.step);
  }
  std::lock_guard<std::mutex> lock(sync_.mutex);
  if (item.ring >= 0) ring_busy_[static_cast<size_t>(item.ring)] = 0;
  if (item.last_micro) {
    GroupFacts& facts = facts_[static_cast<size_t>(item.group)];
    facts.stats = stats;
    facts.landed_step = item.step;
  }
  return {};
}

StatusOr<GradientStats> GradientPath::accumulate_host(const Landing& item, const void* landed) {
  const EngineOptions& o = *ctx_.options;
  const size_t shard = group_layout(item.group).shard_numel;
  if (o.gradient_accumulation_steps == 1) return ops_->stats(landed, o.grad_transfer_dtype, shard);
  float* accum = buffers_[static_cast<size_t>(item.group)].accum[static_cast<size_t>(copy_of(item.step))].as<float>();
  const AccumulateMode mode = item.micro == 0 ? AccumulateMode::kAssign : AccumulateMode::kAdd;
  if (!item.last_micro) {
    STRATA_RETURN_IF_ERROR(ops_->accumulate(accum, landed, o.grad_transfer_dtype, shard, mode));
    return GradientStats{};
  }
  return ops_->accumulate_with_stats(accum, landed, o.grad_transfer_dtype, shard, mode);
}

// Spilled gradients: micro-batches add up in the fp32 scratch (the running sum read back
// from NVMe after the first), and the shard the optimizer will read is stored beside the
// NVMe state; the statistics are taken of exactly what is stored.
StatusOr<GradientPath::SpillPiece> GradientPath::accumulate_spilled(const Landing& item, const void* landed) {
  const EngineOptions& o = *ctx_.options;
  const size_t g = static_cast<size_t>(item.group);
  const size_t shard = group_layout(item.group).shard_numel;
  const unsigned copy = static_cast<unsigned>(copy_of(item.step));
  SpillPiece piece{GradientStats{}, landed, ring_[static_cast<size_t>(item.ring)].capacity()};
  if (o.gradient_accumulation_steps > 1) {
    float* accum = scratch_.as<float>();
    if (item.micro > 0) STRATA_RETURN_IF_ERROR(ctx_.spill->load_gradient(g, copy, accum, scratch_.capacity()));
    const AccumulateMode mode = item.micro == 0 ? AccumulateMode::kAssign : AccumulateMode::kAdd;
    if (item.last_micro) {
      STRATA_ASSIGN_OR_RETURN(piece.stats, ops_->accumulate_with_stats(accum, landed, o.grad_transfer_dtype, shard, mode));
    } else {
      STRATA_RETURN_IF_ERROR(ops_->accumulate(accum, landed, o.grad_transfer_dtype, shard, mode));
    }
    piece.stored = accum;
    piece.capacity = scratch_.capacity();
  } else {
    STRATA_ASSIGN_OR_RETURN(piece.stats, ops_->stats(landed, o.grad_transfer_dtype, shard));
  }
  return piece;
}

// The spill's write is the store's (nvme_write), not the landing's host pass.
Status GradientPath::store_spilled(const Landing& item, const SpillPiece& piece) {
  const auto begin = TraceClock::now();
  STRATA_RETURN_IF_ERROR(ctx_.spill->store_gradient(static_cast<size_t>(item.group), static_cast<unsigned>(copy_of(item.step)),
                                                    piece.stored, piece.capacity));
  ctx_.tracer->record(Stage::kNvmeWrite, item.group, begin, TraceClock::now(), group_layout(item.group).name + " gradient");
  return {};
}

}  // namespace strata::engine_internal
