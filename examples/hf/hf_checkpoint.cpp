#include "examples/hf/hf_checkpoint.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <filesystem>
#include <set>

#include "engine/core/file.h"
#include "engine/core/json_depth.h"
#include "engine/core/log.h"
#include "examples/hf/problem_list.h"

namespace strata::hf {
namespace {

namespace fs = std::filesystem;
using json = nlohmann::json;

// config.json and index files nest a few levels (rope_scaling, weight_map); deeper is damage.
constexpr size_t kMaxJsonDepth = 64;

std::string join_path(const std::string& dir, std::string_view file) { return (fs::path(dir) / file).string(); }

bool is_plain_file_name(const std::string& name) {
  return !name.empty() && name != "." && name != ".." && name.find('/') == std::string::npos && name.find('\0') == std::string::npos;
}

// Opens a weights file; a bad one's error gets `context` (the checkpoint and the file's role).
StatusOr<std::unique_ptr<SafetensorsReader>> open_weights_file(const std::string& path, const HfOpenOptions& options,
                                                               const std::string& context) {
  StatusOr<SafetensorsReader> reader = SafetensorsReader::open(path, options.read);
  if (!reader.ok()) return std::move(reader).status().with_context(context);
  return std::make_unique<SafetensorsReader>(std::move(reader).value());
}

bool looks_like_shard(const std::string& name) {
  return name.rfind("model-", 0) == 0 && name.size() > 18 && name.compare(name.size() - 12, 12, ".safetensors") == 0;
}

// The index's weight_map as shard file -> the tensors it puts there.
StatusOr<std::map<std::string, std::vector<std::string>>> shard_assignment(const json& index, const std::string& index_where) {
  const auto map_it = index.find("weight_map");
  if (map_it == index.end() || !map_it->is_object())
    return InvalidArgumentError(index_where + " has no \"weight_map\" object (tensor name -> shard file)");
  std::map<std::string, std::vector<std::string>> by_file;
  for (auto it = map_it->begin(); it != map_it->end(); ++it) {
    if (!it.value().is_string())
      return InvalidArgumentError(index_where + ": weight_map[\"" + it.key() + "\"] is " + it.value().dump() + ", not a file name");
    const std::string file = it.value().get<std::string>();
    if (!is_plain_file_name(file))
      return InvalidArgumentError(index_where + ": weight_map[\"" + it.key() + "\"] is \"" + file +
                                  "\", which is not a file name within the directory");
    by_file[file].push_back(it.key());
  }
  if (by_file.empty()) return InvalidArgumentError(index_where + ": weight_map is empty");
  return by_file;
}

// "metadata.total_size", when the index has one, against the bytes of the mapped tensors.
void check_total_size(const json& index, uint64_t total_bytes, std::vector<std::string>& problems) {
  const auto meta_it = index.find("metadata");
  if (meta_it == index.end() || !meta_it->is_object()) return;
  const auto total_it = meta_it->find("total_size");
  if (total_it == meta_it->end()) return;
  // transformers writes an integer; some tools write a float with no fraction.
  std::optional<uint64_t> stated;
  if (total_it->is_number_unsigned()) {
    stated = total_it->get<uint64_t>();
  } else if (total_it->is_number_float()) {
    const double value = total_it->get<double>();
    if (value >= 0 && value < 1.8e19 && value == std::floor(value)) stated = static_cast<uint64_t>(value);
  }
  if (!stated) {
    problems.push_back("metadata.total_size is " + total_it->dump() + ", not a byte count");
  } else if (*stated != total_bytes) {
    problems.push_back("metadata.total_size is " + std::to_string(*stated) + " but the mapped tensors hold " +
                       std::to_string(total_bytes) + " bytes (a shard from another download or version?)");
  }
}

}  // namespace

StatusOr<json> read_json_object(const std::string& path, std::string_view where) {
  StatusOr<File> file = File::open(path);
  if (!file.ok()) {
    if (file.status().error_number() == ENOENT) return NotFoundError(std::string(where) + ": " + path + " does not exist");
    return std::move(file).status().with_context(std::string(where));
  }
  STRATA_ASSIGN_OR_RETURN(const std::string text, file->read_to_end());
  if (const size_t depth = json_nesting_depth(text); depth > kMaxJsonDepth)
    return InvalidArgumentError(std::string(where) + ": " + path + " nests " + std::to_string(depth) + " levels deep (damaged?)");
  json value = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (value.is_discarded()) return InvalidArgumentError(std::string(where) + ": " + path + " is not valid JSON");
  if (!value.is_object()) return InvalidArgumentError(std::string(where) + ": " + path + " is not a JSON object");
  return value;
}

SafetensorsDType checkpoint_dtype(const HfTensorSource& source) {
  std::map<SafetensorsDType, uint64_t> bytes;
  for (const std::string& name : source.tensor_names()) {
    const std::optional<HfTensorRef> ref = source.find(name);
    const SafetensorsDType dtype = ref->dtype();
    if (dtype == SafetensorsDType::kF32 || dtype == SafetensorsDType::kBF16 || dtype == SafetensorsDType::kF16)
      bytes[dtype] += ref->tensor->bytes();
  }
  SafetensorsDType most = SafetensorsDType::kF32;
  uint64_t most_bytes = 0;
  for (const auto& [dtype, count] : bytes) {
    if (count > most_bytes) most = dtype, most_bytes = count;
  }
  return most;
}

DType checkpoint_engine_dtype(const HfTensorSource& source) {
  switch (checkpoint_dtype(source)) {
    case SafetensorsDType::kBF16: return DType::kBFloat16;
    case SafetensorsDType::kF16: return DType::kFloat16;
    default: return DType::kFloat32;
  }
}

// ---------------------------------------------------------------------------------------
// One file as a source

SafetensorsFileSource::SafetensorsFileSource(const SafetensorsReader& reader)
    : reader_(&reader), where_("safetensors file " + reader.path()) {}

std::optional<HfTensorRef> SafetensorsFileSource::find(std::string_view name) const {
  const SafetensorsTensor* tensor = reader_->find(name);
  if (tensor == nullptr) return std::nullopt;
  return HfTensorRef{reader_, tensor};
}

std::vector<std::string> SafetensorsFileSource::tensor_names() const {
  std::vector<std::string> names;
  for (const SafetensorsTensor& tensor : reader_->tensors()) names.push_back(tensor.name);
  std::sort(names.begin(), names.end());
  return names;
}

// ---------------------------------------------------------------------------------------
// A model directory

StatusOr<HfCheckpoint> HfCheckpoint::open(const std::string& dir, const HfOpenOptions& options) {
  HfCheckpoint checkpoint;
  checkpoint.dir_ = dir;
  checkpoint.where_ = "Hugging Face checkpoint " + dir;
  std::error_code ec;
  if (!fs::is_directory(dir, ec)) {
    return NotFoundError(checkpoint.where_ + ": " + (fs::exists(dir, ec) ? "is not a directory" : "does not exist") +
                         " (a model directory holds config.json and model.safetensors or model.safetensors.index.json)");
  }
  const std::string config_path = join_path(dir, kConfigFile);
  if (!fs::exists(config_path, ec))
    return NotFoundError(checkpoint.where_ + ": config.json is missing (every model directory has one; it gives the model's shape)");
  STRATA_ASSIGN_OR_RETURN(checkpoint.config_, read_json_object(config_path, checkpoint.where_));

  // transformers looks for the single file first, then the index; so do we.
  const std::string single_path = join_path(dir, kSingleWeightsFile);
  const std::string index_path = join_path(dir, kWeightsIndexFile);
  if (fs::exists(single_path, ec)) {
    if (fs::exists(index_path, ec))
      STRATA_LOG(kWarn) << checkpoint.where_ << ": has both model.safetensors and model.safetensors.index.json; reading "
                        << "model.safetensors, as transformers does";
    STRATA_RETURN_IF_ERROR(checkpoint.open_single(single_path, options));
  } else if (fs::exists(index_path, ec)) {
    STRATA_RETURN_IF_ERROR(checkpoint.open_sharded(index_path, options));
  } else {
    std::string hint;
    if (fs::exists(join_path(dir, "pytorch_model.bin"), ec) || fs::exists(join_path(dir, "pytorch_model.bin.index.json"), ec))
      hint = " (it has pytorch_model.bin weights, which are not read: convert them to safetensors, e.g. with "
             "transformers' save_pretrained(safe_serialization=True))";
    return NotFoundError(checkpoint.where_ + ": neither model.safetensors nor model.safetensors.index.json is there" + hint);
  }
  checkpoint.note_unlisted_shards();
  return checkpoint;
}

Status HfCheckpoint::open_single(const std::string& path, const HfOpenOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader, open_weights_file(path, options, where_));
  files_.push_back(std::move(reader));
  const SafetensorsReader* file = files_.back().get();
  for (const SafetensorsTensor& tensor : file->tensors()) {
    tensors_.emplace(tensor.name, HfTensorRef{file, &tensor});
    total_bytes_ += tensor.bytes();
  }
  return Status::Ok();
}

Status HfCheckpoint::open_sharded(const std::string& index_path, const HfOpenOptions& options) {
  sharded_ = true;
  const std::string index_where = where_ + ": " + std::string(kWeightsIndexFile);
  STRATA_ASSIGN_OR_RETURN(const json index, read_json_object(index_path, where_));
  STRATA_ASSIGN_OR_RETURN(const auto by_file, shard_assignment(index, index_where));
  // Every shard exists and its header is valid, before anything else is looked at.
  std::error_code ec;
  for (const auto& [file, names] : by_file) {
    const std::string path = join_path(dir_, file);
    if (!fs::exists(path, ec))
      return NotFoundError(where_ + ": shard " + file + " is missing (model.safetensors.index.json puts " +
                           std::to_string(names.size()) + " tensors there, e.g. '" + names.front() + "')");
    STRATA_ASSIGN_OR_RETURN(std::unique_ptr<SafetensorsReader> reader, open_weights_file(path, options, where_ + ": shard " + file));
    files_.push_back(std::move(reader));
  }
  std::vector<std::string> problems;
  map_shard_tensors(by_file, problems);
  check_total_size(index, total_bytes_, problems);
  return problem_list_error(index_where + " and its shards disagree", problems);
}

void HfCheckpoint::map_shard_tensors(const std::map<std::string, std::vector<std::string>>& by_file, std::vector<std::string>& problems) {
  std::map<std::string, std::string, std::less<>> holder;  // tensor -> the first shard that holds it
  size_t file_index = 0;  // files_ is in by_file's order
  for (const auto& [file, names] : by_file) {
    const SafetensorsReader* reader = files_[file_index++].get();
    for (const SafetensorsTensor& tensor : reader->tensors()) {
      const auto [it, inserted] = holder.emplace(tensor.name, file);
      if (!inserted) problems.push_back("tensor '" + tensor.name + "' is in two shards, " + it->second + " and " + file);
    }
    for (const std::string& name : names) {
      const SafetensorsTensor* tensor = reader->find(name);
      if (tensor == nullptr) {
        problems.push_back("the index maps tensor '" + name + "' to " + file + ", which does not hold it");
        continue;
      }
      tensors_.emplace(name, HfTensorRef{reader, tensor});
      total_bytes_ += tensor->bytes();
    }
  }
  std::set<std::string, std::less<>> indexed;
  for (const auto& [file, names] : by_file) indexed.insert(names.begin(), names.end());
  std::string unmapped;
  for (const auto& [name, file] : holder) {
    if (indexed.count(name) == 0) unmapped += (unmapped.empty() ? "" : ", ") + name + " (in " + file + ")";
  }
  if (!unmapped.empty())
    STRATA_LOG(kWarn) << where_ << ": model.safetensors.index.json does not map these tensors its shards hold (ignored, as "
                      << "transformers does): " << unmapped;
}

void HfCheckpoint::note_unlisted_shards() {
  std::set<std::string> listed;
  for (const auto& file : files_) listed.insert(fs::path(file->path()).filename().string());
  std::error_code ec;
  for (const auto& entry : fs::directory_iterator(dir_, ec)) {
    const std::string name = entry.path().filename().string();
    if (looks_like_shard(name) && listed.count(name) == 0) unlisted_shards_.push_back(name);
  }
  std::sort(unlisted_shards_.begin(), unlisted_shards_.end());
  if (unlisted_shards_.empty()) return;
  std::string names;
  for (const std::string& name : unlisted_shards_) names += (names.empty() ? "" : ", ") + name;
  STRATA_LOG(kWarn) << where_ << ": shard files " << (sharded_ ? "model.safetensors.index.json does not name" : "beside model.safetensors")
                    << " are not read: " << names;
}

std::vector<std::string> HfCheckpoint::weight_files() const {
  std::vector<std::string> names;
  for (const auto& file : files_) names.push_back(fs::path(file->path()).filename().string());
  std::sort(names.begin(), names.end());
  return names;
}

std::optional<HfTensorRef> HfCheckpoint::find(std::string_view name) const {
  const auto it = tensors_.find(name);
  if (it == tensors_.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> HfCheckpoint::tensor_names() const {
  std::vector<std::string> names;
  names.reserve(tensors_.size());
  for (const auto& [name, ref] : tensors_) names.push_back(name);
  return names;
}

StatusOr<HfTensorRef> HfCheckpoint::require(std::string_view name, std::span<const int64_t> expected_shape) const {
  const std::optional<HfTensorRef> ref = find(name);
  if (!ref) {
    return NotFoundError(where_ + ": tensor '" + std::string(name) + "' is missing (expected shape " +
                         hf::shape_text(expected_shape) + ")");
  }
  if (!std::equal(ref->shape().begin(), ref->shape().end(), expected_shape.begin(), expected_shape.end())) {
    return InvalidArgumentError(where_ + ": tensor '" + std::string(name) + "' in " + ref->file->path() + " has shape " +
                                hf::shape_text(ref->shape()) + ", expected " + hf::shape_text(expected_shape));
  }
  return *ref;
}

Status HfCheckpoint::read_fp32(std::string_view name, uint64_t first, std::span<float> out) const {
  const std::optional<HfTensorRef> ref = find(name);
  if (!ref) return NotFoundError(where_ + ": tensor '" + std::string(name) + "' is missing");
  return ref->read_fp32(first, out).with_context(where_);
}

}  // namespace strata::hf
