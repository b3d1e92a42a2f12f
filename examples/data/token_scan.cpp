#include "examples/data/token_scan.h"

#include <algorithm>
#include <atomic>
#include <string>
#include <vector>

namespace strata::data {
namespace internal {

size_t token_scan_u16_scalar(const uint16_t* tokens, size_t count, uint64_t bound) {
  for (size_t i = 0; i < count; ++i)
    if (token_at_or_above(tokens[i], bound)) return i;
  return count;
}

size_t token_scan_u32_scalar(const uint32_t* tokens, size_t count, uint64_t bound) {
  for (size_t i = 0; i < count; ++i)
    if (token_at_or_above(tokens[i], bound)) return i;
  return count;
}

}  // namespace internal

StatusOr<TokenScanKernels> token_scan_kernels(CpuIsa isa) {
  if (!cpu_isa_supported(isa))
    return UnavailableError("token scan: this CPU or build cannot run " + std::string(cpu_isa_name(isa)) + " kernels");
  TokenScanKernels kernels;
  kernels.isa = isa;
  switch (isa) {
    case CpuIsa::kScalar:
      kernels.scan_u16 = internal::token_scan_u16_scalar;
      kernels.scan_u32 = internal::token_scan_u32_scalar;
      return kernels;
#if defined(STRATA_DATA_X86_KERNELS)
    case CpuIsa::kAvx2:
      kernels.scan_u16 = internal::token_scan_u16_avx2;
      kernels.scan_u32 = internal::token_scan_u32_avx2;
      return kernels;
    case CpuIsa::kAvx512:
      kernels.scan_u16 = internal::token_scan_u16_avx512;
      kernels.scan_u32 = internal::token_scan_u32_avx512;
      return kernels;
#endif
    default: break;
  }
  return UnavailableError("token scan: no kernels for " + std::string(cpu_isa_name(isa)) + " in this build");
}

std::optional<uint64_t> find_token_at_or_above(const TokenSpan& tokens, uint64_t bound, const TokenScanKernels& kernels,
                                               Executor& executor, uint64_t chunk_tokens) {
  // A bound past the token type's range cannot be reached.
  const uint64_t type_limit = tokens.token_bytes == 2 ? uint64_t{1} << 16 : uint64_t{1} << 32;
  if (tokens.count == 0 || bound >= type_limit) return std::nullopt;
  chunk_tokens = std::max<uint64_t>(chunk_tokens, 1);
  const uint64_t chunks = (tokens.count + chunk_tokens - 1) / chunk_tokens;
  // Each chunk lowers `first` to its own first offender; chunks past the lowest one
  // found so far are skipped, so a bad token early in a file ends the scan early.
  std::atomic<uint64_t> first{tokens.count};
  executor.parallel_for(0, chunks, 1, [&](size_t lo, size_t hi) {
    for (size_t chunk = lo; chunk < hi; ++chunk) {
      const uint64_t begin = chunk * chunk_tokens;
      if (begin >= first.load(std::memory_order_relaxed)) return;
      const size_t count = static_cast<size_t>(std::min(chunk_tokens, tokens.count - begin));
      const size_t found = tokens.token_bytes == 2
                               ? kernels.scan_u16(static_cast<const uint16_t*>(tokens.data) + begin, count, bound)
                               : kernels.scan_u32(static_cast<const uint32_t*>(tokens.data) + begin, count, bound);
      if (found == count) continue;
      uint64_t seen = first.load(std::memory_order_relaxed);
      while (begin + found < seen && !first.compare_exchange_weak(seen, begin + found, std::memory_order_relaxed)) {
      }
    }
  });
  const uint64_t index = first.load();
  if (index == tokens.count) return std::nullopt;
  return index;
}

}  // namespace strata::data
