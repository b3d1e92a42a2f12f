// Running the train_gpt binary from a test: in the foreground or in the background, its
// stdout and stderr in files under the test's directory, its summary line parsed; and the
// tiny model settings the trainer's tests share.
#pragma once

#include <sys/types.h>

#include <filesystem>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "tests/support/test_support.h"

namespace strata::testing {

std::string read_file(const std::filesystem::path& path);

struct TrainRun {
  int exit_code = -1;  // the exit status, or 1000 + the signal that ended the process
  std::string out, err;
  nlohmann::json summary;  // the last line of stdout, when it parses
};

// train_gpt started in the background. A process nobody finished (a failed assertion) is
// killed and reaped.
struct StartedRun {
  pid_t pid = -1;
  std::filesystem::path out, err;
  bool reaped = false;
  StartedRun() = default;
  StartedRun(const StartedRun&) = delete;
  StartedRun& operator=(const StartedRun&) = delete;
  StartedRun(StartedRun&& other) noexcept : pid(other.pid), out(other.out), err(other.err), reaped(other.reaped) { other.reaped = true; }
  ~StartedRun();
};

// Any program (argv[0] = program) with its output in run<N>.out / run<N>.err under dir.
StartedRun start_program(const TempDir& dir, const std::string& program, const std::vector<std::string>& args);
StartedRun start_train_gpt(const TempDir& dir, const std::vector<std::string>& args);
TrainRun finish_run(StartedRun& started);  // waits for the process
TrainRun train_gpt(const TempDir& dir, const std::vector<std::string>& args);

// The trainer tests' settings: the tiny preset shrunk further, fp32, a warmup-cosine
// schedule whose length is fixed (so a 4-step run and an 8-step run follow the same
// rates), one thread each; `more` after them.
std::vector<std::string> tiny_train_gpt_args(std::vector<std::string> more);

#define ASSERT_RAN(run) ASSERT_EQ((run).exit_code, 0) << (run).err << (run).out

}  // namespace strata::testing
