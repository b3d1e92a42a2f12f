#include "tests/examples/train_gpt_runner.h"

#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <fstream>
#include <iterator>
#include <sstream>

namespace strata::testing {

namespace fs = std::filesystem;

std::string read_file(const fs::path& path) {
  std::ifstream in(path);
  return std::string((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
}

StartedRun::~StartedRun() {
  if (reaped || pid <= 0) return;
  ::kill(pid, SIGKILL);
  ::waitpid(pid, nullptr, 0);
}

StartedRun start_program(const TempDir& dir, const std::string& binary, const std::vector<std::string>& args) {
  static int counter = 0;
  StartedRun started;
  started.out = dir.path() / ("run" + std::to_string(counter) + ".out");
  started.err = dir.path() / ("run" + std::to_string(counter++) + ".err");
  std::vector<std::string> argv_text = {binary};
  argv_text.insert(argv_text.end(), args.begin(), args.end());
  std::vector<char*> argv;
  for (auto& a : argv_text) argv.push_back(a.data());
  argv.push_back(nullptr);
  started.pid = ::fork();
  if (started.pid == 0) {
    const int out = ::open(started.out.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    const int err = ::open(started.err.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
    if (out < 0 || err < 0 || ::dup2(out, STDOUT_FILENO) < 0 || ::dup2(err, STDERR_FILENO) < 0) ::_exit(126);
    ::execv(binary.c_str(), argv.data());
    ::_exit(127);
  }
  return started;
}

StartedRun start_train_gpt(const TempDir& dir, const std::vector<std::string>& args) {
  return start_program(dir, (binary_dir() / "bin" / "train_gpt").string(), args);
}

TrainRun finish_run(StartedRun& started) {
  int status = 0;
  ::waitpid(started.pid, &status, 0);
  started.reaped = true;
  TrainRun run;
  run.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : WIFSIGNALED(status) ? 1000 + WTERMSIG(status) : -1;
  run.out = read_file(started.out);
  run.err = read_file(started.err);
  std::string last;
  std::istringstream lines(run.out);
  for (std::string line; std::getline(lines, line);)
    if (!line.empty()) last = line;
  run.summary = nlohmann::json::parse(last, nullptr, /*allow_exceptions=*/false);
  return run;
}

TrainRun train_gpt(const TempDir& dir, const std::vector<std::string>& args) {
  StartedRun started = start_train_gpt(dir, args);
  return finish_run(started);
}

std::vector<std::string> tiny_train_gpt_args(std::vector<std::string> more) {
  std::vector<std::string> args = {"--preset", "tiny", "--n-layer", "2", "--n-embd", "32", "--n-ctx", "16", "--vocab-size", "64",
                                   "--seq-len", "16", "--lr", "3e-3", "--seed", "11", "--eval-every", "2",
                                   "--set", "scheduler.type=WarmupCosineLR", "--set", "scheduler.params.warmup_num_steps=3",
                                   "--set", "scheduler.params.total_num_steps=8", "--set", "optimizer.params.weight_decay=0.01",
                                   "--set", "strata.compute_threads=1", "--set", "strata.optimizer_threads=1"};
  args.insert(args.end(), more.begin(), more.end());
  return args;
}

}  // namespace strata::testing
