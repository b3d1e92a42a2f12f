// A thread the system refuses (the process or user thread limit, memory for a stack) while
// the engine, a local cluster or the checkpoint saver starts is an error from that call,
// not std::terminate (an uncaught std::system_error from EngineImpl::start() used to end
// the process). Every spawn of each start-up is made to fail in turn.
#include <gtest/gtest.h>

#include <string>

#include "engine/checkpoint.h"
#include "engine/core/thread.h"
#include "engine/engine.h"
#include "engine/local_cluster.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

bool names_the_limit(const Status& status) {
  const std::string text = status.to_string();
  return status.code() == StatusCode::kResourceExhausted && text.find("cannot start the thread '") != std::string::npos &&
         text.find("RLIMIT_NPROC") != std::string::npos;
}

// Creates and starts a one-group engine on a one-rank CPU cluster; `fail_spawn` (0 = none)
// is the spawn after Engine::create that fails. Returns start()'s status; `spawns` gets
// the spawns start() attempted.
Status start_engine(const std::string& nvme_path, int fail_spawn, int* spawns) {
  LocalClusterOptions cluster_options;
  cluster_options.compute_threads = 1;
  STRATA_ASSIGN_OR_RETURN(auto cluster, LocalCluster::create(cluster_options));
  EngineOptions options;
  options.param_tier = Tier::kNvme;  // the I/O engine's threads too
  options.nvme_path = nvme_path;
  // psync, not auto: auto falls back to psync (a warning, and start() succeeds) when the
  // io_uring reaper thread is refused, which would hide the error this test looks for.
  options.io_engine = IoEngineKind::kPsync;
  STRATA_ASSIGN_OR_RETURN(auto engine,
                          Engine::create(options, cluster->device(0), cluster->gather_communicator(0), cluster->reduce_communicator(0)));
  STRATA_RETURN_IF_ERROR(engine->register_group({"g", {{"w", {64, 64}}}}).status());
  std::optional<ThreadSpawnFailureForTest> failure;
  failure.emplace(fail_spawn == 0 ? 1 << 30 : fail_spawn);
  Status status = engine->start();
  *spawns = failure->attempts();
  return status;
}

TEST(ThreadLimitTest, EngineStartReturnsAnErrorForEveryThreadItCannotStart) {
  testing::TempDir dir;
  int spawns = 0;
  STRATA_ASSERT_OK(start_engine(dir.str(), 0, &spawns));
  ASSERT_GE(spawns, 3);  // at least the fetcher, the gradient path and the optimizer stage
  for (int nth = 1; nth <= spawns; ++nth) {
    testing::TempDir fresh;
    int attempted = 0;
    const Status status = start_engine(fresh.str(), nth, &attempted);
    ASSERT_FALSE(status.ok()) << "spawn " << nth << " of " << spawns;
    EXPECT_TRUE(names_the_limit(status)) << status.to_string();
  }
}

TEST(ThreadLimitTest, LocalClusterRunReturnsAnErrorAndReleasesTheRanksThatStarted) {
  for (int world : {2, 3}) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create({.world_size = world, .compute_threads = 1}));
    std::vector<std::unique_ptr<Stream>> streams;  // made before the failure is armed: its count is the ranks' threads
    for (int rank = 0; rank < world; ++rank) {
      STRATA_ASSERT_OK_AND_ASSIGN(auto stream, cluster->device(rank).create_stream("barrier"));
      streams.push_back(std::move(stream));
    }
    ThreadSpawnFailureForTest failure(world - 1);  // the last rank's thread
    // The ranks that did start wait in a barrier for the missing one: the abort ends it.
    const Status status = cluster->run([&](int rank) -> Status {
      Stream& stream = *streams[static_cast<size_t>(rank)];
      STRATA_RETURN_IF_ERROR(cluster->gather_communicator(rank).barrier(stream));
      return stream.synchronize();
    });
    ASSERT_FALSE(status.ok());
    EXPECT_TRUE(names_the_limit(status)) << status.to_string();
    EXPECT_NE(status.to_string().find("while starting rank " + std::to_string(world - 1)), std::string::npos) << status.to_string();
  }
}

TEST(ThreadLimitTest, CheckpointSaverCreateReturnsAnError) {
  testing::TempDir dir;
  CheckpointSaverOptions options;
  options.directory = dir.str();
  options.world_size = 1;
  options.io.kind = IoEngineKind::kPsync;  // no io_uring fallback to hide the error
  int spawns = 0;
  {
    ThreadSpawnFailureForTest count(1 << 30);
    STRATA_ASSERT_OK_AND_ASSIGN(auto saver, CheckpointSaver::create(options));
    spawns = count.attempts();
    STRATA_ASSERT_OK(saver->finish());
  }
  ASSERT_GE(spawns, 1);
  for (int nth = 1; nth <= spawns; ++nth) {
    ThreadSpawnFailureForTest failure(nth);
    auto saver = CheckpointSaver::create(options);
    ASSERT_FALSE(saver.ok()) << "spawn " << nth;
    EXPECT_TRUE(names_the_limit(saver.status())) << saver.status().to_string();
  }
}

}  // namespace
}  // namespace strata
