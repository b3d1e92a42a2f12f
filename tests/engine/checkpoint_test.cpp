// Checkpoints at the file level: round trips, resharding N -> M ranks, damaged files
// (truncated, corrupted, a bad manifest), interrupted saves (a crashed process, a failing
// step), a disk that fills during a save, re-saving a step, pruning, and concurrent
// submits from rank threads.
#include "engine/checkpoint.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <cmath>
#include <mutex>
#include <optional>
#include <thread>

#include "engine/core/check.h"
#include "engine/local_cluster.h"
#include "examples/models/linear_stack.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using Kind = CheckpointStateKind;
constexpr std::array<Kind, 3> kKinds = {Kind::kMaster, Kind::kExpAvg, Kind::kExpAvgSq};

// Groups with sizes that fill no shard evenly: 1 element, a few odd tensors, one larger
// than a checksum chunk of the tests (64 KiB = 16384 floats) so reads cross chunks.
std::vector<GroupSpec> test_groups() {
  std::vector<GroupSpec> specs;
  specs.push_back({"tiny", {{"scale", {1}}}});
  specs.push_back({"block.0", {{"w", {37, 29}}, {"b", {29}}, {"gain", {3, 5, 7}}}});
  specs.push_back({"big", {{"w", {131, 257}}, {"b", {257}}}});
  specs.push_back({"odd", {{"v", {4099}}}});
  return specs;
}

std::vector<GroupLayout> layouts_for(int world_size) {
  std::vector<GroupLayout> layouts;
  const auto specs = test_groups();
  for (size_t g = 0; g < specs.size(); ++g) {
    auto layout = layout_group(specs[g], static_cast<int>(g), world_size);
    STRATA_CHECK_OK(layout);
    layouts.push_back(*layout);
  }
  return layouts;
}

// The value a test model holds at flat element e of group g's `kind` state (0 in padding),
// salted so that two saves of "different steps" differ.
float state_value(int group, Kind kind, size_t element, uint32_t salt) {
  uint64_t x = (static_cast<uint64_t>(group) << 48) ^ (static_cast<uint64_t>(kind) << 40) ^ element ^
               (static_cast<uint64_t>(salt) << 32);
  x += 0x9e3779b97f4a7c15ull;
  x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
  x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
  x ^= x >> 31;
  return static_cast<float>(static_cast<double>(x >> 11) / static_cast<double>(1ull << 53) * 2.0 - 1.0);
}

RankSnapshot make_snapshot(int rank, int world_size, uint32_t salt, int64_t engine_steps = 7,
                           StaleParameters stale = StaleParameters::kAbsent) {
  auto snapshot = RankSnapshot::allocate(layouts_for(world_size), rank, engine_steps, stale);
  STRATA_CHECK_OK(snapshot);
  std::vector<Kind> kinds(kKinds.begin(), kKinds.end());
  if (stale == StaleParameters::kPresent) kinds.push_back(Kind::kStaleParams);
  for (int g = 0; g < snapshot->group_count(); ++g) {
    const GroupLayout& layout = snapshot->layouts()[static_cast<size_t>(g)];
    for (Kind kind : kinds) {
      std::span<float> shard = snapshot->shard(g, kind);
      for (size_t i = 0; i < shard.size(); ++i) {
        const size_t element = layout.shard_begin(rank) + i;
        shard[i] = element < layout.numel ? state_value(g, kind, element, salt) : 0.0f;
      }
    }
  }
  return std::move(snapshot).value();
}

CheckpointSaverOptions saver_options(const std::string& dir, int world_size) {
  CheckpointSaverOptions options;
  options.directory = dir;
  options.world_size = world_size;
  options.chunk_bytes = 64 << 10;  // several chunks per segment
  options.io.queue_depth = 4;
  return options;
}

// Saves one checkpoint of `world_size` ranks (snapshots built on this thread).
Status save_checkpoint(const std::string& dir, int world_size, int64_t step, uint32_t salt,
                       const std::string& trainer_state = R"({"step": 0})") {
  STRATA_ASSIGN_OR_RETURN(auto saver, CheckpointSaver::create(saver_options(dir, world_size)));
  for (int rank = 0; rank < world_size; ++rank) STRATA_RETURN_IF_ERROR(saver->submit(step, make_snapshot(rank, world_size, salt)));
  STRATA_RETURN_IF_ERROR(saver->submit_trainer_state(step, trainer_state));
  return saver->finish();
}

// Checks that rank `rank` of `world_size` reads exactly the state saved with `salt`.
void expect_shards_match(const CheckpointReader& reader, int world_size, uint32_t salt) {
  const std::vector<GroupLayout> layouts = layouts_for(world_size);
  std::vector<float> shard;
  for (int rank = 0; rank < world_size; ++rank) {
    for (const GroupLayout& layout : layouts) {
      STRATA_ASSERT_OK(reader.check_layout(layout));
      shard.assign(layout.shard_numel, -99.0f);
      for (Kind kind : kKinds) {
        STRATA_ASSERT_OK(reader.load_shard(layout.id, kind, rank, world_size, shard));
        size_t mismatches = 0;
        for (size_t i = 0; i < shard.size(); ++i) {
          const size_t element = layout.shard_begin(rank) + i;
          const float expected = element < layout.numel ? state_value(layout.id, kind, element, salt) : 0.0f;
          if (std::memcmp(&shard[i], &expected, sizeof(float)) != 0) ++mismatches;
        }
        EXPECT_EQ(mismatches, 0u) << "group " << layout.name << " " << checkpoint_state_kind_name(kind) << " rank " << rank
                                  << " of " << world_size;
      }
    }
  }
}

void flip_byte(const std::string& path, uint64_t offset) {
  std::fstream file(path, std::ios::in | std::ios::out | std::ios::binary);
  ASSERT_TRUE(file) << path;
  file.seekg(static_cast<std::streamoff>(offset));
  char byte = 0;
  file.read(&byte, 1);
  byte = static_cast<char>(byte ^ 0x10);
  file.seekp(static_cast<std::streamoff>(offset));
  file.write(&byte, 1);
}

using testing::contains;

// ---------------------------------------------------------------------------------------

TEST(CheckpointTest, RoundTripIsBitExact) {
  testing::TempDir dir;
  const std::string state = R"({"step": 3, "loss_scale": 65536.0, "rng": [1, 2, 3], "data_position": 12})";
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 3, 11, state));
  EXPECT_TRUE(fs::exists(dir.path() / "step-3" / "manifest.json"));
  EXPECT_TRUE(fs::exists(dir.path() / "step-3" / "rank-0-of-2.bin"));
  EXPECT_TRUE(fs::exists(dir.path() / "step-3" / "rank-1-of-2.bin"));
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp-step-3"));

  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(dir.str()));
  EXPECT_EQ(latest.step, 3);
  EXPECT_EQ(latest.path, (dir.path() / "step-3").string());
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(latest.path));
  EXPECT_EQ(reader->step(), 3);
  EXPECT_EQ(reader->engine_steps(), 7);
  EXPECT_EQ(reader->world_size(), 2);
  EXPECT_EQ(reader->trainer_state(), state);  // byte for byte
  ASSERT_EQ(reader->groups().size(), 4u);
  EXPECT_EQ(reader->groups()[1].name, "block.0");
  EXPECT_EQ(reader->groups()[1].tensors[2].shape, (std::vector<int64_t>{3, 5, 7}));
  STRATA_ASSERT_OK(reader->verify());
  expect_shards_match(*reader, 2, 11);
}

TEST(CheckpointTest, ReshardsTwoRanksOntoOneThreeAndFour) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 5, 21));
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open((dir.path() / "step-5").string()));
  for (int world : {1, 3, 4}) {
    SCOPED_TRACE("loading on " + std::to_string(world) + " ranks");
    expect_shards_match(*reader, world, 21);
  }
  // And back: 4 ranks saved, 2 and 1 load.
  testing::TempDir four;
  STRATA_ASSERT_OK(save_checkpoint(four.str(), 4, 6, 22));
  STRATA_ASSERT_OK_AND_ASSIGN(auto from_four, CheckpointReader::open((four.path() / "step-6").string()));
  for (int world : {1, 2}) expect_shards_match(*from_four, world, 22);
  // Arbitrary ranges, including ones that run into the padding.
  const size_t numel = from_four->groups()[3].numel;  // 4099
  std::vector<float> range(300, -1.0f);
  STRATA_ASSERT_OK(from_four->read_range(3, Kind::kExpAvg, numel - 100, range));
  for (size_t i = 0; i < range.size(); ++i) {
    const size_t element = numel - 100 + i;
    EXPECT_EQ(range[i], element < numel ? state_value(3, Kind::kExpAvg, element, 22) : 0.0f) << element;
  }
  // Shards that do not cover the group are refused.
  std::vector<float> small(10);
  EXPECT_EQ(from_four->load_shard(3, Kind::kMaster, 0, 2, small).code(), StatusCode::kInvalidArgument);
}

// A delayed-mode save carries the stale parameters as a fourth segment per group
// (format version 2, declared in the manifest) and reshards like the other kinds; a save
// without them stays format version 1 at 12 bytes per element, as before.
TEST(CheckpointTest, StaleParametersAreAnOptionalFourthSegmentAndExactSavesStayVersion1) {
  testing::TempDir dir;
  const std::string delayed_dir = (dir.path() / "delayed").string(), exact_dir = (dir.path() / "exact").string();
  {
    STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(saver_options(delayed_dir, 2)));
    for (int rank = 0; rank < 2; ++rank)
      STRATA_ASSERT_OK(saver->submit(5, make_snapshot(rank, 2, 3, 7, StaleParameters::kPresent)));
    STRATA_ASSERT_OK(saver->submit_trainer_state(5, "{}"));
    STRATA_ASSERT_OK(saver->finish());
  }
  STRATA_ASSERT_OK(save_checkpoint(exact_dir, 2, 5, 3));

  size_t shard_elements = 0;
  for (const GroupLayout& layout : layouts_for(2)) shard_elements += layout.shard_numel;
  const std::string delayed_path = checkpoint_path(delayed_dir, 5), exact_path = checkpoint_path(exact_dir, 5);
  const std::string delayed_manifest = [&] {
    std::ifstream in(delayed_path + "/manifest.json");
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  const std::string exact_manifest = [&] {
    std::ifstream in(exact_path + "/manifest.json");
    return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  }();
  EXPECT_TRUE(contains(delayed_manifest, "\"version\": 2")) << delayed_manifest.substr(0, 300);
  EXPECT_TRUE(contains(delayed_manifest, "\"stale_parameters\": true"));
  EXPECT_TRUE(contains(delayed_manifest, "\"state\": \"stale_params\""));
  EXPECT_TRUE(contains(exact_manifest, "\"version\": 1"));
  EXPECT_FALSE(contains(exact_manifest, "stale"));
  EXPECT_EQ(std::filesystem::file_size(exact_path + "/rank-0-of-2.bin"), shard_elements * 12);
  EXPECT_EQ(std::filesystem::file_size(delayed_path + "/rank-0-of-2.bin"), shard_elements * 16);

  STRATA_ASSERT_OK_AND_ASSIGN(auto delayed, CheckpointReader::open(delayed_path));
  STRATA_ASSERT_OK(delayed->verify());
  EXPECT_TRUE(delayed->has_stale_parameters());
  for (int world : {1, 2, 3}) {
    expect_shards_match(*delayed, world, 3);
    for (const GroupLayout& layout : layouts_for(world)) {
      std::vector<float> shard(layout.shard_numel);
      for (int rank = 0; rank < world; ++rank) {
        STRATA_ASSERT_OK(delayed->load_shard(layout.id, Kind::kStaleParams, rank, world, shard));
        size_t mismatches = 0;
        for (size_t i = 0; i < shard.size(); ++i) {
          const size_t element = layout.shard_begin(rank) + i;
          const float expected = element < layout.numel ? state_value(layout.id, Kind::kStaleParams, element, 3) : 0.0f;
          mismatches += std::memcmp(&shard[i], &expected, sizeof(float)) != 0;
        }
        EXPECT_EQ(mismatches, 0u) << layout.name << " rank " << rank << " of " << world;
      }
    }
  }
  STRATA_ASSERT_OK_AND_ASSIGN(auto exact, CheckpointReader::open(exact_path));
  EXPECT_FALSE(exact->has_stale_parameters());
  std::vector<float> shard(layouts_for(2)[0].shard_numel);
  const Status missing = exact->load_shard(0, Kind::kStaleParams, 0, 2, shard);
  EXPECT_EQ(missing.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(missing.message(), "stale_params")) << missing.to_string();

  // The ranks of one save agree on it.
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(saver_options((dir.path() / "mixed").string(), 2)));
  STRATA_ASSERT_OK(saver->submit(1, make_snapshot(0, 2, 3, 7, StaleParameters::kPresent)));
  const Status mixed = saver->submit(1, make_snapshot(1, 2, 3, 7));
  EXPECT_EQ(mixed.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(mixed.message(), "stale parameters")) << mixed.to_string();
}

TEST(CheckpointTest, LayoutMismatchIsNamed) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 1, 1, 1));
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open((dir.path() / "step-1").string()));
  auto specs = test_groups();
  specs[1].tensors[0].shape = {37, 30};
  STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout changed, layout_group(specs[1], 1, 1));
  const Status status = reader->check_layout(changed);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(status.message(), "'w' [37, 29]")) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "'w' [37, 30]")) << status.to_string();
  specs[1].name = "block.9";
  STRATA_ASSERT_OK_AND_ASSIGN(GroupLayout renamed, layout_group(specs[1], 1, 1));
  EXPECT_TRUE(contains(reader->check_layout(renamed).message(), "'block.9'"));
}

TEST(CheckpointTest, TruncatedFileIsDetectedAndSkipped) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 1, 1));
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 2, 2));
  const fs::path victim = dir.path() / "step-2" / "rank-1-of-2.bin";
  const auto size = fs::file_size(victim);
  fs::resize_file(victim, size - 4096);

  auto reader = CheckpointReader::open((dir.path() / "step-2").string());
  ASSERT_FALSE(reader.ok());
  EXPECT_EQ(reader.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(contains(reader.status().message(), victim.string() + " is truncated")) << reader.status().to_string();
  EXPECT_TRUE(contains(reader.status().message(), "it has " + std::to_string(size - 4096) + " bytes, the manifest says " +
                                                      std::to_string(size)))
      << reader.status().to_string();

  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(dir.str()));
  EXPECT_EQ(latest.step, 1);
  STRATA_ASSERT_OK_AND_ASSIGN(auto previous, CheckpointReader::open(latest.path));
  expect_shards_match(*previous, 2, 1);
}

TEST(CheckpointTest, CorruptedByteFailsItsChecksum) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 1, 1));
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 2, 2));
  const fs::path victim = dir.path() / "step-2" / "rank-0-of-2.bin";
  // Group 2 ("big") starts after groups 0 and 1 (3 kinds x 2048 floats x 4 bytes each per
  // rank); flip a byte inside its master segment.
  const uint64_t offset = 2 * 3 * 2048 * 4 + 5000;
  flip_byte(victim.string(), offset);

  // Opening checks sizes only; the damage shows on the read that touches it.
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open((dir.path() / "step-2").string()));
  std::vector<float> shard(layouts_for(2)[2].shard_numel);
  const Status status = reader->load_shard(2, Kind::kMaster, 0, 2, shard);
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "checksum mismatch in " + victim.string())) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "'big', master")) << status.to_string();
  // Ranges that do not touch the damaged chunk still read.
  STRATA_EXPECT_OK(reader->load_shard(2, Kind::kExpAvg, 0, 2, shard));
  STRATA_EXPECT_OK(reader->load_shard(2, Kind::kMaster, 1, 2, shard));
  EXPECT_EQ(reader->verify().code(), StatusCode::kDataLoss);

  // latest_complete skips it (and, told not to verify, does not notice).
  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(dir.str()));
  EXPECT_EQ(latest.step, 1);
  LatestCompleteOptions sizes_only;
  sizes_only.verify_checksums = false;
  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef unverified, latest_complete(dir.str(), sizes_only));
  EXPECT_EQ(unverified.step, 2);
}

TEST(CheckpointTest, DamagedManifestOrTrainerStateIsDetected) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 1, 1, 1));
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 1, 2, 2, R"({"step": 2})"));
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 1, 3, 3, R"({"step": 3})"));
  // step-3: a digit of the manifest changed (still valid JSON).
  const fs::path manifest = dir.path() / "step-3" / "manifest.json";
  std::string text;
  {
    std::ifstream in(manifest);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = text.find("\"engine_steps\": 7");
  ASSERT_NE(at, std::string::npos) << text.substr(0, 300);
  text[at + 16] = '8';
  {
    std::ofstream out(manifest, std::ios::trunc);
    out << text;
  }
  auto damaged = CheckpointReader::open((dir.path() / "step-3").string());
  ASSERT_FALSE(damaged.ok());
  EXPECT_EQ(damaged.status().code(), StatusCode::kDataLoss);
  EXPECT_TRUE(contains(damaged.status().message(), "checksum mismatch of the manifest")) << damaged.status().to_string();
  // step-2: the trainer state changed in place (same size).
  flip_byte((dir.path() / "step-2" / "trainer_state.json").string(), 3);
  auto bad_state = CheckpointReader::open((dir.path() / "step-2").string());
  ASSERT_FALSE(bad_state.ok());
  EXPECT_TRUE(contains(bad_state.status().message(), "checksum mismatch in")) << bad_state.status().to_string();
  EXPECT_TRUE(contains(bad_state.status().message(), "trainer_state.json")) << bad_state.status().to_string();

  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(dir.str()));
  EXPECT_EQ(latest.step, 1);
  // Nothing complete at all: kNotFound naming what was skipped.
  fs::remove(dir.path() / "step-1" / "manifest.json");
  auto none = latest_complete(dir.str());
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.status().code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(none.status().message(), "step-1: checkpoint")) << none.status().to_string();
  EXPECT_TRUE(contains(none.status().message(), "has no manifest.json")) << none.status().to_string();
  EXPECT_EQ(latest_complete((dir.path() / "nowhere").string()).status().code(), StatusCode::kNotFound);
}

// A save that dies part-way (the process killed at a point inside the save) leaves only
// a .tmp directory: latest_complete picks the previous checkpoint, and a later save of the
// same step clears the leftovers.
class CheckpointCrashTest : public ::testing::TestWithParam<std::string> {};

TEST_P(CheckpointCrashTest, KilledDuringSaveLeavesThePreviousCheckpoint) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 1, 1));
  const std::string crash_point = GetParam();
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    // The child: save step 2 and die at the crash point (no gtest assertions here).
    CheckpointSaverOptions options = saver_options(dir.str(), 2);
    options.fault_hook = [&](std::string_view point, int64_t) -> Status {
      if (point == crash_point) ::raise(SIGKILL);
      return Status::Ok();
    };
    auto saver = CheckpointSaver::create(options);
    STRATA_CHECK_OK(saver);
    STRATA_CHECK_OK((*saver)->submit(2, make_snapshot(0, 2, 2)));
    STRATA_CHECK_OK((*saver)->submit(2, make_snapshot(1, 2, 2)));
    STRATA_CHECK_OK((*saver)->submit_trainer_state(2, "{}"));
    STRATA_CHECK_OK((*saver)->finish());
    ::_exit(3);  // the crash point was never reached
  }
  int wait_status = 0;
  ASSERT_EQ(::waitpid(child, &wait_status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(wait_status)) << "child exited with " << WEXITSTATUS(wait_status);
  EXPECT_EQ(WTERMSIG(wait_status), SIGKILL);
  EXPECT_TRUE(fs::exists(dir.path() / ".tmp-step-2"));
  EXPECT_FALSE(fs::exists(dir.path() / "step-2"));

  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(dir.str()));
  EXPECT_EQ(latest.step, 1);
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(latest.path));
  expect_shards_match(*reader, 2, 1);

  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 2, 2));
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp-step-2"));
  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef newest, latest_complete(dir.str()));
  EXPECT_EQ(newest.step, 2);
}

INSTANTIATE_TEST_SUITE_P(CrashPoints, CheckpointCrashTest,
                         ::testing::Values("rank_file_open", "rank_file_written", "before_manifest", "before_rename"),
                         [](const auto& info) { return info.param; });

TEST(CheckpointTest, FailedSaveReportsAtWaitAndCleansUp) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 2, 1, 1));
  CheckpointSaverOptions options = saver_options(dir.str(), 2);
  options.fault_hook = [](std::string_view point, int64_t step) -> Status {
    if (point == "before_rename" && step == 2) return IoError("injected failure before the rename");
    return Status::Ok();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
  for (int rank = 0; rank < 2; ++rank) STRATA_ASSERT_OK(saver->submit(2, make_snapshot(rank, 2, 2)));
  STRATA_ASSERT_OK(saver->submit_trainer_state(2, "{}"));
  const Status status = saver->wait();
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(status.to_string(), "injected failure")) << status.to_string();
  EXPECT_TRUE(contains(status.to_string(), "checkpoint step 2 in " + dir.str() + " was not saved")) << status.to_string();
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp-step-2"));
  EXPECT_FALSE(fs::exists(dir.path() / "step-2"));
  // The error was handed over once; the saver keeps working.
  for (int rank = 0; rank < 2; ++rank) STRATA_ASSERT_OK(saver->submit(3, make_snapshot(rank, 2, 3)));
  STRATA_ASSERT_OK(saver->submit_trainer_state(3, "{}"));
  STRATA_ASSERT_OK(saver->finish());
  EXPECT_EQ(saver->last_committed_step(), 3);
  EXPECT_EQ(saver->submit(4, make_snapshot(0, 2, 4)).code(), StatusCode::kFailedPrecondition);
}

TEST(CheckpointTest, FinishAbandonsASaveThatNeverGotAllRanks) {
  testing::TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(saver_options(dir.str(), 2)));
  STRATA_ASSERT_OK(saver->submit(1, make_snapshot(0, 2, 1)));
  const Status status = saver->finish();
  EXPECT_EQ(status.code(), StatusCode::kCancelled);
  EXPECT_TRUE(contains(status.message(), "never received 1, the trainer state")) << status.to_string();
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp-step-1"));
  EXPECT_FALSE(latest_complete(dir.str()).ok());
}

TEST(CheckpointTest, SubmitValidation) {
  testing::TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(saver_options(dir.str(), 2)));
  EXPECT_EQ(saver->submit(1, make_snapshot(0, 1, 1)).code(), StatusCode::kInvalidArgument);  // world size 1 != 2
  STRATA_ASSERT_OK(saver->submit(1, make_snapshot(0, 2, 1)));
  const Status twice = saver->submit(1, make_snapshot(0, 2, 1));
  EXPECT_TRUE(contains(twice.message(), "already submitted")) << twice.to_string();
  const Status steps = saver->submit(1, make_snapshot(1, 2, 1, /*engine_steps=*/8));
  EXPECT_TRUE(contains(steps.message(), "engine step count 8")) << steps.to_string();
  const Status not_json = saver->submit_trainer_state(1, "{oops");
  EXPECT_TRUE(contains(not_json.message(), "not valid JSON")) << not_json.to_string();
  STRATA_ASSERT_OK(saver->submit(1, make_snapshot(1, 2, 1)));
  STRATA_ASSERT_OK(saver->submit_trainer_state(1, "[]"));
  STRATA_ASSERT_OK(saver->wait());
  EXPECT_EQ(saver->last_committed_step(), 1);
  EXPECT_GT(saver->bytes_written(), 2u * 3 * 4 * 2048 * 4);
  EXPECT_FALSE(CheckpointSaver::create(saver_options("", 1)).ok());
  CheckpointSaverOptions bad_chunk = saver_options(dir.str(), 1);
  bad_chunk.chunk_bytes = 1000;
  EXPECT_FALSE(CheckpointSaver::create(bad_chunk).ok());
}

TEST(CheckpointTest, ResavingAStepReplacesItAndKeepLastPrunes) {
  testing::TempDir dir;
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 1, 4, 40));
  STRATA_ASSERT_OK(save_checkpoint(dir.str(), 1, 4, 41));  // same step again: replaced atomically
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open((dir.path() / "step-4").string()));
  expect_shards_match(*reader, 1, 41);
  EXPECT_FALSE(fs::exists(dir.path() / ".tmp-step-4"));

  CheckpointSaverOptions options = saver_options(dir.str(), 1);
  options.keep_last = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
  for (int64_t step : {5, 6, 7}) {
    STRATA_ASSERT_OK(saver->submit(step, make_snapshot(0, 1, static_cast<uint32_t>(step))));
    STRATA_ASSERT_OK(saver->submit_trainer_state(step, "{}"));
  }
  STRATA_ASSERT_OK(saver->finish());
  EXPECT_FALSE(fs::exists(dir.path() / "step-4"));
  EXPECT_FALSE(fs::exists(dir.path() / "step-5"));
  EXPECT_TRUE(fs::exists(dir.path() / "step-6"));
  EXPECT_TRUE(fs::exists(dir.path() / "step-7"));
}

TEST(CheckpointTest, RankThreadsSubmitConcurrently) {
  testing::TempDir dir;
  constexpr int kWorld = 4;
  CheckpointSaverOptions options = saver_options(dir.str(), kWorld);
  options.max_pending_saves = 1;  // the next step's first submit waits for the previous save
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
  std::vector<std::thread> threads;
  std::vector<Status> results(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      for (int64_t step = 1; step <= 3; ++step) {
        Status status = saver->submit(step, make_snapshot(rank, kWorld, static_cast<uint32_t>(100 + step)));
        if (status.ok() && rank == kWorld - 1) status = saver->submit_trainer_state(step, "{\"step\": " + std::to_string(step) + "}");
        if (!status.ok()) {
          results[static_cast<size_t>(rank)] = status;
          return;
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (const Status& status : results) STRATA_EXPECT_OK(status);
  STRATA_ASSERT_OK(saver->finish());
  for (int64_t step = 1; step <= 3; ++step) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open((dir.path() / ("step-" + std::to_string(step))).string()));
    EXPECT_EQ(reader->trainer_state(), "{\"step\": " + std::to_string(step) + "}");
    STRATA_ASSERT_OK(reader->verify());
    expect_shards_match(*reader, 2, static_cast<uint32_t>(100 + step));
  }
}

// A small tmpfs the test mounts (root only): a save that does not fit fails naming ENOSPC
// and the file, and the previous checkpoint stays loadable.
TEST(CheckpointTest, DiskFullDuringSaveKeepsThePreviousCheckpoint) {
  testing::TempDir dir;
  const fs::path mount_point = dir.path() / "small";
  const testing::ScopedTmpfs tmpfs(mount_point, "size=4m");
  if (!tmpfs.mounted) {
    GTEST_SKIP() << "cannot mount a tmpfs at " << mount_point << " (" << std::strerror(errno)
                 << "): this test needs root (CAP_SYS_ADMIN)";
  }

  const std::string save_dir = (mount_point / "ckpt").string();
  STRATA_ASSERT_OK(save_checkpoint(save_dir, 2, 1, 1));
  const uint64_t one_checkpoint = fs::file_size(fs::path(save_dir) / "step-1" / "rank-0-of-2.bin") * 2;
  // Fill the disk until less than one more checkpoint fits.
  const fs::space_info space = fs::space(mount_point);
  const uint64_t filler_bytes = space.available - one_checkpoint / 2;
  {
    const int fd = ::open((mount_point / "filler").c_str(), O_WRONLY | O_CREAT, 0644);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::fallocate(fd, 0, 0, static_cast<off_t>(filler_bytes)), 0) << std::strerror(errno);
    ::close(fd);
  }
  const Status status = save_checkpoint(save_dir, 2, 2, 2);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted) << status.to_string();
  EXPECT_TRUE(contains(status.to_string(), "No space left on device")) << status.to_string();
  EXPECT_TRUE(contains(status.to_string(), "/.tmp-step-2/rank-")) << status.to_string();
  EXPECT_TRUE(contains(status.to_string(), "checkpoint step 2 in " + save_dir + " was not saved")) << status.to_string();
  EXPECT_FALSE(fs::exists(fs::path(save_dir) / ".tmp-step-2"));  // the partial save's space is given back

  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(save_dir));
  EXPECT_EQ(latest.step, 1);
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(latest.path));
  expect_shards_match(*reader, 2, 1);
  expect_shards_match(*reader, 3, 1);
}


// ---------------------------------------------------------------------------------------
// Through the engine: save from a running engine, resume on the same or another world size.

struct TrainSegment {
  int world = 2;
  int first_step = 0;
  int end_step = 0;                       // trains steps [first_step, end_step)
  int save_after = -1;                    // save a checkpoint once this many steps are done
  const CheckpointReader* resume = nullptr;
  Tier optimizer_tier = Tier::kPinned;
  Tier param_tier = Tier::kPinned;
  DType param_dtype = DType::kFloat32;
  OverlapMode overlap = OverlapMode::kExact;
  bool loss_scaling = false;              // dynamic loss scaling, growing every 2 clean steps
};

struct TrainResult {
  std::vector<std::vector<float>> masters;  // per group, the unpadded flat fp32 master
  int64_t steps_taken_after_load = -1;
  float final_loss_scale = 0.0f;
};

models::LinearStackConfig checkpoint_model() {
  models::LinearStackConfig model;
  model.features = 24;
  model.width = 40;
  model.layers = 3;
  model.global_rows = 8;
  return model;
}

StatusOr<TrainResult> train_segment(const TrainSegment& segment, const std::string& work_dir, CheckpointSaver* saver) {
  LocalClusterOptions cluster_options;
  cluster_options.world_size = segment.world;
  cluster_options.device_budget_bytes = size_t{256} << 20;
  cluster_options.compute_threads = 1;
  cluster_options.collective_timeout = std::chrono::seconds(60);
  STRATA_ASSIGN_OR_RETURN(auto cluster, LocalCluster::create(cluster_options));
  const models::LinearStackConfig model_config = checkpoint_model();
  TrainResult result;
  const auto specs = models::linear_stack_groups(model_config);
  for (size_t g = 0; g < specs.size(); ++g) {
    STRATA_ASSIGN_OR_RETURN(GroupLayout layout, layout_group(specs[g], static_cast<int>(g), 1));
    result.masters.emplace_back(layout.numel);
  }
  std::mutex mutex;
  STRATA_RETURN_IF_ERROR(cluster->run([&](int rank) -> Status {
    EngineOptions options;
    options.rank = rank;
    options.world_size = segment.world;
    options.param_dtype = segment.param_dtype;
    options.grad_wire_dtype = DType::kFloat32;
    options.grad_transfer_dtype = DType::kFloat32;
    options.param_tier = segment.param_tier;
    options.optimizer_tier = segment.optimizer_tier;
    options.overlap = segment.overlap;
    options.nvme_path = work_dir + "/nvme-" + std::to_string(segment.world);
    options.adam.lr = 1e-2;
    options.adam.weight_decay = 0.01;
    options.gradient_clipping = 1.0f;
    options.seed = 99;
    options.optimizer_threads = 1;
    options.fp16_loss_scaling = segment.loss_scaling;
    options.loss_scaler.initial_scale = 65536.0f;
    options.loss_scaler.growth_interval = 2;
    options.activation_bytes = models::linear_stack_activation_bytes(model_config, model_config.global_rows / segment.world,
                                                                     options.param_dtype);
    STRATA_ASSIGN_OR_RETURN(auto engine, Engine::create(options, cluster->device(rank), cluster->gather_communicator(rank),
                                                        cluster->reduce_communicator(rank)));
    STRATA_ASSIGN_OR_RETURN(auto model, models::LinearStackModel::create(*engine, model_config, rank, segment.world, true));
    STRATA_RETURN_IF_ERROR(engine->start());
    STRATA_RETURN_IF_ERROR(model->allocate());
    if (segment.resume != nullptr) {
      STRATA_RETURN_IF_ERROR(load_engine_state(*engine, rank, *segment.resume));
      if (rank == 0) result.steps_taken_after_load = engine->steps_taken();
    }
    for (int step = segment.first_step; step < segment.end_step; ++step) {
      STRATA_RETURN_IF_ERROR(model->train_step(step, 1, 1e-2).status());
      if (step + 1 == segment.save_after) {
        STRATA_ASSIGN_OR_RETURN(RankSnapshot snapshot, snapshot_engine_state(*engine, rank));
        STRATA_RETURN_IF_ERROR(saver->submit(step + 1, std::move(snapshot)));
        if (rank == 0) STRATA_RETURN_IF_ERROR(saver->submit_trainer_state(step + 1, "{\"next_step\": " + std::to_string(step + 1) + "}"));
      }
    }
    STRATA_RETURN_IF_ERROR(engine->finish());
    if (rank == 0) result.final_loss_scale = engine->loss_scale();
    std::vector<float> shard;
    for (int g = 0; g < engine->group_count(); ++g) {
      const GroupLayout& layout = engine->layout(g);
      shard.resize(layout.shard_numel);
      STRATA_RETURN_IF_ERROR(engine->read_state_shard(g, Engine::StateKind::kMaster, shard));
      std::lock_guard<std::mutex> lock(mutex);
      for (size_t i = 0; i < layout.shard_numel && layout.shard_begin(rank) + i < layout.numel; ++i) {
        result.masters[static_cast<size_t>(g)][layout.shard_begin(rank) + i] = shard[i];
      }
    }
    return Status::Ok();
  }));
  return result;
}

double relative_error(const std::vector<float>& a, const std::vector<float>& b) {
  double diff = 0.0, norm = 0.0;
  for (size_t i = 0; i < a.size(); ++i) {
    diff += (static_cast<double>(a[i]) - b[i]) * (static_cast<double>(a[i]) - b[i]);
    norm += static_cast<double>(b[i]) * b[i];
  }
  return std::sqrt(diff / std::max(norm, 1e-30));
}

// A run resumed on `world` ranks from a checkpoint saved on 2 against the straight run:
// bit for bit on the saving world size; resharded sums round differently elsewhere.
void expect_resumed_masters(const TrainResult& result, const TrainResult& reference, int world) {
  for (size_t g = 0; g < reference.masters.size(); ++g) {
    if (world == 2) {
      EXPECT_EQ(std::memcmp(result.masters[g].data(), reference.masters[g].data(), reference.masters[g].size() * 4), 0)
          << "group " << g << " differs after resuming on the saving world size";
    } else {
      EXPECT_LT(relative_error(result.masters[g], reference.masters[g]), 1e-5) << "group " << g;
    }
  }
}

// Trains `straight` on 2 ranks, saving into `save_dir` (the save overlaps later steps).
StatusOr<TrainResult> train_and_save(const TrainSegment& straight, const std::string& save_dir, const std::string& work_dir) {
  CheckpointSaverOptions options;
  options.directory = save_dir;
  options.world_size = 2;
  STRATA_ASSIGN_OR_RETURN(auto saver, CheckpointSaver::create(options));
  STRATA_ASSIGN_OR_RETURN(TrainResult result, train_segment(straight, work_dir, saver.get()));
  STRATA_RETURN_IF_ERROR(saver->finish());
  return result;
}

class CheckpointEngineTest : public ::testing::TestWithParam<Tier> {};

TEST_P(CheckpointEngineTest, ResumeContinuesBitIdenticallyAndOnOtherWorldSizes) {
  testing::TempDir dir;
  const std::string save_dir = (dir.path() / "ckpt").string();
  // Straight: 5 steps on 2 ranks, saving after 3 (the save overlaps steps 4 and 5).
  TrainSegment straight;
  straight.end_step = 5;
  straight.save_after = 3;
  straight.optimizer_tier = GetParam();
  STRATA_ASSERT_OK_AND_ASSIGN(TrainResult reference, train_and_save(straight, save_dir, dir.str() + "/a"));

  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(save_dir));
  EXPECT_EQ(latest.step, 3);
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(latest.path));
  EXPECT_EQ(reader->engine_steps(), 3);
  EXPECT_EQ(reader->trainer_state(), "{\"next_step\": 3}");

  for (int world : {2, 1, 4}) {
    SCOPED_TRACE("resumed on " + std::to_string(world) + " ranks");
    TrainSegment resumed;
    resumed.world = world;
    resumed.first_step = 3;
    resumed.end_step = 5;
    resumed.resume = reader.get();
    resumed.optimizer_tier = GetParam();
    STRATA_ASSERT_OK_AND_ASSIGN(TrainResult result, train_segment(resumed, dir.str() + "/b", nullptr));
    EXPECT_EQ(result.steps_taken_after_load, 3);
    expect_resumed_masters(result, reference, world);
  }
}

// The dynamic loss scaler's state travels in the manifest: a resumed run's scale grows
// where the straight run's does (the scale cancels exactly in the update, so the weights
// alone would not show a lost scale).
TEST(CheckpointLossScalerTest, ResumeRestoresTheLossScaler) {
  testing::TempDir dir;
  const std::string save_dir = (dir.path() / "ckpt").string();
  TrainSegment straight;
  straight.end_step = 5;
  straight.save_after = 3;
  straight.loss_scaling = true;
  STRATA_ASSERT_OK_AND_ASSIGN(TrainResult reference, train_and_save(straight, save_dir, dir.str() + "/a"));
  // 65536 grows after steps 2 and 4.
  EXPECT_EQ(reference.final_loss_scale, 262144.0f);

  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(checkpoint_path(save_dir, 3)));
  ASSERT_TRUE(reader->loss_scaler().has_value());
  EXPECT_EQ(reader->loss_scaler()->scale, 131072.0f);
  EXPECT_EQ(reader->loss_scaler()->clean_steps, 1);
  EXPECT_EQ(reader->loss_scaler()->skipped_steps, 0u);

  TrainSegment resumed;
  resumed.world = 1;
  resumed.first_step = 3;
  resumed.end_step = 5;
  resumed.resume = reader.get();
  resumed.loss_scaling = true;
  STRATA_ASSERT_OK_AND_ASSIGN(TrainResult result, train_segment(resumed, dir.str() + "/b", nullptr));
  EXPECT_EQ(result.final_loss_scale, reference.final_loss_scale);
  for (size_t g = 0; g < reference.masters.size(); ++g)
    EXPECT_LT(relative_error(result.masters[g], reference.masters[g]), 1e-5) << "group " << g;

  // A run without loss scaling resumes from it too, ignoring the saved scaler.
  resumed.loss_scaling = false;
  STRATA_ASSERT_OK(train_segment(resumed, dir.str() + "/c", nullptr).status());
}

// Delayed overlap: each step computes with parameters one update behind the masters.
// The checkpoint carries that stale copy, so a resumed run computes its first step with
// the parameters the straight run used and ends on the straight run's bits (on the saving
// world size; on others within rounding, as the reductions add in another order), for
// every tier the parameters and the optimizer state live in and either parameter dtype.
struct DelayedResumeCase {
  const char* name;
  Tier param_tier;
  Tier optimizer_tier;
  DType param_dtype;
};

class CheckpointDelayedResumeTest : public ::testing::TestWithParam<DelayedResumeCase> {};

// Saves after `saved_step` steps of a 6-step delayed run, resumes on 2, 1 and 4 ranks.
void expect_delayed_resume_is_exact(const DelayedResumeCase& tiers, int saved_step, const testing::TempDir& dir) {
  SCOPED_TRACE("saved after step " + std::to_string(saved_step));
  const std::string save_dir = (dir.path() / ("ckpt" + std::to_string(saved_step))).string();
  TrainSegment straight;
  straight.end_step = 6;
  straight.save_after = saved_step;
  straight.overlap = OverlapMode::kDelayed;
  straight.param_tier = tiers.param_tier;
  straight.optimizer_tier = tiers.optimizer_tier;
  straight.param_dtype = tiers.param_dtype;
  STRATA_ASSERT_OK_AND_ASSIGN(TrainResult reference, train_and_save(straight, save_dir, dir.str() + "/a"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(checkpoint_path(save_dir, saved_step)));
  EXPECT_TRUE(reader->has_stale_parameters());
  for (int world : {2, 1, 4}) {
    SCOPED_TRACE("resumed on " + std::to_string(world) + " ranks");
    TrainSegment resumed = straight;
    resumed.world = world;
    resumed.first_step = saved_step;
    resumed.save_after = -1;
    resumed.resume = reader.get();
    STRATA_ASSERT_OK_AND_ASSIGN(TrainResult result, train_segment(resumed, dir.str() + "/b" + std::to_string(world), nullptr));
    expect_resumed_masters(result, reference, world);
  }
}

// After one step the stale copy is the initial parameters; after three, an update's.
TEST_P(CheckpointDelayedResumeTest, ResumeContinuesBitIdentically) {
  testing::TempDir dir;
  for (int saved_step : {3, 1}) expect_delayed_resume_is_exact(GetParam(), saved_step, dir);
}

// Across overlap modes a checkpoint loads and trains on: an exact-mode run drops a
// delayed save's stale parameters (it computes with the masters), and a delayed-mode run
// from an exact save starts from the masters as a fresh delayed run does, so its first
// step is the exact run's step.
TEST(CheckpointOverlapTest, ACheckpointLoadsIntoTheOtherOverlapMode) {
  testing::TempDir dir;
  const std::string delayed_dir = (dir.path() / "delayed").string(), exact_dir = (dir.path() / "exact").string();
  TrainSegment straight;
  straight.end_step = 3;
  straight.save_after = 3;
  straight.overlap = OverlapMode::kDelayed;
  STRATA_ASSERT_OK(train_and_save(straight, delayed_dir, dir.str() + "/a").status());
  STRATA_ASSERT_OK_AND_ASSIGN(auto delayed, CheckpointReader::open(checkpoint_path(delayed_dir, 3)));
  ASSERT_TRUE(delayed->has_stale_parameters());

  // The exact run from the delayed save, saving again after one more step: that save is
  // an exact one (no stale parameters).
  TrainSegment exact_run;
  exact_run.first_step = 3;
  exact_run.end_step = 5;
  exact_run.save_after = 4;
  exact_run.resume = delayed.get();
  STRATA_ASSERT_OK_AND_ASSIGN(TrainResult from_delayed, train_and_save(exact_run, exact_dir, dir.str() + "/b"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto exact, CheckpointReader::open(checkpoint_path(exact_dir, 4)));
  EXPECT_FALSE(exact->has_stale_parameters());

  // The delayed run from that exact save: its first step (step 4) computes with the
  // masters, as the exact run's step 4 did, so after it the two agree bit for bit.
  TrainSegment delayed_run;
  delayed_run.first_step = 4;
  delayed_run.end_step = 5;
  delayed_run.overlap = OverlapMode::kDelayed;
  delayed_run.resume = exact.get();
  STRATA_ASSERT_OK_AND_ASSIGN(TrainResult from_exact, train_segment(delayed_run, dir.str() + "/c", nullptr));
  for (size_t g = 0; g < from_exact.masters.size(); ++g)
    EXPECT_EQ(std::memcmp(from_exact.masters[g].data(), from_delayed.masters[g].data(), from_exact.masters[g].size() * 4), 0)
        << "group " << g;
}

INSTANTIATE_TEST_SUITE_P(
    Placements, CheckpointDelayedResumeTest,
    ::testing::Values(DelayedResumeCase{"pinned_pinned_fp32", Tier::kPinned, Tier::kPinned, DType::kFloat32},
                      DelayedResumeCase{"pinned_pinned_bf16", Tier::kPinned, Tier::kPinned, DType::kBFloat16},
                      DelayedResumeCase{"device_device_bf16", Tier::kDevice, Tier::kDevice, DType::kBFloat16},
                      DelayedResumeCase{"nvme_nvme_bf16", Tier::kNvme, Tier::kNvme, DType::kBFloat16},
                      DelayedResumeCase{"pinned_device_fp32", Tier::kPinned, Tier::kDevice, DType::kFloat32}),
    [](const auto& info) { return std::string(info.param.name); });

INSTANTIATE_TEST_SUITE_P(OptimizerTiers, CheckpointEngineTest, ::testing::Values(Tier::kPinned, Tier::kNvme),
                         [](const auto& info) { return std::string(tier_name(info.param)); });

// ---------------------------------------------------------------------------------------
// Saves that fail loudly and early: the save directory checked and locked at create(),
// a failed save retried once and then reported by poll(), rotation that keeps a
// checkpoint to fall back to.
// ---------------------------------------------------------------------------------------

using testing::ScopedTmpfs;

TEST(CheckpointSaverChecksTest, ASecondSaverOnTheSameDirectoryIsRefusedWithTheHoldersPid) {
  testing::TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(auto first, CheckpointSaver::create(saver_options(dir.str(), 1)));
  auto second = CheckpointSaver::create(saver_options(dir.str(), 1));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(contains(second.status().message(), "save directory '" + dir.str() + "' is in use by another run")) << second.status().to_string();
  EXPECT_TRUE(contains(second.status().message(), "pid " + std::to_string(::getpid()))) << second.status().to_string();
  STRATA_ASSERT_OK(first->finish());
  first.reset();
  // Once the first saver is gone the directory is free again.
  STRATA_ASSERT_OK_AND_ASSIGN(auto third, CheckpointSaver::create(saver_options(dir.str(), 1)));
}

TEST(CheckpointSaverChecksTest, AReadOnlySaveDirectoryIsRefusedAtCreate) {
  testing::TempDir dir;
  const fs::path save = dir.path() / "ro";
  std::optional<ScopedTmpfs> tmpfs;
  if (::geteuid() == 0) {
    // Root writes through permission bits: a read-only mount it is.
    tmpfs.emplace(save, "size=1m,ro");
    if (!tmpfs->mounted) GTEST_SKIP() << "cannot mount a read-only tmpfs at " << save << " (" << std::strerror(errno) << ")";
  } else {
    fs::create_directories(save);
    fs::permissions(save, fs::perms::owner_read | fs::perms::owner_exec);
  }
  auto saver = CheckpointSaver::create(saver_options(save.string(), 1));
  if (!tmpfs) fs::permissions(save, fs::perms::owner_all);
  ASSERT_FALSE(saver.ok());
  EXPECT_EQ(saver.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(saver.status().message(), "save directory '" + save.string() + "' is not writable")) << saver.status().to_string();
}

TEST(CheckpointSaverChecksTest, TooLittleFreeSpaceForTwoCheckpointsIsRefusedAtCreateWithTheFigures) {
  testing::TempDir dir;
  ScopedTmpfs tmpfs(dir.path() / "small", "size=256k");
  if (!tmpfs.mounted) GTEST_SKIP() << "cannot mount a tmpfs (" << std::strerror(errno) << "): this test needs root (CAP_SYS_ADMIN)";
  CheckpointSaverOptions options = saver_options((tmpfs.path / "ckpt").string(), 1);
  options.checkpoint_elements = 10000;  // 120 KB a checkpoint: one fits, two do not
  auto saver = CheckpointSaver::create(options);
  ASSERT_FALSE(saver.ok());
  EXPECT_EQ(saver.status().code(), StatusCode::kFailedPrecondition);
  const std::string text = saver.status().message();
  EXPECT_TRUE(contains(text, "save directory '" + options.directory + "' has ")) << text;
  EXPECT_TRUE(contains(text, "2 checkpoints need")) << text;
  EXPECT_TRUE(contains(text, "12 B x 10000 parameters")) << text;
  options.checkpoint_elements = 4000;  // 48 KB + 64 KiB: two fit
  STRATA_ASSERT_OK_AND_ASSIGN(auto fits, CheckpointSaver::create(options));
}

TEST(CheckpointSaverChecksTest, AFailedSaveIsRetriedOnceAndCommits) {
  testing::TempDir dir;
  CheckpointSaverOptions options = saver_options(dir.str(), 2);
  std::atomic<int> failures{0};
  options.fault_hook = [&](std::string_view point, int64_t) -> Status {
    if (point == "before_manifest" && failures.fetch_add(1) == 0) return IoError("injected failure, once");
    return Status::Ok();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
  for (int rank = 0; rank < 2; ++rank) STRATA_ASSERT_OK(saver->submit(5, make_snapshot(rank, 2, 5)));
  STRATA_ASSERT_OK(saver->submit_trainer_state(5, "{}"));
  STRATA_ASSERT_OK(saver->wait());
  EXPECT_EQ(saver->last_committed_step(), 5);
  EXPECT_EQ(failures.load(), 2);
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open((dir.path() / "step-5").string()));
  STRATA_ASSERT_OK(reader->verify());
  expect_shards_match(*reader, 2, 5);
}

TEST(CheckpointSaverChecksTest, ASaveThatFailsTwiceIsReportedByPollWithoutWaiting) {
  testing::TempDir dir;
  CheckpointSaverOptions options = saver_options(dir.str(), 1);
  std::atomic<int> attempts{0};
  options.fault_hook = [&](std::string_view point, int64_t step) -> Status {
    if (point == "rank_file_written" && step == 2) {
      attempts.fetch_add(1);
      return IoError("injected failure after the rank file");
    }
    return Status::Ok();
  };
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
  STRATA_ASSERT_OK(saver->poll());
  for (int64_t step : {1, 2, 3}) {
    // With one save pending at most, submitting step 3 waits until step 2 has failed.
    STRATA_ASSERT_OK(saver->submit(step, make_snapshot(0, 1, static_cast<uint32_t>(step))));
    STRATA_ASSERT_OK(saver->submit_trainer_state(step, "{}"));
  }
  const Status failed = saver->poll();
  EXPECT_EQ(failed.code(), StatusCode::kIoError) << failed.to_string();
  EXPECT_TRUE(contains(failed.to_string(), "checkpoint step 2 in " + dir.str() + " was not saved")) << failed.to_string();
  EXPECT_TRUE(contains(failed.to_string(), "rank-0-of-1.bin") || contains(failed.to_string(), "rank 0")) << failed.to_string();
  EXPECT_EQ(attempts.load(), 2);  // the save and its retry
  STRATA_ASSERT_OK(saver->poll());  // handed over once
  STRATA_ASSERT_OK(saver->finish());
  EXPECT_EQ(saver->last_committed_step(), 3);
  EXPECT_TRUE(fs::exists(dir.path() / "step-1"));
  EXPECT_FALSE(fs::exists(dir.path() / "step-2"));
}

TEST(CheckpointSaverChecksTest, RotationKeepsTheNewestHealthyCheckpoint) {
  testing::TempDir dir;
  CheckpointSaverOptions options = saver_options(dir.str(), 1);
  options.keep_last = 1;
  options.is_healthy = [](std::string_view state) { return state.find("\"healthy\": true") != std::string_view::npos; };
  STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
  const std::vector<std::pair<int64_t, bool>> saves = {{1, true}, {2, true}, {3, false}, {4, false}};
  for (const auto& [step, healthy] : saves) {
    STRATA_ASSERT_OK(saver->submit(step, make_snapshot(0, 1, static_cast<uint32_t>(step))));
    STRATA_ASSERT_OK(saver->submit_trainer_state(step, std::string("{\"healthy\": ") + (healthy ? "true" : "false") + "}"));
    STRATA_ASSERT_OK(saver->wait());
  }
  STRATA_ASSERT_OK(saver->finish());
  EXPECT_FALSE(fs::exists(dir.path() / "step-1"));
  EXPECT_TRUE(fs::exists(dir.path() / "step-2"));  // the newest healthy one, older than keep_last allows
  EXPECT_FALSE(fs::exists(dir.path() / "step-3"));
  EXPECT_TRUE(fs::exists(dir.path() / "step-4"));
}

}  // namespace
}  // namespace strata
