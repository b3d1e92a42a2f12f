// The names and shapes of Hugging Face's GPT-2 checkpoints in a safetensors file
// (examples/hf/safetensors.h reads the file).
//
// GPT-2 (Hugging Face's GPT2Model / GPT2LMHeadModel): `wte.weight` [vocab, n_embd],
// `wpe.weight` [n_ctx, n_embd], per block i `h.{i}.ln_1.{weight,bias}` [n_embd],
// `h.{i}.attn.c_attn.weight` [n_embd, 3 n_embd] (Conv1D: (in, out)), `.bias` [3 n_embd],
// `h.{i}.attn.c_proj.weight` [n_embd, n_embd], `.bias`, `h.{i}.ln_2.*`,
// `h.{i}.mlp.c_fc.weight` [n_embd, 4 n_embd], `.bias` [4 n_embd],
// `h.{i}.mlp.c_proj.weight` [4 n_embd, n_embd], `.bias` [n_embd], `ln_f.{weight,bias}`;
// each with or without a `transformer.` prefix. `h.{i}.attn.bias`,
// `h.{i}.attn.masked_bias` (causal-mask buffers) and `lm_head.weight` (tied to wte) are
// not parameters and are ignored.
#pragma once

#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/status.h"
#include "examples/hf/safetensors.h"

namespace strata::gpt {

using hf::SafetensorsReader;
using hf::SafetensorsTensor;

struct Gpt2Dims {
  int64_t n_layer = 0;
  int64_t n_embd = 0;
  int64_t vocab_size = 0;
  int64_t n_ctx = 0;
};

struct NamedShape {
  std::string name;  // without the "transformer." prefix
  std::vector<int64_t> shape;
};

// Every GPT-2 parameter tensor, in Hugging Face's order: wte, wpe, h.0.* ... h.{L-1}.*, ln_f.*.
std::vector<NamedShape> gpt2_tensor_shapes(const Gpt2Dims& dims);
// The names of block `layer`'s tensors, in order, without prefix.
std::vector<NamedShape> gpt2_block_tensor_shapes(const Gpt2Dims& dims, int64_t layer);
// Buffers and tied copies a file may carry that are not parameters.
bool is_gpt2_ignored_tensor(std::string_view name);
// "transformer.h.0.ln_1.weight" -> "h.0.ln_1.weight"; other names unchanged.
std::string_view strip_gpt2_prefix(std::string_view name);

// Finds `name` (given without prefix) as stored with or without "transformer.", with
// `expected_shape`. kNotFound names the tensor (both spellings) and the file;
// kInvalidArgument names the tensor, the file, the expected and the actual shape.
StatusOr<const SafetensorsTensor*> find_gpt2_tensor(const SafetensorsReader& reader, std::string_view name,
                                                    std::span<const int64_t> expected_shape);
// Reads the dimensions from the file: vocab_size and n_embd from wte, n_ctx from wpe,
// n_layer from the h.{i} blocks present.
StatusOr<Gpt2Dims> infer_gpt2_dims(const SafetensorsReader& reader);
// Checks every parameter of `dims` is present with its shape (the error lists all that
// are missing or wrong, naming the file); logs one warning listing tensors the file has
// that are neither parameters nor ignored buffers.
Status check_gpt2_file(const SafetensorsReader& reader, const Gpt2Dims& dims);

}  // namespace strata::gpt
