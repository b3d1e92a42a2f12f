// Hugging Face model directories, written: `config.json`, the weights as one
// `model.safetensors` or as shards `model-00001-of-0000N.safetensors` with
// `model.safetensors.index.json`, and the tokenizer files of a source directory; the
// layout transformers' save_pretrained writes, so from_pretrained(dir) loads it.
//
// Sharding follows huggingface_hub's split_state_dict_into_shards: tensors in the given
// order fill a shard until the next one would push it past `shard_bytes`; a tensor larger
// than `shard_bytes` gets a shard of its own (in order here; huggingface_hub lists such a
// shard before the one still open, which changes only the numbering). The index is
// {"metadata": {"total_size": bytes}, "weight_map": {name: file}} with sorted keys and
// two-space indentation, as transformers dumps it; each shard's __metadata__ has
// "format": "pt".
//
// Data streams from the caller: tensors are written one after the other, each in chunks
// of `chunk_elements` asked from a callback, converted to the tensor's dtype on the way,
// so no more than a chunk is in memory here. The directory is built under a temporary
// name beside `dir` and renamed into place at the end, so a crash or an error never
// leaves a half export at `dir`.
#pragma once

#include <cstdint>
#include <functional>
#include <map>
#include <span>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "examples/hf/safetensors.h"

namespace strata::hf {

// transformers' max_shard_size default, "5GB" (decimal: 5 * 10^9 bytes).
inline constexpr uint64_t kDefaultShardBytes = 5'000'000'000;

// Tokenizer and generation files a model directory carries beside its weights.
inline constexpr std::string_view kTokenizerFiles[] = {
    "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
    "vocab.json",     "merges.txt",            "generation_config.json",
};

struct HfExportTensor {
  std::string name;
  std::vector<int64_t> shape;
  hf::SafetensorsDType dtype = hf::SafetensorsDType::kF32;  // F32, BF16 or F16
  uint64_t numel() const;
  uint64_t bytes() const;
};

// Fills `out` with elements [first, first + out.size()) (row-major) of tensors[index].
using HfTensorFill = std::function<Status(size_t index, uint64_t first, std::span<float> out)>;

// Which tensors go to which file.
struct HfShardPlan {
  std::vector<std::vector<size_t>> shards;  // tensor indices per file, in order
  std::vector<std::string> file_names;      // {"model.safetensors"} or "model-0000i-of-0000N.safetensors"
  uint64_t total_bytes = 0;                 // every tensor's bytes
};
HfShardPlan plan_hf_shards(std::span<const HfExportTensor> tensors, uint64_t shard_bytes);

struct HfExportOptions {
  uint64_t shard_bytes = kDefaultShardBytes;     // the most tensor bytes in one file (a larger tensor gets its own)
  std::map<std::string, std::string> metadata;  // every file's "__metadata__" ("format": "pt" is added)
  std::string tokenizer_source_dir;             // kTokenizerFiles found here are copied along; empty: none
  size_t chunk_elements = size_t{1} << 20;      // elements asked from the callback at a time
};

// Writes the model directory `dir` (see the top of this file). `dir` may be missing, empty,
// or an earlier export (holding only files an export writes), which is replaced whole;
// any other directory is refused untouched, so an export never deletes a user's files.
// Errors name the directory, the file and the tensor.
Status write_hf_checkpoint(const std::string& dir, const nlohmann::json& config, std::span<const HfExportTensor> tensors,
                           const HfTensorFill& fill, const HfExportOptions& options = {});

// What write_hf_checkpoint checks of `dir` before it writes anything, for a trainer to
// check before training: OK when `dir` is missing, empty or an earlier export.
Status check_export_directory(const std::string& dir);

// Writes one safetensors file at `path` holding `tensors` in order, each filled from
// `fill` (index into `tensors`) chunk by chunk; "<path>.tmp" until complete.
Status write_safetensors_file(const std::string& path, std::span<const HfExportTensor> tensors, const HfTensorFill& fill,
                              std::map<std::string, std::string> metadata = {}, size_t chunk_elements = size_t{1} << 20);

// Writes `value` as JSON (2-space indent, a final newline) to "<path>.tmp", fsyncs it and
// renames it to `path`.
Status write_json_file(const std::string& path, const nlohmann::json& value);

// config.json's "torch_dtype" for weights written as `dtype`: "bfloat16", "float16", else "float32".
std::string_view torch_dtype_name(SafetensorsDType dtype);

// The safetensors dtype an export writes for engine `dtype` (fp32, bf16 or fp16; others
// are refused, the error starting with `who`, e.g. "GPT-2 export").
StatusOr<SafetensorsDType> export_safetensors_dtype(DType dtype, std::string_view who);

}  // namespace strata::hf
