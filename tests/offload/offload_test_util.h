// Helpers for the offload tests: byte patterns, aligned scratch memory, and running a
// piece of a test in a forked child (for process-wide state: rlimits, capabilities, a
// private mount namespace, a second process holding a lock).
#pragma once

#include <fcntl.h>
#include <sched.h>
#include <sys/mount.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>

#include "offload/nvme_store.h"

// Opens a store into `var`; skips the test (with the reason) where the kernel refuses
// the io_uring engine the options ask for.
#define OPEN_STORE_OR_SKIP(var, options)                                      \
  auto var##_or = ::strata::NvmeStore::open(options);                         \
  if (!var##_or.ok() && var##_or.status().code() == ::strata::StatusCode::kUnavailable) \
    GTEST_SKIP() << var##_or.status().message();                              \
  STRATA_ASSERT_OK(var##_or);                                                 \
  std::unique_ptr<::strata::NvmeStore> var = std::move(var##_or).value()

namespace strata::testing {

// A deterministic pattern that differs per seed and per byte position.
inline void fill_pattern(void* data, size_t bytes, uint64_t seed) {
  auto* p = static_cast<unsigned char*>(data);
  uint64_t state = seed * 0x9E3779B97F4A7C15ULL + 1;
  for (size_t i = 0; i < bytes; ++i) {
    state ^= state << 13;
    state ^= state >> 7;
    state ^= state << 17;
    p[i] = static_cast<unsigned char>(state >> 24);
  }
}

// The index of the first byte where `data` differs from the pattern, or -1.
inline int64_t first_pattern_mismatch(const void* data, size_t bytes, uint64_t seed) {
  auto expected = std::make_unique<unsigned char[]>(bytes == 0 ? 1 : bytes);
  fill_pattern(expected.get(), bytes, seed);
  const auto* p = static_cast<const unsigned char*>(data);
  for (size_t i = 0; i < bytes; ++i) {
    if (p[i] != expected[i]) return static_cast<int64_t>(i);
  }
  return -1;
}

struct FreeDeleter {
  void operator()(void* p) const { std::free(p); }
};
using AlignedMemory = std::unique_ptr<char, FreeDeleter>;
inline AlignedMemory aligned_memory(size_t bytes, size_t alignment = 4096) {
  return AlignedMemory(static_cast<char*>(std::aligned_alloc(alignment, (bytes + alignment - 1) / alignment * alignment)));
}

// Runs `body` in a forked child and returns what it returned (or "child crashed: ...").
// The child's stderr goes to `child_stderr` when given. The caller must have no other
// threads running (no live engines) when calling this.
inline std::string run_in_child(const std::function<std::string()>& body, std::string* child_stderr = nullptr) {
  int result_pipe[2];
  int stderr_pipe[2];
  if (::pipe(result_pipe) != 0 || ::pipe(stderr_pipe) != 0) return "pipe failed";
  const pid_t pid = ::fork();
  if (pid < 0) return "fork failed";
  if (pid == 0) {
    ::close(result_pipe[0]);
    ::close(stderr_pipe[0]);
    if (child_stderr != nullptr) ::dup2(stderr_pipe[1], STDERR_FILENO);
    const std::string result = body();
    size_t written = 0;
    while (written < result.size()) {
      const ssize_t n = ::write(result_pipe[1], result.data() + written, result.size() - written);
      if (n <= 0) break;
      written += static_cast<size_t>(n);
    }
    ::_exit(0);
  }
  ::close(result_pipe[1]);
  ::close(stderr_pipe[1]);
  auto drain = [](int fd) {
    std::string text;
    char chunk[4096];
    for (;;) {
      const ssize_t n = ::read(fd, chunk, sizeof(chunk));
      if (n <= 0) break;
      text.append(chunk, static_cast<size_t>(n));
    }
    ::close(fd);
    return text;
  };
  std::string err = drain(stderr_pipe[0]);
  std::string result = drain(result_pipe[0]);
  int wstatus = 0;
  ::waitpid(pid, &wstatus, 0);
  if (child_stderr != nullptr) *child_stderr = err;
  if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
    return "child crashed (wait status " + std::to_string(wstatus) + "): " + result;
  }
  return result;
}

// In a child: enters a private mount namespace (so mounts vanish with the child) and
// mounts a tmpfs of `size` at `dir`. Returns an empty string, or why it could not.
inline std::string mount_private_tmpfs(const std::string& dir, const std::string& size) {
  if (::unshare(CLONE_NEWNS) != 0) return std::string("unshare(CLONE_NEWNS): ") + std::strerror(errno);
  if (::mount("none", "/", nullptr, MS_REC | MS_PRIVATE, nullptr) != 0) {
    return std::string("mount --make-rprivate /: ") + std::strerror(errno);
  }
  const std::string options = "size=" + size;
  if (::mount("strata-test", dir.c_str(), "tmpfs", 0, options.c_str()) != 0) {
    return std::string("mount tmpfs: ") + std::strerror(errno);
  }
  return "";
}

}  // namespace strata::testing
