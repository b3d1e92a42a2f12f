// spawn_thread (engine/core/thread.h): a thread the system refuses is a Status naming the
// thread and the limits, never std::terminate; the test-only injection fails one chosen
// spawn; and the executor built on it reports a refused worker. A thread's nice value is
// its own: the executors' workers and the CPU device's threads lower theirs when asked,
// and the threads that call them keep theirs.
#include "engine/core/thread.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <fstream>
#include <map>
#include <mutex>
#include <string>
#include <thread>

#include "engine/core/cpu_device.h"
#include "engine/core/executor.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::contains;

int current_thread_nice() {
  errno = 0;
  return ::getpriority(PRIO_PROCESS, static_cast<id_t>(::gettid()));
}

// A nice value above the test process's own (which may already run niced, e.g. under a
// CI that lowers it): lowering needs no privilege, so it works wherever the test runs.
int a_lower_priority() { return std::min(current_thread_nice() + 5, 19); }

// Runs a two-chunk parallel_for whose chunks wait for each other, so that two different
// threads run them (the caller and one worker), and returns each one's nice value by
// thread id. A chunk that waits more than 30 s gives up, and the test then fails on the
// count of threads instead of hanging.
std::map<pid_t, int> nice_of_each_thread_in_a_parallel_for(Executor& executor) {
  std::mutex mutex;
  std::map<pid_t, int> nice_by_thread;
  std::atomic<int> started{0};
  executor.parallel_for(0, 2, 1, [&](size_t lo, size_t hi) {
    for (size_t i = lo; i < hi; ++i) {
      {
        std::lock_guard<std::mutex> lock(mutex);
        nice_by_thread[::gettid()] = current_thread_nice();
      }
      started.fetch_add(1);
      const auto give_up = std::chrono::steady_clock::now() + std::chrono::seconds(30);
      while (started.load() < 2 && std::chrono::steady_clock::now() < give_up) std::this_thread::yield();
    }
  });
  return nice_by_thread;
}

TEST(ThreadTest, SpawnRunsTheBodyAndNamesTheThread) {
  std::atomic<bool> ran{false};
  std::string name;
  StatusOr<std::thread> thread = spawn_thread("strata:test-thread-long-name", [&] {
    ran = true;
    char buffer[32] = {};
    pthread_getname_np(pthread_self(), buffer, sizeof(buffer));
    name = buffer;
  });
  ASSERT_TRUE(thread.ok()) << thread.status().to_string();
  thread->join();
  EXPECT_TRUE(ran);
  EXPECT_EQ(name, "strata:test-thr");  // Linux keeps 15 characters
}

TEST(ThreadTest, TheInjectedFailureIsTheNthSpawnAndNamesTheLimit) {
  ThreadSpawnFailureForTest failure(2);
  StatusOr<std::thread> first = spawn_thread("first", [] {});
  ASSERT_TRUE(first.ok());
  first->join();
  StatusOr<std::thread> second = spawn_thread("second", [] {});
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kResourceExhausted);
  const std::string message = second.status().message();
  EXPECT_TRUE(contains(message, "cannot start the thread 'second': Resource temporarily unavailable (errno 11)")) << message;
  EXPECT_TRUE(contains(message, "RLIMIT_NPROC (ulimit -u, threads per user) is ")) << message;
  EXPECT_TRUE(contains(message, "Raise the thread limit (ulimit -u) or the memory limits (ulimit -v)")) << message;
  StatusOr<std::thread> third = spawn_thread("third", [] {});
  ASSERT_TRUE(third.ok());
  third->join();
  EXPECT_EQ(failure.attempts(), 3);
}

// The child process leaves no room in its address space for another thread stack: the
// system refuses the thread itself (no injection). A raw std::thread would end the
// child in std::terminate (SIGABRT); a Status lets it exit 0.
TEST(ThreadTest, ARealRefusalUnderAnAddressSpaceLimitIsAStatusNotATerminate) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    long pages = 0;
    std::ifstream("/proc/self/statm") >> pages;
    const rlim_t used = static_cast<rlim_t>(pages) * static_cast<rlim_t>(::sysconf(_SC_PAGESIZE));
    const rlimit limit{used + (1 << 20), used + (1 << 20)};  // 1 MiB more: less than one 8 MiB stack
    if (::setrlimit(RLIMIT_AS, &limit) != 0) ::_exit(3);
    StatusOr<std::unique_ptr<Executor>> executor = make_executor({.threads = 4, .kind = ExecutorKind::kThreads});
    if (executor.ok()) ::_exit(4);
    const std::string message = executor.status().to_string();  // with the context trail
    ::_exit(contains(message, "cannot start the thread 'strata:exec'") && contains(message, "RLIMIT_AS") &&
                    contains(message, "while starting a 4-thread executor")
                ? 0
                : 5);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0);
}

TEST(ThreadTest, EveryWorkerOfTheExecutorAndAStreamReportARefusedThread) {
  for (int nth = 1; nth <= 3; ++nth) {
    ThreadSpawnFailureForTest failure(nth);
    StatusOr<std::unique_ptr<Executor>> executor = make_executor({.threads = 4, .kind = ExecutorKind::kThreads});
    ASSERT_FALSE(executor.ok()) << nth;
    EXPECT_TRUE(contains(executor.status().message(), "'strata:exec'")) << executor.status().message();
  }
  CpuDeviceOptions options;
  StatusOr<std::unique_ptr<CpuDevice>> device = CpuDevice::create(options);
  ASSERT_TRUE(device.ok()) << device.status().to_string();
  ThreadSpawnFailureForTest failure(1);
  StatusOr<std::unique_ptr<Stream>> stream = (*device)->create_stream("compute");
  ASSERT_FALSE(stream.ok());
  EXPECT_TRUE(contains(stream.status().message(), "cannot start the thread 'strata:compute'")) << stream.status().message();
}

TEST(ThreadTest, LoweringTheNiceValueChangesOnlyTheCallingThread) {
  const int own = current_thread_nice();
  const int lower = a_lower_priority();
  int seen_inside = -100;
  StatusOr<std::thread> thread = spawn_thread("strata:niced", [&] {
    const Status status = set_current_thread_nice(lower);
    EXPECT_TRUE(status.ok()) << status.to_string();
    seen_inside = current_thread_nice();
  });
  ASSERT_TRUE(thread.ok());
  thread->join();
  EXPECT_EQ(seen_inside, lower);
  EXPECT_EQ(current_thread_nice(), own);
}

// In a child that has no privilege (root gives it up by becoming nobody, uid 65534): a
// thread that lowered its priority cannot raise it back, and says so.
TEST(ThreadTest, RaisingTheNiceValueBackWithoutPrivilegeIsAStatusNamingIt) {
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    if (::geteuid() == 0 && ::setuid(65534) != 0) ::_exit(3);
    if (!set_current_thread_nice(19).ok()) ::_exit(4);
    const Status status = set_current_thread_nice(0);
    if (status.ok()) ::_exit(5);
    ::_exit(contains(status.message(), "setpriority(nice 0) of this thread") && contains(status.message(), "Permission denied")
                ? 0
                : 6);
  }
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFEXITED(status)) << "the child died of signal " << WTERMSIG(status);
  EXPECT_EQ(WEXITSTATUS(status), 0) << "3: setuid failed, 4: could not lower, 5: raised it back, 6: the message";
}

class ExecutorNiceTest : public ::testing::TestWithParam<ExecutorKind> {};

TEST_P(ExecutorNiceTest, WorkersTakeTheirNiceValueAndTheCallerKeepsItsOwn) {
  if (GetParam() == ExecutorKind::kTbb && built_with_thread_sanitizer()) GTEST_SKIP() << "no oneTBB under ThreadSanitizer";
  const int own = current_thread_nice();
  const int lower = a_lower_priority();
  if (lower == own) GTEST_SKIP() << "the test already runs at nice 19: there is no lower priority to give";
  StatusOr<std::unique_ptr<Executor>> executor = make_executor({.threads = 2, .kind = GetParam(), .worker_nice = lower});
  ASSERT_TRUE(executor.ok()) << executor.status().to_string();
  const std::map<pid_t, int> nice_by_thread = nice_of_each_thread_in_a_parallel_for(**executor);
  ASSERT_EQ(nice_by_thread.size(), 2u) << "two chunks that wait for each other ran on one thread";
  for (const auto& [thread, nice] : nice_by_thread) EXPECT_EQ(nice, thread == ::gettid() ? own : lower) << thread;
  EXPECT_EQ(current_thread_nice(), own);
}

// Plain threads only: oneTBB's workers are the process's, and a test before this one has
// lowered theirs (which is why CPU Adam runs on plain threads of its own).
TEST(ThreadTest, PlainThreadWorkersKeepTheProcessPriorityByDefault) {
  const int own = current_thread_nice();
  StatusOr<std::unique_ptr<Executor>> executor = make_executor({.threads = 2, .kind = ExecutorKind::kThreads});
  ASSERT_TRUE(executor.ok()) << executor.status().to_string();
  const std::map<pid_t, int> nice_by_thread = nice_of_each_thread_in_a_parallel_for(**executor);
  ASSERT_EQ(nice_by_thread.size(), 2u);
  for (const auto& [thread, nice] : nice_by_thread) EXPECT_EQ(nice, own) << thread;
}

INSTANTIATE_TEST_SUITE_P(Kinds, ExecutorNiceTest, ::testing::Values(ExecutorKind::kThreads, ExecutorKind::kTbb),
                         [](const ::testing::TestParamInfo<ExecutorKind>& info) {
                           return info.param == ExecutorKind::kTbb ? std::string("Tbb") : std::string("Threads");
                         });

// The nice values a CPU device's threads run at: a task on one of its streams reads its
// worker's, then runs a parallel_for on the device's executor (two threads, see above).
struct DeviceThreadsNice {
  int stream = -100;
  std::map<pid_t, int> compute;
};

StatusOr<DeviceThreadsNice> nice_of_the_device_threads(const CpuDeviceOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<CpuDevice> device, CpuDevice::create(options));
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<Stream> stream, device->create_stream("compute"));
  DeviceThreadsNice seen;
  STRATA_RETURN_IF_ERROR(stream->enqueue_host([&]() -> Status {
    seen.stream = current_thread_nice();
    seen.compute = nice_of_each_thread_in_a_parallel_for(device->executor());
    return {};
  }));
  STRATA_RETURN_IF_ERROR(stream->synchronize());
  return seen;
}

// The CPU device stands in for an accelerator: its stream workers and its executor's workers
// run at thread_nice, so the host stages (CPU Adam, the gradient landing, the I/O) that share
// the cores with it run first.
TEST(ThreadTest, TheCpuDevicesStreamAndComputeThreadsRunAtItsThreadNice) {
  const int own = current_thread_nice();
  CpuDeviceOptions options;
  options.thread_nice = a_lower_priority();
  if (options.thread_nice == own) GTEST_SKIP() << "the test already runs at nice 19";
  options.compute = {.threads = 2, .kind = built_with_thread_sanitizer() ? ExecutorKind::kThreads : ExecutorKind::kTbb};
  StatusOr<DeviceThreadsNice> seen = nice_of_the_device_threads(options);
  ASSERT_TRUE(seen.ok()) << seen.status().to_string();
  EXPECT_EQ(seen->stream, options.thread_nice);
  ASSERT_EQ(seen->compute.size(), 2u);
  for (const auto& [thread, nice] : seen->compute) EXPECT_EQ(nice, options.thread_nice) << thread;
  EXPECT_EQ(current_thread_nice(), own);
}

TEST(ThreadTest, ACpuDeviceAtThreadNiceZeroLeavesItsThreadsAtTheProcessPriority) {
  const int own = current_thread_nice();
  CpuDeviceOptions options;
  options.thread_nice = 0;
  options.compute = {.threads = 2, .kind = ExecutorKind::kThreads};
  StatusOr<DeviceThreadsNice> seen = nice_of_the_device_threads(options);
  ASSERT_TRUE(seen.ok()) << seen.status().to_string();
  EXPECT_EQ(seen->stream, own);
  ASSERT_EQ(seen->compute.size(), 2u);
  for (const auto& [thread, nice] : seen->compute) EXPECT_EQ(nice, own) << thread;
}

}  // namespace
}  // namespace strata
