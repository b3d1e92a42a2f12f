// Host memory that a device stream reads or writes after the call that enqueued the copy
// has returned, so that a model never drains the device to hand it inputs or to read its
// losses.
//
// - UploadStaging: pinned memory for one pass's inputs, in two fills used in turn. A copy
//   from it runs when the stream reaches it (a CpuDevice's worker, a CUDA DMA engine), so
//   a fill is written again only after the copies of its last use have run, marked by an
//   event recorded after them. With two fills that use is the one before last: in a
//   pipeline its copies are long done, so the wait is a check even when one micro-batch
//   stages the same pass twice (an evaluation batch, then the training batch).
// - LossReadback: each micro-batch's per-row loss pieces copied into their own pinned
//   record behind the compute, with an event; the sum is taken when the caller asks
//   (after the step's last micro-batch has been enqueued), not at the end of every
//   micro-batch. Records are reused once taken, so memory is bounded by the micro-batches
//   in flight.
//
// Pinned, not pageable: a CUDA copy between the device and pageable memory may wait for
// the stream (device to pageable host always does), which is the drain these avoid.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/status.h"
#include "offload/pinned_arena.h"

namespace strata::lm {

class UploadStaging {
 public:
  static StatusOr<UploadStaging> create(Device& device, size_t bytes, const std::string& purpose);
  UploadStaging() = default;
  UploadStaging(UploadStaging&&) noexcept = default;
  UploadStaging& operator=(UploadStaging&&) noexcept = default;
  ~UploadStaging();  // waits for the fills' copies: they read this memory

  // Waits until the stream has run the copies of the next fill's last use (returns their
  // error), then gives its memory to fill.
  StatusOr<std::byte*> begin_fill();
  // After enqueuing this fill's copies on `stream`: marks where they end.
  Status end_fill(Stream& stream);
  size_t size() const { return bytes_; }

 private:
  static constexpr int kFills = 2;
  std::unique_ptr<PinnedArena> arena_;
  PinnedBuffer fills_[kFills];
  std::unique_ptr<Event> consumed_[kFills];
  size_t bytes_ = 0;
  int next_ = 0;
};

// Where a micro-batch's loss pieces are on the device: row r's loss is
// loss_lse[r] + chunk_losses[target_chunk[r] * rows + r], rows with target_chunk -1 carry
// none (the vocabulary head's split of the cross-entropy, examples/lm/vocab_chunks.h).
struct LossPieces {
  const float* loss_lse = nullptr;      // device, [rows]
  const float* chunk_losses = nullptr;  // device, [chunks, rows]
  size_t rows = 0;
  size_t chunks = 0;
  std::span<const int32_t> target_chunk;  // host, [rows]: the chunk holding each row's target, or -1
};

// A queued micro-batch's loss, redeemed once with LossReadback::take.
struct LossTicket {
  size_t record = 0;
  uint64_t serial = 0;  // 0: none (the pass was not run)
};

class LossReadback {
 public:
  explicit LossReadback(Device& device);
  LossReadback(LossReadback&&) noexcept;
  LossReadback& operator=(LossReadback&&) noexcept;
  ~LossReadback();

  // Enqueues the copies of `pieces` on `stream` into a free record (a new one when all are
  // in flight) and returns at once.
  StatusOr<LossTicket> queue(Stream& stream, const LossPieces& pieces);
  // Waits for the ticket's copies and returns the sum of its rows' losses in row order (in
  // double, as the host always summed them). The record is free again after.
  StatusOr<double> take(LossTicket ticket);
  // Records in flight (queued, not yet taken).
  size_t in_flight() const;
  // Records ever made (the most in flight at once).
  size_t records() const { return records_.size(); }

 private:
  struct Record;
  StatusOr<size_t> free_record(size_t bytes);

  Device* device_;
  std::vector<std::unique_ptr<Record>> records_;
  uint64_t next_serial_ = 1;
};

}  // namespace strata::lm
