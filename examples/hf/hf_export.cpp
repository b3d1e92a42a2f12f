#include "examples/hf/hf_export.h"

#include <fcntl.h>
#include <stdio.h>  // renameat2, RENAME_EXCHANGE

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <set>

#include <unistd.h>

#include "engine/core/file.h"
#include "engine/core/log.h"
#include "examples/hf/hf_checkpoint.h"

namespace strata::hf {
namespace {

namespace fs = std::filesystem;
using hf::SafetensorsDType;

std::string shard_file_name(size_t index, size_t count) {
  char name[64];
  std::snprintf(name, sizeof(name), "model-%05zu-of-%05zu.safetensors", index + 1, count);
  return name;
}

// A file an export writes (so a directory holding only these is an earlier export).
bool is_export_file(const std::string& name) {
  if (name == kConfigFile || name == kSingleWeightsFile || name == kWeightsIndexFile) return true;
  if (name.rfind("model-", 0) == 0 && name.size() > 12 && name.compare(name.size() - 12, 12, ".safetensors") == 0) return true;
  return std::find(std::begin(kTokenizerFiles), std::end(kTokenizerFiles), name) != std::end(kTokenizerFiles);
}

// `dir` as an absolute path without a trailing slash (its last component is the name renamed into place).
fs::path export_target_path(const std::string& dir) {
  fs::path target = fs::absolute(dir).lexically_normal();
  if (target.filename().empty()) target = target.parent_path();
  return target;
}

// What is at `target` now, and so how the finished export takes its place.
enum class ExportTarget : uint8_t { kAbsent, kEmpty, kEarlierExport };

StatusOr<ExportTarget> inspect_target(const fs::path& target) {
  std::error_code ec;
  const std::string where = "export directory " + target.string();
  // The export is staged beside the target and renamed, so its parent must take new entries.
  if (fs::exists(target.parent_path(), ec) && ::access(target.parent_path().c_str(), W_OK) != 0)
    return Status::FromErrno(errno, where + ": the export is built beside it, but " + target.parent_path().string() +
                                        " is not writable");
  const fs::file_status status = fs::symlink_status(target, ec);
  if (!fs::exists(status)) return ExportTarget::kAbsent;
  if (fs::is_symlink(status))
    return InvalidArgumentError(where + " is a symbolic link; give the directory it points to (the export replaces it whole)");
  if (!fs::is_directory(status)) return InvalidArgumentError(where + " exists and is not a directory");
  std::string foreign;
  bool empty = true;
  for (const auto& entry : fs::directory_iterator(target, ec)) {
    empty = false;
    const std::string name = entry.path().filename().string();
    if (!entry.is_regular_file() || !is_export_file(name)) foreign += (foreign.empty() ? "" : ", ") + name;
  }
  if (ec) return IoError("cannot list " + where + ": " + ec.message());
  if (!foreign.empty())
    return InvalidArgumentError(where + " holds files an export does not write (" + foreign +
                                "); an export replaces its directory whole, so give a new or empty directory");
  return empty ? ExportTarget::kEmpty : ExportTarget::kEarlierExport;
}

// Removes the temporary directory unless the export was renamed into place.
class TemporaryDirectory {
 public:
  explicit TemporaryDirectory(fs::path path) : path_(std::move(path)) {}
  ~TemporaryDirectory() {
    if (path_.empty()) return;
    std::error_code ec;
    fs::remove_all(path_, ec);
  }
  TemporaryDirectory(const TemporaryDirectory&) = delete;
  TemporaryDirectory& operator=(const TemporaryDirectory&) = delete;
  const fs::path& path() const { return path_; }

 private:
  fs::path path_;
};

// Puts the finished `staged` directory at `target`: a plain rename when nothing (or an
// empty directory) is there; for an earlier export, an atomic exchange where the file
// system has one, else the old one moved aside first. The old contents end in `staged`.
Status move_into_place(const fs::path& staged, const fs::path& target, ExportTarget what) {
  const std::string from = staged.string(), to = target.string();
  if (what != ExportTarget::kEarlierExport) {
    if (::rename(from.c_str(), to.c_str()) != 0) return Status::FromErrno(errno, "rename(" + from + ", " + to + ")");
    return Status::Ok();
  }
  if (::renameat2(AT_FDCWD, from.c_str(), AT_FDCWD, to.c_str(), RENAME_EXCHANGE) == 0) return Status::Ok();
  if (errno != EINVAL && errno != ENOSYS) return Status::FromErrno(errno, "renameat2(" + from + ", " + to + ", RENAME_EXCHANGE)");
  const fs::path aside = staged.string() + ".old";
  std::error_code ec;
  fs::remove_all(aside, ec);
  if (::rename(to.c_str(), aside.c_str()) != 0) return Status::FromErrno(errno, "rename(" + to + ", " + aside.string() + ")");
  if (::rename(from.c_str(), to.c_str()) != 0) return Status::FromErrno(errno, "rename(" + from + ", " + to + ")");
  if (::rename(aside.c_str(), from.c_str()) != 0) fs::remove_all(aside, ec);
  return Status::Ok();
}

Status check_export_tensors(std::span<const HfExportTensor> tensors, const std::string& where) {
  std::set<std::string, std::less<>> names;
  for (const HfExportTensor& tensor : tensors) {
    if (tensor.name.empty()) return InvalidArgumentError(where + ": a tensor has an empty name");
    if (!names.insert(tensor.name).second) return InvalidArgumentError(where + ": tensor '" + tensor.name + "' is listed twice");
    if (tensor.dtype != SafetensorsDType::kF32 && tensor.dtype != SafetensorsDType::kBF16 && tensor.dtype != SafetensorsDType::kF16)
      return InvalidArgumentError(where + ": tensor '" + tensor.name + "' has dtype " +
                                  std::string(hf::safetensors_dtype_name(tensor.dtype)) + "; an export writes F32, BF16 or F16");
    for (int64_t dim : tensor.shape)
      if (dim < 0) return InvalidArgumentError(where + ": tensor '" + tensor.name + "' has shape " + hf::shape_text(tensor.shape));
  }
  return Status::Ok();
}

Status copy_tokenizer_files(const std::string& source_dir, const fs::path& to) {
  std::error_code ec;
  for (std::string_view name : kTokenizerFiles) {
    const fs::path source = fs::path(source_dir) / name;
    if (!fs::is_regular_file(source, ec)) continue;
    fs::copy_file(source, to / name, fs::copy_options::overwrite_existing, ec);
    if (ec) return IoError("cannot copy " + source.string() + " to " + (to / name).string() + ": " + ec.message());
    // On the disk before the directory is renamed into place, as the weights are.
    STRATA_ASSIGN_OR_RETURN(File copy, File::open((to / name).string()));
    STRATA_RETURN_IF_ERROR(copy.sync());
  }
  return Status::Ok();
}

}  // namespace

Status check_export_directory(const std::string& dir) { return inspect_target(export_target_path(dir)).status(); }

uint64_t HfExportTensor::numel() const {
  uint64_t n = 1;
  for (int64_t dim : shape) n *= static_cast<uint64_t>(std::max<int64_t>(dim, 0));
  return n;
}

uint64_t HfExportTensor::bytes() const { return numel() * hf::safetensors_dtype_size(dtype); }

HfShardPlan plan_hf_shards(std::span<const HfExportTensor> tensors, uint64_t shard_bytes) {
  HfShardPlan plan;
  std::vector<size_t> current;
  uint64_t current_bytes = 0;
  auto close_current = [&]() {
    if (!current.empty()) plan.shards.push_back(std::move(current));
    current.clear();
    current_bytes = 0;
  };
  for (size_t i = 0; i < tensors.size(); ++i) {
    const uint64_t bytes = tensors[i].bytes();
    plan.total_bytes += bytes;
    if (bytes > shard_bytes) {
      close_current();
      plan.shards.push_back({i});
      continue;
    }
    if (current_bytes + bytes > shard_bytes) close_current();
    current.push_back(i);
    current_bytes += bytes;
  }
  close_current();
  if (plan.shards.empty()) plan.shards.emplace_back();  // no tensors: one empty file
  if (plan.shards.size() == 1) {
    plan.file_names.emplace_back(kSingleWeightsFile);
  } else {
    for (size_t s = 0; s < plan.shards.size(); ++s) plan.file_names.push_back(shard_file_name(s, plan.shards.size()));
  }
  return plan;
}

Status write_safetensors_file(const std::string& path, std::span<const HfExportTensor> tensors, const HfTensorFill& fill,
                              std::map<std::string, std::string> metadata, size_t chunk_elements) {
  std::vector<hf::SafetensorsTensorSpec> specs;
  specs.reserve(tensors.size());
  for (const HfExportTensor& tensor : tensors) specs.push_back({tensor.name, tensor.dtype, tensor.shape});
  STRATA_ASSIGN_OR_RETURN(hf::SafetensorsWriter writer, hf::SafetensorsWriter::create(path, std::move(specs), std::move(metadata)));
  for (size_t i = 0; i < tensors.size(); ++i) {
    if (tensors[i].numel() == 0) continue;  // complete from the start
    STRATA_RETURN_IF_ERROR(writer.write_tensor(
        tensors[i].name, [&](uint64_t first, std::span<float> out) { return fill(i, first, out); }, chunk_elements));
  }
  return writer.finish();
}

Status write_json_file(const std::string& path, const nlohmann::json& value) {
  const std::string tmp = path + ".tmp";
  const std::string text = value.dump(2) + "\n";
  {
    STRATA_ASSIGN_OR_RETURN(File file, File::open(tmp, {.flags = O_WRONLY | O_CREAT | O_TRUNC}));
    STRATA_RETURN_IF_ERROR(file.write_all(text.data(), text.size()));
    STRATA_RETURN_IF_ERROR(file.sync());
    STRATA_RETURN_IF_ERROR(file.close());
  }
  if (::rename(tmp.c_str(), path.c_str()) != 0) {
    const int error = errno;
    ::unlink(tmp.c_str());
    return Status::FromErrno(error, "rename(" + tmp + ", " + path + ")");
  }
  return Status::Ok();
}

Status write_hf_checkpoint(const std::string& dir, const nlohmann::json& config, std::span<const HfExportTensor> tensors,
                           const HfTensorFill& fill, const HfExportOptions& options) {
  const fs::path target = export_target_path(dir);
  const std::string where = "export to " + target.string();
  if (!config.is_object()) return InvalidArgumentError(where + ": the config is not a JSON object");
  if (options.shard_bytes == 0) return InvalidArgumentError(where + ": the shard size must be positive");
  STRATA_RETURN_IF_ERROR(check_export_tensors(tensors, where));
  STRATA_ASSIGN_OR_RETURN(const ExportTarget what, inspect_target(target));

  std::error_code ec;
  fs::create_directories(target.parent_path(), ec);
  if (ec) return IoError(where + ": cannot create " + target.parent_path().string() + ": " + ec.message());
  // Beside the target (one file system, so the final rename is atomic); a leftover from a
  // crashed export has the same name and is cleared first.
  TemporaryDirectory staged(target.parent_path() / ("." + target.filename().string() + ".partial"));
  fs::remove_all(staged.path(), ec);
  fs::create_directory(staged.path(), ec);
  if (ec) return IoError(where + ": cannot create the temporary directory " + staged.path().string() + ": " + ec.message());

  const HfShardPlan plan = plan_hf_shards(tensors, options.shard_bytes);
  auto metadata = options.metadata;
  metadata.emplace("format", "pt");
  nlohmann::json weight_map = nlohmann::json::object();
  for (size_t s = 0; s < plan.shards.size(); ++s) {
    std::vector<HfExportTensor> shard_tensors;
    for (size_t index : plan.shards[s]) {
      shard_tensors.push_back(tensors[index]);
      weight_map[tensors[index].name] = plan.file_names[s];
    }
    const std::vector<size_t>& indices = plan.shards[s];
    STRATA_RETURN_IF_ERROR_CTX(
        write_safetensors_file((staged.path() / plan.file_names[s]).string(), shard_tensors,
                               [&](size_t i, uint64_t first, std::span<float> out) { return fill(indices[i], first, out); },
                               metadata, options.chunk_elements),
        where + ": writing " + plan.file_names[s]);
  }
  if (plan.shards.size() > 1) {
    const nlohmann::json index = {{"metadata", {{"total_size", plan.total_bytes}}}, {"weight_map", std::move(weight_map)}};
    STRATA_RETURN_IF_ERROR_CTX(write_json_file((staged.path() / kWeightsIndexFile).string(), index), where);
  }
  STRATA_RETURN_IF_ERROR_CTX(write_json_file((staged.path() / kConfigFile).string(), config), where);
  if (!options.tokenizer_source_dir.empty())
    STRATA_RETURN_IF_ERROR_CTX(copy_tokenizer_files(options.tokenizer_source_dir, staged.path()), where);

  STRATA_RETURN_IF_ERROR_CTX(fsync_directory(staged.path().string()), where);
  STRATA_RETURN_IF_ERROR_CTX(move_into_place(staged.path(), target, what), where);
  STRATA_RETURN_IF_ERROR_CTX(fsync_directory(target.parent_path().string()), where);
  STRATA_LOG(kInfo) << "exported " << target.string() << " (" << plan.file_names.size() << " weight file"
                    << (plan.file_names.size() == 1 ? "" : "s") << ", " << plan.total_bytes << " bytes)";
  return Status::Ok();
}

std::string_view torch_dtype_name(SafetensorsDType dtype) {
  switch (dtype) {
    case SafetensorsDType::kBF16: return "bfloat16";
    case SafetensorsDType::kF16: return "float16";
    default: return "float32";
  }
}

StatusOr<SafetensorsDType> export_safetensors_dtype(DType dtype, std::string_view who) {
  switch (dtype) {
    case DType::kFloat32: return SafetensorsDType::kF32;
    case DType::kBFloat16: return SafetensorsDType::kBF16;
    case DType::kFloat16: return SafetensorsDType::kF16;
    default:
      return InvalidArgumentError(std::string(who) + ": weights are written as fp32, bf16 or fp16, not " +
                                  std::string(dtype_name(dtype)));
  }
}

}  // namespace strata::hf
