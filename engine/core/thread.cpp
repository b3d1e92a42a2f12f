#include "engine/core/thread.h"

#include <dirent.h>
#include <pthread.h>
#include <sys/resource.h>
#include <unistd.h>

#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>

#include "engine/core/log.h"

namespace strata {
namespace {

// The armed injection: `target` is the failing spawn's number (0 = none armed) and
// `count` the spawns seen since arming. The only mutable global here, and test-only.
std::atomic<int> g_injected_target{0};
std::atomic<int> g_injected_count{0};

std::string limit_text(rlim_t value) { return value == RLIM_INFINITY ? std::string("unlimited") : std::to_string(value); }

// Threads of this process (entries of /proc/self/task); -1 where it cannot be read.
int thread_count() {
  DIR* dir = ::opendir("/proc/self/task");
  if (dir == nullptr) return -1;
  int count = 0;
  while (const dirent* entry = ::readdir(dir))
    if (entry->d_name[0] != '.') ++count;
  ::closedir(dir);
  return count;
}

}  // namespace

namespace internal {

Status thread_spawn_error(std::string_view name, int error) {
  std::string text = "cannot start the thread '" + std::string(name) + "': " + std::strerror(error) + " (errno " + std::to_string(error) + ")";
  rlimit nproc{};
  if (::getrlimit(RLIMIT_NPROC, &nproc) == 0)
    text += "; RLIMIT_NPROC (ulimit -u, threads per user) is " + limit_text(nproc.rlim_cur) + " (hard " + limit_text(nproc.rlim_max) + ")";
  rlimit stack{};
  if (::getrlimit(RLIMIT_STACK, &stack) == 0) text += ", RLIMIT_STACK (bytes per thread stack) " + limit_text(stack.rlim_cur);
  rlimit address_space{};
  if (::getrlimit(RLIMIT_AS, &address_space) == 0) text += ", RLIMIT_AS " + limit_text(address_space.rlim_cur);
  if (const int threads = thread_count(); threads >= 0) text += "; this process runs " + std::to_string(threads) + " threads";
  // pthread_create says EAGAIN both at the thread limit and when no stack can be mapped.
  text += error == EAGAIN ? ". Raise the thread limit (ulimit -u) or the memory limits (ulimit -v), or run fewer threads "
                            "(strata.compute_threads, strata.optimizer_threads)"
                          : ". The system is out of memory for a thread stack";
  return ResourceExhaustedError(std::move(text));
}

Status injected_thread_spawn_failure(std::string_view name) {
  const int target = g_injected_target.load();
  if (target == 0) return {};
  if (g_injected_count.fetch_add(1) + 1 != target) return {};
  return thread_spawn_error(name, EAGAIN);
}

}  // namespace internal

Status set_current_thread_nice(int nice) {
  if (::setpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()), nice) != 0)
    return Status::FromErrno(errno, "setpriority(nice " + std::to_string(nice) + ") of this thread");
  return {};
}

void lower_current_thread_priority(int nice) {
  errno = 0;
  const int current = ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
  if (errno == 0 && current >= nice) return;  // already that low (or lower): never raise it
  const Status status = set_current_thread_nice(nice);
  static std::once_flag warned;
  if (!status.ok()) std::call_once(warned, [&] { STRATA_LOG(kWarn) << "a thread keeps its priority: " << status.to_string(); });
}

namespace internal {

void set_current_thread_name(const std::string& name) { (void)pthread_setname_np(pthread_self(), name.substr(0, 15).c_str()); }

}  // namespace internal

ThreadSpawnFailureForTest::ThreadSpawnFailureForTest(int nth) {
  g_injected_count.store(0);
  g_injected_target.store(nth);
}

ThreadSpawnFailureForTest::~ThreadSpawnFailureForTest() { g_injected_target.store(0); }

int ThreadSpawnFailureForTest::attempts() const { return g_injected_count.load(); }

}  // namespace strata
