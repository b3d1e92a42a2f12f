#include "examples/strata_launch/process_group.h"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/prctl.h>
#include <sys/signalfd.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <chrono>
#include <cstring>
#include <optional>
#include <utility>
#include <vector>

#include "engine/core/check.h"
#include "engine/core/file.h"

extern char** environ;

namespace strata::launch {
namespace {

using Clock = std::chrono::steady_clock;

constexpr std::array<int, 3> kForwardedSignals = {SIGINT, SIGTERM, SIGHUP};
// After the last child has exited, its pipes are read to the end; a pipe that stays open
// (a grandchild holds it) and silent this long is given up.
constexpr std::chrono::milliseconds kDrainAfterExit{1000};

std::string signal_text(int signal_number) {
  const char* abbrev = ::sigabbrev_np(signal_number);
  return std::to_string(signal_number) + (abbrev != nullptr ? " (SIG" + std::string(abbrev) + ")" : "");
}

// One local process and its two output pipes.
struct Child {
  int local_rank = 0;
  int rank = 0;
  pid_t pid = -1;
  bool running = false;
  File out;  // read end of its stdout pipe; closed at end of stream
  File err;
  LinePrefixer out_lines;
  LinePrefixer err_lines;
};

// Blocks the signals the supervisor reads through a signalfd; restores the mask on exit.
class SignalMaskGuard {
 public:
  static StatusOr<SignalMaskGuard> block(const sigset_t& signals) {
    SignalMaskGuard guard;
    const int error = ::pthread_sigmask(SIG_BLOCK, &signals, &guard.previous_);
    if (error != 0) return Status::FromErrno(error, "pthread_sigmask(SIG_BLOCK) for strata-launch's signals");
    guard.active_ = true;
    return guard;
  }
  SignalMaskGuard(SignalMaskGuard&& other) noexcept : previous_(other.previous_), active_(std::exchange(other.active_, false)) {}
  SignalMaskGuard& operator=(SignalMaskGuard&&) = delete;
  ~SignalMaskGuard() {
    if (active_) ::pthread_sigmask(SIG_SETMASK, &previous_, nullptr);
  }
  const sigset_t& previous() const { return previous_; }

 private:
  SignalMaskGuard() { sigemptyset(&previous_); }
  sigset_t previous_;
  bool active_ = false;
};

// argv/envp arrays prepared before fork (the child may only make async-signal-safe calls).
struct ExecArguments {
  std::vector<std::string> storage_argv;
  std::vector<std::string> storage_envp;
  std::vector<char*> argv;
  std::vector<char*> envp;
  std::string exec_failure_prefix;  // "strata-launch: cannot execute PROGRAM: "
};

ExecArguments exec_arguments(const LaunchPlan& plan, int local_rank) {
  ExecArguments arguments;
  arguments.storage_argv = plan.command;
  std::vector<std::string> inherited;
  for (char** entry = environ; *entry != nullptr; ++entry) inherited.emplace_back(*entry);
  arguments.storage_envp = child_environment(plan, local_rank, inherited);
  for (std::string& text : arguments.storage_argv) arguments.argv.push_back(text.data());
  arguments.argv.push_back(nullptr);
  for (std::string& text : arguments.storage_envp) arguments.envp.push_back(text.data());
  arguments.envp.push_back(nullptr);
  arguments.exec_failure_prefix = "strata-launch: cannot execute " + plan.command.front() + ": ";
  return arguments;
}

// In the forked child: its own process group, death with the launcher, the pipes as
// stdout and stderr, the launcher's original signal mask, then exec. Never returns.
[[noreturn]] void exec_child(const ExecArguments& arguments, int out_fd, int err_fd, const sigset_t& mask,
                             pid_t launcher) {
  ::setpgid(0, 0);
  ::prctl(PR_SET_PDEATHSIG, SIGKILL);
  if (::getppid() != launcher) ::_exit(128 + SIGKILL);  // the launcher died before prctl
  ::dup2(out_fd, STDOUT_FILENO);
  ::dup2(err_fd, STDERR_FILENO);
  ::sigprocmask(SIG_SETMASK, &mask, nullptr);
  ::execvpe(arguments.argv[0], arguments.argv.data(), arguments.envp.data());
  const char* reason = ::strerror(errno);
  (void)!::write(STDERR_FILENO, arguments.exec_failure_prefix.data(), arguments.exec_failure_prefix.size());
  (void)!::write(STDERR_FILENO, reason, std::strlen(reason));
  (void)!::write(STDERR_FILENO, "\n", 1);
  ::_exit(127);
}

StatusOr<std::pair<File, File>> make_pipe(const std::string& name) {
  int fds[2];
  int result = 0;
  STRATA_SYSCALL(result, ::pipe2(fds, O_CLOEXEC));
  return std::make_pair(File(fds[0], name + " (read end)"), File(fds[1], name + " (write end)"));
}

// Forks local rank `child.local_rank`, connecting its stdout and stderr to new pipes.
Status start_child(const LaunchPlan& plan, const sigset_t& child_mask, Child& child) {
  const std::string name = "rank " + std::to_string(child.rank);
  STRATA_ASSIGN_OR_RETURN(auto out_pipe, make_pipe(name + " stdout pipe"));
  STRATA_ASSIGN_OR_RETURN(auto err_pipe, make_pipe(name + " stderr pipe"));
  const ExecArguments arguments = exec_arguments(plan, child.local_rank);
  const pid_t launcher = ::getpid();
  const pid_t pid = ::fork();
  if (pid < 0) return Status::FromErrno(errno, "fork for " + name);
  if (pid == 0) exec_child(arguments, out_pipe.second.fd(), err_pipe.second.fd(), child_mask, launcher);
  ::setpgid(pid, pid);  // also here, so that signals sent right away reach the group
  child.pid = pid;
  child.running = true;
  child.out = std::move(out_pipe.first);
  child.err = std::move(err_pipe.first);
  return Status::Ok();
}

class Supervisor {
 public:
  Supervisor(const LaunchPlan& plan, const LaunchOutput& output) : plan_(plan), output_(output) {}
  StatusOr<LaunchResult> run();

 private:
  Status notice(const std::string& text) { return output_.err("strata-launch: " + text + "\n"); }
  void signal_running(int signal_number);
  Status begin_stopping(const std::string& why);
  Status on_signal(const signalfd_siginfo& info);
  Status reap_children(pid_t first_hint);
  Status read_output(File& pipe, LinePrefixer& lines);
  Status poll_once();
  bool any_running() const;
  bool any_pipe_open() const;

  const LaunchPlan& plan_;
  const LaunchOutput& output_;
  std::vector<Child> children_;
  File signals_;
  std::optional<LaunchResult> failure_;            // the first rank that failed
  bool stopping_ = false;                           // a rank failed: the others were sent SIGTERM
  std::optional<Clock::time_point> kill_deadline_;  // when SIGKILL follows (a failure or a forwarded signal)
  bool killed_ = false;
  bool drained_ = false;  // every child has exited and the open pipes were silent for kDrainAfterExit
};

bool Supervisor::any_running() const {
  for (const Child& child : children_)
    if (child.running) return true;
  return false;
}

bool Supervisor::any_pipe_open() const {
  for (const Child& child : children_)
    if (child.out.is_open() || child.err.is_open()) return true;
  return false;
}

void Supervisor::signal_running(int signal_number) {
  // ESRCH (a group that has just exited) is the only expected failure and is harmless.
  for (const Child& child : children_)
    if (child.running) ::kill(-child.pid, signal_number);
}

Status Supervisor::begin_stopping(const std::string& why) {
  if (stopping_) return Status::Ok();
  stopping_ = true;
  // A forwarded signal may have started the grace period already; it is not restarted.
  if (!kill_deadline_) kill_deadline_ = Clock::now() + plan_.grace_period;
  char grace[32];
  std::snprintf(grace, sizeof(grace), "%.1f s", static_cast<double>(plan_.grace_period.count()) / 1000.0);
  if (any_running()) STRATA_RETURN_IF_ERROR(notice(why + ": stopping the other local ranks (SIGTERM, SIGKILL after " + grace + ")"));
  signal_running(SIGTERM);
  // A stopped rank (SIGSTOP, a debugger) acts on the SIGTERM only once continued; without
  // this it would hold the launcher for the whole grace period.
  signal_running(SIGCONT);
  return Status::Ok();
}

Status Supervisor::on_signal(const signalfd_siginfo& info) {
  const int signal_number = static_cast<int>(info.ssi_signo);
  if (signal_number == SIGCHLD) return reap_children(static_cast<pid_t>(info.ssi_pid));
  STRATA_RETURN_IF_ERROR(notice("received signal " + signal_text(signal_number) + ", passing it on to the local ranks"));
  signal_running(signal_number);
  // The children decide how to end (a trainer may save first), within the grace period.
  if (!kill_deadline_) kill_deadline_ = Clock::now() + plan_.grace_period;
  return Status::Ok();
}

Status Supervisor::reap_children(pid_t first_hint) {
  // Every child that has ended, then processed with `first_hint` first: when several end
  // between two wake-ups, waitpid returns them in fork order, but the SIGCHLD that woke
  // us (the first since the last read; later ones merge into it) names the one that ended
  // first, whose failure is the cause of the others'.
  std::vector<std::pair<pid_t, int>> ended;
  for (;;) {
    int wait_status = 0;
    const pid_t pid = ::waitpid(-1, &wait_status, WNOHANG);
    if (pid == 0 || (pid < 0 && errno == ECHILD)) break;
    if (pid < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "waitpid for the local ranks");
    }
    ended.emplace_back(pid, wait_status);
  }
  std::stable_partition(ended.begin(), ended.end(), [&](const auto& entry) { return entry.first == first_hint; });
  for (const auto& [pid, wait_status] : ended) {
    for (Child& child : children_) {
      if (child.pid != pid || !child.running) continue;
      child.running = false;
      ::kill(-pid, SIGKILL);  // anything the rank left behind in its group
      const bool failed = !WIFEXITED(wait_status) || WEXITSTATUS(wait_status) != 0;
      if (failed && !failure_) {
        failure_ = LaunchResult{exit_code_of_wait_status(wait_status), child.rank, describe_wait_status(wait_status)};
        STRATA_RETURN_IF_ERROR(begin_stopping("rank " + std::to_string(child.rank) + " (pid " + std::to_string(pid) +
                                              ") " + failure_->failure));
      }
    }
  }
  return Status::Ok();
}

Status Supervisor::read_output(File& pipe, LinePrefixer& lines) {
  std::array<char, 65536> buffer;
  const ssize_t bytes = ::read(pipe.fd(), buffer.data(), buffer.size());
  if (bytes < 0 && (errno == EINTR || errno == EAGAIN)) return Status::Ok();
  if (bytes < 0) return Status::FromErrno(errno, "read from " + pipe.path());
  if (bytes == 0) {
    pipe.reset();
    return lines.finish();
  }
  return lines.feed(std::span<const char>(buffer.data(), static_cast<size_t>(bytes)));
}

Status Supervisor::poll_once() {
  std::vector<pollfd> fds = {{signals_.fd(), POLLIN, 0}};
  std::vector<std::pair<File*, LinePrefixer*>> streams;
  for (Child& child : children_) {
    for (auto [pipe, lines] : {std::pair{&child.out, &child.out_lines}, std::pair{&child.err, &child.err_lines}}) {
      if (!pipe->is_open()) continue;
      fds.push_back({pipe->fd(), POLLIN, 0});
      streams.emplace_back(pipe, lines);
    }
  }
  const bool all_exited = !any_running();
  std::optional<Clock::time_point> wake;
  if (all_exited) wake = Clock::now() + kDrainAfterExit;
  else if (kill_deadline_ && !killed_) wake = kill_deadline_;
  int timeout_ms = -1;
  if (wake) {
    const auto left = std::chrono::ceil<std::chrono::milliseconds>(*wake - Clock::now()).count();
    timeout_ms = static_cast<int>(std::clamp<long long>(left, 0, 60000));
  }
  const int ready = ::poll(fds.data(), fds.size(), timeout_ms);
  if (ready < 0 && errno != EINTR) return Status::FromErrno(errno, "poll over the local ranks' output");
  if (ready == 0 && all_exited) drained_ = true;
  if (kill_deadline_ && !killed_ && Clock::now() >= *kill_deadline_ && any_running()) {
    killed_ = true;
    STRATA_RETURN_IF_ERROR(notice("grace period over: sending SIGKILL to the local ranks still running"));
    signal_running(SIGKILL);
  }
  if (ready <= 0) return Status::Ok();
  if (fds[0].revents & POLLIN) {
    signalfd_siginfo info{};
    const ssize_t bytes = ::read(signals_.fd(), &info, sizeof(info));
    if (bytes == sizeof(info)) STRATA_RETURN_IF_ERROR(on_signal(info));
  }
  for (size_t i = 1; i < fds.size(); ++i)
    if (fds[i].revents & (POLLIN | POLLHUP | POLLERR))
      STRATA_RETURN_IF_ERROR(read_output(*streams[i - 1].first, *streams[i - 1].second));
  return Status::Ok();
}

StatusOr<LaunchResult> Supervisor::run() {
  sigset_t handled;
  sigemptyset(&handled);
  sigaddset(&handled, SIGCHLD);
  for (int signal_number : kForwardedSignals) sigaddset(&handled, signal_number);
  STRATA_ASSIGN_OR_RETURN(const SignalMaskGuard mask, SignalMaskGuard::block(handled));
  int fd = -1;
  STRATA_SYSCALL(fd, ::signalfd(-1, &handled, SFD_CLOEXEC | SFD_NONBLOCK));
  signals_ = File(fd, "strata-launch signalfd");

  children_.reserve(static_cast<size_t>(plan_.nproc_per_node));
  for (int local_rank = 0; local_rank < plan_.nproc_per_node; ++local_rank) {
    const int rank = plan_.global_rank(local_rank);
    const std::string prefix = "[rank " + std::to_string(rank) + "] ";
    children_.push_back(Child{local_rank, rank, -1, false, File(), File(), LinePrefixer(prefix, output_.out),
                              LinePrefixer(prefix, output_.err)});
    Status started = start_child(plan_, mask.previous(), children_.back());
    if (!started.ok()) {  // stop the ones already running before reporting
      signal_running(SIGKILL);
      while (any_running() && reap_children(-1).ok() && any_running()) ::usleep(10000);
      return started;
    }
  }
  while (any_running() || (any_pipe_open() && !drained_))
    STRATA_RETURN_IF_ERROR(poll_once());
  for (Child& child : children_) {  // a grandchild kept a pipe open: end its lines anyway
    STRATA_RETURN_IF_ERROR(child.out_lines.finish());
    STRATA_RETURN_IF_ERROR(child.err_lines.finish());
  }
  return failure_.value_or(LaunchResult{});
}

}  // namespace

std::string describe_wait_status(int wait_status) {
  if (WIFEXITED(wait_status)) return "exited with code " + std::to_string(WEXITSTATUS(wait_status));
  if (WIFSIGNALED(wait_status)) return "was killed by signal " + signal_text(WTERMSIG(wait_status));
  return "ended with wait status " + std::to_string(wait_status);
}

int exit_code_of_wait_status(int wait_status) {
  if (WIFEXITED(wait_status)) return WEXITSTATUS(wait_status);
  if (WIFSIGNALED(wait_status)) return 128 + WTERMSIG(wait_status);
  return 255;
}

StatusOr<LaunchResult> run_local_ranks(const LaunchPlan& plan, const LaunchOutput& output) {
  if (plan.command.empty()) return InvalidArgumentError("run_local_ranks: no command to launch");
  if (plan.master_port == 0)
    return InvalidArgumentError("run_local_ranks: master_port is 0; pick one first (pick_free_port)");
  Supervisor supervisor(plan, output);
  return supervisor.run();
}

}  // namespace strata::launch
