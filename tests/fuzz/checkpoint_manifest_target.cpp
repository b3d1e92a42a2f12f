// engine/checkpoint_reader.cpp's manifest checks under fuzzing. Every input is tried twice: as
// written (almost always stopped by the manifest's own checksum) and resealed with a
// matching checksum, so the layout checks behind it see the mutations. A manifest the
// parser accepts describes rank files whose segments tile them exactly, with one checksum
// per chunk, and groups whose tensors lie inside them: CheckpointReader reads by these
// numbers without checking them again.
#include <string>
#include <string_view>

#include "engine/checkpoint.h"
#include "tests/fuzz/fuzz_targets.h"

namespace strata::fuzz {

namespace {

__extension__ using u128 = unsigned __int128;  // sums and products of 64-bit sizes, never wrapping

void check_groups(const CheckpointManifest& manifest) {
  STRATA_FUZZ_CHECK(manifest.group_base.size() == manifest.groups.size(), "manifest: a group without a base offset");
  u128 base = 0;
  for (size_t g = 0; g < manifest.groups.size(); ++g) {
    const SavedGroup& group = manifest.groups[g];
    STRATA_FUZZ_CHECK(manifest.group_base[g] == base, "manifest: a group's block is not where the groups before it end");
    STRATA_FUZZ_CHECK(u128{group.shard_numel} * static_cast<unsigned>(manifest.world_size) >= group.numel,
                      "manifest: the shards do not cover a group");
    for (const SavedTensor& tensor : group.tensors) {
      STRATA_FUZZ_CHECK(u128{tensor.offset} + tensor.numel <= group.numel, "manifest: a tensor ends past its group");
    }
    base += u128{group.shard_numel} * sizeof(float) * kCheckpointStateKinds;
  }
  STRATA_FUZZ_CHECK(base == manifest.rank_file_bytes, "manifest: the rank file size is not the groups' blocks");
}

void check_files(const CheckpointManifest& manifest) {
  STRATA_FUZZ_CHECK(manifest.files.size() == static_cast<size_t>(manifest.world_size) + 1,
                    "manifest: not one file per rank plus the trainer state");
  for (const ManifestFile& file : manifest.files) {
    STRATA_FUZZ_CHECK(file.name.find('/') == std::string::npos && !file.name.empty(), "manifest: a file name that is a path");
    u128 end = 0;
    for (const ManifestSegment& segment : file.segments) {
      STRATA_FUZZ_CHECK(segment.offset == end, "manifest: segments that do not tile their file");
      end += segment.bytes;
      const u128 chunks = (u128{segment.bytes} + manifest.chunk_bytes - 1) / manifest.chunk_bytes;
      STRATA_FUZZ_CHECK(segment.checksums.size() == chunks, "manifest: a segment without one checksum per chunk");
      if (file.rank >= 0) {
        STRATA_FUZZ_CHECK(segment.group >= 0 && static_cast<size_t>(segment.group) < manifest.groups.size(),
                          "manifest: a segment of a group that does not exist");
      }
    }
    STRATA_FUZZ_CHECK(end == file.bytes, "manifest: a file's segments do not add up to its size");
  }
}

void parse_and_check(std::string_view text) {
  StatusOr<CheckpointManifest> manifest = parse_checkpoint_manifest(text, "fuzz/manifest.json");
  if (!manifest.ok()) {
    STRATA_FUZZ_CHECK(manifest.status().code() == StatusCode::kDataLoss, "manifest: an error that is not kDataLoss");
    STRATA_FUZZ_CHECK(manifest.status().message().starts_with("fuzz/manifest.json"), "manifest: an error that does not name the file");
    return;
  }
  STRATA_FUZZ_CHECK(manifest->world_size >= 1 && manifest->chunk_bytes > 0 && manifest->chunk_bytes % 4096 == 0,
                    "manifest: an accepted world size or chunk size out of range");
  check_groups(*manifest);
  check_files(*manifest);
}

}  // namespace

int fuzz_checkpoint_manifest(const uint8_t* data, size_t size) {
  const std::string_view text(reinterpret_cast<const char*>(data), size);
  parse_and_check(text);
  StatusOr<std::string> resealed = reseal_checkpoint_manifest(text);
  if (resealed.ok()) parse_and_check(*resealed);
  return 0;
}

}  // namespace strata::fuzz
