// The trainer's reliability, through the train_gpt binary: a save directory checked and
// locked before step 1, a failed save reported at the step it fails and stopping the run
// (or not, by policy) with the last good checkpoint kept, divergence stopping the run
// naming the step (or skipped steps that leave the weights untouched), and SIGTERM
// finishing the step, saving and exiting 143, with a resume that ends at the straight
// run's weights bit for bit. Tiny models: each run takes about a second.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "examples/hf/safetensors.h"
#include "tests/examples/train_gpt_runner.h"
#include "tests/support/test_support.h"

namespace strata::gpt {
namespace {

using hf::SafetensorsReader;
using hf::SafetensorsTensorSpec;
using hf::SafetensorsWriter;

namespace fs = std::filesystem;

using testing::contains;
using testing::finish_run;
using testing::read_file;
using testing::start_train_gpt;
using testing::train_gpt;
using testing::TrainRun;
using Started = testing::StartedRun;

// Waits (up to a minute: a loaded machine) until the file holds `needle`.
bool wait_for_text(const fs::path& path, const std::string& needle) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::minutes(1);
  while (std::chrono::steady_clock::now() < deadline) {
    if (contains(read_file(path), needle)) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  return false;
}

std::vector<std::string> tiny(std::vector<std::string> more) { return testing::tiny_train_gpt_args(std::move(more)); }

using testing::ScopedTmpfs;

uint64_t directory_bytes(const fs::path& path) {
  uint64_t bytes = 0;
  for (const auto& entry : fs::recursive_directory_iterator(path))
    if (entry.is_regular_file()) bytes += (entry.file_size() + 4095) / 4096 * 4096;
  return bytes;
}

// ---------------------------------------------------------------------------------------
// Graceful preemption
// ---------------------------------------------------------------------------------------

TEST(GptTrainerTest, SigtermFinishesTheStepSavesAndExits143AndTheResumeIsBitIdentical) {
  testing::TempDir dir;
  const std::string save = (dir.path() / "ckpt").string();
  Started started = start_train_gpt(dir, tiny({"--steps", "100000", "--save-dir", save}));
  ASSERT_TRUE(wait_for_text(started.out, "3/100000 | loss")) << read_file(started.err);
  ASSERT_EQ(::kill(started.pid, SIGTERM), 0);
  const TrainRun stopped = finish_run(started);
  ASSERT_EQ(stopped.exit_code, 128 + SIGTERM) << stopped.err << stopped.out;
  EXPECT_TRUE(contains(stopped.err, "SIGTERM received: finishing the current step")) << stopped.err;
  ASSERT_TRUE(stopped.summary.is_object()) << stopped.out;
  EXPECT_EQ(stopped.summary["stopped_by_signal"], SIGTERM);
  const int64_t steps_done = stopped.summary["first_step"].get<int64_t>() + static_cast<int64_t>(stopped.summary["losses"].size()) - 1;
  ASSERT_GE(steps_done, 3);
  const std::string checkpoint = save + "/step-" + std::to_string(steps_done);
  EXPECT_TRUE(contains(stopped.out, "stopped by SIGTERM after step " + std::to_string(steps_done) + " of 100000; checkpoint saved to " +
                                        checkpoint + " (continue with --resume " + save + ")"))
      << stopped.out;
  EXPECT_EQ(stopped.summary["checkpoint"], checkpoint);
  STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(save));
  EXPECT_EQ(latest.step, steps_done);

  const std::string total = std::to_string(steps_done + 3);
  const TrainRun straight = train_gpt(dir, tiny({"--steps", total}));
  ASSERT_RAN(straight);
  const TrainRun resumed = train_gpt(dir, tiny({"--steps", total, "--resume", save}));
  ASSERT_RAN(resumed);
  EXPECT_EQ(resumed.summary["resumed_from_step"], steps_done);
  EXPECT_EQ(resumed.summary["param_checksum"], straight.summary["param_checksum"]);
  EXPECT_EQ(resumed.summary["final_loss"], straight.summary["final_loss"]);
}

TEST(GptTrainerTest, SigtermWithoutASaveDirectorySaysNothingWasSaved) {
  testing::TempDir dir;
  Started started = start_train_gpt(dir, tiny({"--steps", "100000"}));
  ASSERT_TRUE(wait_for_text(started.out, "2/100000 | loss")) << read_file(started.err);
  ASSERT_EQ(::kill(started.pid, SIGINT), 0);
  const TrainRun stopped = finish_run(started);
  ASSERT_EQ(stopped.exit_code, 128 + SIGINT) << stopped.err << stopped.out;
  EXPECT_TRUE(contains(stopped.out, "stopped by SIGINT after step ")) << stopped.out;
  EXPECT_TRUE(contains(stopped.out, "no --save-dir: nothing saved")) << stopped.out;
}

// ---------------------------------------------------------------------------------------
// The save directory: locked, checked at start, a failed save at the step it fails
// ---------------------------------------------------------------------------------------

TEST(GptTrainerTest, ASecondRunOnTheSameSaveDirectoryIsRefusedAtStart) {
  testing::TempDir dir;
  const std::string save = (dir.path() / "ckpt").string();
  Started first = start_train_gpt(dir, tiny({"--steps", "100000", "--save-dir", save, "--save-every", "1000"}));
  ASSERT_TRUE(wait_for_text(first.out, "2/100000 | loss")) << read_file(first.err);
  const TrainRun second = train_gpt(dir, tiny({"--steps", "4", "--save-dir", save}));
  ::kill(first.pid, SIGTERM);
  const TrainRun first_run = finish_run(first);
  EXPECT_EQ(first_run.exit_code, 128 + SIGTERM) << first_run.err;
  EXPECT_NE(second.exit_code, 0);
  EXPECT_TRUE(contains(second.err, "save directory '" + save + "' is in use by another run (pid " + std::to_string(first.pid)))
      << second.err;
  EXPECT_FALSE(contains(second.out, "step 1/")) << second.out;
}

TEST(GptTrainerTest, ASaveDirectoryOnADiskThatFillsStopsTheRunAtTheFailingSave) {
  testing::TempDir dir;
  // The size of one checkpoint of this model.
  const std::string probe = (dir.path() / "probe").string();
  ASSERT_RAN(train_gpt(dir, tiny({"--steps", "1", "--save-dir", probe})));
  const uint64_t one = directory_bytes(fs::path(probe) / "step-1");

  {
    // Too small for two checkpoints: refused before step 1, with the figures.
    ScopedTmpfs tiny_disk(dir.path() / "tiny_disk", "size=" + std::to_string(one));
    if (!tiny_disk.mounted) GTEST_SKIP() << "cannot mount a tmpfs (" << std::strerror(errno) << "): this test needs root (CAP_SYS_ADMIN)";
    const std::string save = (tiny_disk.path / "ckpt").string();
    const TrainRun run = train_gpt(dir, tiny({"--steps", "4", "--save-dir", save}));
    EXPECT_EQ(run.exit_code, 1);
    EXPECT_TRUE(contains(run.err, "save directory '" + save + "' has ")) << run.err;
    EXPECT_TRUE(contains(run.err, "2 checkpoints need")) << run.err;
    EXPECT_FALSE(contains(run.out, "step 1/")) << run.out;
  }
  for (const std::string policy : {"stop", "continue"}) {
    // Room for two checkpoints and a half: the third save fails.
    ScopedTmpfs disk(dir.path() / ("disk_" + policy), "size=" + std::to_string(one * 5 / 2 + 65536));
    ASSERT_TRUE(disk.mounted);
    const std::string save = (disk.path / "ckpt").string();
    const TrainRun run = train_gpt(dir, tiny({"--steps", "40", "--save-dir", save, "--save-every", "1", "--set",
                                              "strata.checkpoint.on_save_failure=" + policy}));
    EXPECT_TRUE(contains(run.err, "checkpoint: saving step 3 to " + save + " failed")) << run.err;  // logged, then retried
    EXPECT_TRUE(contains(run.err, "checkpoint step 3 in " + save + " was not saved")) << run.err;
    EXPECT_TRUE(contains(run.err, "No space left on device")) << run.err;
    STRATA_ASSERT_OK_AND_ASSIGN(CheckpointRef latest, latest_complete(save));
    EXPECT_EQ(latest.step, 2) << policy;
    if (policy == "stop") {
      EXPECT_EQ(run.exit_code, 1) << run.err;
      EXPECT_TRUE(contains(run.err, "stopping the run (strata.checkpoint.on_save_failure=stop); the last good checkpoint is " + save +
                                        "/step-2"))
          << run.err;
      EXPECT_FALSE(contains(run.out, "step 40/40")) << "the run went on after the failed save";
    } else {
      ASSERT_RAN(run);
      EXPECT_TRUE(contains(run.err, "training goes on (strata.checkpoint.on_save_failure=continue)")) << run.err;
      EXPECT_TRUE(contains(run.out, "step 40/40")) << run.out;
      EXPECT_EQ(run.summary["checkpoint"], save + "/step-2");
    }
  }
}

// ---------------------------------------------------------------------------------------
// Divergence
// ---------------------------------------------------------------------------------------

// A copy of `exported` (a model.safetensors) with one NaN in h.0.mlp.c_fc.weight.
std::string write_with_a_nan(const std::string& exported, const fs::path& to) {
  auto reader = SafetensorsReader::open(exported);
  EXPECT_TRUE(reader.ok()) << reader.status().to_string();
  std::vector<SafetensorsTensorSpec> specs;
  for (const auto& t : reader->tensors()) specs.push_back({t.name, t.dtype, t.shape});
  fs::create_directories(to);
  const std::string path = (to / "model.safetensors").string();
  auto writer = SafetensorsWriter::create(path, specs);
  EXPECT_TRUE(writer.ok()) << writer.status().to_string();
  for (const auto& t : reader->tensors()) {
    size_t n = 1;
    for (int64_t d : t.shape) n *= static_cast<size_t>(d);
    std::vector<float> values(n);
    EXPECT_TRUE(reader->read_fp32(t, 0, values).ok());
    if (t.name == "h.0.mlp.c_fc.weight") values[7] = std::nanf("");
    EXPECT_TRUE(writer->append_fp32(t.name, values).ok());
  }
  EXPECT_TRUE(writer->finish().ok());
  return path;
}

TEST(GptTrainerTest, ANanInTheInitialWeightsStopsTheRunNamingTheStepAndSavesNothing) {
  testing::TempDir dir;
  const std::string exported = (dir.path() / "export").string();
  ASSERT_RAN(train_gpt(dir, tiny({"--steps", "1", "--export", exported})));
  const std::string nan_weights = write_with_a_nan(exported + "/model.safetensors", dir.path() / "nan");
  const std::string save = (dir.path() / "ckpt").string();
  const TrainRun run = train_gpt(dir, tiny({"--init-from", nan_weights, "--steps", "4", "--save-dir", save, "--save-every", "1",
                                            "--keep-checkpoints", "1"}));
  EXPECT_EQ(run.exit_code, 1) << run.err << run.out;
  EXPECT_TRUE(contains(run.err, "step 1: the loss is nan")) << run.err;
  EXPECT_TRUE(contains(run.err, "training diverged; stopped without saving this state")) << run.err;
  EXPECT_TRUE(contains(run.err, "The last good checkpoint is none (no checkpoint was saved)")) << run.err;
  EXPECT_FALSE(contains(run.out, "step 2/")) << run.out;
  EXPECT_FALSE(latest_complete(save).ok());
}

TEST(GptTrainerTest, MaxNonfiniteStepsSkipsStepsWithoutTouchingTheWeightsThenStops) {
  testing::TempDir dir;
  const std::string exported = (dir.path() / "export").string();
  ASSERT_RAN(train_gpt(dir, tiny({"--steps", "1", "--export", exported})));
  const std::string nan_weights = write_with_a_nan(exported + "/model.safetensors", dir.path() / "nan");
  const TrainRun initial = train_gpt(dir, tiny({"--init-from", nan_weights, "--steps", "0"}));
  ASSERT_RAN(initial);
  const std::string save = (dir.path() / "ckpt").string();
  const TrainRun skipped = train_gpt(dir, tiny({"--init-from", nan_weights, "--steps", "3", "--set", "strata.max_nonfinite_steps=3",
                                                "--save-dir", save}));
  ASSERT_RAN(skipped);
  // The checkpoint records that its step's loss was not finite, for rotation to tell.
  const auto state = nlohmann::json::parse(read_file(fs::path(save) / "step-3" / "trainer_state.json"), nullptr, false);
  EXPECT_EQ(state.value("loss_finite", true), false) << state.dump();
  EXPECT_EQ(skipped.summary["nonfinite_steps"], 3);
  EXPECT_EQ(skipped.summary["param_checksum"], initial.summary["param_checksum"]);  // no step touched the weights
  EXPECT_TRUE(contains(skipped.err, "step 3: the loss is nan")) << skipped.err;
  EXPECT_TRUE(contains(skipped.err, "step skipped, weights unchanged (3 of strata.max_nonfinite_steps=3)")) << skipped.err;
  const TrainRun stopped = train_gpt(dir, tiny({"--init-from", nan_weights, "--steps", "5", "--set", "strata.max_nonfinite_steps=3"}));
  EXPECT_EQ(stopped.exit_code, 1);
  EXPECT_TRUE(contains(stopped.err, "step 4: the loss is nan")) << stopped.err;
  EXPECT_TRUE(contains(stopped.err, "3 step(s) skipped before, strata.max_nonfinite_steps=3")) << stopped.err;
}

}  // namespace
}  // namespace strata::gpt
