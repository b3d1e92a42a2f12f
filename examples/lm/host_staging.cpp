#include "examples/lm/host_staging.h"

#include <algorithm>

namespace strata::lm {
namespace {

// One page-locked arena holding one buffer of `bytes`: small, made once and reused.
StatusOr<std::unique_ptr<PinnedArena>> make_arena(size_t bytes) {
  PinnedArenaOptions options;
  options.bytes = std::max<size_t>(bytes, 1);
  options.try_huge_pages = false;  // a few pages; a huge page each would waste 2 MiB
  return PinnedArena::create(options);
}

}  // namespace

StatusOr<UploadStaging> UploadStaging::create(Device& device, size_t bytes, const std::string& purpose) {
  UploadStaging staging;
  staging.bytes_ = std::max<size_t>(bytes, 1);
  const size_t page_rounded = (staging.bytes_ + 4095) / 4096 * 4096;
  STRATA_ASSIGN_OR_RETURN(staging.arena_, make_arena(kFills * page_rounded));
  for (int i = 0; i < kFills; ++i) {
    STRATA_ASSIGN_OR_RETURN(staging.fills_[i], staging.arena_->allocate(staging.bytes_, purpose + " (fill " + std::to_string(i) + ")"));
    STRATA_ASSIGN_OR_RETURN(staging.consumed_[i], device.create_event());
  }
  return staging;
}

UploadStaging::~UploadStaging() {
  // An error here belongs to the stream's owner, who sees it at its own next wait.
  for (auto& consumed : consumed_) {
    if (consumed != nullptr) (void)consumed->synchronize();
  }
}

StatusOr<std::byte*> UploadStaging::begin_fill() {
  if (consumed_[next_] == nullptr) return FailedPreconditionError("upload staging used before create()");
  STRATA_RETURN_IF_ERROR(consumed_[next_]->synchronize().with_context("the upload before last from this staging"));
  return fills_[next_].as<std::byte>();
}

Status UploadStaging::end_fill(Stream& stream) {
  STRATA_RETURN_IF_ERROR(stream.record(*consumed_[next_]));
  next_ = (next_ + 1) % kFills;
  return {};
}

struct LossReadback::Record {
  std::unique_ptr<PinnedArena> arena;
  PinnedBuffer pieces;  // loss_lse [rows], then chunk_losses [chunks, rows]
  std::vector<int32_t> target_chunk;
  size_t rows = 0;
  std::unique_ptr<Event> arrived;
  uint64_t serial = 0;  // 0: free
};

LossReadback::LossReadback(Device& device) : device_(&device) {}
LossReadback::LossReadback(LossReadback&&) noexcept = default;
LossReadback& LossReadback::operator=(LossReadback&&) noexcept = default;

LossReadback::~LossReadback() {
  // The copies write into the records: let them land before the memory goes. An error
  // here belongs to the stream's owner, who sees it at its own next wait.
  for (auto& record : records_) {
    if (record->serial != 0 && record->arrived) (void)record->arrived->synchronize();
  }
}

StatusOr<size_t> LossReadback::free_record(size_t bytes) {
  size_t index = records_.size();
  for (size_t i = 0; i < records_.size(); ++i) {
    if (records_[i]->serial == 0) {
      index = i;
      break;
    }
  }
  if (index == records_.size()) {
    auto record = std::make_unique<Record>();
    STRATA_ASSIGN_OR_RETURN(record->arrived, device_->create_event());
    records_.push_back(std::move(record));
  }
  Record& record = *records_[index];
  if (record.pieces.size() < bytes) {
    record.pieces.reset();
    record.arena.reset();
    STRATA_ASSIGN_OR_RETURN(record.arena, make_arena(bytes));
    STRATA_ASSIGN_OR_RETURN(record.pieces, record.arena->allocate(bytes, "loss pieces of a micro-batch"));
  }
  return index;
}

StatusOr<LossTicket> LossReadback::queue(Stream& stream, const LossPieces& pieces) {
  if (pieces.target_chunk.size() != pieces.rows)
    return InvalidArgumentError("loss readback: " + std::to_string(pieces.target_chunk.size()) + " target chunks for " +
                                std::to_string(pieces.rows) + " rows");
  for (const int32_t chunk : pieces.target_chunk) {
    if (chunk < -1 || static_cast<size_t>(chunk + 1) > pieces.chunks)
      return InvalidArgumentError("loss readback: target chunk " + std::to_string(chunk) + " outside [-1, " + std::to_string(pieces.chunks) + ")");
  }
  const size_t lse_bytes = pieces.rows * 4, chunk_bytes = pieces.chunks * pieces.rows * 4;
  STRATA_ASSIGN_OR_RETURN(const size_t index, free_record(lse_bytes + chunk_bytes));
  Record& record = *records_[index];
  record.rows = pieces.rows;
  record.target_chunk.assign(pieces.target_chunk.begin(), pieces.target_chunk.end());
  auto* host = record.pieces.as<char>();
  STRATA_RETURN_IF_ERROR(device_->copy_async(host, pieces.loss_lse, lse_bytes, CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(device_->copy_async(host + lse_bytes, pieces.chunk_losses, chunk_bytes, CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(stream.record(*record.arrived));
  record.serial = next_serial_++;
  return LossTicket{index, record.serial};
}

StatusOr<double> LossReadback::take(LossTicket ticket) {
  if (ticket.serial == 0 || ticket.record >= records_.size() || records_[ticket.record]->serial != ticket.serial)
    return InvalidArgumentError("loss readback: ticket " + std::to_string(ticket.serial) + " is not in flight (taken twice, or never queued)");
  Record& record = *records_[ticket.record];
  record.serial = 0;  // free again, whatever the wait says: the stream's error is reported once
  STRATA_RETURN_IF_ERROR(record.arrived->synchronize().with_context("reading a micro-batch's losses"));
  const size_t n = record.rows;
  const float* loss_lse = record.pieces.as<float>();
  const float* chunk_losses = loss_lse + n;
  double sum = 0.0;
  for (size_t r = 0; r < n; ++r) {
    const int32_t k = record.target_chunk[r];
    if (k < 0) continue;
    sum += static_cast<double>(loss_lse[r]) + static_cast<double>(chunk_losses[static_cast<size_t>(k) * n + r]);
  }
  return sum;
}

size_t LossReadback::in_flight() const {
  return static_cast<size_t>(std::count_if(records_.begin(), records_.end(), [](const auto& record) { return record->serial != 0; }));
}

}  // namespace strata::lm
