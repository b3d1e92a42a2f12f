#include "engine/param_fetcher.h"

#include <algorithm>
#include <sstream>

namespace strata::engine_internal {

// ----------------------------------------------------------------------- set-up

StatusOr<std::unique_ptr<ParamFetcher>> ParamFetcher::create(const ParamFetcherContext& context, ParamFetcherHooks hooks) {
  auto fetcher = std::make_unique<ParamFetcher>(context, std::move(hooks));
  fetcher->persistent_.resize(context.layouts->size());
  for (size_t g = 0; g < context.layouts->size(); ++g) fetcher->persistent_[g].persistent = context.plan->persistent[g] != 0;
  return fetcher;
}

ParamFetcher::~ParamFetcher() { stop(); }

Status ParamFetcher::allocate() {
  const EngineOptions& o = *ctx_.options;
  const EnginePlan& plan = *ctx_.plan;
  const bool staging_shard = o.world_size > 1 && o.param_tier != Tier::kDevice;
  slots_.resize(static_cast<size_t>(plan.gather_slots));
  slot_fills_.assign(slots_.size(), 0);
  for (size_t i = 0; i < slots_.size(); ++i) {
    Slot& slot = slots_[i];
    const std::string name = "gather slot " + std::to_string(i);
    STRATA_ASSIGN_OR_RETURN(slot.full, ctx_.device->allocate(param_bytes(plan.max_gather_elements), name));
    if (staging_shard) {
      STRATA_ASSIGN_OR_RETURN(slot.shard, ctx_.device->allocate(param_bytes(plan.max_gather_shard), name + " staging shard"));
    }
    if (o.param_tier == Tier::kNvme) {
      STRATA_ASSIGN_OR_RETURN(slot.nvme_stage, ctx_.arena->allocate(param_bytes(plan.max_gather_shard), name + " NVMe staging"));
    }
    STRATA_ASSIGN_OR_RETURN(slot.ready, ctx_.device->create_event());
    STRATA_ASSIGN_OR_RETURN(slot.released, ctx_.device->create_event());
    STRATA_ASSIGN_OR_RETURN(slot.h2d_done, ctx_.device->create_event());
  }
  for (size_t g = 0; g < persistent_.size(); ++g) STRATA_RETURN_IF_ERROR(allocate_persistent(static_cast<int>(g)));
  return {};
}

Status ParamFetcher::allocate_persistent(int g) {
  const EngineOptions& o = *ctx_.options;
  Persistent& p = persistent_[static_cast<size_t>(g)];
  if (!p.persistent || direct_view()) return {};
  const GroupLayout& layout = group_layout(g);
  const std::string name = "group " + layout.name;
  STRATA_ASSIGN_OR_RETURN(p.full, ctx_.device->allocate(param_bytes(layout.padded_numel), name + " persistent"));
  if (o.world_size > 1 && o.param_tier != Tier::kDevice) {
    STRATA_ASSIGN_OR_RETURN(p.shard, ctx_.device->allocate(param_bytes(layout.shard_numel), name + " persistent staging"));
  }
  if (o.param_tier == Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(p.stage, ctx_.arena->allocate(param_bytes(layout.shard_numel), name + " persistent NVMe staging"));
  }
  STRATA_ASSIGN_OR_RETURN(p.ready, ctx_.device->create_event());
  STRATA_ASSIGN_OR_RETURN(p.released, ctx_.device->create_event());
  STRATA_ASSIGN_OR_RETURN(p.h2d_done, ctx_.device->create_event());
  return {};
}

Status ParamFetcher::start() {
  return sync_.start("strata:fetcher", [this] { loop(); });
}

void ParamFetcher::stop() { sync_.stop(); }

void ParamFetcher::abort(const Status& status) { sync_.abort(status); }

std::function<std::string()> ParamFetcher::describer() const {
  return [this] { return StageSync::with_engine(describe(), hooks_.describe_engine); };
}

std::string ParamFetcher::describe() const {
  std::lock_guard<std::mutex> lock(sync_.mutex);
  std::ostringstream text;
  text << "fetcher at request " << next_fetch_id_ << " of " << (next_request_id_ - 1) << " planned";
  if (!requests_.empty()) {
    const Request& r = requests_.front();
    text << "; oldest request " << r.id << " (group " << r.group << ", slot " << r.position.index << " phase " << r.position.phase
         << ", version " << r.version << ", ready " << r.ready << ", consumed " << r.consumed << ")";
  }
  text << "; slot releases:";
  for (const Slot& slot : slots_) text << " " << slot.releases;
  return text.str();
}

// ----------------------------------------------------------------------- model thread

bool ParamFetcher::takes_slot(int g) const { return !direct_view() && !persistent_[static_cast<size_t>(g)].persistent; }

uint64_t ParamFetcher::plan_fetch(int g, int64_t step, int64_t version) {
  if (direct_view()) return 0;
  Request request;
  request.group = g;
  request.step = step;
  request.version = version;
  if (persistent_[static_cast<size_t>(g)].persistent) {
    if (persistent_[static_cast<size_t>(g)].planned_version == version) return 0;
    persistent_[static_cast<size_t>(g)].planned_version = version;
  } else {
    const uint64_t use = slot_uses_++;
    request.position = {static_cast<int>(use % slots_.size()), use / slots_.size()};
  }
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    request.id = next_request_id_++;
    requests_.push_back(request);
  }
  sync_.cv.notify_all();
  return request.id;
}

void ParamFetcher::abandon(uint64_t id) {
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    Request& r = request_locked(id);
    r.abandoned = true;
    r.consumed = true;
    if (r.position.index < 0) persistent_[static_cast<size_t>(r.group)].planned_version = -1;
    // A fill already done frees its slot here (one still running frees it when done). No
    // release event is needed: the slot's next fill is enqueued on the streams that made
    // this one, so it follows it in stream order.
    if (r.ready && r.position.index >= 0) ++slots_[static_cast<size_t>(r.position.index)].releases;
    retire_locked();
  }
  sync_.cv.notify_all();
}

StatusOr<void*> ParamFetcher::take(uint64_t id, PipelineState* position) {
  int g = -1;
  {
    std::unique_lock<std::mutex> lock(sync_.mutex);
    STRATA_RETURN_IF_ERROR(stage_wait(lock, sync_.cv, sync_.halt, [&] { return request_locked(id).ready; }, "a gathered group", describer()));
    Request& r = request_locked(id);
    r.consumed = true;
    *position = r.position;
    g = r.group;
    retire_locked();
  }
  // Compute waits for the gathered data (the event was recorded before `ready` was set).
  if (position->index < 0) return take_persistent(g);
  Slot& slot = slots_[static_cast<size_t>(position->index)];
  STRATA_RETURN_IF_ERROR(ctx_.compute->wait(*slot.ready));
  return slot.full.data();
}

StatusOr<void*> ParamFetcher::take_persistent(int g) {
  Persistent& p = persistent_[static_cast<size_t>(g)];
  if (!p.ready) return InternalError("group " + group_layout(g).name + " has no persistent gathered copy");
  STRATA_RETURN_IF_ERROR(ctx_.compute->wait(*p.ready));
  return p.full.data();
}

Status ParamFetcher::wait_taken(int g, const PipelineState& position) {
  if (position.index < 0) {
    const Persistent& p = persistent_[static_cast<size_t>(g)];
    if (!p.ready) return InternalError("group " + group_layout(g).name + " has no persistent gathered copy");
    return p.ready->synchronize();
  }
  return slots_[static_cast<size_t>(position.index)].ready->synchronize();
}

Status ParamFetcher::release(int g, const PipelineState& position) {
  if (position.index < 0) return ctx_.compute->record(*persistent_[static_cast<size_t>(g)].released);
  Slot& slot = slots_[static_cast<size_t>(position.index)];
  STRATA_RETURN_IF_ERROR(ctx_.compute->record(*slot.released));
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    ++slot.releases;
  }
  sync_.cv.notify_all();
  return {};
}

void ParamFetcher::set_steps_finished(int64_t steps) {
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    steps_finished_ = steps;
  }
  sync_.cv.notify_all();
}

Status ParamFetcher::wait_idle() {
  std::unique_lock<std::mutex> lock(sync_.mutex);
  STRATA_RETURN_IF_ERROR(stage_wait(lock, sync_.cv, sync_.halt, [&] { return next_fetch_id_ == next_request_id_; }, "outstanding fetches", describer()));
  retire_locked();
  return {};
}

void ParamFetcher::forget_persistent_fetches() {
  for (Persistent& p : persistent_) p.planned_version = -1;
}

void ParamFetcher::retire_locked() {
  while (!requests_.empty() && requests_.front().ready && requests_.front().consumed) requests_.pop_front();
}

// ----------------------------------------------------------------------- the worker

void ParamFetcher::loop() {
  for (;;) {
    Request* request = nullptr;
    {
      std::unique_lock<std::mutex> lock(sync_.mutex);
      sync_.cv.wait(lock, [&] { return sync_.halt.halted() || (!requests_.empty() && requests_.back().id >= next_fetch_id_); });
      if (sync_.halt.halted()) return;
      // Requests stay put in the deque (push_back and pop_front keep references).
      request = &request_locked(next_fetch_id_);
    }
    const int g = request->group;
    Status status = fetch(*request);
    if (!status.ok()) {
      hooks_.failed(std::move(status).with_context("fetching group " + std::to_string(g)));
      return;
    }
  }
}

// The parameters must hold the version the use needs, and the buffer must be free: the
// slot's previous occupants released, or (persistent) the previous step's uses over.
Status ParamFetcher::wait_until_fillable(const Request& r) {
  STRATA_RETURN_IF_ERROR(ctx_.versions->wait_for(r.group, r.version, "a parameter update", describer()));
  std::unique_lock<std::mutex> lock(sync_.mutex);
  if (r.position.index >= 0) {
    const Slot& slot = slots_[static_cast<size_t>(r.position.index)];
    return stage_wait(lock, sync_.cv, sync_.halt, [&] { return slot.releases >= r.position.phase; }, "a gather slot", describer());
  }
  return stage_wait(lock, sync_.cv, sync_.halt, [&] { return steps_finished_ >= r.step; }, "the previous step", describer());
}

ParamFetcher::Target ParamFetcher::target_of(const Request& r) {
  Target t;
  if (r.position.index < 0) {
    Persistent& p = persistent_[static_cast<size_t>(r.group)];
    t = {p.full.data(), p.shard.data(), &p.stage, p.ready.get(), p.released.get(), p.h2d_done.get()};
  } else {
    Slot& slot = slots_[static_cast<size_t>(r.position.index)];
    t = {slot.full.data(), slot.shard.data(), &slot.nvme_stage, slot.ready.get(), slot.released.get(), slot.h2d_done.get()};
  }
  return t;
}

// Starts the NVMe reads of the requests after `r` that can start now: their version is
// in, their slot's earlier occupants have been filled (so the last H2D out of the
// staging is enqueued) and that H2D has finished.
Status ParamFetcher::submit_read_ahead(const Request& r) {
  const uint64_t depth = static_cast<uint64_t>(std::max(1, ctx_.plan->prefetch_depth));
  for (uint64_t id = r.id + 1; id <= r.id + depth; ++id) {
    Request* next = nullptr;
    {
      std::lock_guard<std::mutex> lock(sync_.mutex);
      if (requests_.empty() || id > requests_.back().id) break;
      next = &request_locked(id);
    }
    if (next->read_submitted) continue;
    if (next->position.index < 0 || ctx_.versions->version(next->group) < next->version) break;
    Slot& slot = slots_[static_cast<size_t>(next->position.index)];
    if (slot_fills_[static_cast<size_t>(next->position.index)] < next->position.phase) break;
    STRATA_ASSIGN_OR_RETURN(bool staging_free, slot.h2d_done->query());
    if (!staging_free) break;
    const GroupLayout& layout = group_layout(next->group);
    next->read_begin = TraceClock::now();
    STRATA_ASSIGN_OR_RETURN(next->read_ticket, ctx_.nvme->read_async(ctx_.shards->source(next->group, next->version).extent,
                                                                     slot.nvme_stage.data(), param_bytes(layout.shard_numel), 0,
                                                                     slot.nvme_stage.capacity(), &next->read_completed));
    next->read_submitted = true;
  }
  return {};
}

StatusOr<const void*> ParamFetcher::read_from_nvme(Request& r, const Target& target) {
  const GroupLayout& layout = group_layout(r.group);
  if (!r.read_submitted) {
    // The staging buffer's previous H2D must be over before the read overwrites it.
    STRATA_RETURN_IF_ERROR(target.h2d_done->synchronize());
    r.read_begin = TraceClock::now();
    STRATA_ASSIGN_OR_RETURN(r.read_ticket, ctx_.nvme->read_async(ctx_.shards->source(r.group, r.version).extent,
                                                                 target.nvme_stage->data(), param_bytes(layout.shard_numel), 0,
                                                                 target.nvme_stage->capacity(), &r.read_completed));
    r.read_submitted = true;
  }
  // While this read completes, keep starting the reads of the requests behind it as they
  // appear and their staging frees up (the model plans requests as it goes).
  for (;;) {
    STRATA_RETURN_IF_ERROR(submit_read_ahead(r));
    if (ctx_.nvme->io_engine().done(r.read_ticket)) break;
    std::unique_lock<std::mutex> lock(sync_.mutex);
    if (sync_.halt.halted()) break;
    sync_.cv.wait_for(lock, std::chrono::microseconds(200));
  }
  STRATA_RETURN_IF_ERROR(ctx_.nvme->wait(r.read_ticket));
  ctx_.tracer->record(Stage::kNvmeRead, r.group, r.read_begin, r.read_completed, layout.name);
  return static_cast<const void*>(target.nvme_stage->data());
}

// H2D of this rank's shard (host or NVMe parameters), then the all-gather (world > 1).
Status ParamFetcher::fill_device(const Request& r, const Target& t, const void* host_source) {
  const EngineOptions& o = *ctx_.options;
  const int world = o.world_size;
  const GroupLayout& layout = group_layout(r.group);
  const size_t shard = layout.shard_numel;
  const std::string& label = layout.name;
  if (host_source != nullptr) {
    void* h2d_target = world == 1 ? t.dest : t.staging;
    // World 1 overwrites the gathered buffer itself: wait for its last reader. Otherwise
    // the staging shard: wait for the all-gather that read it last.
    STRATA_RETURN_IF_ERROR(ctx_.h2d->wait(world == 1 ? *t.released : *t.ready));
    STRATA_RETURN_IF_ERROR(ctx_.stream_trace->traced(*ctx_.h2d, Stage::kH2D, r.group, label, [&] {
      return ctx_.device->copy_async(h2d_target, host_source, param_bytes(shard), CopyKind::kHostToDevice, *ctx_.h2d);
    }));
    STRATA_RETURN_IF_ERROR(ctx_.h2d->record(*t.h2d_done));
    if (world == 1) STRATA_RETURN_IF_ERROR(ctx_.h2d->record(*t.ready));
  }
  if (world > 1) {
    if (host_source != nullptr) STRATA_RETURN_IF_ERROR(ctx_.gather->wait(*t.h2d_done));
    STRATA_RETURN_IF_ERROR(ctx_.gather->wait(*t.released));
    const void* source = host_source != nullptr ? t.staging : ctx_.shards->source(r.group, r.version).device;
    STRATA_RETURN_IF_ERROR(ctx_.stream_trace->traced(*ctx_.gather, Stage::kAllGather, r.group, label, [&] {
      return ctx_.gather_comm->all_gather(source, t.dest, shard, o.param_dtype, *ctx_.gather);
    }));
    STRATA_RETURN_IF_ERROR(ctx_.gather->record(*t.ready));
  }
  return {};
}

Status ParamFetcher::fetch(Request& r) {
  STRATA_RETURN_IF_ERROR(wait_until_fillable(r));
  const Target target = target_of(r);
  const void* host_source = nullptr;
  const ParamSource where = ctx_.shards->source(r.group, r.version);
  if (where.tier == Tier::kNvme) {
    STRATA_ASSIGN_OR_RETURN(host_source, read_from_nvme(r, target));
  } else {
    host_source = where.host;  // nullptr on the device tier: the all-gather reads the device copy
  }
  STRATA_RETURN_IF_ERROR(fill_device(r, target, host_source));
  const bool slot_fill = r.position.index >= 0;
  if (slot_fill) ++slot_fills_[static_cast<size_t>(r.position.index)];
  bool abandoned = false;
  {
    std::lock_guard<std::mutex> lock(sync_.mutex);
    abandoned = r.abandoned;
    // Nobody will compute with an abandoned fill: the slot is free once the fill is done.
    if (slot_fill && abandoned) ++slots_[static_cast<size_t>(r.position.index)].releases;
    // Once ready, the model may retire the request: `r` is not touched after this.
    r.ready = true;
    ++next_fetch_id_;
    retire_locked();
  }
  if (slot_fill && abandoned) {
    Stream& last = ctx_.options->world_size > 1 ? *ctx_.gather : *ctx_.h2d;
    STRATA_RETURN_IF_ERROR(last.record(*target.released));
  }
  sync_.cv.notify_all();
  return {};
}

}  // namespace strata::engine_internal
