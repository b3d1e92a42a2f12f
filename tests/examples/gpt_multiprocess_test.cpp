// train_gpt with one rank per process (CPU device, Gloo), started by the test itself the
// way torchrun starts them (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT per
// child): the same weights, bit for bit, as the same world as threads of one process,
// with NVMe files per rank; only rank 0 prints; checkpoints written by every process and
// committed by rank 0 resume on threads and on another process count; a --world-size
// that disagrees with WORLD_SIZE is an error naming both; a process killed mid-run makes
// the other exit non-zero naming it.
#include <gtest/gtest.h>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <cstdlib>
#include <iostream>
#include <string>
#include <thread>
#include <vector>

#include "tests/examples/train_gpt_runner.h"
#include "tests/support/test_support.h"

namespace strata::gpt {
namespace {

using testing::contains;
using testing::StartedRun;
using testing::TrainRun;

std::vector<std::string> tiny(std::vector<std::string> more) { return testing::tiny_train_gpt_args(std::move(more)); }

// A port nobody listens on now (the kernel's pick for a socket bound and closed again).
int free_port() {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  socklen_t length = sizeof(address);
  if (fd < 0 || ::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)) != 0 ||
      ::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length) != 0) {
    if (fd >= 0) ::close(fd);
    return 0;
  }
  ::close(fd);
  return ntohs(address.sin_port);
}

// Starts `world` train_gpt processes with the launcher variables torchrun would give them.
std::vector<StartedRun> start_processes(const testing::TempDir& dir, int world, const std::vector<std::string>& args) {
  const std::string port = std::to_string(free_port());
  std::vector<StartedRun> runs;
  for (int rank = 0; rank < world; ++rank) {
    // The child inherits the environment at fork: set it for this child, then restore.
    ::setenv("RANK", std::to_string(rank).c_str(), 1);
    ::setenv("LOCAL_RANK", std::to_string(rank).c_str(), 1);
    ::setenv("WORLD_SIZE", std::to_string(world).c_str(), 1);
    ::setenv("MASTER_ADDR", "127.0.0.1", 1);
    ::setenv("MASTER_PORT", port.c_str(), 1);
    runs.push_back(testing::start_train_gpt(dir, args));
  }
  for (const char* name : {"RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}) ::unsetenv(name);
  return runs;
}

TEST(TrainGptMultiprocessTest, TwoProcessesEndOnTheTwoThreadRunsChecksum) {
  testing::TempDir dir;
  const std::vector<std::string> common = {"--steps", "8", "--micro-batch", "2", "--grad-accum", "2"};
  std::vector<std::string> threads_args = common;
  threads_args.insert(threads_args.end(), {"--world-size", "2"});
  TrainRun threads = testing::train_gpt(dir, tiny(threads_args));
  ASSERT_RAN(threads);

  // The processes keep their optimizer state on NVMe, in one nvme_path: each rank has its
  // own files there (placement does not change the bits).
  const std::string nvme = (dir.path() / "nvme").string();
  std::vector<std::string> process_args = common;
  process_args.insert(process_args.end(), {"--offload-optimizer", "nvme", "--nvme-path", nvme});
  std::vector<StartedRun> started = start_processes(dir, 2, tiny(process_args));
  TrainRun rank0 = testing::finish_run(started[0]);
  TrainRun rank1 = testing::finish_run(started[1]);
  ASSERT_RAN(rank0);
  ASSERT_RAN(rank1);
  for (const char* file : {"strata-rank0.swap", "strata-rank1.swap"})
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(nvme) / file)) << file;
  EXPECT_EQ(rank0.summary["world_size"], 2);
  EXPECT_EQ(rank0.summary["param_checksum"], threads.summary["param_checksum"]) << rank0.out;
  EXPECT_EQ(rank0.summary["losses"], threads.summary["losses"]);
  EXPECT_EQ(rank0.summary["eval_loss"], threads.summary["eval_loss"]);
  EXPECT_TRUE(contains(rank0.out, "step 8/8 | loss")) << rank0.out;
  EXPECT_TRUE(rank1.out.empty()) << "only rank 0 prints: " << rank1.out;
}

TEST(TrainGptMultiprocessTest, FourProcessesEndOnTheFourThreadRunsChecksum) {
  testing::TempDir dir;
  const std::vector<std::string> common = {"--steps", "8", "--micro-batch", "1"};
  std::vector<std::string> threads_args = common;
  threads_args.insert(threads_args.end(), {"--world-size", "4"});
  TrainRun threads = testing::train_gpt(dir, tiny(threads_args));
  ASSERT_RAN(threads);
  std::vector<StartedRun> started = start_processes(dir, 4, tiny(common));
  std::vector<TrainRun> runs;
  for (StartedRun& run : started) runs.push_back(testing::finish_run(run));
  for (const TrainRun& run : runs) ASSERT_RAN(run);
  EXPECT_EQ(runs[0].summary["param_checksum"], threads.summary["param_checksum"]) << runs[0].out;
  EXPECT_EQ(runs[0].summary["losses"], threads.summary["losses"]);
}

// Every process writes its own shard into the checkpoint, rank 0 commits the manifest once
// all are durable; the checkpoint resumes on the same world as threads (bit for bit) and
// on another process count (within the tolerance of another summation order).
TEST(TrainGptMultiprocessTest, ACheckpointSavedByTwoProcessesResumesOnThreadsAndOnFourProcesses) {
  testing::TempDir dir;
  const std::string save = (dir.path() / "ckpt").string();
  TrainRun straight = testing::train_gpt(dir, tiny({"--steps", "8", "--micro-batch", "2", "--world-size", "2"}));
  ASSERT_RAN(straight);

  std::vector<StartedRun> saving = start_processes(dir, 2, tiny({"--steps", "4", "--micro-batch", "2", "--save-dir", save}));
  TrainRun saved0 = testing::finish_run(saving[0]);
  TrainRun saved1 = testing::finish_run(saving[1]);
  ASSERT_RAN(saved0);
  ASSERT_RAN(saved1);
  EXPECT_EQ(saved0.summary["checkpoint"], save + "/step-4");
  for (const char* file : {"manifest.json", "rank-0-of-2.bin", "rank-1-of-2.bin", "trainer_state.json"})
    EXPECT_TRUE(std::filesystem::exists(std::filesystem::path(save) / "step-4" / file)) << file;

  TrainRun threads = testing::train_gpt(dir, tiny({"--steps", "8", "--micro-batch", "2", "--world-size", "2", "--resume", save}));
  ASSERT_RAN(threads);
  EXPECT_EQ(threads.summary["resumed_from_step"], 4);
  EXPECT_EQ(threads.summary["param_checksum"], straight.summary["param_checksum"]);

  // The global batch stays 4 sequences: 4 processes x 1.
  std::vector<StartedRun> four = start_processes(dir, 4, tiny({"--steps", "8", "--micro-batch", "1", "--resume", save}));
  std::vector<TrainRun> runs;
  for (StartedRun& run : four) runs.push_back(testing::finish_run(run));
  for (const TrainRun& run : runs) ASSERT_RAN(run);
  EXPECT_EQ(runs[0].summary["resumed_from_step"], 4);
  const auto want = straight.summary["losses"].get<std::vector<double>>();
  const auto got = runs[0].summary["losses"].get<std::vector<double>>();
  ASSERT_EQ(got.size(), 4u);
  for (size_t i = 0; i < 4; ++i) EXPECT_NEAR(got[i], want[4 + i], 1e-5 * std::abs(want[4 + i])) << "step " << i + 5;
}

TEST(TrainGptMultiprocessTest, AWorldSizeFlagThatDisagreesWithTheLauncherIsNamed) {
  testing::TempDir dir;
  std::vector<StartedRun> started = start_processes(dir, 2, tiny({"--steps", "2", "--world-size", "3"}));
  for (StartedRun& run : started) {
    TrainRun finished = testing::finish_run(run);
    EXPECT_NE(finished.exit_code, 0);
    EXPECT_TRUE(contains(finished.err, "strata.world_size is 3")) << finished.err;
    EXPECT_TRUE(contains(finished.err, "WORLD_SIZE=2")) << finished.err;
  }
}

TEST(TrainGptMultiprocessTest, AKilledProcessMakesTheOtherExitNamingIt) {
  testing::TempDir dir;
  std::vector<StartedRun> started = start_processes(dir, 2, tiny({"--steps", "100000", "--eval-every", "0",
                                                                  "--set", "scheduler.params.total_num_steps=100000"}));
  // Wait until rank 0 has printed its plan (flushed; progress lines to a file are not),
  // let it train a little, then kill rank 1 without warning.
  const auto begin = std::chrono::steady_clock::now();
  while (!contains(testing::read_file(started[0].out), "Strata plan") &&
         std::chrono::steady_clock::now() - begin < std::chrono::seconds(30))
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  ASSERT_TRUE(contains(testing::read_file(started[0].out), "Strata plan"))
      << "rank 0 did not start training; its stderr:\n" << testing::read_file(started[0].err) << "\nrank 1's:\n"
      << testing::read_file(started[1].err);
  std::this_thread::sleep_for(std::chrono::milliseconds(500));
  ASSERT_EQ(::kill(started[1].pid, SIGKILL), 0);
  const auto killed = std::chrono::steady_clock::now();
  TrainRun rank0 = testing::finish_run(started[0]);
  TrainRun rank1 = testing::finish_run(started[1]);
  EXPECT_EQ(rank1.exit_code, 1000 + SIGKILL);
  EXPECT_NE(rank0.exit_code, 0) << rank0.out;
  EXPECT_TRUE(contains(rank0.err, "rank 1")) << rank0.err;
  std::cerr << "rank 0's error: " << rank0.err;
  EXPECT_LT(std::chrono::steady_clock::now() - killed, std::chrono::seconds(30));
}

}  // namespace
}  // namespace strata::gpt
