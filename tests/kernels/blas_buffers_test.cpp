// OpenBLAS's working buffers under an address-space limit (`ulimit -v`): OpenBLAS maps one
// (about 128 MiB) for each thread on its first product and retries forever where the limit
// refuses it, so reserve_blas_buffers maps them up front or fails naming the buffer. Each
// case runs in a child process under its own limit; this program's own process never
// multiplies, so no child inherits a buffer OpenBLAS already mapped.
#include <gtest/gtest.h>

#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmath>
#include <csignal>
#include <cstdio>
#include <functional>
#include <string>
#include <vector>

#include "kernels/transformer_ops_cpu.h"

#if __has_include(<cblas.h>)
#include <cblas.h>
#endif

namespace strata {
namespace {

#if defined(OPENBLAS_VERSION) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
// What this process maps now, in bytes (VmSize in /proc/self/status); 0 when unknown.
size_t mapped_bytes() {
  FILE* status = std::fopen("/proc/self/status", "r");
  if (status == nullptr) return 0;
  char line[256];
  size_t kib = 0;
  while (std::fgets(line, sizeof line, status) != nullptr) {
    if (std::sscanf(line, "VmSize: %zu kB", &kib) == 1) break;
  }
  std::fclose(status);
  return kib * 1024;
}

// Caps this process's address space at what it maps now plus `headroom` bytes.
bool limit_address_space(size_t headroom) {
  const size_t mapped = mapped_bytes();
  const rlimit limit{mapped + headroom, mapped + headroom};
  return mapped > 0 && setrlimit(RLIMIT_AS, &limit) == 0;
}

// Runs `body` in a child process that SIGALRM ends after `seconds` (a hang); its exit
// status, or 128 + the signal that ended it.
int exit_status_of_child(unsigned seconds, const std::function<int()>& body) {
  const pid_t pid = fork();
  if (pid == 0) {
    alarm(seconds);
    _exit(body());
  }
  int status = 0;
  if (pid < 0 || waitpid(pid, &status, 0) != pid) return -1;
  return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// A product through OpenBLAS's buffer (large enough not to take a small-matrix path):
// 0 when it is right, 3 when not.
int multiply_once() {
  const int n = 256;
  std::vector<float> a(n * n, 1.0f), b(n * n, 0.5f), c(n * n, std::nanf(""));
  cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, n, n, n, 1.0f, a.data(), n, b.data(), n, 0.0f, c.data(), n);
  return c[0] == 0.5f * n && c[n * n - 1] == 0.5f * n ? 0 : 3;
}

constexpr int kHung = 128 + SIGALRM;

TEST(BlasBuffersTest, ReservingWhereTheLimitRefusesTheBuffersFailsNamingTheFirstOneRefused) {
  const int status = exit_status_of_child(20, [] {
    if (!limit_address_space(size_t{64} << 20)) return 2;  // room for less than one buffer
    const Status reserved = kernels::cpu::reserve_blas_buffers(2);
    if (reserved.code() != StatusCode::kOutOfMemory) return 4;
    return reserved.message().find("'OpenBLAS working buffer 1 of 2'") != std::string::npos ? 0 : 5;
  });
  EXPECT_EQ(status, 0) << "2: no limit set; 4: not OUT_OF_MEMORY; 5: the buffer is not named; " << kHung << ": hung";
}

TEST(BlasBuffersTest, AProductAfterTheReservationNeedsNoRoomBeyondIt) {
  const int status = exit_status_of_child(20, [] {
    if (!kernels::cpu::reserve_blas_buffers(1).ok()) return 4;
    // Room for the product's matrices, not for another buffer.
    if (!limit_address_space(size_t{32} << 20)) return 2;
    return multiply_once();
  });
  EXPECT_EQ(status, 0) << "2: no limit set; 3: a wrong product; 4: the reservation failed; " << kHung
                       << ": hung in the product";
}

// What the reservation is for: the same product without it never returns. When an
// OpenBLAS no longer retries a refused buffer, this skips.
TEST(BlasBuffersTest, WithoutTheReservationTheSameProductRetriesItsBufferForever) {
  const int status = exit_status_of_child(3, [] {
    if (!limit_address_space(size_t{32} << 20)) return 2;
    return multiply_once();
  });
  ASSERT_NE(status, 2) << "no limit set";
  if (status != kHung) GTEST_SKIP() << "this OpenBLAS does not hang on a refused buffer (exit " << status << ")";
}
#else
TEST(BlasBuffersTest, NeedsOpenBlasAndNoSanitizer) {
  GTEST_SKIP() << "OpenBLAS's buffers are OpenBLAS's (none here), and a sanitizer's shadow memory leaves no address-space limit to set";
}
#endif

}  // namespace
}  // namespace strata
