#include "engine/checkpoint.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <limits>
#include <type_traits>
#include <utility>

#include <nlohmann/json.hpp>

#include "engine/checkpoint_format.h"
#include "engine/core/check.h"
#include "engine/core/json_depth.h"
#include "engine/engine_plan.h"
#include "offload/checksum.h"

namespace strata {

namespace fs = std::filesystem;
using namespace checkpoint_format;

struct CheckpointReader::File {
  std::string name;
  std::string path;
  int rank = -1;
  uint64_t bytes = 0;
  bool direct = false;
  ::strata::File fd;
  std::vector<Segment> segments;  // rank files: group_segment_[group] + kind
};

CheckpointReader::~CheckpointReader() = default;

namespace {

// Typed access to manifest fields with errors naming the field.
class ManifestFields {
 public:
  explicit ManifestFields(std::string path) : path_(std::move(path)) {}

  template <class T>
  StatusOr<T> get(const json& object, std::string_view key, std::string_view where) const {
    if (!object.is_object()) return error(std::string(where) + " is not an object");
    const auto it = object.find(key);
    if (it == object.end()) return error(std::string(where) + " has no field '" + std::string(key) + "'");
    const std::string field = std::string(where) + "." + std::string(key);
    // json's own conversion truncates 1.5, wraps -1 into a size_t and makes 1e300 an
    // undefined int: integers are checked here, in their own type.
    if constexpr (std::is_integral_v<T> && !std::is_same_v<T, bool>) {
      return integer<T>(*it, field);
    } else if constexpr (std::is_same_v<T, std::vector<int64_t>>) {
      if (!it->is_array()) return error(field + " is not an array");
      std::vector<int64_t> values;
      for (size_t i = 0; i < it->size(); ++i) {
        STRATA_ASSIGN_OR_RETURN(const int64_t value, integer<int64_t>((*it)[i], field + "[" + std::to_string(i) + "]"));
        values.push_back(value);
      }
      return values;
    } else {
      try {
        return it->template get<T>();
      } catch (const json::exception& e) {
        return error(field + " has the wrong type (" + e.what() + ")");
      }
    }
  }
  template <class T>
  StatusOr<T> integer(const json& value, const std::string& field) const {
    if (value.is_number_unsigned() && std::in_range<T>(value.get<uint64_t>())) return static_cast<T>(value.get<uint64_t>());
    if (value.is_number_integer() && !value.is_number_unsigned() && std::in_range<T>(value.get<int64_t>())) {
      return static_cast<T>(value.get<int64_t>());
    }
    return error(field + " is " + (value.is_structured() ? std::string("an ") + value.type_name() : value.dump()) + ", not an integer in [" + std::to_string(std::numeric_limits<T>::min()) + ", " +
                 std::to_string(std::numeric_limits<T>::max()) + "]");
  }
  StatusOr<const json*> array(const json& object, std::string_view key, std::string_view where) const {
    if (!object.is_object()) return error(std::string(where) + " is not an object");
    const auto it = object.find(key);
    if (it == object.end() || !it->is_array()) return error(std::string(where) + "." + std::string(key) + " is missing or not an array");
    return &*it;
  }
  Status error(const std::string& what) const { return DataLossError(path_ + ": " + what); }

 private:
  std::string path_;
};

}  // namespace

namespace {

Status parse_manifest_groups(const json& manifest, const ManifestFields& fields, CheckpointManifest& out) {
  STRATA_ASSIGN_OR_RETURN(const json* groups, fields.array(manifest, "groups", "the manifest"));
  uint64_t block_offset = 0;
  size_t segments = 0;  // of a rank file, before the group's
  for (size_t g = 0; g < groups->size(); ++g) {
    const json& entry = (*groups)[g];
    const std::string where = "groups[" + std::to_string(g) + "]";
    SavedGroup group;
    STRATA_ASSIGN_OR_RETURN(group.id, fields.get<int>(entry, "id", where));
    STRATA_ASSIGN_OR_RETURN(group.name, fields.get<std::string>(entry, "name", where));
    STRATA_ASSIGN_OR_RETURN(group.numel, fields.get<size_t>(entry, "numel", where));
    STRATA_ASSIGN_OR_RETURN(group.shard_numel, fields.get<size_t>(entry, "shard_numel", where));
    if (group.id != static_cast<int>(g)) return fields.error(where + " has id " + std::to_string(group.id));
    if (entry.contains("frozen")) {
      STRATA_ASSIGN_OR_RETURN(group.frozen, fields.get<bool>(entry, "frozen", where));
    }
    // A rank file holds three (or, with stale parameters, four) shards of every trainable
    // group (none of a frozen one); its size must fit 64 bits.
    uint64_t block_bytes = 0;
    uint64_t block_end = 0;
    const uint64_t kinds = group.frozen ? 0 : static_cast<uint64_t>(out.kinds);
    if (__builtin_mul_overflow(uint64_t{group.shard_numel}, kinds * sizeof(float), &block_bytes) ||
        __builtin_add_overflow(block_offset, block_bytes, &block_end)) {
      return fields.error(where + " ('" + group.name + "'): shard_numel " + std::to_string(group.shard_numel) +
                          " makes the rank files larger than 2^64 bytes");
    }
    if (group.shard_numel == 0 || group.shard_numel < group.numel / static_cast<size_t>(out.world_size) +
                                                          (group.numel % static_cast<size_t>(out.world_size) != 0)) {
      return fields.error(where + " ('" + group.name + "'): shard_numel " + std::to_string(group.shard_numel) + " x " +
                          std::to_string(out.world_size) + " ranks does not cover its " + std::to_string(group.numel) +
                          " elements");
    }
    STRATA_ASSIGN_OR_RETURN(const json* tensors, fields.array(entry, "tensors", where));
    for (size_t t = 0; t < tensors->size(); ++t) {
      const std::string twhere = where + ".tensors[" + std::to_string(t) + "]";
      SavedTensor tensor;
      STRATA_ASSIGN_OR_RETURN(tensor.name, fields.get<std::string>((*tensors)[t], "name", twhere));
      STRATA_ASSIGN_OR_RETURN(tensor.shape, fields.get<std::vector<int64_t>>((*tensors)[t], "shape", twhere));
      STRATA_ASSIGN_OR_RETURN(tensor.offset, fields.get<size_t>((*tensors)[t], "offset", twhere));
      STRATA_ASSIGN_OR_RETURN(tensor.numel, fields.get<size_t>((*tensors)[t], "numel", twhere));
      if (tensor.offset > group.numel || tensor.numel > group.numel - tensor.offset) {
        return fields.error(twhere + " (offset " + std::to_string(tensor.offset) + ", numel " + std::to_string(tensor.numel) +
                            ") ends past its group's numel " + std::to_string(group.numel));
      }
      group.tensors.push_back(std::move(tensor));
    }
    out.group_base.push_back(block_offset);
    out.group_segment.push_back(group.frozen ? kNoSegment : segments);
    if (!group.frozen) segments += static_cast<size_t>(out.kinds);
    block_offset = block_end;
    out.groups.push_back(std::move(group));
  }
  out.rank_file_bytes = block_offset;
  out.rank_file_segments = segments;
  return Status::Ok();
}

Status parse_manifest_segments(const json& entry, const ManifestFields& fields, const std::string& where,
                               const CheckpointManifest& manifest, ManifestFile& file) {
  const bool is_rank_file = file.rank >= 0;
  STRATA_ASSIGN_OR_RETURN(const json* segments, fields.array(entry, "segments", where));
  const size_t kinds = static_cast<size_t>(manifest.kinds);
  const size_t expected_segments = is_rank_file ? manifest.rank_file_segments : 1;
  // Rank files: segment s belongs to the trainable group whose segments start at or before it.
  size_t group_of_segment = 0;
  if (segments->size() != expected_segments) {
    return fields.error(where + " ('" + file.name + "') has " + std::to_string(segments->size()) + " segments, expected " +
                        std::to_string(expected_segments));
  }
  for (size_t s = 0; s < segments->size(); ++s) {
    const json& sentry = (*segments)[s];
    const std::string swhere = where + ".segments[" + std::to_string(s) + "]";
    ManifestSegment segment;
    STRATA_ASSIGN_OR_RETURN(segment.offset, fields.get<uint64_t>(sentry, "offset", swhere));
    STRATA_ASSIGN_OR_RETURN(segment.bytes, fields.get<uint64_t>(sentry, "bytes", swhere));
    STRATA_ASSIGN_OR_RETURN(const std::vector<std::string> sums, fields.get<std::vector<std::string>>(sentry, "checksums", swhere));
    if (is_rank_file) {
      while (manifest.group_segment[group_of_segment] == kNoSegment || manifest.group_segment[group_of_segment] + kinds <= s)
        ++group_of_segment;
      segment.group = static_cast<int>(group_of_segment);
      segment.kind = kSegmentKinds[s % kinds];
      const size_t shard_bytes = manifest.groups[static_cast<size_t>(segment.group)].shard_numel * sizeof(float);
      const uint64_t expected_offset = manifest.group_base[static_cast<size_t>(segment.group)] +
                                       static_cast<uint64_t>(s % kinds) * shard_bytes;
      if (segment.offset != expected_offset || segment.bytes != shard_bytes) {
        return fields.error(swhere + " is at [" + std::to_string(segment.offset) + ", +" + std::to_string(segment.bytes) +
                            "), expected [" + std::to_string(expected_offset) + ", +" + std::to_string(shard_bytes) + ")");
      }
    } else if (segment.offset != 0 || segment.bytes != file.bytes) {
      return fields.error(swhere + " does not cover the whole trainer state");
    }
    const uint64_t chunks = segment.bytes / manifest.chunk_bytes + (segment.bytes % manifest.chunk_bytes != 0);
    if (sums.size() != chunks) {
      return fields.error(swhere + " has " + std::to_string(sums.size()) + " checksums for " + std::to_string(chunks) + " chunks");
    }
    for (const std::string& text : sums) {
      uint64_t value = 0;
      if (!parse_hex64(text, &value)) return fields.error(swhere + " has a checksum that is not hex: '" + text + "'");
      segment.checksums.push_back(value);
    }
    file.segments.push_back(std::move(segment));
  }
  return Status::Ok();
}

Status parse_manifest_files(const json& manifest, const ManifestFields& fields, CheckpointManifest& out) {
  STRATA_ASSIGN_OR_RETURN(const json* files, fields.array(manifest, "files", "the manifest"));
  if (files->size() != static_cast<size_t>(out.world_size) + 1) {
    return fields.error("lists " + std::to_string(files->size()) + " files, expected " + std::to_string(out.world_size) +
                        " rank files and the trainer state");
  }
  for (size_t f = 0; f < files->size(); ++f) {
    const json& entry = (*files)[f];
    const std::string where = "files[" + std::to_string(f) + "]";
    ManifestFile file;
    STRATA_ASSIGN_OR_RETURN(file.name, fields.get<std::string>(entry, "name", where));
    STRATA_ASSIGN_OR_RETURN(file.bytes, fields.get<uint64_t>(entry, "bytes", where));
    const bool is_rank_file = f < static_cast<size_t>(out.world_size);
    if (is_rank_file) {
      STRATA_ASSIGN_OR_RETURN(file.rank, fields.get<int>(entry, "rank", where));
      if (file.rank != static_cast<int>(f) || file.name != rank_file_name(file.rank, out.world_size)) {
        return fields.error(where + " ('" + file.name + "') is not rank " + std::to_string(f) + "'s file");
      }
      if (file.bytes != out.rank_file_bytes) {
        return fields.error(where + " ('" + file.name + "') has " + std::to_string(file.bytes) + " bytes, the groups need " +
                            std::to_string(out.rank_file_bytes));
      }
    } else if (file.name != kTrainerStateName) {
      return fields.error(where + " is '" + file.name + "', expected " + std::string(kTrainerStateName));
    }
    if (file.name.find('/') != std::string::npos) return fields.error(where + " names a path, not a file");
    STRATA_RETURN_IF_ERROR(parse_manifest_segments(entry, fields, where, out, file));
    out.files.push_back(std::move(file));
  }
  return Status::Ok();
}

}  // namespace

StatusOr<CheckpointManifest> parse_checkpoint_manifest(std::string_view text, const std::string& manifest_path) {
  if (const size_t depth = json_nesting_depth(text); depth > kMaxManifestDepth) {
    return DataLossError(manifest_path + " nests " + std::to_string(depth) + " levels of objects and arrays; a manifest has " +
                         std::to_string(kManifestDepth) + ": the manifest is damaged");
  }
  json manifest = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object()) {
    return DataLossError(manifest_path + " is not a JSON object (" + std::to_string(text.size()) + " bytes): the manifest is damaged");
  }
  const ManifestFields fields(manifest_path);
  STRATA_ASSIGN_OR_RETURN(const std::string format, fields.get<std::string>(manifest, "format", "the manifest"));
  if (format != kFormatName) return fields.error("format is '" + format + "', expected '" + std::string(kFormatName) + "'");
  STRATA_ASSIGN_OR_RETURN(const int version, fields.get<int>(manifest, "version", "the manifest"));
  if (version != kFormatVersion && version != kFormatVersionStale) {
    return fields.error("format version " + std::to_string(version) + " is not one of the supported " + std::to_string(kFormatVersion) +
                        " and " + std::to_string(kFormatVersionStale));
  }
  bool stale_parameters = false;
  if (manifest.contains("stale_parameters")) {
    STRATA_ASSIGN_OR_RETURN(stale_parameters, fields.get<bool>(manifest, "stale_parameters", "the manifest"));
  }
  if (stale_parameters != (version == kFormatVersionStale)) {
    return fields.error("format version " + std::to_string(version) + (stale_parameters ? " with" : " without") +
                        " stale_parameters (version " + std::to_string(kFormatVersionStale) + " has them, version " +
                        std::to_string(kFormatVersion) + " does not)");
  }
  STRATA_ASSIGN_OR_RETURN(const std::string stored_sum, fields.get<std::string>(manifest, "manifest_checksum", "the manifest"));
  uint64_t expected_sum = 0;
  if (!parse_hex64(stored_sum, &expected_sum)) return fields.error("manifest_checksum '" + stored_sum + "' is not hex");
  const uint64_t actual_sum = manifest_checksum(manifest);
  if (actual_sum != expected_sum) {
    return fields.error("checksum mismatch of the manifest itself: stored " + stored_sum + ", computed " + hex64(actual_sum));
  }

  CheckpointManifest out;
  out.kinds = stale_parameters ? kStaleKinds : kCheckpointStateKinds;
  STRATA_ASSIGN_OR_RETURN(out.step, fields.get<int64_t>(manifest, "step", "the manifest"));
  STRATA_ASSIGN_OR_RETURN(out.engine_steps, fields.get<int64_t>(manifest, "engine_steps", "the manifest"));
  if (manifest.contains("loss_scaler")) {
    const json& entry = manifest["loss_scaler"];
    const std::string where = "the manifest's loss_scaler";
    LossScaler::State scaler{};
    STRATA_ASSIGN_OR_RETURN(scaler.scale, fields.get<float>(entry, "scale", where));
    STRATA_ASSIGN_OR_RETURN(scaler.clean_steps, fields.get<int>(entry, "clean_steps", where));
    STRATA_ASSIGN_OR_RETURN(scaler.remaining_hysteresis, fields.get<int>(entry, "remaining_hysteresis", where));
    STRATA_ASSIGN_OR_RETURN(scaler.skipped_steps, fields.get<uint64_t>(entry, "skipped_steps", where));
    if (!(scaler.scale > 0.0f) || !std::isfinite(scaler.scale)) return fields.error(where + ": scale " + std::to_string(scaler.scale) + " is not positive");
    out.loss_scaler = scaler;
  }
  STRATA_ASSIGN_OR_RETURN(out.world_size, fields.get<int>(manifest, "world_size", "the manifest"));
  STRATA_ASSIGN_OR_RETURN(out.chunk_bytes, fields.get<size_t>(manifest, "chunk_bytes", "the manifest"));
  if (out.world_size < 1) return fields.error("world_size " + std::to_string(out.world_size) + " is below 1");
  if (out.chunk_bytes == 0 || out.chunk_bytes % kDirectIoAlignment != 0) {
    return fields.error("chunk_bytes " + std::to_string(out.chunk_bytes) + " is not a positive multiple of 4096");
  }
  STRATA_RETURN_IF_ERROR(parse_manifest_groups(manifest, fields, out));
  STRATA_RETURN_IF_ERROR(parse_manifest_files(manifest, fields, out));
  return out;
}

StatusOr<std::string> reseal_checkpoint_manifest(std::string_view text) {
  if (json_nesting_depth(text) > kMaxManifestDepth) return InvalidArgumentError("reseal_checkpoint_manifest: nested too deeply");
  json manifest = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (manifest.is_discarded() || !manifest.is_object()) return InvalidArgumentError("reseal_checkpoint_manifest: not a JSON object");
  manifest["manifest_checksum"] = hex64(manifest_checksum(manifest));
  return manifest.dump(1) + "\n";
}

StatusOr<std::unique_ptr<CheckpointReader>> CheckpointReader::open(const std::string& checkpoint_dir,
                                                                   const CheckpointReadOptions& options) {
  std::unique_ptr<CheckpointReader> reader(new CheckpointReader());
  reader->options_ = options;
  reader->path_ = checkpoint_dir;
  std::error_code error;
  if (!fs::is_directory(checkpoint_dir, error)) return NotFoundError("checkpoint " + checkpoint_dir + " is not a directory");
  const std::string manifest_path = (fs::path(checkpoint_dir) / kManifestName).string();
  auto manifest_text = read_small_file(manifest_path);
  if (!manifest_text.ok()) {
    if (manifest_text.status().code() == StatusCode::kNotFound) {
      return NotFoundError("checkpoint " + checkpoint_dir + " has no " + std::string(kManifestName) +
                           " (an incomplete save)");
    }
    return std::move(manifest_text).status();
  }
  STRATA_ASSIGN_OR_RETURN(CheckpointManifest manifest, parse_checkpoint_manifest(*manifest_text, manifest_path));
  reader->step_ = manifest.step;
  reader->engine_steps_ = manifest.engine_steps;
  reader->loss_scaler_ = manifest.loss_scaler;
  reader->world_size_ = manifest.world_size;
  reader->chunk_bytes_ = manifest.chunk_bytes;
  reader->kinds_ = manifest.kinds;
  reader->groups_ = std::move(manifest.groups);
  reader->group_base_ = std::move(manifest.group_base);
  reader->group_segment_ = std::move(manifest.group_segment);

  for (ManifestFile& entry : manifest.files) {
    File file;
    file.name = std::move(entry.name);
    file.rank = entry.rank;
    file.bytes = entry.bytes;
    file.segments = std::move(entry.segments);
    file.path = (fs::path(checkpoint_dir) / file.name).string();
    const bool is_rank_file = file.rank >= 0;

    // Size: a short file is truncated.
    struct stat info {};
    if (::stat(file.path.c_str(), &info) != 0) {
      const int stat_errno = errno;
      if (stat_errno == ENOENT) {
        return DataLossError("checkpoint " + checkpoint_dir + ": " + file.name + " is missing (the manifest lists it)");
      }
      return Status::FromErrno(stat_errno, "stat(" + file.path + ")");
    }
    const uint64_t size = static_cast<uint64_t>(info.st_size);
    if (size < file.bytes) {
      return DataLossError("checkpoint " + checkpoint_dir + ": " + file.path + " is truncated: it has " + std::to_string(size) +
                           " bytes, the manifest says " + std::to_string(file.bytes));
    }
    if (size > file.bytes) {
      return DataLossError("checkpoint " + checkpoint_dir + ": " + file.path + " has " + std::to_string(size) +
                           " bytes, more than the " + std::to_string(file.bytes) + " the manifest says");
    }
    if (is_rank_file) {
      file.direct = options.direct_io;
      STRATA_ASSIGN_OR_RETURN(file.fd, open_maybe_direct(file.path, O_RDONLY, &file.direct));
    }
    reader->files_.push_back(std::move(file));
  }

  // The trainer state: small, read and checked now.
  File& state_file = reader->files_.back();
  STRATA_ASSIGN_OR_RETURN(reader->trainer_state_, read_small_file(state_file.path));
  if (reader->trainer_state_.size() != state_file.bytes) {
    return DataLossError("checkpoint " + checkpoint_dir + ": " + state_file.path + " changed size while being read");
  }
  if (options.verify_checksums) {
    const Segment& segment = state_file.segments.front();
    const std::vector<uint64_t> sums = chunk_checksums(reader->trainer_state_.data(), reader->trainer_state_.size(), reader->chunk_bytes_);
    for (size_t c = 0; c < sums.size(); ++c) {
      if (sums[c] != segment.checksums[c]) {
        return DataLossError("checkpoint " + checkpoint_dir + ": checksum mismatch in " + state_file.path + " chunk " +
                             std::to_string(c) + ": stored " + hex64(segment.checksums[c]) + ", computed " + hex64(sums[c]));
      }
    }
  }
  return reader;
}

Status CheckpointReader::read_segment(const File& file, const Segment& segment, uint64_t offset, size_t bytes,
                                      void* out) const {
  if (bytes == 0) return Status::Ok();
  if (offset + bytes > segment.bytes) {
    return InternalError("checkpoint read past a segment of " + file.path + ": [" + std::to_string(offset) + ", +" +
                         std::to_string(bytes) + ") of " + std::to_string(segment.bytes));
  }
  const size_t chunk = chunk_bytes_;
  STRATA_ASSIGN_OR_RETURN(const AlignedBuffer buffer, AlignedBuffer::allocate(chunk, kDirectIoAlignment));
  auto* destination = static_cast<unsigned char*>(out);
  for (uint64_t c = offset / chunk; c * chunk < offset + bytes; ++c) {
    const uint64_t chunk_begin = c * chunk;
    const size_t chunk_size = static_cast<size_t>(std::min<uint64_t>(chunk, segment.bytes - chunk_begin));
    STRATA_RETURN_IF_ERROR(file.fd.read_exact(buffer.data(), chunk_size, segment.offset + chunk_begin));
    if (options_.verify_checksums) {
      const uint64_t sum = xxhash64(buffer.data(), chunk_size);
      if (sum != segment.checksums[c]) {
        return DataLossError("checksum mismatch in " + file.path + " (group " + std::to_string(segment.group) + " '" +
                             groups_[static_cast<size_t>(segment.group)].name + "', " +
                             std::string(checkpoint_state_kind_name(segment.kind)) + ", bytes [" +
                             std::to_string(segment.offset + chunk_begin) + ", " +
                             std::to_string(segment.offset + chunk_begin + chunk_size) + ") of the file): stored " +
                             hex64(segment.checksums[c]) + ", computed " + hex64(sum));
      }
    }
    const uint64_t copy_begin = std::max(offset, chunk_begin);
    const uint64_t copy_end = std::min<uint64_t>(offset + bytes, chunk_begin + chunk_size);
    std::memcpy(destination + (copy_begin - offset), buffer.data() + (copy_begin - chunk_begin), copy_end - copy_begin);
  }
  return Status::Ok();
}

Status CheckpointReader::check_layout(const GroupLayout& layout) const {
  if (layout.id < 0 || static_cast<size_t>(layout.id) >= groups_.size()) {
    return InvalidArgumentError("checkpoint " + path_ + " has " + std::to_string(groups_.size()) + " groups; the model's group " +
                                std::to_string(layout.id) + " ('" + layout.name + "') is not among them");
  }
  const SavedGroup& saved = groups_[static_cast<size_t>(layout.id)];
  const std::string what = "checkpoint " + path_ + ": group " + std::to_string(layout.id);
  if (saved.name != layout.name) {
    return InvalidArgumentError(what + " is '" + saved.name + "' in the checkpoint but '" + layout.name + "' in the model");
  }
  if (saved.tensors.size() != layout.tensors.size()) {
    return InvalidArgumentError(what + " ('" + saved.name + "') has " + std::to_string(saved.tensors.size()) +
                                " tensors in the checkpoint, " + std::to_string(layout.tensors.size()) + " in the model");
  }
  auto shape_text = [](const std::vector<int64_t>& shape) {
    std::string text = "[";
    for (size_t i = 0; i < shape.size(); ++i) text += (i ? ", " : "") + std::to_string(shape[i]);
    return text + "]";
  };
  for (size_t t = 0; t < saved.tensors.size(); ++t) {
    const SavedTensor& a = saved.tensors[t];
    const TensorLayout& b = layout.tensors[t];
    if (a.name != b.name || a.shape != b.shape || a.offset != b.offset || a.numel != b.numel) {
      return InvalidArgumentError(what + " ('" + saved.name + "'), tensor " + std::to_string(t) + ": the checkpoint has '" +
                                  a.name + "' " + shape_text(a.shape) + " at offset " + std::to_string(a.offset) +
                                  ", the model '" + b.name + "' " + shape_text(b.shape) + " at offset " + std::to_string(b.offset));
    }
  }
  if (saved.numel != layout.numel) {
    return InvalidArgumentError(what + " ('" + saved.name + "') has " + std::to_string(saved.numel) +
                                " elements in the checkpoint, " + std::to_string(layout.numel) + " in the model");
  }
  if (saved.frozen == layout.trainable) {
    return InvalidArgumentError(what + " ('" + saved.name + "') is " + (saved.frozen ? "frozen" : "trainable") +
                                " in the checkpoint but " + (layout.trainable ? "trainable" : "frozen") +
                                " in the model: a group must be frozen in both or in neither");
  }
  return Status::Ok();
}

Status CheckpointReader::read_range(int group, CheckpointStateKind kind, uint64_t first, std::span<float> out) const {
  if (group < 0 || static_cast<size_t>(group) >= groups_.size()) {
    return InvalidArgumentError("checkpoint " + path_ + ": no group " + std::to_string(group) + " (it has " +
                                std::to_string(groups_.size()) + ")");
  }
  if (static_cast<int>(kind) >= kinds_) {
    return InvalidArgumentError("checkpoint " + path_ + " has no " + std::string(checkpoint_state_kind_name(kind)) +
                                " (not a delayed-mode save)");
  }
  const SavedGroup& saved = groups_[static_cast<size_t>(group)];
  if (saved.frozen) {
    return FailedPreconditionError("checkpoint " + path_ + ": group " + std::to_string(group) + " ('" + saved.name +
                                   "') is frozen; checkpoints hold no state of frozen groups (load their weights from their source)");
  }
  const uint64_t end = first + out.size();
  const uint64_t data_end = std::min<uint64_t>(end, saved.numel);
  uint64_t element = first;
  while (element < data_end) {
    const uint64_t rank = element / saved.shard_numel;
    const uint64_t rank_end = std::min<uint64_t>(data_end, (rank + 1) * saved.shard_numel);
    const File& file = files_[static_cast<size_t>(rank)];
    const Segment& segment = file.segments[group_segment_[static_cast<size_t>(group)] + static_cast<size_t>(kind)];
    const uint64_t local = element - rank * saved.shard_numel;
    STRATA_RETURN_IF_ERROR_CTX(read_segment(file, segment, local * sizeof(float), (rank_end - element) * sizeof(float),
                                            out.data() + (element - first)),
                               "reading group '" + saved.name + "' " + std::string(checkpoint_state_kind_name(kind)) +
                                   " elements [" + std::to_string(first) + ", " + std::to_string(end) + ") from checkpoint " + path_);
    element = rank_end;
  }
  // Padding (and anything past the group) reads as zeros.
  const uint64_t zero_from = std::max(first, data_end);
  if (zero_from < end) std::fill(out.begin() + static_cast<ptrdiff_t>(zero_from - first), out.end(), 0.0f);
  return Status::Ok();
}

Status CheckpointReader::load_shard(int group, CheckpointStateKind kind, int rank, int world_size, std::span<float> out) const {
  if (world_size < 1 || rank < 0 || rank >= world_size) {
    return InvalidArgumentError("checkpoint load_shard: rank " + std::to_string(rank) + " of world size " + std::to_string(world_size));
  }
  if (group >= 0 && static_cast<size_t>(group) < groups_.size() &&
      out.size() * static_cast<size_t>(world_size) < groups_[static_cast<size_t>(group)].numel) {
    return InvalidArgumentError("checkpoint load_shard: " + std::to_string(world_size) + " shards of " +
                                std::to_string(out.size()) + " elements do not cover group '" +
                                groups_[static_cast<size_t>(group)].name + "' (" +
                                std::to_string(groups_[static_cast<size_t>(group)].numel) + " elements)");
  }
  return read_range(group, kind, static_cast<uint64_t>(rank) * out.size(), out);
}

Status CheckpointReader::verify() const {
  for (size_t f = 0; f + 1 < files_.size(); ++f) {
    const File& file = files_[f];
    STRATA_ASSIGN_OR_RETURN(const AlignedBuffer scratch, AlignedBuffer::allocate(chunk_bytes_, kDirectIoAlignment));
    for (const Segment& segment : file.segments) {
      // read_segment checks every chunk; read a chunk at a time into scratch.
      for (uint64_t at = 0; at < segment.bytes; at += chunk_bytes_) {
        const size_t bytes = static_cast<size_t>(std::min<uint64_t>(chunk_bytes_, segment.bytes - at));
        STRATA_RETURN_IF_ERROR(read_segment(file, segment, at, bytes, scratch.data()));
      }
    }
  }
  return Status::Ok();
}

}  // namespace strata
