// kill -9 during checkpoint saves, through the train_gpt binary: a chain of runs, each
// resuming from the newest complete checkpoint and killed with SIGKILL at a random moment
// inside a save, ends (with a last run to completion) at the straight run's
// param_checksum, every time.
//
// Kill moments. STRATA_TEST_CHECKPOINT_PAUSE_MS (examples/train/trainer.cpp) makes the
// saver announce each point of a save on stderr and pause there: the test waits for a
// chosen point (rank_file_open, rank_file_written, before_manifest, before_rename) of the
// first or second save of a run and kills a random 0-1.5 pauses later, so some kills land
// at the point and some in the work after it (writing shards, the manifest, the rename,
// the fsyncs, the next step). Every fifth kill instead lands at a random time after the
// start (start-up, loading the checkpoint, training). The test prints what it covered.
//
// The seed is random per run and printed; STRATA_KILL_SEED=<n> repeats a sequence.
#include <gtest/gtest.h>

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include "engine/checkpoint.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;

constexpr int kSteps = 6;
constexpr int kPauseMs = 25;
constexpr int kKills = 24;
constexpr auto kRunLimit = std::chrono::seconds(120);  // a run that takes longer has hung

const std::vector<std::string> kSavePoints = {"rank_file_open", "rank_file_written", "before_manifest", "before_rename"};

std::vector<std::string> tiny_args(const std::vector<std::string>& more) {
  std::vector<std::string> args = {"--preset", "tiny", "--n-layer", "2", "--n-embd", "32", "--n-ctx", "16", "--vocab-size", "64",
                                   "--seq-len", "16", "--lr", "3e-3", "--seed", "11", "--steps", std::to_string(kSteps),
                                   "--set", "strata.compute_threads=1", "--set", "strata.optimizer_threads=1"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

// A train_gpt process: stdout to a file, stderr through a pipe the test reads. The
// destructor kills and reaps it, so no failure leaves one behind.
class TrainProcess {
 public:
  TrainProcess(const std::vector<std::string>& args, const fs::path& stdout_path, int pause_ms) {
    int fds[2];
    if (::pipe2(fds, O_CLOEXEC) != 0) return;
    const std::string binary = (testing::binary_dir() / "bin" / "train_gpt").string();
    pid_ = ::fork();
    if (pid_ == 0) {
      ::dup2(fds[1], STDERR_FILENO);
      const int out = ::open(stdout_path.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      if (out >= 0) ::dup2(out, STDOUT_FILENO);
      if (pause_ms > 0) ::setenv("STRATA_TEST_CHECKPOINT_PAUSE_MS", std::to_string(pause_ms).c_str(), 1);
      std::vector<char*> argv;
      argv.push_back(const_cast<char*>(binary.c_str()));
      for (const std::string& arg : args) argv.push_back(const_cast<char*>(arg.c_str()));
      argv.push_back(nullptr);
      ::execv(binary.c_str(), argv.data());
      ::_exit(127);
    }
    ::close(fds[1]);
    stderr_fd_ = fds[0];
  }
  ~TrainProcess() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      int status = 0;
      ::waitpid(pid_, &status, 0);
    }
    if (stderr_fd_ >= 0) ::close(stderr_fd_);
  }
  TrainProcess(const TrainProcess&) = delete;
  TrainProcess& operator=(const TrainProcess&) = delete;

  bool started() const { return pid_ > 0 && stderr_fd_ >= 0; }
  const std::string& stderr_text() const { return stderr_; }

  // Reads stderr until `line_part` has appeared `occurrence` times (true), the process
  // closes stderr (false), or the deadline passes (false).
  bool wait_for_line(const std::string& line_part, int occurrence, Clock::time_point deadline) {
    int seen = 0;
    size_t scanned = 0;
    for (;;) {
      for (size_t end; (end = stderr_.find('\n', scanned)) != std::string::npos; scanned = end + 1) {
        if (stderr_.substr(scanned, end - scanned).find(line_part) != std::string::npos && ++seen == occurrence) {
          return true;
        }
      }
      if (!read_some(deadline)) return false;
    }
  }

  // Drains stderr until the process closes it (or the deadline), then reaps it. Returns
  // the wait status, or -1 when the deadline passed.
  int wait(Clock::time_point deadline) {
    while (read_some(deadline)) {
    }
    if (Clock::now() >= deadline) return -1;
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return status;
  }

  int kill_and_reap() {
    ::kill(pid_, SIGKILL);
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    while (read_some(Clock::now() + std::chrono::seconds(5))) {
    }
    return status;
  }

 private:
  // One read (waiting until the deadline for data); false at end of file or deadline.
  bool read_some(Clock::time_point deadline) {
    const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) return false;
    pollfd poll_fd{stderr_fd_, POLLIN, 0};
    if (::poll(&poll_fd, 1, static_cast<int>(left)) <= 0) return false;
    char buffer[4096];
    const ssize_t got = ::read(stderr_fd_, buffer, sizeof(buffer));
    if (got <= 0) return false;
    stderr_.append(buffer, static_cast<size_t>(got));
    return true;
  }

  pid_t pid_ = -1;
  int stderr_fd_ = -1;
  bool reaped_ = false;
  std::string stderr_;
};

std::string read_text(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

// The summary JSON (the last line of stdout).
nlohmann::json summary_of(const fs::path& stdout_path) {
  std::string last;
  std::istringstream lines(read_text(stdout_path));
  for (std::string line; std::getline(lines, line);) {
    if (!line.empty()) last = line;
  }
  return nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
}

// What a killed run left in the save directory.
std::string describe_save_dir(const fs::path& save_dir) {
  std::vector<std::string> names;
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(save_dir, error)) names.push_back(entry.path().filename().string());
  std::sort(names.begin(), names.end());
  std::string text;
  for (const std::string& name : names) text += (text.empty() ? "" : " ") + name;
  return text.empty() ? "(empty)" : text;
}

bool has_tmp_dir(const fs::path& save_dir) {
  std::error_code error;
  for (const auto& entry : fs::directory_iterator(save_dir, error)) {
    if (entry.path().filename().string().rfind(".tmp-", 0) == 0) return true;
  }
  return false;
}

// Arguments for the next run of a chain: resume from the newest complete checkpoint, if any.
std::vector<std::string> chain_args(const fs::path& save_dir, int64_t* resumed_from) {
  std::vector<std::string> more = {"--save-dir", save_dir.string(), "--save-every", "1"};
  StatusOr<CheckpointRef> latest = latest_complete(save_dir.string(), {.verify_checksums = true});
  *resumed_from = latest.ok() ? latest->step : -1;
  if (latest.ok()) {
    more.push_back("--resume");
    more.push_back(save_dir.string());
  }
  return tiny_args(more);
}

TEST(KillResumeTest, SigkillDuringSavesThenResumingEndsAtTheStraightChecksum) {
  const char* seed_text = std::getenv("STRATA_KILL_SEED");
  const uint64_t seed = seed_text != nullptr ? std::strtoull(seed_text, nullptr, 10) : std::random_device{}();
  std::mt19937_64 random(seed);
  RecordProperty("seed", std::to_string(seed));
  SCOPED_TRACE("STRATA_KILL_SEED=" + std::to_string(seed));
  testing::TempDir dir;

  // The straight run.
  const fs::path straight_out = dir.path() / "straight.out";
  std::string reference;
  {
    TrainProcess straight(tiny_args({}), straight_out, 0);
    ASSERT_TRUE(straight.started());
    const int status = straight.wait(Clock::now() + kRunLimit);
    ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << straight.stderr_text();
    reference = summary_of(straight_out).value("param_checksum", "");
    ASSERT_EQ(reference.size(), 16u) << read_text(straight_out);
  }

  std::map<std::string, int> kills_by_target;    // what the test aimed at
  std::map<std::string, int> kills_by_leftover;  // what the save directory showed after
  int kills = 0, chains = 0, run_index = 0;
  std::string log;
  while (kills < kKills) {
    // One chain: a fresh save directory, killed runs until one finishes, then the check.
    const fs::path save_dir = dir.path() / ("chain-" + std::to_string(chains));
    for (bool finished = false; !finished;) {
      int64_t resumed_from = -1;
      const std::vector<std::string> args = chain_args(save_dir, &resumed_from);
      const fs::path out = dir.path() / ("run-" + std::to_string(run_index++) + ".out");
      const bool kill_this_run = kills < kKills && resumed_from < kSteps;
      TrainProcess run(args, out, kill_this_run ? kPauseMs : 0);
      ASSERT_TRUE(run.started());
      const auto deadline = Clock::now() + kRunLimit;
      if (kill_this_run) {
        std::string target;
        bool reached = true;
        if (kills % 5 == 4) {
          const int delay_ms = std::uniform_int_distribution<int>(0, 600)(random);
          target = "random time after start";
          std::this_thread::sleep_for(std::chrono::milliseconds(delay_ms));
        } else {
          const std::string& point = kSavePoints[std::uniform_int_distribution<size_t>(0, kSavePoints.size() - 1)(random)];
          const int occurrence = std::uniform_int_distribution<int>(1, 2)(random);
          target = point + (occurrence == 1 ? " of the run's first save" : " of the run's second save");
          reached = run.wait_for_line("strata-test: checkpoint " + point + " step", occurrence, deadline);
          ASSERT_LT(Clock::now(), deadline) << "a run neither reached " << target << " nor ended within "
                                            << kRunLimit.count() << " s:\n" << run.stderr_text();
          std::this_thread::sleep_for(std::chrono::milliseconds(std::uniform_int_distribution<int>(0, kPauseMs * 3 / 2)(random)));
        }
        const int status = run.kill_and_reap();
        if (WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) {
          ++kills;
          ++kills_by_target[target];
          const std::string leftover = has_tmp_dir(save_dir) ? "a .tmp-step-* directory (killed inside a save)"
                                                             : "complete checkpoints only";
          ++kills_by_leftover[leftover];
          log += "kill " + std::to_string(kills) + ": resumed from " + std::to_string(resumed_from) + ", aimed at " + target +
                 (reached ? "" : " (not reached)") + "; left " + describe_save_dir(save_dir) + "\n";
          continue;
        }
        // It ended before the kill: it must have finished cleanly.
        ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << run.stderr_text();
      } else {
        const int status = run.wait(deadline);
        ASSERT_NE(status, -1) << "a resumed run did not end within " << kRunLimit.count() << " s";
        ASSERT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0) << run.stderr_text() << read_text(out);
      }
      const nlohmann::json summary = summary_of(out);
      EXPECT_EQ(summary.value("param_checksum", ""), reference)
          << "chain " << chains << " ended at a different checksum; the kills:\n" << log << run.stderr_text();
      log += "chain " + std::to_string(chains) + " finished from step " + std::to_string(resumed_from) + " at " +
             summary.value("param_checksum", "?") + "\n";
      finished = true;
    }
    ++chains;
  }
  std::ostringstream report;
  report << kills << " kills over " << chains << " chains, every chain ending at " << reference << "\n  aimed at:";
  for (const auto& [target, count] : kills_by_target) report << "\n    " << count << " x " << target;
  report << "\n  left behind:";
  for (const auto& [leftover, count] : kills_by_leftover) report << "\n    " << count << " x " << leftover;
  std::cout << report.str() << "\n" << log;
  RecordProperty("coverage", report.str());
  EXPECT_GE(kills, kKills);
}

}  // namespace
}  // namespace strata
