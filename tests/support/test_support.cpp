#include "tests/support/test_support.h"

#include <sys/mount.h>
#include <unistd.h>

#include <atomic>
#include <cstdlib>
#include <system_error>

namespace strata::testing {

TempDir::TempDir() {
  const char* root_env = std::getenv("STRATA_TEST_TMPDIR");
  std::filesystem::path root = root_env != nullptr ? std::filesystem::path(root_env) : std::filesystem::temp_directory_path() / "strata-tests";
  std::filesystem::create_directories(root);
  static std::atomic<int> counter{0};
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  std::string name = info != nullptr ? std::string(info->test_suite_name()) + "." + info->name() : "test";
  for (char& c : name) {
    if (c == '/' || c == ' ') c = '_';
  }
  path_ = root / (name + "-" + std::to_string(::getpid()) + "-" + std::to_string(counter++));
  std::filesystem::remove_all(path_);
  std::filesystem::create_directories(path_);
}

TempDir::~TempDir() {
  std::error_code ignored;
  std::filesystem::remove_all(path_, ignored);
}

std::filesystem::path source_dir() {
  const char* dir = std::getenv("STRATA_SOURCE_DIR");
  return dir != nullptr ? std::filesystem::path(dir) : std::filesystem::current_path();
}

std::filesystem::path binary_dir() {
  const char* dir = std::getenv("STRATA_BINARY_DIR");
  return dir != nullptr ? std::filesystem::path(dir) : std::filesystem::current_path();
}

ScopedTmpfs::ScopedTmpfs(const std::filesystem::path& at, const std::string& options) : path(at) {
  std::filesystem::create_directories(path);
  mounted = ::mount("tmpfs", path.c_str(), "tmpfs", 0, options.c_str()) == 0;
}

ScopedTmpfs::~ScopedTmpfs() {
  if (mounted) ::umount2(path.c_str(), MNT_DETACH);
}

}  // namespace strata::testing
