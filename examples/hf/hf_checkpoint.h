// Hugging Face model directories, read: `config.json` and the weights, either one
// `model.safetensors` or `model.safetensors.index.json` with the shards it names
// (`model-00001-of-00004.safetensors` ...), as transformers' save_pretrained writes them.
//
// HfCheckpoint::open checks the whole directory before any tensor data is read, so a
// broken download fails at start-up with the file and tensor to look at, not halfway
// through a load: config.json parses; the index parses and has a "weight_map" of tensor
// name -> shard file; every shard it names exists and its safetensors header is valid
// (SafetensorsReader: dtypes, shapes, data offsets inside the file, so a truncated shard
// is an error naming it); every tensor the index maps is in the shard it names; no tensor
// is in two shards; "metadata.total_size", when present, equals the sum of the tensors'
// bytes. Shard files in the directory that the index does not name are noted (a warning,
// and unlisted_shards()).
//
// Tensors are then looked up by name and read as fp32 by element range (F32, BF16, F16
// convert), straight from the files with pread, so a rank can stream just the rows of a
// tensor that fall into its shard without the model ever being in host memory.
#pragma once

#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/core/dtype.h"
#include "engine/core/status.h"
#include "examples/hf/safetensors.h"

namespace strata::hf {

using hf::SafetensorsDType;
using hf::SafetensorsReader;
using hf::SafetensorsTensor;

// The file names transformers uses.
inline constexpr std::string_view kConfigFile = "config.json";
inline constexpr std::string_view kSingleWeightsFile = "model.safetensors";
inline constexpr std::string_view kWeightsIndexFile = "model.safetensors.index.json";

// One tensor of a checkpoint: its header entry and the file that holds it (both owned by
// the source it came from, valid while that source lives).
struct HfTensorRef {
  const SafetensorsReader* file = nullptr;
  const SafetensorsTensor* tensor = nullptr;

  const std::string& name() const { return tensor->name; }
  SafetensorsDType dtype() const { return tensor->dtype; }
  const std::vector<int64_t>& shape() const { return tensor->shape; }
  uint64_t numel() const { return tensor->numel; }
  // Elements [first, first + out.size()) in row-major order, converted to fp32.
  // Thread-safe.
  Status read_fp32(uint64_t first, std::span<float> out) const { return file->read_fp32(*tensor, first, out); }
};

// Where weights are read from: a model directory (HfCheckpoint) or one safetensors file
// (SafetensorsFileSource). The engine loader (hf_weights.h) reads through this.
class HfTensorSource {
 public:
  virtual ~HfTensorSource() = default;
  // nullopt when the source has no tensor of that name.
  virtual std::optional<HfTensorRef> find(std::string_view name) const = 0;
  // Every tensor name, sorted.
  virtual std::vector<std::string> tensor_names() const = 0;
  // Starts every error about the source: "Hugging Face checkpoint /m" or "safetensors file /m/x.safetensors".
  virtual const std::string& where() const = 0;
  // Elements [first, first + out.size()) of a tensor find() gave, as fp32: every read the
  // loader makes goes through here (a wrapper may count or throttle them).
  virtual Status read_fp32(const HfTensorRef& tensor, uint64_t first, std::span<float> out) const {
    return tensor.read_fp32(first, out);
  }
};

// One safetensors file as a source (borrowed: the reader must outlive this).
class SafetensorsFileSource final : public HfTensorSource {
 public:
  explicit SafetensorsFileSource(const SafetensorsReader& reader);
  std::optional<HfTensorRef> find(std::string_view name) const override;
  std::vector<std::string> tensor_names() const override;
  const std::string& where() const override { return where_; }

 private:
  const SafetensorsReader* reader_;
  std::string where_;
};

struct HfOpenOptions {
  hf::SafetensorsReadOptions read;  // per shard file
};

class HfCheckpoint final : public HfTensorSource {
 public:
  // Opens and checks `dir` (see the top of this file). kNotFound for a missing directory,
  // config.json, weights file or shard; kInvalidArgument for malformed or inconsistent
  // ones; each message names the directory, the file and, where one is at fault, the tensor.
  static StatusOr<HfCheckpoint> open(const std::string& dir, const HfOpenOptions& options = {});
  HfCheckpoint(HfCheckpoint&&) noexcept = default;
  HfCheckpoint& operator=(HfCheckpoint&&) noexcept = default;
  HfCheckpoint(const HfCheckpoint&) = delete;
  HfCheckpoint& operator=(const HfCheckpoint&) = delete;
  ~HfCheckpoint() override = default;

  const std::string& dir() const { return dir_; }
  // config.json as parsed (an object), for the model family to read its shape from.
  const nlohmann::json& config() const { return config_; }
  // True when the weights came through model.safetensors.index.json.
  bool sharded() const { return sharded_; }
  // The weight files' names (within dir()), sorted: {"model.safetensors"} or the shards.
  std::vector<std::string> weight_files() const;
  // Files named like shards (model-*.safetensors) that the index does not name.
  const std::vector<std::string>& unlisted_shards() const { return unlisted_shards_; }
  // The sum of every tensor's bytes (what "metadata.total_size" must say).
  uint64_t total_bytes() const { return total_bytes_; }

  std::optional<HfTensorRef> find(std::string_view name) const override;
  std::vector<std::string> tensor_names() const override;
  const std::string& where() const override { return where_; }

  // The tensor, which must exist (kNotFound) with `expected_shape` (kInvalidArgument
  // naming both shapes); either error names the tensor, its file and the directory.
  StatusOr<HfTensorRef> require(std::string_view name, std::span<const int64_t> expected_shape) const;
  // Elements [first, first + out.size()) of tensor `name`, as fp32.
  Status read_fp32(std::string_view name, uint64_t first, std::span<float> out) const;
  using HfTensorSource::read_fp32;

 private:
  HfCheckpoint() = default;
  Status open_single(const std::string& path, const HfOpenOptions& options);
  Status open_sharded(const std::string& index_path, const HfOpenOptions& options);
  // Fills tensors_ from the shards (files_, in by_file's order) as the index maps them;
  // lists tensors in two shards and mapped tensors a shard lacks in `problems`.
  void map_shard_tensors(const std::map<std::string, std::vector<std::string>>& by_file, std::vector<std::string>& problems);
  void note_unlisted_shards();

  std::string dir_;
  std::string where_;
  nlohmann::json config_;
  bool sharded_ = false;
  // unique_ptr: HfTensorRef points at the readers, which must not move.
  std::vector<std::unique_ptr<SafetensorsReader>> files_;
  std::map<std::string, HfTensorRef, std::less<>> tensors_;
  std::vector<std::string> unlisted_shards_;
  uint64_t total_bytes_ = 0;
};

// The dtype a checkpoint's weights are in, for an export "in the checkpoint's dtype": the
// F32, BF16 or F16 that holds the most bytes of its tensors (F32 when it has none of them).
SafetensorsDType checkpoint_dtype(const HfTensorSource& source);
// The same as the engine's DType (fp32, bf16 or fp16).
DType checkpoint_engine_dtype(const HfTensorSource& source);

// Reads `path` as a JSON object; errors (kNotFound, kInvalidArgument) start with `where`
// and name the file.
StatusOr<nlohmann::json> read_json_object(const std::string& path, std::string_view where);

}  // namespace strata::hf
