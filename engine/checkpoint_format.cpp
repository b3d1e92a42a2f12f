#include "engine/checkpoint_format.h"

#include <fcntl.h>

#include <algorithm>
#include <cerrno>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "engine/core/log.h"
#include "offload/checksum.h"

namespace strata {

namespace fs = std::filesystem;

namespace checkpoint_format {

std::string hex64(uint64_t value) {
  char text[20];
  std::snprintf(text, sizeof(text), "%016llx", static_cast<unsigned long long>(value));
  return text;
}

bool parse_hex64(const std::string& text, uint64_t* value) {
  if (text.empty() || text.size() > 16) return false;
  uint64_t result = 0;
  for (char c : text) {
    int digit;
    if (c >= '0' && c <= '9') digit = c - '0';
    else if (c >= 'a' && c <= 'f') digit = c - 'a' + 10;
    else if (c >= 'A' && c <= 'F') digit = c - 'A' + 10;
    else return false;
    result = (result << 4) | static_cast<uint64_t>(digit);
  }
  *value = result;
  return true;
}

std::string rank_file_name(int rank, int world_size) {
  return "rank-" + std::to_string(rank) + "-of-" + std::to_string(world_size) + ".bin";
}

std::vector<uint64_t> chunk_checksums(const void* data, size_t bytes, size_t chunk_bytes) {
  std::vector<uint64_t> sums;
  const auto* cursor = static_cast<const unsigned char*>(data);
  for (size_t done = 0; done < bytes; done += chunk_bytes) {
    sums.push_back(xxhash64(cursor + done, std::min(chunk_bytes, bytes - done)));
  }
  return sums;
}

StatusOr<File> open_maybe_direct(const std::string& path, int flags, bool* direct) {
  STRATA_ASSIGN_OR_RETURN(File file, File::open(path, {.flags = flags,
                                                       .direct_io = *direct ? FileDirectIo::kPreferred : FileDirectIo::kOff,
                                                       .max_direct_alignment = kDirectIoAlignment}));
  if (*direct && !file.direct_io()) {
    STRATA_LOG_ONCE(kWarn) << "checkpoint: the file system under '" << fs::path(path).parent_path().string()
                           << "' refuses O_DIRECT at " << kDirectIoAlignment << " bytes; using buffered I/O for checkpoint files";
  }
  *direct = file.direct_io();
  return file;
}

Status write_file_durably(const std::string& path, std::string_view data) {
  STRATA_ASSIGN_OR_RETURN(File file, File::open(path, {.flags = O_WRONLY | O_CREAT | O_TRUNC}));
  STRATA_RETURN_IF_ERROR(file.write_all(data.data(), data.size()));
  return file.sync();
}

StatusOr<std::string> read_small_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) {
    const int error = errno;
    if (error == ENOENT) return NotFoundError(path + " does not exist");
    return Status::FromErrno(error != 0 ? error : EIO, "open(" + path + ")");
  }
  std::ostringstream text;
  text << in.rdbuf();
  if (in.bad()) return IoError("reading " + path + " failed");
  return text.str();
}

int64_t parse_step_name(std::string_view name) {
  constexpr std::string_view kPrefix = "step-";
  if (name.size() <= kPrefix.size() || name.substr(0, kPrefix.size()) != kPrefix) return -1;
  int64_t step = 0;
  for (char c : name.substr(kPrefix.size())) {
    if (c < '0' || c > '9') return -1;
    if (step > (INT64_MAX - 9) / 10) return -1;
    step = step * 10 + (c - '0');
  }
  return step;
}

uint64_t manifest_checksum(json manifest) {
  manifest.erase("manifest_checksum");
  const std::string text = manifest.dump();
  return xxhash64(text.data(), text.size());
}

json group_to_json(const GroupLayout& layout) {
  json tensors = json::array();
  for (const TensorLayout& tensor : layout.tensors) {
    tensors.push_back({{"name", tensor.name}, {"shape", tensor.shape}, {"offset", tensor.offset}, {"numel", tensor.numel}});
  }
  json group = {{"id", layout.id},
                {"name", layout.name},
                {"numel", layout.numel},
                {"shard_numel", layout.shard_numel},
                {"tensors", std::move(tensors)}};
  // Only where true, so manifests without frozen groups stay as they were.
  if (!layout.trainable) group["frozen"] = true;
  return group;
}

Status check_same_layouts(const std::vector<GroupLayout>& expected, const std::vector<GroupLayout>& got, int rank) {
  if (expected.size() != got.size()) {
    return InvalidArgumentError("rank " + std::to_string(rank) + " has " + std::to_string(got.size()) +
                                " groups, another rank of the same save has " + std::to_string(expected.size()));
  }
  for (size_t g = 0; g < expected.size(); ++g) {
    const GroupLayout& a = expected[g];
    const GroupLayout& b = got[g];
    if (a.name != b.name || a.numel != b.numel || a.shard_numel != b.shard_numel || a.world_size != b.world_size ||
        a.tensors.size() != b.tensors.size() || a.trainable != b.trainable) {
      return InvalidArgumentError("rank " + std::to_string(rank) + "'s group " + std::to_string(g) + " ('" + b.name + "', " +
                                  std::to_string(b.numel) + " elements, shard " + std::to_string(b.shard_numel) +
                                  (b.trainable ? "" : ", frozen") + ") differs from another rank's ('" + a.name + "', " +
                                  std::to_string(a.numel) + " elements, shard " + std::to_string(a.shard_numel) +
                                  (a.trainable ? "" : ", frozen") + ")");
    }
  }
  return Status::Ok();
}

}  // namespace checkpoint_format

std::string_view checkpoint_state_kind_name(CheckpointStateKind kind) {
  switch (kind) {
    case CheckpointStateKind::kMaster: return "master";
    case CheckpointStateKind::kExpAvg: return "exp_avg";
    case CheckpointStateKind::kExpAvgSq: return "exp_avg_sq";
    case CheckpointStateKind::kStaleParams: return "stale_params";
  }
  return "?";
}

std::string checkpoint_dir_name(int64_t step) { return "step-" + std::to_string(step); }
std::string checkpoint_path(const std::string& save_dir, int64_t step) {
  return (fs::path(save_dir) / checkpoint_dir_name(step)).string();
}

}  // namespace strata
