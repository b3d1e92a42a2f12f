#include "optim/nvme_adam_state.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "engine/core/log.h"

namespace strata {

namespace {

using Clock = std::chrono::steady_clock;

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

double seconds_since(Clock::time_point start) { return std::chrono::duration<double>(Clock::now() - start).count(); }

std::string piece_name(size_t group, size_t begin, size_t end) {
  return "group " + std::to_string(group) + " elements [" + std::to_string(begin) + ", " + std::to_string(end) + ")";
}

}  // namespace

// One staging slot: the pinned state of one piece (and its gradient and new parameters
// where those are staged), and the transfers in flight on it.
struct NvmeAdamState::Slot {
  PinnedBuffer buffer;
  float* master = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  void* grad = nullptr;        // stored gradients only
  void* param = nullptr;       // staged parameters only
  size_t master_capacity = 0;  // bytes each sub-buffer may hold (rounded to the alignment, for O_DIRECT)
  size_t moment_capacity = 0;
  size_t grad_capacity = 0;
  size_t param_capacity = 0;
  IoTicket tickets[4];         // reads or writes of master, exp_avg, exp_avg_sq (and the gradient)
  Clock::time_point completed[4];  // when each transfer finished (stamped by the store)
  bool writing = false;        // the tickets are write-backs
  Clock::time_point submitted;
  size_t group = 0;
  size_t begin = 0, end = 0;   // the piece's elements in the group
};

NvmeAdamState::NvmeAdamState(ConstructionKey, NvmeStore& store, std::vector<size_t> group_elements,
                             const NvmeAdamStateOptions& options)
    : store_(store), group_elements_(std::move(group_elements)), options_(options) {}

NvmeAdamState::~NvmeAdamState() {
  for (const GroupExtents& group : extents_) {
    std::vector<NvmeExtent> all{group.master, group.exp_avg, group.exp_avg_sq};
    all.insert(all.end(), group.gradients.begin(), group.gradients.end());
    for (NvmeExtent extent : all) {
      if (!extent.valid()) continue;
      const Status status = store_.free(extent);
      if (!status.ok()) STRATA_LOG(kWarn) << "nvme adam state: freeing an extent failed: " << status.to_string();
    }
  }
}

size_t NvmeAdamState::piece_alignment(const NvmeAdamStateOptions& options, size_t store_granularity) {
  size_t narrowest = std::min<size_t>(4, dtype_size(options.moment_type));
  if (options.stored_gradient_type) narrowest = std::min(narrowest, dtype_size(*options.stored_gradient_type));
  // The caller writes staged parameters to extents of the same store at the piece's offset.
  if (options.staged_param_type) narrowest = std::min(narrowest, dtype_size(*options.staged_param_type));
  return store_granularity / narrowest;
}

// The arrays of a slot sit one colour gap apart, so that pieces of 2^k elements do not
// put the streams CPU Adam reads and writes together at addresses congruent modulo large
// powers of two (which collide in the caches: see PinnedArena's colouring).
size_t NvmeAdamState::slot_bytes(const NvmeAdamStateOptions& options, size_t piece, size_t store_alignment) {
  const size_t gap = round_up(PinnedArena::kColourGapBytes, store_alignment);
  size_t bytes = round_up(piece * 4, store_alignment) + 2 * round_up(piece * dtype_size(options.moment_type), store_alignment) + 2 * gap;
  if (options.stored_gradient_type) bytes += round_up(piece * dtype_size(*options.stored_gradient_type), store_alignment) + gap;
  if (options.staged_param_type) bytes += round_up(piece * dtype_size(*options.staged_param_type), store_alignment) + gap;
  return bytes;
}

StatusOr<std::unique_ptr<NvmeAdamState>> NvmeAdamState::create(NvmeStore& store, PinnedArena& arena, std::vector<size_t> group_elements,
                                                                const NvmeAdamStateOptions& options) {
  if (options.moment_type != DType::kFloat32 && options.moment_type != DType::kBFloat16)
    return InvalidArgumentError("nvme adam state: moments must be fp32 or bf16, got " + std::string(dtype_name(options.moment_type)));
  if (options.slots < 3)
    return InvalidArgumentError("nvme adam state: the pipeline needs at least 3 slots (read ahead, step, write back), got " +
                                std::to_string(options.slots));
  if (options.stored_gradient_type && options.gradient_copies < 1)
    return InvalidArgumentError("nvme adam state: stored gradients need at least one copy");
  if (group_elements.empty()) return InvalidArgumentError("nvme adam state: no groups");
  auto state = std::make_unique<NvmeAdamState>(ConstructionKey(), store, std::move(group_elements), options);

  // A piece starts where every array's byte offset is a multiple of the store's transfer
  // granularity (the checksum block, or the O_DIRECT alignment without checksums).
  const size_t granularity = store.transfer_granularity();
  const size_t align_elements = piece_alignment(options, granularity);
  // At least one element: a state whose groups all hold nothing still has a (smallest) ring.
  const size_t largest_group = std::max<size_t>(1, *std::max_element(state->group_elements_.begin(), state->group_elements_.end()));
  const size_t per_slot = options.pinned_budget_bytes / options.slots;
  const size_t unit = slot_bytes(options, align_elements, store.alignment());
  size_t piece = 0;
  if (options.piece_elements > 0) {
    piece = std::max(align_elements, options.piece_elements / align_elements * align_elements);
  } else {
    // slot_bytes is affine in whole alignment units: grow the piece unit by unit.
    piece = per_slot >= unit ? per_slot / unit * align_elements : 0;
  }
  piece = std::min(piece, round_up(largest_group, align_elements));
  if (piece == 0 || slot_bytes(options, piece, store.alignment()) > per_slot)
    return InvalidArgumentError("nvme adam state: a pinned budget of " + std::to_string(options.pinned_budget_bytes) + " bytes over " +
                                std::to_string(options.slots) + " slots cannot hold a piece of " +
                                std::to_string(std::max(piece, align_elements)) + " elements; raise the budget to at least " +
                                std::to_string(options.slots * slot_bytes(options, std::max(piece, align_elements), store.alignment())) +
                                " bytes or lower sub_group_size");
  state->piece_elements_ = piece;

  for (unsigned i = 0; i < options.slots; ++i) {
    auto slot = std::make_unique<Slot>();
    const size_t a = store.alignment();
    slot->master_capacity = round_up(piece * 4, a);
    slot->moment_capacity = round_up(piece * dtype_size(options.moment_type), a);
    if (options.stored_gradient_type) slot->grad_capacity = round_up(piece * dtype_size(*options.stored_gradient_type), a);
    if (options.staged_param_type) slot->param_capacity = round_up(piece * dtype_size(*options.staged_param_type), a);
    STRATA_ASSIGN_OR_RETURN(slot->buffer, arena.allocate(slot_bytes(options, piece, a), "optimizer-state ring slot " + std::to_string(i)));
    const size_t gap = round_up(PinnedArena::kColourGapBytes, a);
    char* next = slot->buffer.as<char>();
    slot->master = reinterpret_cast<float*>(next);
    next += slot->master_capacity + gap;
    slot->exp_avg = next;
    next += slot->moment_capacity + gap;
    slot->exp_avg_sq = next;
    next += slot->moment_capacity;
    if (slot->grad_capacity > 0) {
      slot->grad = next + gap;
      next += gap + slot->grad_capacity;
    }
    if (slot->param_capacity > 0) slot->param = next + gap;
    state->slots_.push_back(std::move(slot));
  }

  state->extents_.resize(state->group_elements_.size());
  const size_t moment_width = dtype_size(options.moment_type);
  for (size_t g = 0; g < state->group_elements_.size(); ++g) {
    const std::string prefix = options.key_prefix + "/group" + std::to_string(g) + "/";
    const size_t n = state->group_elements_[g];
    if (n == 0) continue;  // a group without state (an engine's frozen group): no extents
    GroupExtents& extents = state->extents_[g];
    STRATA_ASSIGN_OR_RETURN(extents.master, store.allocate(prefix + "master", n * 4));
    STRATA_ASSIGN_OR_RETURN(extents.exp_avg, store.allocate(prefix + "exp_avg", n * moment_width));
    STRATA_ASSIGN_OR_RETURN(extents.exp_avg_sq, store.allocate(prefix + "exp_avg_sq", n * moment_width));
    if (options.stored_gradient_type) {
      for (unsigned c = 0; c < options.gradient_copies; ++c) {
        STRATA_ASSIGN_OR_RETURN(NvmeExtent grad, store.allocate(prefix + "grad" + std::to_string(c), n * dtype_size(*options.stored_gradient_type)));
        extents.gradients.push_back(grad);
      }
    }
  }
  return state;
}

Status NvmeAdamState::store_group(size_t group, const float* master, const void* exp_avg, const void* exp_avg_sq) {
  STRATA_RETURN_IF_ERROR(check_group_has_state(group));
  const size_t n = group_elements_[group];
  if (master != nullptr) STRATA_RETURN_IF_ERROR(store_range(group, Array::kMaster, 0, n, master));
  if (exp_avg != nullptr) STRATA_RETURN_IF_ERROR(store_range(group, Array::kExpAvg, 0, n, exp_avg));
  if (exp_avg_sq != nullptr) STRATA_RETURN_IF_ERROR(store_range(group, Array::kExpAvgSq, 0, n, exp_avg_sq));
  return {};
}

Status NvmeAdamState::load_group(size_t group, float* master, void* exp_avg, void* exp_avg_sq) {
  STRATA_RETURN_IF_ERROR(check_group_has_state(group));
  const size_t n = group_elements_[group];
  if (master != nullptr) STRATA_RETURN_IF_ERROR(load_range(group, Array::kMaster, 0, n, master));
  if (exp_avg != nullptr) STRATA_RETURN_IF_ERROR(load_range(group, Array::kExpAvg, 0, n, exp_avg));
  if (exp_avg_sq != nullptr) STRATA_RETURN_IF_ERROR(load_range(group, Array::kExpAvgSq, 0, n, exp_avg_sq));
  return {};
}

Status NvmeAdamState::store_range(size_t group, Array array, size_t first, size_t count, const void* values) {
  STRATA_RETURN_IF_ERROR(flush());
  STRATA_ASSIGN_OR_RETURN(const ArrayRange range, array_range(group, array, first, count));
  STRATA_RETURN_IF_ERROR_CTX(store_.write(range.extent, values, range.bytes, range.offset), "storing " + range.what);
  return {};
}

Status NvmeAdamState::load_range(size_t group, Array array, size_t first, size_t count, void* values) {
  STRATA_RETURN_IF_ERROR(flush());
  STRATA_ASSIGN_OR_RETURN(const ArrayRange range, array_range(group, array, first, count));
  STRATA_RETURN_IF_ERROR_CTX(store_.read(range.extent, values, range.bytes, range.offset), "loading " + range.what);
  return {};
}

StatusOr<NvmeAdamState::ArrayRange> NvmeAdamState::array_range(size_t group, Array array, size_t first, size_t count) const {
  STRATA_RETURN_IF_ERROR(check_group_has_state(group));
  const size_t n = group_elements_[group];
  static constexpr const char* kNames[] = {"master", "exp_avg", "exp_avg_sq"};
  const char* name = kNames[static_cast<int>(array)];
  if (first > n || count > n - first)
    return InvalidArgumentError("nvme adam state: elements [" + std::to_string(first) + ", " + std::to_string(first + count) + ") of group " +
                           std::to_string(group) + " " + name + ", which has " + std::to_string(n));
  const size_t size = array == Array::kMaster ? 4 : dtype_size(options_.moment_type);
  const GroupExtents& e = extents_[group];
  const NvmeExtent extent = array == Array::kMaster ? e.master : array == Array::kExpAvg ? e.exp_avg : e.exp_avg_sq;
  return ArrayRange{extent, first * size, count * size,
                    "group " + std::to_string(group) + " " + name + " elements [" + std::to_string(first) + ", " + std::to_string(first + count) + ")"};
}

Status NvmeAdamState::check_group_has_state(size_t group) const {
  if (group >= groups()) return InvalidArgumentError("nvme adam state: no group " + std::to_string(group) + " (of " + std::to_string(groups()) + ")");
  if (group_elements_[group] == 0)
    return FailedPreconditionError("nvme adam state: group " + std::to_string(group) + " has no elements, so no state");
  return {};
}

Status NvmeAdamState::check_gradient_access(size_t group, unsigned copy, const char* what) const {
  if (!options_.stored_gradient_type) return FailedPreconditionError(std::string("nvme adam state: ") + what + " but gradients are not stored");
  if (group >= groups()) return InvalidArgumentError(std::string("nvme adam state: ") + what + " of group " + std::to_string(group) + " (of " + std::to_string(groups()) + ")");
  if (group_elements_[group] == 0) return FailedPreconditionError(std::string("nvme adam state: ") + what + " of group " + std::to_string(group) + ", which has no elements");
  if (copy >= options_.gradient_copies)
    return InvalidArgumentError(std::string("nvme adam state: ") + what + " of gradient copy " + std::to_string(copy) + " (of " +
                                std::to_string(options_.gradient_copies) + ")");
  return {};
}

Status NvmeAdamState::store_gradient(size_t group, unsigned copy, const void* grad, size_t capacity_bytes) {
  STRATA_RETURN_IF_ERROR(check_gradient_access(group, copy, "store_gradient"));
  const size_t bytes = group_elements_[group] * dtype_size(*options_.stored_gradient_type);
  STRATA_RETURN_IF_ERROR_CTX(store_.write(extents_[group].gradients[copy], grad, bytes, 0, capacity_bytes),
                             "spilling the gradient of group " + std::to_string(group));
  gradient_bytes_written_.fetch_add(bytes, std::memory_order_relaxed);
  return {};
}

Status NvmeAdamState::load_gradient(size_t group, unsigned copy, void* grad, size_t capacity_bytes) {
  STRATA_RETURN_IF_ERROR(check_gradient_access(group, copy, "load_gradient"));
  const size_t bytes = group_elements_[group] * dtype_size(*options_.stored_gradient_type);
  STRATA_RETURN_IF_ERROR_CTX(store_.read(extents_[group].gradients[copy], grad, bytes, 0, capacity_bytes),
                             "reading back the gradient of group " + std::to_string(group));
  gradient_bytes_read_.fetch_add(bytes, std::memory_order_relaxed);
  return {};
}

Status NvmeAdamState::read_piece(const Piece& piece, const AdamGroupIo& io, Slot& slot) {
  const GroupExtents& extents = extents_[piece.group];
  const size_t n = piece.end - piece.begin;
  const size_t width = dtype_size(options_.moment_type);
  slot.writing = false;
  slot.group = piece.group;
  slot.begin = piece.begin;
  slot.end = piece.end;
  slot.submitted = Clock::now();
  STRATA_ASSIGN_OR_RETURN(slot.tickets[0], store_.read_async(extents.master, slot.master, n * 4, piece.begin * 4, slot.master_capacity,
                                                                           &slot.completed[0]));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[1],
                          store_.read_async(extents.exp_avg, slot.exp_avg, n * width, piece.begin * width, slot.moment_capacity,
                                            &slot.completed[1]));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[2],
                          store_.read_async(extents.exp_avg_sq, slot.exp_avg_sq, n * width, piece.begin * width, slot.moment_capacity,
                                            &slot.completed[2]));
  stats_.bytes_read += n * state_bytes_per_element();
  if (io.grad == nullptr) {
    const size_t gwidth = dtype_size(*options_.stored_gradient_type);
    STRATA_ASSIGN_OR_RETURN(slot.tickets[3], store_.read_async(extents.gradients[io.stored_gradient_copy], slot.grad, n * gwidth,
                                                               piece.begin * gwidth, slot.grad_capacity, &slot.completed[3]));
    stats_.bytes_read += n * gwidth;
  }
  return {};
}

Status NvmeAdamState::write_piece(const Piece& piece, Slot& slot) {
  const GroupExtents& extents = extents_[piece.group];
  const size_t n = piece.end - piece.begin;
  const size_t width = dtype_size(options_.moment_type);
  slot.writing = true;
  slot.group = piece.group;
  slot.begin = piece.begin;
  slot.end = piece.end;
  slot.submitted = Clock::now();
  STRATA_ASSIGN_OR_RETURN(slot.tickets[0], store_.write_async(extents.master, slot.master, n * 4, piece.begin * 4, slot.master_capacity,
                                                                            &slot.completed[0]));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[1],
                          store_.write_async(extents.exp_avg, slot.exp_avg, n * width, piece.begin * width, slot.moment_capacity,
                                             &slot.completed[1]));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[2],
                          store_.write_async(extents.exp_avg_sq, slot.exp_avg_sq, n * width, piece.begin * width, slot.moment_capacity,
                                             &slot.completed[2]));
  stats_.bytes_written += n * state_bytes_per_element();
  return {};
}

Status NvmeAdamState::wait_slot(Slot& slot) {
  Status first;
  bool any = false;
  Clock::time_point finished = slot.submitted;
  for (size_t i = 0; i < std::size(slot.tickets); ++i) {
    IoTicket& ticket = slot.tickets[i];
    if (!ticket.valid()) continue;
    any = true;
    Status status = store_.wait(ticket);
    ticket = IoTicket{};
    finished = std::max(finished, slot.completed[i]);
    if (first.ok() && !status.ok()) first = std::move(status);
  }
  // The transfers' interval ends when the last one finished, not when this wait came.
  if (any && transfer_done_) transfer_done_(slot.group, slot.writing, slot.submitted, finished);
  return first;
}

Status NvmeAdamState::check_group_step(const NvmeAdamGroupStep& step) const {
  const size_t g = step.group;
  if (g >= groups()) return InvalidArgumentError("nvme adam state: step names group " + std::to_string(g) + " (of " + std::to_string(groups()) + ")");
  if (step.io.grad == nullptr) {
    if (!options_.stored_gradient_type)
      return InvalidArgumentError("nvme adam state: group " + std::to_string(g) + " has no gradient (none passed, none stored)");
    if (step.io.grad_type != *options_.stored_gradient_type || step.io.stored_gradient_copy >= options_.gradient_copies)
      return InvalidArgumentError("nvme adam state: group " + std::to_string(g) + " asks for a stored gradient copy " +
                                  std::to_string(step.io.stored_gradient_copy) + " of type " + std::string(dtype_name(step.io.grad_type)) +
                                  " that the state does not keep");
  }
  if (step.io.param == nullptr && options_.staged_param_type && step.io.param_type != *options_.staged_param_type)
    return InvalidArgumentError("nvme adam state: group " + std::to_string(g) + " stages parameters as " +
                                std::string(dtype_name(step.io.param_type)) + ", the slots hold " +
                                std::string(dtype_name(*options_.staged_param_type)));
  size_t covered = 0;
  for (const AdamPlanRun& run : step.runs) {
    if (run.begin != covered || run.end < run.begin || run.plan == nullptr)
      return InvalidArgumentError("nvme adam state: the plan runs of group " + std::to_string(g) + " do not tile it in order");
    covered = run.end;
  }
  if (covered != group_elements_[g])
    return InvalidArgumentError("nvme adam state: the plan runs of group " + std::to_string(g) + " cover " + std::to_string(covered) +
                                " of its " + std::to_string(group_elements_[g]) + " elements");
  return {};
}

// Steps one piece in its slot: every plan run that overlaps it, on the state in the slot.
Status NvmeAdamState::step_piece(CpuAdam& adam, const Piece& piece, const NvmeAdamGroupStep& step, Slot& slot,
                                 const NvmeAdamStepSinks& sinks) {
  const AdamGroupIo& io = step.io;
  const size_t gsize = dtype_size(io.grad_type);
  const size_t psize = dtype_size(io.param_type);
  const bool staged = io.param == nullptr && options_.staged_param_type.has_value();
  auto step_range = [&](size_t begin, size_t end, const AdamStepPlan& plan) -> Status {
    if (plan.skip) return {};
    const size_t local = begin - piece.begin;  // into the slot
    kernels::AdamBuffers buffers;
    buffers.grad = io.grad != nullptr ? static_cast<const char*>(io.grad) + begin * gsize : static_cast<const char*>(slot.grad) + local * gsize;
    buffers.grad_type = io.grad_type;
    buffers.master = slot.master + local;
    buffers.exp_avg = static_cast<char*>(slot.exp_avg) + local * dtype_size(options_.moment_type);
    buffers.exp_avg_sq = static_cast<char*>(slot.exp_avg_sq) + local * dtype_size(options_.moment_type);
    buffers.moment_type = options_.moment_type;
    buffers.param = io.param != nullptr ? static_cast<char*>(io.param) + begin * psize
                    : staged            ? static_cast<char*>(slot.param) + local * psize
                                        : nullptr;
    buffers.param_type = io.param_type;
    buffers.count = end - begin;
    return adam.step(buffers, plan);
  };
  const auto start = Clock::now();
  for (const AdamPlanRun& run : step.runs) {
    const size_t begin = std::max(run.begin, piece.begin), end = std::min(run.end, piece.end);
    if (begin < end) STRATA_RETURN_IF_ERROR(step_range(begin, end, *run.plan));
  }
  stats_.compute_seconds += seconds_since(start);
  if (sinks.stepped) sinks.stepped(piece.group, start, Clock::now());
  if (staged && sinks.staged_params) STRATA_RETURN_IF_ERROR(sinks.staged_params(piece.group, piece.begin, piece.end, slot.param));
  return {};
}

Status NvmeAdamState::step(CpuAdam& adam, std::span<const AdamGroupIo> io, const AdamStepPlan& plan, std::span<const size_t> order) {
  if (plan.skip) return {};
  if (io.size() != groups())
    return InvalidArgumentError("nvme adam state: step got gradients for " + std::to_string(io.size()) + " groups, the state has " +
                                std::to_string(groups()));
  std::vector<size_t> all;
  if (order.empty()) {
    all.resize(groups());
    for (size_t g = 0; g < groups(); ++g) all[g] = g;
    order = all;
  }
  const AdamPlanRun whole_run{0, 0, &plan};
  std::vector<NvmeAdamGroupStep> steps;
  std::vector<AdamPlanRun> runs(order.size(), whole_run);
  for (size_t i = 0; i < order.size(); ++i) {
    const size_t g = order[i];
    if (g >= groups()) return InvalidArgumentError("nvme adam state: step order names group " + std::to_string(g) + " (of " + std::to_string(groups()) + ")");
    if (io[g].grad == nullptr) return InvalidArgumentError("nvme adam state: group " + std::to_string(g) + " has no gradient");
    runs[i].end = group_elements_[g];
    steps.push_back({g, io[g], std::span<const AdamPlanRun>(&runs[i], 1)});
  }
  STRATA_RETURN_IF_ERROR(step_groups(adam, steps, {}));
  return flush();
}

Status NvmeAdamState::step_groups(CpuAdam& adam, std::span<const NvmeAdamGroupStep> groups_to_step, const NvmeAdamStepSinks& sinks) {
  std::vector<Piece> pieces;
  for (size_t i = 0; i < groups_to_step.size(); ++i) {
    const NvmeAdamGroupStep& step = groups_to_step[i];
    STRATA_RETURN_IF_ERROR(check_group_step(step));
    bool any = false;
    for (const AdamPlanRun& run : step.runs) any = any || !run.plan->skip;
    if (!any) continue;  // nothing to update: no I/O for this group
    for (size_t begin = 0; begin < group_elements_[step.group]; begin += piece_elements_)
      pieces.push_back({i, step.group, begin, std::min(group_elements_[step.group], begin + piece_elements_)});
  }
  transfer_done_ = sinks.transfer_done;
  const size_t slot_count = slots_.size();
  const size_t ahead = slot_count - 2;  // pieces read ahead of the one being stepped
  // Piece k uses slot (base + k) mod count: the slots whose write-backs a previous call
  // left in flight are reused last.
  const size_t base = next_slot_;
  auto slot_of = [&](size_t k) -> Slot& { return *slots_[(base + k) % slot_count]; };
  auto read_into_slot = [&](size_t k) -> Status {
    // The slot's last write-back must finish before the read overwrites its staging, and
    // so must any write-back of the same elements (a group stepped again soon after).
    Slot& slot = slot_of(k);
    const Piece& piece = pieces[k];
    const auto start = Clock::now();
    for (auto& other : slots_) {
      const bool same_elements = other->writing && other->group == piece.group && other->begin < piece.end && piece.begin < other->end;
      if (same_elements) STRATA_RETURN_IF_ERROR(wait_slot(*other));
    }
    STRATA_RETURN_IF_ERROR(wait_slot(slot));
    stats_.slot_wait_seconds += seconds_since(start);
    return read_piece(pieces[k], groups_to_step[pieces[k].step_index].io, slot);
  };
  auto run = [&]() -> Status {
    for (size_t k = 0; k < std::min(ahead, pieces.size()); ++k) STRATA_RETURN_IF_ERROR(read_into_slot(k));
    for (size_t k = 0; k < pieces.size(); ++k) {
      if (k + ahead < pieces.size()) STRATA_RETURN_IF_ERROR(read_into_slot(k + ahead));
      const Piece& piece = pieces[k];
      const NvmeAdamGroupStep& step = groups_to_step[piece.step_index];
      Slot& slot = slot_of(k);
      const auto start = Clock::now();
      STRATA_RETURN_IF_ERROR_CTX(wait_slot(slot), "reading the optimizer state of " + piece_name(piece.group, piece.begin, piece.end));
      stats_.read_wait_seconds += seconds_since(start);
      STRATA_RETURN_IF_ERROR(step_piece(adam, piece, step, slot, sinks));
      STRATA_RETURN_IF_ERROR(write_piece(piece, slot));
      ++stats_.pieces;
      const bool last_of_group = k + 1 == pieces.size() || pieces[k + 1].step_index != piece.step_index;
      if (last_of_group && sinks.group_stepped) STRATA_RETURN_IF_ERROR(sinks.group_stepped(piece.group));
    }
    return {};
  };
  Status status = run();
  next_slot_ = (base + pieces.size()) % slot_count;
  if (!status.ok()) {
    // Every transfer finishes before the staging can be reused, error or not.
    const Status drained = flush();
    (void)drained;  // the step's own error is the one to report
    return status;
  }
  if (!pieces.empty()) ++stats_.steps;
  // The last pieces' write-backs stay in flight: the next call overlaps them with its
  // reads, and flush() (or any state access) waits for them.
  return {};
}

Status NvmeAdamState::flush() {
  Status first;
  for (auto& slot : slots_) {
    Status drained = wait_slot(*slot);
    if (first.ok() && !drained.ok()) first = std::move(drained).with_context("writing the optimizer state back");
  }
  return first;
}

}  // namespace strata
