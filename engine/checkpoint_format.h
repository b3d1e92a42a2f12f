// What the checkpoint files share between the saver, the reader and latest_complete
// (engine/checkpoint.h is the interface and describes the layout on disk): the format's
// names and versions, checksums, file helpers and the manifest's group records.
// Internal to the checkpoint code.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "engine/core/file.h"
#include "engine/core/status.h"

namespace strata::checkpoint_format {

using json = nlohmann::json;

constexpr std::string_view kFormatName = "strata-checkpoint";
constexpr int kFormatVersion = 1;            // master, exp_avg, exp_avg_sq per group
constexpr int kFormatVersionStale = 2;       // and the stale parameters (delayed overlap mode)
constexpr int kStaleKinds = kCheckpointStateKinds + 1;
constexpr size_t kDirectIoAlignment = 4096;
constexpr std::string_view kManifestName = "manifest.json";
// A manifest nests 6 levels (manifest, files, file, segments, segment, checksums); deeper
// is damage, refused before parsing (dumping it for its checksum recurses per level).
constexpr size_t kManifestDepth = 6;
constexpr size_t kMaxManifestDepth = 8;
constexpr std::string_view kTrainerStateName = "trainer_state.json";
constexpr std::string_view kTmpPrefix = ".tmp-";

constexpr std::array<CheckpointStateKind, kCheckpointStateKinds> kAllKinds = {
    CheckpointStateKind::kMaster, CheckpointStateKind::kExpAvg, CheckpointStateKind::kExpAvgSq};
// Segment s of a group in a rank file, for either layout.
constexpr std::array<CheckpointStateKind, kStaleKinds> kSegmentKinds = {
    CheckpointStateKind::kMaster, CheckpointStateKind::kExpAvg, CheckpointStateKind::kExpAvgSq, CheckpointStateKind::kStaleParams};

// XXH64 as 16 lower-case hex digits, and back (false on anything else).
std::string hex64(uint64_t value);
bool parse_hex64(const std::string& text, uint64_t* value);

// "rank-<r>-of-<world>.bin".
std::string rank_file_name(int rank, int world_size);

// The chunk checksums of `bytes` bytes at `data`.
std::vector<uint64_t> chunk_checksums(const void* data, size_t bytes, size_t chunk_bytes);

// Opens `path` with `flags`, with O_DIRECT when `direct` and the file system takes it at
// 4 KiB (a file system that wants more alignment gets buffered I/O). *direct is set to what
// was used.
StatusOr<File> open_maybe_direct(const std::string& path, int flags, bool* direct);

// Writes `data` to a new file at `path` (buffered) and fsyncs it.
Status write_file_durably(const std::string& path, std::string_view data);

// A whole small file (a manifest, the trainer state); kNotFound when it does not exist.
StatusOr<std::string> read_small_file(const std::string& path);

// "step-<N>" -> N, or -1.
int64_t parse_step_name(std::string_view name);

// The manifest's checksum: XXH64 of its canonical text without the checksum field.
uint64_t manifest_checksum(json manifest);

// A group's manifest record (id, name, sizes, tensors; "frozen" only where true).
json group_to_json(const GroupLayout& layout);

// Same groups (names, sizes, tensors) and world size; the error names `rank`'s group.
Status check_same_layouts(const std::vector<GroupLayout>& expected, const std::vector<GroupLayout>& got, int rank);

}  // namespace strata::checkpoint_format
