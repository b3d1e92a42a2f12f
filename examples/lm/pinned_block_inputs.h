// Pinned-host activation checkpointing (ActivationCheckpointing::kPinnedHost), the same for
// every transformer family: each training block's input (all but the last block's, which
// stays on the device) is copied to pinned host memory on a copy stream while the block
// computes, and copied back one block ahead of its recompute in the backward. The residual
// stream is two device buffers used in turn (TransformerLayout::add_residual_stream), so a
// block waits until the input it overwrites has been saved, and the backward waits until
// the input it recomputes from is back.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string_view>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/status.h"
#include "offload/pinned_arena.h"

namespace strata::lm {

class PinnedBlockInputs {
 public:
  // `slots` inputs of `slot_bytes` each; `family` names the buffers and the copy stream
  // ("GPT" -> "GPT block input 3", "gpt activation copies").
  static StatusOr<PinnedBlockInputs> create(Device& device, int slots, size_t slot_bytes, std::string_view family);
  PinnedBlockInputs() = default;  // inactive: nothing to save or restore
  PinnedBlockInputs(PinnedBlockInputs&&) noexcept = default;
  PinnedBlockInputs& operator=(PinnedBlockInputs&&) noexcept = default;
  ~PinnedBlockInputs();

  bool active() const { return copy_stream_ != nullptr; }
  // Forward, before block `layer` of `layers` computes from `input` (`bytes`): its input is
  // saved (unless it is the last block's) and the compute stream waits until block
  // layer - 1's input has been saved.
  Status save(Stream& compute, int64_t layer, int64_t layers, const void* input, size_t bytes);
  // Backward, once the buffer `slot` that held block m's input (or the final residual, m =
  // layers) is no longer read: block m-2's input is copied back into it.
  Status restore(Stream& compute, int64_t m, void* slot, size_t bytes);
  // Backward, before block `layer` of `layers` recomputes: waits until its input is back.
  Status wait_restored(Stream& compute, int64_t layer, int64_t layers);
  // Waits for the copies in flight (before the buffers are freed).
  Status synchronize();

 private:
  Device* device_ = nullptr;
  std::unique_ptr<PinnedArena> arena_;
  std::vector<PinnedBuffer> inputs_;  // block inputs 0 .. L-2
  std::unique_ptr<Stream> copy_stream_;
  std::unique_ptr<Event> input_ready_, slot_free_;
  std::unique_ptr<Event> saved_[2], restored_[2];
};

}  // namespace strata::lm
