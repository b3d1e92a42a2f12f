// The skeleton every transformer family's activations share (GPT-2, the Llama family): one
// device buffer carved into aligned sub-buffers, each counted in a named line of the plan;
// the residual stream (block inputs on the device, or two buffers with the inputs in pinned
// host memory); the vocabulary head's buffers; the attention workspace; the checks on a
// run's shape; and the plan the trainer prints. A family adds its own blocks' buffers
// between these parts and names what differs (its label, its embedding row).
#pragma once

#include <cstddef>
#include <cstdint>
#include <deque>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "examples/lm/causal_lm.h"
#include "examples/lm/vocab_chunks.h"

namespace strata::lm {

// The device buffer's plan: what a family's make_layout fills in.
struct TransformerLayout {
  size_t total = 0;                                  // bytes carved so far
  std::deque<std::pair<std::string, size_t>> lines;  // a deque: line() hands out pointers to its entries
  VocabChunks chunks;
  VocabHeadShape head_shape;
  VocabHeadPlan head;
  size_t vocab_head = 0;         // the vocabulary head's sub-buffers
  size_t positions = 0;          // int32 position ids
  std::vector<size_t> resid;     // block inputs + the final residual (kPinnedHost: two, used in turn)
  size_t pinned_slot_bytes = 0;  // kPinnedHost: one training block input in pinned memory
  int pinned_slots = 0;          // kPinnedHost: blocks 0 .. L-2 (the last block's input stays on the device)
  size_t attention_workspace = 0, attention_workspace_bytes = 0;

  // A new line of the plan, named `what`, counting 0 bytes so far.
  size_t* line(const std::string& what);
  // Carves `bytes` (at least 1, rounded up to kSubBufferAlignment) off the end, counting
  // them in the line `line_total` points at; returns the offset.
  size_t add(size_t bytes, size_t* line_total);
  // Plans the vocabulary head for `shape` (head_shape, head).
  Status plan_head(const VocabHeadShape& shape);
  // The residual stream: `layers` block inputs and the final residual of `stream_bytes`
  // each, or under kPinnedHost two such buffers and layers - 1 pinned slots of
  // `pinned_input_bytes` (rounded up to 4 KiB).
  void add_residual_stream(ActivationCheckpointing mode, size_t layers, size_t stream_bytes, size_t pinned_input_bytes);
  // How many sets of block activations to carve (`kept_sets` when nothing is recomputed,
  // else one) and the line that counts them.
  size_t block_activation_sets(ActivationCheckpointing mode, size_t kept_sets, size_t** line_total);
  // What every family carves after its blocks: the vocabulary head's buffer (its own lines
  // say what its bytes hold), then the attention's scratch of `attention_workspace_bytes`
  // when it needs any.
  void add_head_and_attention(size_t attention_workspace_bytes);
};

// The run's shape a family checks before it plans: errors start with `family` ("GPT
// model") and name the embedding's row (`row_name`: "wte row", "embedding row").
struct TransformerRunShape {
  std::string_view family;
  std::string_view row_name;
  int64_t width = 0;  // the embedding's row, in elements
  int64_t batch = 0;
  int64_t eval_batch = 0;
  int64_t head_chunk_rows = 0;
  size_t vocab_chunk_bytes = 0;
};
Status check_transformer_run(const TransformerRunShape& shape);

// Device (and pinned) memory a family's model needs: one device buffer of device_bytes
// (rounded the way the device's allocator rounds it), plus the BLAS workspace on CUDA.
struct TransformerActivationPlan {
  std::string family;        // "GPT", "Llama": starts the text
  size_t device_bytes = 0;   // everything the model allocates on the device (declare as activation_bytes)
  size_t pinned_bytes = 0;   // block inputs in pinned host memory (kPinnedHost)
  DType compute_dtype = DType::kFloat32;
  int64_t head_rows = 0;     // token rows per LM-head block
  VocabChunks chunks;
  std::vector<std::pair<std::string, size_t>> lines;  // what the device bytes hold, for the log
  std::string text() const;
  ActivationPlan summary() const;  // the family-neutral form the trainer takes
};
TransformerActivationPlan plan_of_layout(std::string family, const TransformerLayout& layout, DeviceKind device);
// A family's plan function: its make_layout's result planned (in the compute dtype the
// layout planned its head for), or make_layout's error.
template <class Layout>
StatusOr<TransformerActivationPlan> plan_of_layout(std::string family, StatusOr<Layout> layout, DeviceKind device) {
  STRATA_RETURN_IF_ERROR(layout.status());
  return plan_of_layout(std::move(family), *layout, device);
}

}  // namespace strata::lm
