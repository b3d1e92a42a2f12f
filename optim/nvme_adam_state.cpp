#include "optim/nvme_adam_state.h"

#include <algorithm>
#include <chrono>
#include <string>

#include "engine/core/log.h"

namespace strata {

namespace {

size_t round_up(size_t value, size_t multiple) { return (value + multiple - 1) / multiple * multiple; }

double seconds_since(std::chrono::steady_clock::time_point start) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

}  // namespace

// One staging slot: the pinned state of one piece, and the transfers in flight on it.
struct NvmeAdamState::Slot {
  PinnedBuffer buffer;
  float* master = nullptr;
  void* exp_avg = nullptr;
  void* exp_avg_sq = nullptr;
  size_t master_capacity = 0;  // bytes each sub-buffer may hold (4 KiB rounded, for O_DIRECT)
  size_t moment_capacity = 0;
  IoTicket tickets[3];         // reads or writes of master, exp_avg, exp_avg_sq
};

NvmeAdamState::NvmeAdamState(ConstructionKey, NvmeStore& store, PinnedArena& arena, std::vector<size_t> group_elements,
                             const NvmeAdamStateOptions& options)
    : store_(store), arena_(arena), group_elements_(std::move(group_elements)), options_(options) {}

NvmeAdamState::~NvmeAdamState() {
  for (const GroupExtents& group : extents_) {
    for (NvmeExtent extent : {group.master, group.exp_avg, group.exp_avg_sq}) {
      if (!extent.valid()) continue;
      const Status status = store_.free(extent);
      if (!status.ok()) STRATA_LOG(kWarn) << "nvme adam state: freeing an extent failed: " << status.to_string();
    }
  }
}

StatusOr<std::unique_ptr<NvmeAdamState>> NvmeAdamState::create(NvmeStore& store, PinnedArena& arena, std::vector<size_t> group_elements,
                                                                const NvmeAdamStateOptions& options) {
  if (options.moment_type != DType::kFloat32 && options.moment_type != DType::kBFloat16)
    return InvalidArgumentError("nvme adam state: moments must be fp32 or bf16, got " + std::string(dtype_name(options.moment_type)));
  if (options.slots < 3)
    return InvalidArgumentError("nvme adam state: the pipeline needs at least 3 slots (read ahead, step, write back), got " +
                                std::to_string(options.slots));
  if (group_elements.empty()) return InvalidArgumentError("nvme adam state: no groups");
  for (size_t g = 0; g < group_elements.size(); ++g) {
    if (group_elements[g] == 0) return InvalidArgumentError("nvme adam state: group " + std::to_string(g) + " has no elements");
  }
  auto state = std::make_unique<NvmeAdamState>(ConstructionKey(), store, arena, std::move(group_elements), options);

  // A piece starts where every array's byte offset is a multiple of the store's transfer
  // granularity (the checksum block, or the O_DIRECT alignment without checksums).
  const size_t granularity = store.checksums() ? store.checksum_block_bytes() : store.alignment();
  const size_t moment_width = dtype_size(options.moment_type);
  const size_t align_elements = granularity / std::min<size_t>(4, moment_width);
  const size_t per_slot = options.pinned_budget_bytes / options.slots;
  const size_t overhead = 3 * store.alignment();  // each sub-buffer rounds up to the alignment
  const size_t usable = per_slot > overhead ? per_slot - overhead : 0;
  size_t piece = usable / state->state_bytes_per_element() / align_elements * align_elements;
  if (piece == 0)
    return InvalidArgumentError("nvme adam state: a pinned budget of " + std::to_string(options.pinned_budget_bytes) + " bytes over " +
                                std::to_string(options.slots) + " slots cannot hold one piece of " + std::to_string(align_elements) +
                                " elements (" + std::to_string(align_elements * state->state_bytes_per_element()) +
                                " bytes of state each); raise the budget to at least " +
                                std::to_string(options.slots * (align_elements * state->state_bytes_per_element() + overhead)));
  const size_t largest_group = *std::max_element(state->group_elements_.begin(), state->group_elements_.end());
  piece = std::min(piece, round_up(largest_group, align_elements));
  state->piece_elements_ = piece;

  for (unsigned i = 0; i < options.slots; ++i) {
    auto slot = std::make_unique<Slot>();
    slot->master_capacity = round_up(piece * 4, store.alignment());
    slot->moment_capacity = round_up(piece * moment_width, store.alignment());
    STRATA_ASSIGN_OR_RETURN(slot->buffer, arena.allocate(slot->master_capacity + 2 * slot->moment_capacity,
                                                          "nvme adam state slot " + std::to_string(i)));
    char* base = slot->buffer.as<char>();
    slot->master = reinterpret_cast<float*>(base);
    slot->exp_avg = base + slot->master_capacity;
    slot->exp_avg_sq = base + slot->master_capacity + slot->moment_capacity;
    state->slots_.push_back(std::move(slot));
  }

  state->extents_.resize(state->group_elements_.size());
  for (size_t g = 0; g < state->group_elements_.size(); ++g) {
    const std::string prefix = options.key_prefix + "/group" + std::to_string(g) + "/";
    const size_t n = state->group_elements_[g];
    GroupExtents& extents = state->extents_[g];
    STRATA_ASSIGN_OR_RETURN(extents.master, store.allocate(prefix + "master", n * 4));
    STRATA_ASSIGN_OR_RETURN(extents.exp_avg, store.allocate(prefix + "exp_avg", n * moment_width));
    STRATA_ASSIGN_OR_RETURN(extents.exp_avg_sq, store.allocate(prefix + "exp_avg_sq", n * moment_width));
  }
  return state;
}

Status NvmeAdamState::store_group(size_t group, const float* master, const void* exp_avg, const void* exp_avg_sq) {
  if (group >= groups()) return InvalidArgumentError("nvme adam state: no group " + std::to_string(group) + " (of " + std::to_string(groups()) + ")");
  const size_t n = group_elements_[group];
  const size_t moment_bytes = n * dtype_size(options_.moment_type);
  STRATA_RETURN_IF_ERROR_CTX(store_.write(extents_[group].master, master, n * 4), "storing group " + std::to_string(group) + " master");
  STRATA_RETURN_IF_ERROR_CTX(store_.write(extents_[group].exp_avg, exp_avg, moment_bytes), "storing group " + std::to_string(group) + " exp_avg");
  STRATA_RETURN_IF_ERROR_CTX(store_.write(extents_[group].exp_avg_sq, exp_avg_sq, moment_bytes),
                             "storing group " + std::to_string(group) + " exp_avg_sq");
  return {};
}

Status NvmeAdamState::load_group(size_t group, float* master, void* exp_avg, void* exp_avg_sq) {
  if (group >= groups()) return InvalidArgumentError("nvme adam state: no group " + std::to_string(group) + " (of " + std::to_string(groups()) + ")");
  const size_t n = group_elements_[group];
  const size_t moment_bytes = n * dtype_size(options_.moment_type);
  STRATA_RETURN_IF_ERROR_CTX(store_.read(extents_[group].master, master, n * 4), "loading group " + std::to_string(group) + " master");
  STRATA_RETURN_IF_ERROR_CTX(store_.read(extents_[group].exp_avg, exp_avg, moment_bytes), "loading group " + std::to_string(group) + " exp_avg");
  STRATA_RETURN_IF_ERROR_CTX(store_.read(extents_[group].exp_avg_sq, exp_avg_sq, moment_bytes),
                             "loading group " + std::to_string(group) + " exp_avg_sq");
  return {};
}

Status NvmeAdamState::read_piece(const Piece& piece, Slot& slot) {
  const GroupExtents& extents = extents_[piece.group];
  const size_t n = piece.end - piece.begin;
  const size_t width = dtype_size(options_.moment_type);
  STRATA_ASSIGN_OR_RETURN(slot.tickets[0], store_.read_async(extents.master, slot.master, n * 4, piece.begin * 4, slot.master_capacity));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[1],
                          store_.read_async(extents.exp_avg, slot.exp_avg, n * width, piece.begin * width, slot.moment_capacity));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[2],
                          store_.read_async(extents.exp_avg_sq, slot.exp_avg_sq, n * width, piece.begin * width, slot.moment_capacity));
  stats_.bytes_read += n * state_bytes_per_element();
  return {};
}

Status NvmeAdamState::write_piece(const Piece& piece, Slot& slot) {
  const GroupExtents& extents = extents_[piece.group];
  const size_t n = piece.end - piece.begin;
  const size_t width = dtype_size(options_.moment_type);
  STRATA_ASSIGN_OR_RETURN(slot.tickets[0], store_.write_async(extents.master, slot.master, n * 4, piece.begin * 4, slot.master_capacity));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[1],
                          store_.write_async(extents.exp_avg, slot.exp_avg, n * width, piece.begin * width, slot.moment_capacity));
  STRATA_ASSIGN_OR_RETURN(slot.tickets[2],
                          store_.write_async(extents.exp_avg_sq, slot.exp_avg_sq, n * width, piece.begin * width, slot.moment_capacity));
  stats_.bytes_written += n * state_bytes_per_element();
  return {};
}

Status NvmeAdamState::wait_slot(Slot& slot) {
  Status first;
  for (IoTicket& ticket : slot.tickets) {
    if (!ticket.valid()) continue;
    Status status = store_.wait(ticket);
    ticket = IoTicket{};
    if (first.ok() && !status.ok()) first = std::move(status);
  }
  return first;
}

Status NvmeAdamState::step(CpuAdam& adam, std::span<const AdamGroupIo> io, const AdamStepPlan& plan, std::span<const size_t> order) {
  if (plan.skip) return {};
  if (io.size() != groups())
    return InvalidArgumentError("nvme adam state: step got gradients for " + std::to_string(io.size()) + " groups, the state has " +
                                std::to_string(groups()));
  std::vector<Piece> pieces;
  auto add_group = [&](size_t g) -> Status {
    if (g >= groups()) return InvalidArgumentError("nvme adam state: step order names group " + std::to_string(g) + " (of " + std::to_string(groups()) + ")");
    if (io[g].grad == nullptr) return InvalidArgumentError("nvme adam state: group " + std::to_string(g) + " has no gradient");
    for (size_t begin = 0; begin < group_elements_[g]; begin += piece_elements_)
      pieces.push_back({g, begin, std::min(group_elements_[g], begin + piece_elements_)});
    return {};
  };
  if (order.empty()) {
    for (size_t g = 0; g < groups(); ++g) STRATA_RETURN_IF_ERROR(add_group(g));
  } else {
    for (size_t g : order) STRATA_RETURN_IF_ERROR(add_group(g));
  }

  const size_t slot_count = slots_.size();
  const size_t ahead = slot_count - 2;  // pieces read ahead of the one being stepped
  auto run = [&]() -> Status {
    for (size_t k = 0; k < std::min(ahead, pieces.size()); ++k) STRATA_RETURN_IF_ERROR(read_piece(pieces[k], *slots_[k % slot_count]));
    for (size_t k = 0; k < pieces.size(); ++k) {
      if (const size_t next = k + ahead; next < pieces.size()) {
        // The slot of piece `next` last held piece next - slot_count: its write-back must finish first.
        Slot& slot = *slots_[next % slot_count];
        const auto start = std::chrono::steady_clock::now();
        STRATA_RETURN_IF_ERROR(wait_slot(slot));
        stats_.slot_wait_seconds += seconds_since(start);
        STRATA_RETURN_IF_ERROR(read_piece(pieces[next], slot));
      }
      const Piece& piece = pieces[k];
      Slot& slot = *slots_[k % slot_count];
      auto start = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR_CTX(wait_slot(slot), "reading the optimizer state of group " + std::to_string(piece.group) + " elements [" +
                                                      std::to_string(piece.begin) + ", " + std::to_string(piece.end) + ")");
      stats_.read_wait_seconds += seconds_since(start);
      const AdamGroupIo& group = io[piece.group];
      kernels::AdamBuffers buffers;
      buffers.grad = static_cast<const char*>(group.grad) + piece.begin * dtype_size(group.grad_type);
      buffers.grad_type = group.grad_type;
      buffers.master = slot.master;
      buffers.exp_avg = slot.exp_avg;
      buffers.exp_avg_sq = slot.exp_avg_sq;
      buffers.moment_type = options_.moment_type;
      buffers.param = group.param == nullptr ? nullptr : static_cast<char*>(group.param) + piece.begin * dtype_size(group.param_type);
      buffers.param_type = group.param_type;
      buffers.count = piece.end - piece.begin;
      start = std::chrono::steady_clock::now();
      STRATA_RETURN_IF_ERROR(adam.step(buffers, plan));
      stats_.compute_seconds += seconds_since(start);
      STRATA_RETURN_IF_ERROR(write_piece(piece, slot));
      ++stats_.pieces;
    }
    return {};
  };
  Status status = run();
  // Every transfer finishes before the staging can be reused or freed, error or not.
  for (auto& slot : slots_) {
    Status drained = wait_slot(*slot);
    if (status.ok() && !drained.ok()) status = std::move(drained).with_context("writing the optimizer state back");
  }
  if (status.ok()) ++stats_.steps;
  return status;
}

}  // namespace strata
