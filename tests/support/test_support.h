// Helpers shared by the tests.
#pragma once

#include <gtest/gtest.h>

#include <condition_variable>
#include <filesystem>
#include <mutex>
#include <string>

#include "engine/core/status.h"

namespace strata::testing {

// A fresh directory for this test, under STRATA_TEST_TMPDIR (set per test by CTest) or
// the system temp directory; removed with its contents on destruction.
class TempDir {
 public:
  TempDir();
  ~TempDir();
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::string str() const { return path_.string(); }

 private:
  std::filesystem::path path_;
};

// A tmpfs of the given mount options (e.g. "size=256k", "ro") mounted at `at` (created if
// missing) and unmounted on destruction, whatever the test did. Mounting needs root:
// `mounted` is false where it was refused, and the test skips with the reason.
struct ScopedTmpfs {
  std::filesystem::path path;
  bool mounted = false;
  ScopedTmpfs(const std::filesystem::path& at, const std::string& options);
  ~ScopedTmpfs();
  ScopedTmpfs(const ScopedTmpfs&) = delete;
  ScopedTmpfs& operator=(const ScopedTmpfs&) = delete;
};

// A one-shot gate a stream task waits on (`wait()`) until the test opens it: holds a stream
// at a point while the test checks what the host can do meanwhile. It opens when destroyed
// too, so declared after the streams it cannot leave one blocked while its destructor
// drains it (otherwise use OpenOnExit).
class Gate {
 public:
  Gate() = default;
  ~Gate() { open(); }
  Gate(const Gate&) = delete;
  Gate& operator=(const Gate&) = delete;
  void open() {
    std::lock_guard<std::mutex> lock(mutex_);
    open_ = true;
    opened_.notify_all();
  }
  void wait() {
    std::unique_lock<std::mutex> lock(mutex_);
    opened_.wait(lock, [&] { return open_; });
  }

 private:
  std::mutex mutex_;
  std::condition_variable opened_;
  bool open_ = false;
};

// Opens a gate when the scope ends (a failed assertion returns early). Declare it after
// the streams the gate holds.
class OpenOnExit {
 public:
  explicit OpenOnExit(Gate& gate) : gate_(gate) {}
  ~OpenOnExit() { gate_.open(); }
  OpenOnExit(const OpenOnExit&) = delete;
  OpenOnExit& operator=(const OpenOnExit&) = delete;

 private:
  Gate& gate_;
};

// The source tree's root (STRATA_SOURCE_DIR) and the build tree's (STRATA_BINARY_DIR).
std::filesystem::path source_dir();
std::filesystem::path binary_dir();

// Whether `text` contains `part` (error messages, program output).
inline bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

}  // namespace strata::testing

#define STRATA_ASSERT_OK(expr)                                                    \
  do {                                                                            \
    const ::strata::Status strata_test_status_ = ::strata::internal::as_status(expr); \
    ASSERT_TRUE(strata_test_status_.ok()) << strata_test_status_.to_string();     \
  } while (0)

#define STRATA_EXPECT_OK(expr)                                                    \
  do {                                                                            \
    const ::strata::Status strata_test_status_ = ::strata::internal::as_status(expr); \
    EXPECT_TRUE(strata_test_status_.ok()) << strata_test_status_.to_string();     \
  } while (0)

// `STRATA_ASSERT_OK_AND_ASSIGN(auto x, f());`
#define STRATA_ASSERT_OK_AND_ASSIGN(lhs, expr) \
  STRATA_ASSERT_OK_AND_ASSIGN_IMPL(STRATA_STATUS_CONCAT(strata_test_statusor_, __LINE__), lhs, expr)
#define STRATA_ASSERT_OK_AND_ASSIGN_IMPL(tmp, lhs, expr)          \
  auto tmp = (expr);                                              \
  ASSERT_TRUE(tmp.ok()) << tmp.status().to_string();              \
  lhs = std::move(tmp).value()
