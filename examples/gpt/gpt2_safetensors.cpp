#include "examples/gpt/gpt2_safetensors.h"

#include <set>

#include "engine/core/log.h"

namespace strata::gpt {
namespace {

using hf::shape_text;

constexpr std::string_view kGpt2Prefix = "transformer.";

}  // namespace

std::vector<NamedShape> gpt2_block_tensor_shapes(const Gpt2Dims& dims, int64_t layer) {
  const std::string p = "h." + std::to_string(layer) + ".";
  const int64_t c = dims.n_embd;
  return {
      {p + "ln_1.weight", {c}},
      {p + "ln_1.bias", {c}},
      {p + "attn.c_attn.weight", {c, 3 * c}},
      {p + "attn.c_attn.bias", {3 * c}},
      {p + "attn.c_proj.weight", {c, c}},
      {p + "attn.c_proj.bias", {c}},
      {p + "ln_2.weight", {c}},
      {p + "ln_2.bias", {c}},
      {p + "mlp.c_fc.weight", {c, 4 * c}},
      {p + "mlp.c_fc.bias", {4 * c}},
      {p + "mlp.c_proj.weight", {4 * c, c}},
      {p + "mlp.c_proj.bias", {c}},
  };
}

std::vector<NamedShape> gpt2_tensor_shapes(const Gpt2Dims& dims) {
  std::vector<NamedShape> shapes;
  shapes.push_back({"wte.weight", {dims.vocab_size, dims.n_embd}});
  shapes.push_back({"wpe.weight", {dims.n_ctx, dims.n_embd}});
  for (int64_t layer = 0; layer < dims.n_layer; ++layer) {
    for (NamedShape& shape : gpt2_block_tensor_shapes(dims, layer)) shapes.push_back(std::move(shape));
  }
  shapes.push_back({"ln_f.weight", {dims.n_embd}});
  shapes.push_back({"ln_f.bias", {dims.n_embd}});
  return shapes;
}

std::string_view strip_gpt2_prefix(std::string_view name) {
  if (name.substr(0, kGpt2Prefix.size()) == kGpt2Prefix) name.remove_prefix(kGpt2Prefix.size());
  return name;
}

bool is_gpt2_ignored_tensor(std::string_view name) {
  name = strip_gpt2_prefix(name);
  if (name == "lm_head.weight") return true;
  auto ends_with = [&](std::string_view suffix) {
    return name.size() >= suffix.size() && name.substr(name.size() - suffix.size()) == suffix;
  };
  return name.substr(0, 2) == "h." && (ends_with(".attn.bias") || ends_with(".attn.masked_bias"));
}

StatusOr<const SafetensorsTensor*> find_gpt2_tensor(const SafetensorsReader& reader, std::string_view name,
                                                    std::span<const int64_t> expected_shape) {
  const std::string bare(strip_gpt2_prefix(name));
  const std::string prefixed = std::string(kGpt2Prefix) + bare;
  const SafetensorsTensor* tensor = reader.find(bare);
  const std::string* found_as = &bare;
  if (tensor == nullptr) {
    tensor = reader.find(prefixed);
    found_as = &prefixed;
  }
  if (tensor == nullptr) {
    return NotFoundError("GPT-2 tensor '" + bare + "' (or '" + prefixed + "') is missing from safetensors file " +
                         reader.path() + " (expected shape " + shape_text(expected_shape) + ")");
  }
  if (!std::equal(tensor->shape.begin(), tensor->shape.end(), expected_shape.begin(), expected_shape.end())) {
    return InvalidArgumentError("GPT-2 tensor '" + *found_as + "' in safetensors file " + reader.path() + " has shape " +
                                shape_text(tensor->shape) + ", expected " + shape_text(expected_shape));
  }
  return tensor;
}

StatusOr<Gpt2Dims> infer_gpt2_dims(const SafetensorsReader& reader) {
  auto lookup = [&](std::string_view name) -> const SafetensorsTensor* {
    const SafetensorsTensor* tensor = reader.find(name);
    return tensor != nullptr ? tensor : reader.find(std::string(kGpt2Prefix) + std::string(name));
  };
  const SafetensorsTensor* wte = lookup("wte.weight");
  const SafetensorsTensor* wpe = lookup("wpe.weight");
  if (wte == nullptr || wpe == nullptr) {
    return NotFoundError("safetensors file " + reader.path() + " is not a GPT-2 checkpoint: " +
                         (wte == nullptr ? "wte.weight" : "wpe.weight") + " (with or without 'transformer.') is missing");
  }
  if (wte->shape.size() != 2 || wpe->shape.size() != 2 || wte->shape[1] != wpe->shape[1]) {
    return InvalidArgumentError("safetensors file " + reader.path() + ": wte.weight " + shape_text(wte->shape) +
                                " and wpe.weight " + shape_text(wpe->shape) + " are not [vocab, n_embd] and [n_ctx, n_embd]");
  }
  Gpt2Dims dims;
  dims.vocab_size = wte->shape[0];
  dims.n_embd = wte->shape[1];
  dims.n_ctx = wpe->shape[0];
  while (lookup("h." + std::to_string(dims.n_layer) + ".ln_1.weight") != nullptr) ++dims.n_layer;
  return dims;
}

Status check_gpt2_file(const SafetensorsReader& reader, const Gpt2Dims& dims) {
  std::vector<std::string> problems;
  std::set<std::string, std::less<>> expected;
  for (const NamedShape& shape : gpt2_tensor_shapes(dims)) {
    expected.insert(shape.name);
    auto tensor = find_gpt2_tensor(reader, shape.name, shape.shape);
    if (!tensor.ok()) {
      const SafetensorsTensor* present = reader.find(shape.name);
      if (present == nullptr) present = reader.find(std::string(kGpt2Prefix) + shape.name);
      problems.push_back(present == nullptr ? shape.name + " missing"
                                            : shape.name + " has shape " + shape_text(present->shape) + ", expected " +
                                                  shape_text(shape.shape));
    } else if (!safetensors_dtype_is_float((*tensor)->dtype)) {
      problems.push_back(shape.name + " has dtype " + std::string(safetensors_dtype_name((*tensor)->dtype)));
    }
  }
  std::string unexpected;
  for (const SafetensorsTensor& tensor : reader.tensors()) {
    const std::string_view bare = strip_gpt2_prefix(tensor.name);
    if (expected.find(bare) == expected.end() && !is_gpt2_ignored_tensor(tensor.name)) {
      unexpected += (unexpected.empty() ? "" : ", ") + tensor.name;
    }
  }
  if (!unexpected.empty()) {
    STRATA_LOG(kWarn) << "safetensors file " << reader.path() << " has tensors a GPT-2 with " << dims.n_layer
                      << " layers does not use (ignored): " << unexpected;
  }
  if (problems.empty()) return Status::Ok();
  std::string text = "safetensors file " + reader.path() + " does not hold a GPT-2 with n_layer " + std::to_string(dims.n_layer) +
                     ", n_embd " + std::to_string(dims.n_embd) + ", vocab_size " + std::to_string(dims.vocab_size) +
                     ", n_ctx " + std::to_string(dims.n_ctx) + ": ";
  const size_t shown = std::min<size_t>(problems.size(), 12);
  for (size_t i = 0; i < shown; ++i) text += (i ? "; " : "") + problems[i];
  if (problems.size() > shown) text += "; and " + std::to_string(problems.size() - shown) + " more";
  return InvalidArgumentError(text);
}

}  // namespace strata::gpt
