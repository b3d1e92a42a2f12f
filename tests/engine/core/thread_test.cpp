// spawn_thread (engine/core/thread.h): a thread the system refuses is a Status naming the
// thread and the limits, never std::terminate; the test-only injection fails one chosen
// spawn; and the executor built on it reports a refused worker.
#include "engine/core/thread.h"

#include <gtest/gtest.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <fstream>
#include <string>

#include "engine/core/cpu_device.h"
#include "engine/core/executor.h"

namespace strata {
namespace {

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

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

}  // namespace
}  // namespace strata
