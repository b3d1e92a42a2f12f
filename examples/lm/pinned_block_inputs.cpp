#include "examples/lm/pinned_block_inputs.h"

#include <cctype>
#include <string>

namespace strata::lm {

StatusOr<PinnedBlockInputs> PinnedBlockInputs::create(Device& device, int slots, size_t slot_bytes, std::string_view family) {
  PinnedBlockInputs p;
  p.device_ = &device;
  if (slots > 0) {
    PinnedArenaOptions arena_options;
    arena_options.bytes = static_cast<size_t>(slots) * slot_bytes;
    STRATA_ASSIGN_OR_RETURN(p.arena_, PinnedArena::create(arena_options));
    for (int i = 0; i < slots; ++i) {
      STRATA_ASSIGN_OR_RETURN(PinnedBuffer slot, p.arena_->allocate(slot_bytes, std::string(family) + " block input " + std::to_string(i)));
      p.inputs_.push_back(std::move(slot));
    }
  }
  std::string stream_name(family);
  for (char& ch : stream_name) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  STRATA_ASSIGN_OR_RETURN(p.copy_stream_, device.create_stream(stream_name + " activation copies"));
  STRATA_ASSIGN_OR_RETURN(p.input_ready_, device.create_event());
  STRATA_ASSIGN_OR_RETURN(p.slot_free_, device.create_event());
  for (int i = 0; i < 2; ++i) {
    STRATA_ASSIGN_OR_RETURN(p.saved_[i], device.create_event());
    STRATA_ASSIGN_OR_RETURN(p.restored_[i], device.create_event());
  }
  return p;
}

PinnedBlockInputs::~PinnedBlockInputs() {
  // An error here was already reported by the call that enqueued the copy.
  if (copy_stream_) (void)copy_stream_->synchronize();
}

Status PinnedBlockInputs::save(Stream& compute, int64_t layer, int64_t layers, const void* input, size_t bytes) {
  if (layer < layers - 1) {
    STRATA_RETURN_IF_ERROR(compute.record(*input_ready_));
    STRATA_RETURN_IF_ERROR(copy_stream_->wait(*input_ready_));
    STRATA_RETURN_IF_ERROR(device_->copy_async(inputs_[static_cast<size_t>(layer)].data(), input, bytes, CopyKind::kDeviceToHost, *copy_stream_));
    STRATA_RETURN_IF_ERROR(copy_stream_->record(*saved_[layer % 2]));
  }
  // This block writes over block layer-1's input: wait until it has been saved.
  if (layer >= 1) STRATA_RETURN_IF_ERROR(compute.wait(*saved_[(layer - 1) % 2]));
  return {};
}

Status PinnedBlockInputs::restore(Stream& compute, int64_t m, void* slot, size_t bytes) {
  if (!active() || m - 2 < 0) return {};
  STRATA_RETURN_IF_ERROR(compute.record(*slot_free_));
  STRATA_RETURN_IF_ERROR(copy_stream_->wait(*slot_free_));
  STRATA_RETURN_IF_ERROR(device_->copy_async(slot, inputs_[static_cast<size_t>(m - 2)].data(), bytes, CopyKind::kHostToDevice, *copy_stream_));
  return copy_stream_->record(*restored_[(m - 2) % 2]);
}

Status PinnedBlockInputs::wait_restored(Stream& compute, int64_t layer, int64_t layers) {
  if (!active() || layer >= layers - 1) return {};
  return compute.wait(*restored_[layer % 2]);
}

Status PinnedBlockInputs::synchronize() { return active() ? copy_stream_->synchronize() : Status::Ok(); }

}  // namespace strata::lm
