// Checkpoints saved by ranks that are processes: one CheckpointSaver per process on one
// shared directory (here two savers in one process, each holding one rank), the records of
// the other processes' files handed to rank 0's through add_peer_files(). A process whose
// part fails — its file cannot be written, or its snapshot never reached its saver — fails
// the step on rank 0's saver, which ends it (no wait for files that will never come) and
// leaves no checkpoint and no temporary directory.
#include "engine/checkpoint.h"

#include <gtest/gtest.h>

#include <filesystem>
#include <memory>
#include <string>
#include <vector>

#include "engine/core/check.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using testing::contains;
constexpr int kWorld = 2;
constexpr int64_t kStep = 4;

std::vector<GroupLayout> two_rank_layouts() {
  std::vector<GroupLayout> layouts;
  const std::vector<GroupSpec> specs = {{"block.0", {{"w", {37, 29}}, {"b", {29}}}}, {"head", {{"w", {5000}}}}};
  for (size_t g = 0; g < specs.size(); ++g) {
    StatusOr<GroupLayout> layout = layout_group(specs[g], static_cast<int>(g), kWorld);
    STRATA_CHECK_OK(layout);
    layouts.push_back(*layout);
  }
  return layouts;
}

// Rank `rank`'s shards, every element `rank + 1` (padding included: the test reads shards whole).
RankSnapshot rank_snapshot(int rank) {
  StatusOr<RankSnapshot> snapshot = RankSnapshot::allocate(two_rank_layouts(), rank, kStep);
  STRATA_CHECK_OK(snapshot);
  for (int g = 0; g < snapshot->group_count(); ++g)
    for (CheckpointStateKind kind : {CheckpointStateKind::kMaster, CheckpointStateKind::kExpAvg, CheckpointStateKind::kExpAvgSq})
      for (float& v : snapshot->shard(g, kind)) v = static_cast<float>(rank + 1);
  return std::move(snapshot).value();
}

// The saver of the process holding rank `rank` alone.
std::unique_ptr<CheckpointSaver> process_saver(const std::string& dir, int rank) {
  CheckpointSaverOptions options;
  options.directory = dir;
  options.world_size = kWorld;
  options.first_rank = rank;
  options.local_ranks = 1;
  StatusOr<std::unique_ptr<CheckpointSaver>> saver = CheckpointSaver::create(options);
  STRATA_CHECK_OK(saver);
  return std::move(saver).value();
}

class CheckpointProcessesTest : public ::testing::Test {
 protected:
  // Rank 0's part of step kStep up to its records: trainer state, snapshot, its file written.
  std::string rank0_records() {
    STRATA_CHECK_OK(rank0->submit_trainer_state(kStep, R"({"step": 4})"));
    STRATA_CHECK_OK(rank0->submit(kStep, rank_snapshot(0)));
    StatusOr<std::string> records = rank0->local_files(kStep);
    STRATA_CHECK_OK(records);
    return *records;
  }
  std::string rank1_records() {
    STRATA_CHECK_OK(rank1->submit(kStep, rank_snapshot(1)));
    StatusOr<std::string> records = rank1->local_files(kStep);
    STRATA_CHECK_OK(records);
    return *records;
  }
  void expect_no_checkpoint() const {
    EXPECT_FALSE(fs::exists(dir.path() / ("step-" + std::to_string(kStep))));
    EXPECT_FALSE(fs::exists(dir.path() / (".tmp-step-" + std::to_string(kStep))));
  }

  testing::TempDir dir;
  std::unique_ptr<CheckpointSaver> rank0 = process_saver(dir.str(), 0);
  std::unique_ptr<CheckpointSaver> rank1 = process_saver(dir.str(), 1);
};

TEST_F(CheckpointProcessesTest, RankZeroCommitsOnceTheOtherProcessFilesAreIn) {
  const std::string mine = rank0_records();
  const std::string theirs = rank1_records();
  STRATA_ASSERT_OK(rank1->wait());
  STRATA_ASSERT_OK(rank0->add_peer_files(kStep, {mine, theirs}));
  STRATA_ASSERT_OK(rank0->wait());
  EXPECT_EQ(rank0->last_committed_step(), kStep);
  STRATA_ASSERT_OK_AND_ASSIGN(auto reader, CheckpointReader::open(checkpoint_path(dir.str(), kStep)));
  STRATA_ASSERT_OK(reader->verify());
  std::vector<float> shard(two_rank_layouts()[1].shard_numel);
  STRATA_ASSERT_OK(reader->load_shard(1, CheckpointStateKind::kExpAvg, 1, kWorld, shard));
  EXPECT_EQ(shard.front(), 2.0f);  // rank 1's file (its shard starts inside the 5000 elements)
}

TEST_F(CheckpointProcessesTest, AProcessReportsItsFailedWriteAfterAnEarlierSaveThatWentWell) {
  (void)rank1_records();  // step 4 written, and not waited on
  fs::create_directories(dir.path() / ".tmp-step-5" / "rank-1-of-2.bin");
  STRATA_ASSERT_OK(rank1->submit(5, rank_snapshot(1)));
  STRATA_ASSERT_OK_AND_ASSIGN(const std::string records, rank1->local_files(5));
  EXPECT_TRUE(contains(records, "\"error\"")) << records;
  EXPECT_EQ(rank1->wait().code(), StatusCode::kIoError);  // not hidden behind the earlier save's outcome
}

TEST_F(CheckpointProcessesTest, AProcessWhoseFileCannotBeWrittenFailsTheStepWithoutAWait) {
  fs::create_directories(dir.path() / ".tmp-step-4" / "rank-1-of-2.bin");  // rank 1's file cannot be opened
  const std::string mine = rank0_records();
  const std::string theirs = rank1_records();
  EXPECT_TRUE(contains(theirs, "\"error\"")) << theirs;
  EXPECT_EQ(rank1->wait().code(), StatusCode::kIoError);
  STRATA_ASSERT_OK(rank0->add_peer_files(kStep, {mine, theirs}));
  const Status saved = rank0->wait();  // used to wait forever for rank 1's file
  EXPECT_EQ(saved.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(saved.to_string(), "a process (rank 1) failed to write its rank files")) << saved.to_string();
  EXPECT_TRUE(contains(saved.to_string(), "rank-1-of-2.bin")) << saved.to_string();
  EXPECT_EQ(rank0->last_committed_step(), -1);
  expect_no_checkpoint();  // rank 0's file and the blocking directory went with the step
}

TEST_F(CheckpointProcessesTest, AProcessThatNeverSubmittedFailsTheStepAndTheNextSaveCommits) {
  const std::string mine = rank0_records();
  const std::string theirs = rank1->failed_files(DataLossError("rank 1 could not read its optimizer state"));
  STRATA_ASSERT_OK(rank0->add_peer_files(kStep, {mine, theirs}));
  const Status saved = rank0->wait();
  EXPECT_TRUE(contains(saved.to_string(), "rank 1 could not read its optimizer state")) << saved.to_string();
  expect_no_checkpoint();
  // Both savers go on: the step saved again commits.
  const std::string again = rank0_records();
  STRATA_ASSERT_OK(rank0->add_peer_files(kStep, {again, rank1_records()}));
  STRATA_ASSERT_OK(rank0->wait());
  EXPECT_EQ(rank0->last_committed_step(), kStep);
}

TEST_F(CheckpointProcessesTest, RankZerosOwnFailureBeforeItsSnapshotEndsTheStep) {
  STRATA_ASSERT_OK(rank0->submit_trainer_state(kStep, "{}"));
  const std::string mine = rank0->failed_files(IoError("rank 0 could not read its state"));
  STRATA_ASSERT_OK(rank0->add_peer_files(kStep, {mine, rank1_records()}));
  const Status saved = rank0->wait();
  EXPECT_TRUE(contains(saved.to_string(), "rank 0 could not read its state")) << saved.to_string();
  expect_no_checkpoint();  // rank 1's file went with the step
}

}  // namespace
}  // namespace strata
