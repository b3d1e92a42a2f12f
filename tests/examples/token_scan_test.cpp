// The token file's vocabulary scan (examples/data/token_scan.h): every ISA's span function
// against the scalar reference at odd sizes and offender positions, and the parallel
// driver's answer (the lowest offending index) for any chunking and thread count.
#include "examples/data/token_scan.h"

#include <gtest/gtest.h>

#include <cstdint>
#include <vector>

#include "tests/support/test_support.h"

namespace strata::data {
namespace {

constexpr size_t kSizes[] = {1, 7, 22, 55, 64, 65, 129, 4097};

std::vector<CpuIsa> runnable_isas() {
  std::vector<CpuIsa> isas;
  for (CpuIsa isa : {CpuIsa::kScalar, CpuIsa::kAvx2, CpuIsa::kAvx512})
    if (token_scan_kernels(isa).ok()) isas.push_back(isa);
  return isas;
}

template <class T>
std::vector<T> below(size_t n, uint32_t bound) {
  std::vector<T> tokens(n);
  for (size_t i = 0; i < n; ++i) tokens[i] = static_cast<T>((i * 2654435761u) % bound);
  return tokens;
}

TEST(TokenScanTest, EverySpanFunctionMatchesTheScalarReferenceAtOddSizesAndPositions) {
  for (CpuIsa isa : runnable_isas()) {
    SCOPED_TRACE(std::string(cpu_isa_name(isa)));
    const TokenScanKernels kernels = *token_scan_kernels(isa);
    for (size_t n : kSizes) {
      for (uint32_t bound : {1u, 255u, 50257u, 65535u}) {
        std::vector<uint16_t> u16 = below<uint16_t>(n, bound);
        std::vector<uint32_t> u32 = below<uint32_t>(n, bound);
        EXPECT_EQ(kernels.scan_u16(u16.data(), n, bound), n) << n;
        EXPECT_EQ(kernels.scan_u32(u32.data(), n, bound), n) << n;
        for (size_t position : {size_t{0}, n / 2, n - 1}) {
          for (uint32_t bad : {bound, std::min<uint32_t>(bound + 1, 65535u), 65535u}) {
            if (bad < bound) continue;
            std::vector<uint16_t> a = u16;
            std::vector<uint32_t> b = u32;
            a[position] = static_cast<uint16_t>(bad);
            b[position] = bad;
            EXPECT_EQ(kernels.scan_u16(a.data(), n, bound), internal::token_scan_u16_scalar(a.data(), n, bound));
            EXPECT_EQ(kernels.scan_u16(a.data(), n, bound), position) << "n " << n << " bound " << bound;
            EXPECT_EQ(kernels.scan_u32(b.data(), n, bound), position) << "n " << n << " bound " << bound;
          }
        }
      }
      // Values no uint16 reaches; the top bit of uint32 (an unsigned compare, not signed).
      std::vector<uint16_t> top16(n, 65535);
      EXPECT_EQ(kernels.scan_u16(top16.data(), n, 65536), n);
      std::vector<uint32_t> top32 = below<uint32_t>(n, 1000);
      top32[n - 1] = 0x80000000u;
      EXPECT_EQ(kernels.scan_u32(top32.data(), n, 1000), n - 1);
      EXPECT_EQ(kernels.scan_u32(top32.data(), n, 0x80000001u), n);
    }
  }
}

TEST(TokenScanTest, TheDriverFindsTheLowestOffenderForAnyChunkingAndThreadCount) {
  const size_t n = 100003;
  std::vector<uint16_t> tokens = below<uint16_t>(n, 50257);
  for (size_t bad : {size_t{99999}, size_t{70001}, size_t{40000}}) tokens[bad] = 60000;
  for (int threads : {1, 2, 3}) {
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Executor> executor, make_executor({.threads = threads}));
    for (CpuIsa isa : runnable_isas()) {
      const TokenScanKernels kernels = *token_scan_kernels(isa);
      for (uint64_t chunk : {uint64_t{1} << 20, uint64_t{4096}, uint64_t{7}, uint64_t{1}}) {
        const TokenSpan span{.data = tokens.data(), .token_bytes = 2, .count = n};
        EXPECT_EQ(find_token_at_or_above(span, 50257, kernels, *executor, chunk), std::optional<uint64_t>(40000))
            << threads << " threads, chunk " << chunk;
        EXPECT_EQ(find_token_at_or_above(span, 60001, kernels, *executor, chunk), std::nullopt);
        const TokenSpan empty{.data = tokens.data(), .token_bytes = 2, .count = 0};
        EXPECT_EQ(find_token_at_or_above(empty, 1, kernels, *executor, chunk), std::nullopt);
      }
    }
  }
}

}  // namespace
}  // namespace strata::data
