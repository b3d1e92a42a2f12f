#include "engine/engine_plan.h"

#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>
#include <filesystem>
#include <functional>
#include <fstream>
#include <map>
#include <sstream>

#include "engine/core/log.h"
#include "offload/nvme_store.h"
#include "optim/nvme_adam_state.h"

namespace strata::engine_internal {

namespace {

constexpr size_t kMiB = size_t{1} << 20;
constexpr size_t kArenaSlackBytes = size_t{4} << 20;  // the host arena's fixed slack (host_arena_bytes)

// MemAvailable from /proc/meminfo, or 0 when unknown.
size_t host_memory_available() {
  std::ifstream in("/proc/meminfo");
  std::string key;
  size_t value = 0;
  std::string unit;
  while (in >> key >> value >> unit) {
    if (key == "MemAvailable:") return value * 1024;
  }
  return 0;
}

// The facts of the model that do not depend on any choice.
// The optimizer-state ring's options as the plan sizes them (and the engine creates them).
NvmeAdamStateOptions ring_shape(const EngineOptions& o, const EnginePlan& plan) {
  NvmeAdamStateOptions ring;
  ring.slots = static_cast<unsigned>(o.optimizer_buffer_count > 0 ? o.optimizer_buffer_count : 4);
  if (plan.gradients_spilled) {
    ring.stored_gradient_type = o.gradient_accumulation_steps > 1 ? DType::kFloat32 : o.grad_transfer_dtype;
    ring.gradient_copies = o.overlap == OverlapMode::kDelayed ? 2 : 1;
  }
  if (o.param_tier == Tier::kNvme || o.param_tier == Tier::kDevice) ring.staged_param_type = o.param_dtype;
  return ring;
}

struct ModelShape {
  size_t max_padded = 0, max_shard = 0;          // groups that take a gather slot
  size_t all_max_padded = 0, all_max_shard = 0;  // every group
  // Gradients and optimizer state are sized by the trainable groups alone (frozen groups
  // have neither): the largest, the largest but one (by padded size), and the largest shard.
  size_t trainable_max_padded = 0, trainable_second_max_padded = 0, trainable_max_shard = 0;
  size_t total_numel = 0, total_shard = 0;
  size_t trainable_numel = 0;
  int frozen_groups = 0;
  size_t persistent_full_bytes = 0, persistent_shard_bytes = 0, persistent_stage_bytes = 0;
  int slot_groups = 0;                           // groups that take a gather slot
};

// Gradient buffers beyond the ones the model holds: two (double buffering), or one.
enum class GradientBuffering : uint8_t { kDouble, kSingle };

class Planner {
 public:
  explicit Planner(const PlanInputs& in) : in_(in), o_(*in.options) {}

  StatusOr<EnginePlan> plan() {
    if (in_.layouts.empty()) return FailedPreconditionError("start(): no parameter groups registered");
    measure_shape();
    const bool automatic = o_.prefetch_depth == EngineOptions::kAutoDepth;
    const int cap = automatic ? std::min(kMaxAutomaticPrefetchDepth, std::max(1, shape_.slot_groups)) : o_.prefetch_depth;
    EnginePlan chosen;
    for (int depth = cap; depth >= 0; --depth) {
      STRATA_ASSIGN_OR_RETURN(chosen, plan_with_depth(depth, GradientBuffering::kDouble));
      if (!automatic || fits(chosen)) break;
    }
    // The last resort before the budget check fails: one gradient buffer where two do
    // not fit (each group's backward then waits until the previous group's gradients have
    // left the device).
    if (!fits(chosen) && in_.schedule_known()) {
      STRATA_ASSIGN_OR_RETURN(EnginePlan single, plan_with_depth(chosen.prefetch_depth, GradientBuffering::kSingle));
      if (fits(single)) chosen = std::move(single);
    }
    chosen.prefetch_depth_chosen = automatic;
    chosen.text = describe(chosen);
    return chosen;
  }

 private:
  bool fits(const EnginePlan& p) const {
    const bool device_fits = p.device_bytes <= p.device_budget_bytes;
    const bool pinned_fits = o_.pinned_budget_bytes == 0 || p.pinned_bytes + p.host_bytes <= plan_host_bytes_within(o_.pinned_budget_bytes);
    return device_fits && pinned_fits && (o_.optimizer_tier != Tier::kNvme || p.state_piece_elements > 0);
  }

  size_t param_bytes(size_t elements) const { return elements * dtype_size(o_.param_dtype); }
  int copies() const { return o_.overlap == OverlapMode::kDelayed ? 2 : 1; }
  bool direct_view() const { return o_.param_tier == Tier::kDevice && o_.world_size == 1; }
  // Per-shard state of the trainable groups (gradients, master weights, moments).
  size_t sum_trainable_shards(size_t bytes_per_element) const {
    size_t total = 0;
    for (const auto& g : in_.layouts)
      if (g.trainable) total += round_up_4k(g.shard_numel * bytes_per_element);
    return total;
  }
  // Every group's parameter copies (a frozen group has one in either overlap mode).
  size_t param_shard_bytes(bool rounded) const {
    size_t total = 0;
    for (const auto& g : in_.layouts) {
      const size_t bytes = param_bytes(g.shard_numel);
      total += static_cast<size_t>(g.trainable ? copies() : 1) * (rounded ? round_up_4k(bytes) : bytes);
    }
    return total;
  }

  void measure_shape() {
    persistent_.clear();
    std::vector<size_t> padded;
    for (const auto& g : in_.layouts)
      if (g.trainable) padded.push_back(g.padded_numel);
    std::sort(padded.begin(), padded.end(), std::greater<>());
    shape_.trainable_max_padded = padded.empty() ? 0 : padded.front();
    shape_.trainable_second_max_padded = padded.size() > 1 ? padded[1] : shape_.trainable_max_padded;
    for (const auto& g : in_.layouts) {
      if (g.trainable) {
        shape_.trainable_numel += g.numel;
        shape_.trainable_max_shard = std::max(shape_.trainable_max_shard, g.shard_numel);
      } else {
        ++shape_.frozen_groups;
      }
      const bool persistent = g.padded_numel <= o_.persistence_threshold;
      persistent_.push_back(persistent ? 1 : 0);
      shape_.total_numel += g.numel;
      shape_.total_shard += g.shard_numel;
      shape_.all_max_padded = std::max(shape_.all_max_padded, g.padded_numel);
      shape_.all_max_shard = std::max(shape_.all_max_shard, g.shard_numel);
      if (persistent) {
        if (!direct_view()) shape_.persistent_full_bytes += param_bytes(g.padded_numel);
        if (o_.world_size > 1 && o_.param_tier != Tier::kDevice) shape_.persistent_shard_bytes += param_bytes(g.shard_numel);
        if (o_.param_tier == Tier::kNvme) shape_.persistent_stage_bytes += round_up_4k(param_bytes(g.shard_numel));
      } else {
        shape_.max_padded = std::max(shape_.max_padded, g.padded_numel);
        shape_.max_shard = std::max(shape_.max_shard, g.shard_numel);
        ++shape_.slot_groups;
      }
    }
  }

  // Gradient slots: two (one being written by a group's backward, one draining the
  // previous group's gradients to the host), or one where two do not fit; plus one for
  // every gradient the model holds between uses (declared, or a group used more than twice
  // per micro-batch: a tied group). Without a declared schedule, three.
  int gradient_slot_count(GradientBuffering buffering) const {
    if (shape_.trainable_max_padded == 0) return 0;  // every group frozen: no gradients
    const int base = buffering == GradientBuffering::kSingle ? 1 : 2;
    if (in_.held_gradients >= 0) return base + in_.held_gradients;
    if (in_.schedule.empty()) return 3;
    std::map<int, int> uses;
    for (int g : in_.schedule) ++uses[g];
    int slots = base;
    for (const auto& [g, n] : uses) slots += n > 2 ? 1 : 0;
    return slots;
  }

  StatusOr<EnginePlan> plan_with_depth(int requested_depth, GradientBuffering buffering) const {
    EnginePlan p;
    p.persistent = persistent_;
    p.max_gather_elements = shape_.max_padded;
    p.max_gather_shard = shape_.max_shard;
    p.max_padded_elements = shape_.all_max_padded;
    p.max_shard_elements = shape_.all_max_shard;
    p.max_trainable_shard_elements = shape_.trainable_max_shard;
    p.pinned_budget_bytes = o_.pinned_budget_bytes;
    p.device_budget_bytes = in_.device_budget_bytes;
    p.state_bytes = shape_.total_numel * dtype_size(o_.param_dtype) + shape_.trainable_numel * (12 + 4);
    size_gather_slots(p, requested_depth);
    p.gradient_slots = gradient_slot_count(buffering);
    p.single_gradient_buffer = buffering == GradientBuffering::kSingle;
    p.gradient_slot_elements.assign(static_cast<size_t>(p.gradient_slots), std::max<size_t>(shape_.trainable_second_max_padded, 1));
    if (p.gradient_slots > 0) p.gradient_slot_elements.front() = shape_.trainable_max_padded;
    if (o_.world_size > 1 && o_.reduce_bucket_elements > 0 && o_.reduce_bucket_elements < shape_.trainable_max_shard)
      p.reduce_bucket_elements = o_.reduce_bucket_elements;
    p.gradients_spilled = o_.optimizer_tier == Tier::kNvme && p.gradient_slots > 0;
    p.landing_buffers = p.gradients_spilled ? p.gradient_slots + 1 : 0;
    add_device_lines(p);
    STRATA_RETURN_IF_ERROR(add_host_lines(p));
    add_nvme_lines(p);
    return p;
  }

  void size_gather_slots(EnginePlan& p, int depth) const {
    const size_t max_padded = shape_.max_padded;
    if (o_.prefetch_bucket_elements > 0 && max_padded > 0)
      depth = std::min<int>(depth, static_cast<int>(std::max<size_t>(1, o_.prefetch_bucket_elements / max_padded)));
    int slots = depth + 1;
    if (o_.max_live_elements > 0 && max_padded > 0)
      slots = std::min<int>(slots, static_cast<int>(std::max<size_t>(1, o_.max_live_elements / max_padded)));
    // offload_param.buffer_count: each gather slot has its own NVMe read-staging buffer.
    if (o_.param_tier == Tier::kNvme && o_.param_buffer_count > 0) slots = std::min(slots, o_.param_buffer_count);
    p.prefetch_depth = slots - 1;
    const bool any_slot_groups = max_padded > 0 && !direct_view();
    p.gather_slots = any_slot_groups ? slots : 0;
  }

  void add(EnginePlan& p, std::string what, Tier tier, size_t bytes) const {
    if (bytes == 0) return;
    p.lines.push_back({std::move(what), tier, bytes});
    if (tier == Tier::kDevice) p.device_bytes += bytes;
    else if (tier == Tier::kNvme) p.nvme_bytes += bytes;
    else if (tier == Tier::kPinned) p.pinned_bytes += bytes;
    else p.host_bytes += bytes;
  }

  void add_device_lines(EnginePlan& p) const {
    const int world = o_.world_size;
    const size_t slots = static_cast<size_t>(p.gather_slots);
    const size_t gslots = static_cast<size_t>(p.gradient_slots);
    const std::string pname(dtype_name(o_.param_dtype));
    add(p, "gather buffers (" + std::to_string(slots) + " x " + format_bytes(param_bytes(shape_.max_padded)) + ")", Tier::kDevice,
        slots * param_bytes(shape_.max_padded));
    if (world > 1 && o_.param_tier != Tier::kDevice) add(p, "device staging shards", Tier::kDevice, slots * param_bytes(shape_.max_shard));
    if (o_.param_tier == Tier::kDevice) add(p, "parameter shards (" + pname + ")", Tier::kDevice, param_shard_bytes(false));
    add(p, "persistent groups (gathered)", Tier::kDevice, shape_.persistent_full_bytes + shape_.persistent_shard_bytes);
    size_t gradient_elements = 0;
    for (size_t elements : p.gradient_slot_elements) gradient_elements += elements;
    if (gslots == 1)
      add(p, "gradient buffer (fp32: 1 x " + format_bytes(shape_.trainable_max_padded * 4) + ")", Tier::kDevice, gradient_elements * 4);
    if (gslots > 1)
      add(p, "gradient buffers (fp32: 1 x " + format_bytes(shape_.trainable_max_padded * 4) + " + " + std::to_string(gslots - 1) + " x " +
                 format_bytes(p.gradient_slot_elements.back() * 4) + ")",
          Tier::kDevice, gradient_elements * 4);
    if (world > 1) add(p, "reduce-scatter shards", Tier::kDevice, gradient_elements / static_cast<size_t>(world) * 4);
    add(p, "reduce-scatter buckets (reduce_bucket_size " + std::to_string(p.reduce_bucket_elements) + ")", Tier::kDevice,
        gslots * p.reduce_bucket_elements * 4 * static_cast<size_t>(world));
    if (o_.grad_transfer_dtype != DType::kFloat32)
      add(p, "gradient transfer cast (one, shared by the slots)", Tier::kDevice, shape_.trainable_max_shard * dtype_size(o_.grad_transfer_dtype));
    if (o_.optimizer_tier == Tier::kDevice) {
      size_t state = 0;
      for (const auto& g : in_.layouts) state += g.trainable ? g.shard_numel * 16 : 0;
      add(p, "master weights + exp_avg + exp_avg_sq + gradient accumulators (fp32)", Tier::kDevice, state);
      if (o_.param_tier != Tier::kDevice) add(p, "new-parameter staging", Tier::kDevice, param_bytes(shape_.trainable_max_shard));
    }
    add(p, "norm all-reduce", Tier::kDevice, 256);
    add(p, "activations (declared by the model)", Tier::kDevice, o_.activation_bytes);
  }

  Status add_host_lines(EnginePlan& p) const {
    const Tier host = o_.pin_memory ? Tier::kPinned : Tier::kHost;
    const std::string pname(dtype_name(o_.param_dtype));
    const std::string tname(dtype_name(o_.grad_transfer_dtype));
    const size_t tsize = dtype_size(o_.grad_transfer_dtype);
    const bool nvme_params = o_.param_tier == Tier::kNvme;
    if (o_.param_tier == Tier::kPinned || o_.param_tier == Tier::kHost)
      add(p, "parameter shards (" + pname + ")", host, param_shard_bytes(true));
    if (nvme_params) {
      add(p, "NVMe parameter read staging (" + std::to_string(std::max(p.gather_slots, 1)) + " x " +
                 format_bytes(round_up_4k(param_bytes(shape_.max_shard))) + ")",
          host, static_cast<size_t>(std::max(p.gather_slots, 1)) * round_up_4k(param_bytes(shape_.max_shard)));
      add(p, "NVMe parameter read staging (persistent groups)", host, shape_.persistent_stage_bytes);
    }
    // New parameters on their way to the device or NVMe: in the optimizer ring's slots
    // when the state streams from NVMe, else one shard's worth.
    if ((nvme_params || o_.param_tier == Tier::kDevice) && o_.optimizer_tier != Tier::kNvme)
      add(p, "new-parameter staging", host, round_up_4k(param_bytes(shape_.trainable_max_shard)));
    const size_t grad_shard = shape_.trainable_max_shard;
    if (p.gradients_spilled) {
      add(p, "gradient landing ring (" + std::to_string(p.landing_buffers) + " x " + tname + " " +
                 format_bytes(round_up_4k(grad_shard * tsize)) + ")",
          host, static_cast<size_t>(p.landing_buffers) * round_up_4k(grad_shard * tsize));
      if (o_.gradient_accumulation_steps > 1)
        add(p, "gradient accumulation scratch (fp32)", host, round_up_4k(grad_shard * 4));
    } else {
      add(p, "gradient landing shards (" + tname + ")", host, copies() * sum_trainable_shards(tsize));
      if (o_.gradient_accumulation_steps > 1 && o_.optimizer_tier != Tier::kDevice)
        add(p, "gradient accumulators (fp32)", host, copies() * sum_trainable_shards(4));
    }
    if (o_.optimizer_tier == Tier::kPinned || o_.optimizer_tier == Tier::kHost)
      add(p, "master weights + exp_avg + exp_avg_sq (fp32)", host, 3 * sum_trainable_shards(4));
    else if (o_.optimizer_tier == Tier::kDevice)
      add(p, "optimizer-state access staging", host, round_up_4k(grad_shard * 12));
    else
      size_state_ring(p, host);
    return {};
  }

  // The NVMe optimizer-state ring: the largest chunk the pinned budget leaves room for.
  void size_state_ring(EnginePlan& p, Tier host) const {
    const NvmeAdamStateOptions ring = ring_shape(o_, p);
    const size_t used = p.pinned_bytes + p.host_bytes;
    const size_t within = plan_host_bytes_within(o_.pinned_budget_bytes);
    const size_t room = o_.pinned_budget_bytes > 0 ? (within > used ? within - used : 0) : kDefaultStateRingBytes;
    const size_t align = NvmeAdamState::piece_alignment(ring, planned_store_granularity(o_));
    const size_t unit = NvmeAdamState::slot_bytes(ring, align, kPlannedStoreAlignment);
    size_t piece = room / ring.slots / unit * align;
    // At least one chunk's worth, as the state allocates, when every group is frozen.
    const size_t whole = (std::max<size_t>(shape_.trainable_max_shard, 1) + align - 1) / align * align;
    if (o_.sub_group_elements > 0) piece = std::min(piece, std::max(align, o_.sub_group_elements / align * align));
    piece = std::min(piece, whole);
    p.state_ring_slots = static_cast<int>(ring.slots);
    p.state_piece_elements = piece;
    // A ring that cannot hold one chunk is still planned at the smallest chunk, so the
    // printed plan and the error show what it needs.
    p.state_ring_bytes = ring.slots * NvmeAdamState::slot_bytes(ring, std::max(piece, align), kPlannedStoreAlignment);
    add(p, "optimizer-state ring (" + std::to_string(ring.slots) + " chunks of " + std::to_string(std::max(piece, align)) +
               " elements: master + exp_avg + exp_avg_sq" + (ring.stored_gradient_type ? " + gradient" : "") +
               (ring.staged_param_type ? " + new parameters" : "") + ")",
        host, p.state_ring_bytes);
  }

  void add_nvme_lines(EnginePlan& p) const {
    const std::string pname(dtype_name(o_.param_dtype));
    if (o_.param_tier == Tier::kNvme)
      add(p, "parameter shards (" + pname + ")", Tier::kNvme, param_shard_bytes(true));
    if (o_.optimizer_tier == Tier::kNvme) {
      add(p, "master weights + exp_avg + exp_avg_sq (fp32)", Tier::kNvme, 3 * sum_trainable_shards(4));
      if (p.gradients_spilled) {
        const NvmeAdamStateOptions ring = ring_shape(o_, p);
        add(p, "gradient shards (" + std::string(dtype_name(*ring.stored_gradient_type)) + ")", Tier::kNvme,
            ring.gradient_copies * sum_trainable_shards(dtype_size(*ring.stored_gradient_type)));
      }
    }
  }

  std::string describe(const EnginePlan& p) const {
    std::ostringstream text;
    text << "Strata plan, rank " << o_.rank << " of " << o_.world_size << ": " << in_.layouts.size() << " groups, "
         << shape_.total_numel << " parameters";
    if (shape_.frozen_groups > 0)
      text << " (" << shape_.frozen_groups << " frozen group(s): parameters only; " << shape_.trainable_numel << " trainable)";
    text << "; training state " << format_bytes(p.state_bytes) << " (all ranks)\n";
    text << "  parameters: " << dtype_name(o_.param_dtype) << " on " << tier_name(o_.param_tier) << "; optimizer state: fp32 on "
         << tier_name(o_.optimizer_tier) << "; gradients: " << dtype_name(o_.grad_wire_dtype) << " on the wire, "
         << dtype_name(o_.grad_transfer_dtype) << " to the host" << (p.gradients_spilled ? ", spilled to NVMe" : "") << "\n";
    for (const auto& l : p.lines) text << "  " << tier_name(l.tier) << ": " << l.what << " = " << format_bytes(l.bytes) << "\n";
    text << "  device: " << format_bytes(p.device_bytes) << " of a " << format_bytes(p.device_budget_bytes) << " budget; "
         << (o_.pin_memory ? "pinned: " : "pageable host: ") << format_bytes(p.pinned_bytes + p.host_bytes);
    if (o_.pinned_budget_bytes > 0) text << " of a " << format_bytes(o_.pinned_budget_bytes) << " budget";
    text << "; nvme: " << format_bytes(p.nvme_bytes);
    if (p.nvme_bytes > 0) text << " under " << o_.nvme_path;
    text << "\n  prefetch depth " << p.prefetch_depth << (p.prefetch_depth_chosen ? " (automatic: the deepest that fits)" : "")
         << " (" << p.gather_slots << " gather slots), optimizer overlap " << overlap_mode_name(o_.overlap) << ", "
         << o_.gradient_accumulation_steps << " micro-batch(es) per step";
    if (p.single_gradient_buffer)
      text << "; one gradient buffer (two do not fit the device budget: each group's backward waits for the previous group's "
              "gradients to leave)";
    if (p.state_ring_slots > 0)
      text << "; optimizer-state chunks of " << p.state_piece_elements << " elements"
           << (o_.sub_group_elements > 0 ? " (sub_group_size " + std::to_string(o_.sub_group_elements) + ")" : " (automatic)");
    return text.str();
  }

  const PlanInputs& in_;
  const EngineOptions& o_;
  ModelShape shape_;
  std::vector<char> persistent_;
};

Status check_device_budget(const EnginePlan& plan, const EngineOptions& options) {
  if (plan.device_bytes <= plan.device_budget_bytes) return {};
  std::ostringstream message;
  message << "the device budget of " << format_bytes(plan.device_budget_bytes) << " cannot hold the plan's "
          << format_bytes(plan.device_bytes) << ":";
  for (const auto& l : plan.lines)
    if (l.tier == Tier::kDevice) message << " " << l.what << " " << format_bytes(l.bytes) << ";";
  // Settings that would fit: the budget needed, or a shallower prefetch.
  const size_t per_slot = plan.gather_slots > 0 ? plan.lines.front().bytes / static_cast<size_t>(plan.gather_slots) : 0;
  message << " settings that would fit: a device budget of at least " << (plan.device_bytes + kMiB - 1) / kMiB << " MiB";
  if (plan.gather_slots > 1 && per_slot > 0) {
    const size_t fixed = plan.device_bytes - per_slot * static_cast<size_t>(plan.gather_slots);
    if (fixed + 2 * per_slot <= plan.device_budget_bytes) {
      const size_t max_slots = (plan.device_budget_bytes - fixed) / per_slot;
      message << ", or prefetch depth " << (max_slots - 1) << " (stage3_max_live_parameters / strata.prefetch_depth)";
    }
  }
  if (options.activation_bytes > 0) message << ", or fewer activations (smaller micro-batch or activation checkpointing)";
  return OutOfMemoryError(message.str());
}

Status check_pinned_budget(const EnginePlan& plan, const EngineOptions& options) {
  const size_t host = plan.pinned_bytes + plan.host_bytes;
  const bool ring_empty = options.optimizer_tier == Tier::kNvme && plan.state_piece_elements == 0;
  if (options.pinned_budget_bytes == 0 || (host <= plan_host_bytes_within(options.pinned_budget_bytes) && !ring_empty)) return {};
  std::ostringstream message;
  message << "the pinned budget of " << format_bytes(options.pinned_budget_bytes) << " cannot hold the plan's " << format_bytes(host)
          << " and the host arena's slack (" << format_bytes(host_arena_bytes(host) - host) << "):";
  for (const auto& l : plan.lines)
    if (l.tier == Tier::kPinned || l.tier == Tier::kHost) message << " " << l.what << " " << format_bytes(l.bytes) << ";";
  message << " settings that would fit: a pinned budget of at least " << (host_arena_bytes(host) + kMiB - 1) / kMiB << " MiB (strata.pinned_budget_mib)";
  if (options.param_tier == Tier::kPinned || options.param_tier == Tier::kHost) message << ", or parameters on nvme";
  if (options.optimizer_tier == Tier::kPinned || options.optimizer_tier == Tier::kHost) message << ", or optimizer state on nvme";
  if (options.optimizer_tier == Tier::kNvme)
    message << ", or fewer optimizer-state chunks (offload_optimizer.buffer_count, at least 3) or a smaller sub_group_size";
  if (options.param_tier == Tier::kNvme) message << ", or a shallower prefetch (fewer NVMe read staging buffers)";
  return OutOfMemoryError(message.str());
}

}  // namespace

size_t host_arena_bytes(size_t plan_host_bytes) {
  return plan_host_bytes == 0 ? 0 : plan_host_bytes + plan_host_bytes / 32 + kArenaSlackBytes;
}

size_t plan_host_bytes_within(size_t budget) {
  if (budget <= kArenaSlackBytes) return 0;
  // The largest h with host_arena_bytes(h) <= budget: start from one that fits (a multiple
  // of 32) and step up, at most 32 bytes.
  size_t h = (budget - kArenaSlackBytes) / 33 * 32;
  while (host_arena_bytes(h + 1) <= budget) ++h;
  return h;
}

std::string format_bytes(size_t bytes) {
  char text[64];
  if (bytes >= (size_t{1} << 30)) std::snprintf(text, sizeof(text), "%.2f GiB", double(bytes) / double(size_t{1} << 30));
  else if (bytes >= kMiB) std::snprintf(text, sizeof(text), "%.1f MiB", double(bytes) / double(kMiB));
  else if (bytes >= 1024) std::snprintf(text, sizeof(text), "%.1f KiB", double(bytes) / 1024.0);
  else std::snprintf(text, sizeof(text), "%zu B", bytes);
  return text;
}

size_t round_up_4k(size_t bytes) { return (bytes + 4095) / 4096 * 4096; }

size_t planned_store_granularity(const EngineOptions& options) {
  return options.nvme_checksum ? NvmeStoreOptions{}.checksum_block_bytes : kPlannedStoreAlignment;
}

NvmeAdamStateOptions state_ring_options(const EngineOptions& options, const EnginePlan& plan) {
  NvmeAdamStateOptions ring = ring_shape(options, plan);
  ring.key_prefix = "optim";
  ring.piece_elements = plan.state_piece_elements;
  ring.pinned_budget_bytes = plan.state_ring_bytes;
  return ring;
}

StatusOr<EnginePlan> make_engine_plan(const PlanInputs& inputs) {
  if (inputs.options == nullptr) return InvalidArgumentError("make_engine_plan: no options");
  Planner planner(inputs);
  return planner.plan();
}

Status check_plan_budgets(const EnginePlan& plan, const EngineOptions& options) {
  STRATA_RETURN_IF_ERROR(check_device_budget(plan, options));
  STRATA_RETURN_IF_ERROR(check_pinned_budget(plan, options));
  const size_t host_needed = plan.pinned_bytes + plan.host_bytes;
  if (const size_t available = host_memory_available(); available > 0 && host_needed > available) {
    return OutOfMemoryError("the plan needs " + format_bytes(host_needed) + " of host memory (" +
                            (options.pin_memory ? "pinned" : "pageable") + ") but only " + format_bytes(available) +
                            " is available (MemAvailable); move optimizer state to nvme (offload_optimizer.device) or use fewer ranks per machine");
  }
  return {};
}

Status check_plan_against_machine(const EnginePlan& plan, const EngineOptions& options) {
  STRATA_RETURN_IF_ERROR(check_plan_budgets(plan, options));
  if (options.pin_memory && plan.pinned_bytes > 0) {
    rlimit limit{};
    if (getrlimit(RLIMIT_MEMLOCK, &limit) == 0 && limit.rlim_cur != RLIM_INFINITY && plan.pinned_bytes > limit.rlim_cur && geteuid() != 0) {
      STRATA_LOG(kWarn) << "the plan pins " << format_bytes(plan.pinned_bytes) << " but RLIMIT_MEMLOCK is " << format_bytes(limit.rlim_cur)
                        << ": host state will be pageable unless the limit is raised (ulimit -l) or CUDA registers it";
    }
  }
  if (plan.nvme_bytes > 0) {
    std::error_code ignored;
    std::filesystem::create_directories(options.nvme_path, ignored);
    // A file a finished run left is reused: it counts as room.
    STRATA_ASSIGN_OR_RETURN(const size_t free_bytes, NvmeStore::room_bytes(options.nvme_path, options.rank));
    if (plan.nvme_bytes > free_bytes) {
      return ResourceExhaustedError("nvme_path " + options.nvme_path + " has " + format_bytes(free_bytes) + " free but rank " +
                                    std::to_string(options.rank) + " needs " + format_bytes(plan.nvme_bytes) +
                                    " there; free space, point nvme_path at a larger disk, or keep optimizer state on cpu");
    }
  }
  return {};
}

}  // namespace strata::engine_internal
