#include "examples/lm/transformer_layout.h"

#include <algorithm>
#include <sstream>

#include "examples/lm/model_memory.h"
#include "examples/lm/transformer_model.h"

namespace strata::lm {

size_t* TransformerLayout::line(const std::string& what) {
  lines.emplace_back(what, 0);
  return &lines.back().second;
}

size_t TransformerLayout::add(size_t bytes, size_t* line_total) {
  const size_t offset = total;
  const size_t reserved = round_up(std::max<size_t>(bytes, 1), kSubBufferAlignment);
  total += reserved;
  *line_total += reserved;
  return offset;
}

Status TransformerLayout::plan_head(const VocabHeadShape& shape) {
  head_shape = shape;
  STRATA_ASSIGN_OR_RETURN(head, plan_vocab_head(head_shape));
  return {};
}

void TransformerLayout::add_residual_stream(ActivationCheckpointing mode, size_t layers, size_t stream_bytes,
                                            size_t pinned_input_bytes) {
  const bool pinned = mode == ActivationCheckpointing::kPinnedHost;
  size_t* l_resid = line(pinned ? "residual stream (2 buffers; block inputs in pinned memory)"
                                : "block inputs (" + std::to_string(layers) + " + the final residual)");
  const size_t slots = pinned ? 2 : layers + 1;
  for (size_t i = 0; i < slots; ++i) resid.push_back(add(stream_bytes, l_resid));
  if (pinned && layers > 1) {
    pinned_slots = static_cast<int>(layers - 1);
    pinned_slot_bytes = round_up(pinned_input_bytes, 4096);
  }
}

size_t TransformerLayout::block_activation_sets(ActivationCheckpointing mode, size_t kept_sets, size_t** line_total) {
  const bool keep_all = mode == ActivationCheckpointing::kOff;
  const size_t sets = keep_all ? kept_sets : 1;
  *line_total = line(keep_all ? "block activations (" + std::to_string(sets) + " sets)"
                              : "block activations (1 set, recomputed in backward)");
  return sets;
}

void TransformerLayout::add_head_and_attention(size_t attention_bytes) {
  size_t counted_by_lines = 0;  // the head's own lines say what its bytes hold
  vocab_head = add(head.bytes, &counted_by_lines);
  for (const auto& [what, bytes] : head.lines) lines.emplace_back(what, bytes);
  attention_workspace_bytes = attention_bytes;
  if (attention_bytes > 0) attention_workspace = add(attention_bytes, line("attention workspace"));
}

Status check_transformer_run(const TransformerRunShape& s) {
  const std::string family(s.family);
  if (s.batch < 1)
    return InvalidArgumentError(family + ": batch must be at least 1 sequence per rank, got " + std::to_string(s.batch));
  if (s.eval_batch < 0) return InvalidArgumentError(family + ": eval_batch must be >= 0");
  if (s.head_chunk_rows < 0) return InvalidArgumentError(family + ": head_chunk_rows must be >= 0");
  if (s.vocab_chunk_bytes < static_cast<size_t>(s.width) * 4)
    return InvalidArgumentError(family + ": vocab_chunk_bytes (" + std::to_string(s.vocab_chunk_bytes) + ") is less than one fp32 " +
                                std::string(s.row_name) + " (" + std::to_string(s.width * 4) + " bytes)");
  return {};
}

std::string TransformerActivationPlan::text() const {
  std::ostringstream out;
  out << family << " activations (" << dtype_name(compute_dtype) << "): " << bytes_text(device_bytes) << " on the device";
  if (pinned_bytes > 0) out << ", " << bytes_text(pinned_bytes) << " pinned";
  out << "\n";
  for (const auto& [what, bytes] : lines) out << "  " << what << " = " << bytes_text(bytes) << "\n";
  return out.str();
}

ActivationPlan TransformerActivationPlan::summary() const {
  ActivationPlan out;
  out.device_bytes = device_bytes;
  out.pinned_bytes = pinned_bytes;
  out.compute_dtype = compute_dtype;
  out.text = text();
  return out;
}

TransformerActivationPlan plan_of_layout(std::string family, const TransformerLayout& layout, DeviceKind device) {
  TransformerActivationPlan plan;
  plan.family = std::move(family);
  plan.compute_dtype = layout.head_shape.compute_dtype;
  plan.head_rows = layout.head.head_rows;
  plan.chunks = layout.chunks;
  plan.lines.assign(layout.lines.begin(), layout.lines.end());
  plan.device_bytes = device_reservation(layout.total, device);
  plan.device_bytes += model_blas_device_bytes(device, plan.lines);
  plan.pinned_bytes = static_cast<size_t>(layout.pinned_slots) * layout.pinned_slot_bytes;
  return plan;
}

Status register_model_groups(Engine& engine, std::span<const GroupSpec> specs, std::string_view family) {
  for (size_t g = 0; g < specs.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(int id, engine.register_group(specs[g]));
    if (id != static_cast<int>(g))
      return FailedPreconditionError(std::string(family) + ": the engine gave group " + specs[g].name + " id " + std::to_string(id) +
                                     ", expected " + std::to_string(g) + " (register the model's groups first)");
  }
  return {};
}

}  // namespace strata::lm
