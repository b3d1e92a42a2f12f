// parse_checkpoint_manifest on its own: a real manifest (tests/fuzz/corpus) parses, and the
// damage the fuzzer found — integers that wrap or do not fit their type, sizes whose sums
// overflow 64 bits — is refused with kDataLoss naming the manifest and the field, instead
// of being accepted with wrapped sizes. Each edited manifest is resealed, so the checks
// behind the manifest's own checksum are what refuse it.
#include <gtest/gtest.h>

#include <fstream>
#include <functional>
#include <iterator>
#include <ostream>
#include <string>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using json = nlohmann::json;

json seed_manifest() {
  std::ifstream in(testing::source_dir() / "tests/fuzz/corpus/checkpoint_manifest/one_rank_one_layer.json");
  return json::parse(std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()));
}

StatusOr<CheckpointManifest> parse_resealed(const json& manifest) {
  StatusOr<std::string> text = reseal_checkpoint_manifest(manifest.dump());
  if (!text.ok()) return std::move(text).status();
  return parse_checkpoint_manifest(*text, "step-1/manifest.json");
}

TEST(CheckpointManifestTest, AManifestWrittenByTheSaverParsesWithItsLayout) {
  StatusOr<CheckpointManifest> manifest = parse_resealed(seed_manifest());
  ASSERT_TRUE(manifest.ok()) << manifest.status().to_string();
  EXPECT_EQ(manifest->world_size, 1);
  ASSERT_EQ(manifest->files.size(), 2u);
  EXPECT_EQ(manifest->files[0].bytes, manifest->rank_file_bytes);
  EXPECT_EQ(manifest->files[0].segments.size(), manifest->groups.size() * kCheckpointStateKinds);
  EXPECT_EQ(manifest->files[1].name, "trainer_state.json");
}

TEST(CheckpointManifestTest, AnEditThatIsNotResealedFailsTheManifestsOwnChecksum) {
  json manifest = seed_manifest();
  manifest["step"] = 2;
  StatusOr<CheckpointManifest> parsed = parse_checkpoint_manifest(manifest.dump(), "step-1/manifest.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.status().message().find("checksum mismatch of the manifest itself"), std::string::npos);
}

// Computing the manifest's checksum dumps it, recursing once per level: 100k levels
// overflowed the stack.
TEST(CheckpointManifestTest, AManifestNestedDeeperThanItsFormatIsRefusedBeforeParsing) {
  json manifest = seed_manifest();
  const std::string text = manifest.dump();
  const std::string deep = text.substr(0, text.size() - 1) + R"(,"extra":)" + std::string(100000, '[') + std::string(100000, ']') + "}";
  StatusOr<CheckpointManifest> parsed = parse_checkpoint_manifest(deep, "step-1/manifest.json");
  ASSERT_FALSE(parsed.ok());
  EXPECT_EQ(parsed.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(parsed.status().message().find("step-1/manifest.json nests 100001 levels of objects and arrays; a manifest has 6"),
            std::string::npos)
      << parsed.status().message();
}

struct ManifestDamage {
  std::string name;
  std::function<void(json&)> edit;
  std::string message;  // a fragment of the error
};

void PrintTo(const ManifestDamage& damage, std::ostream* out) { *out << damage.name; }

class CheckpointManifestDamageTest : public ::testing::TestWithParam<ManifestDamage> {};

TEST_P(CheckpointManifestDamageTest, IsRefusedAsDataLossNamingTheField) {
  json manifest = seed_manifest();
  GetParam().edit(manifest);
  StatusOr<CheckpointManifest> parsed = parse_resealed(manifest);
  ASSERT_FALSE(parsed.ok()) << "accepted: " << manifest.dump();
  EXPECT_EQ(parsed.status().code(), StatusCode::kDataLoss);
  EXPECT_NE(parsed.status().message().find("step-1/manifest.json"), std::string::npos) << parsed.status().message();
  EXPECT_NE(parsed.status().message().find(GetParam().message), std::string::npos) << parsed.status().message();
}

constexpr uint64_t kMaxU64 = 18446744073709551615ull;

INSTANTIATE_TEST_SUITE_P(
    FuzzFindings, CheckpointManifestDamageTest,
    ::testing::Values(
        ManifestDamage{"NegativeChunkBytesIsNotASize", [](json& m) { m["chunk_bytes"] = -4096; },
                       "the manifest.chunk_bytes is -4096, not an integer in [0, "},
        ManifestDamage{"AFractionalWorldSizeIsNotTruncated", [](json& m) { m["world_size"] = 1.5; },
                       "the manifest.world_size is 1.5, not an integer"},
        ManifestDamage{"AStepBeyondInt64IsNotConverted", [](json& m) { m["step"] = 1e300; }, "the manifest.step is 1e+300"},
        ManifestDamage{"AFractionalShapeIsNotTruncated", [](json& m) { m["groups"][0]["tensors"][0]["shape"][0] = 1.5; },
                       "groups[0].tensors[0].shape[0] is 1.5"},
        ManifestDamage{"AShardWhoseRankFileWouldPass2To64BytesDoesNotWrap",
                       [](json& m) { m["groups"][0]["shard_numel"] = uint64_t{1} << 62; }, "larger than 2^64 bytes"},
        ManifestDamage{"ATensorWhoseEndWrapsIsPastItsGroup",
                       [](json& m) { m["groups"][0]["tensors"][1]["numel"] = kMaxU64; }, "ends past its group's numel 2560"},
        // 2^64 - 1 bytes in 1 MiB chunks: 2^44 of them, not (bytes + chunk - 1) wrapped to 0.
        ManifestDamage{"AChunkCountThatWouldWrapIsCountedRight",
                       [](json& m) {
                         m["files"][1]["bytes"] = kMaxU64;
                         m["files"][1]["segments"][0]["bytes"] = kMaxU64;
                       },
                       "has 1 checksums for 17592186044416 chunks"}),
    [](const ::testing::TestParamInfo<ManifestDamage>& info) { return info.param.name; });

}  // namespace
}  // namespace strata
