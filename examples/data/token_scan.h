// The vocabulary scan of a token file: finds the first token id at or above a bound (the
// model's vocabulary size) so a bad file fails when it is opened, not when a sampled
// window happens to hit the bad token mid-run.
//
// Three layers, as the CPU Adam's: the element function token_at_or_above; a span
// function per instruction set (scalar reference, AVX2, AVX-512; chosen at run time from
// CPUID, optim/cpu_isa.h) that returns the first offending index of a contiguous span on
// the calling thread; and the parallel driver find_token_at_or_above that cuts the
// tokens into chunks, scans them on an Executor and keeps the lowest offending index.
#pragma once

#include <cstddef>
#include <cstdint>
#include <optional>

#include "engine/core/executor.h"
#include "engine/core/status.h"
#include "optim/cpu_isa.h"

namespace strata::data {

// The element function: the token is outside a vocabulary of `bound` ids.
inline bool token_at_or_above(uint32_t token, uint64_t bound) { return token >= bound; }

// The index of the first of `count` tokens at or above `bound`, or `count` when none is.
using TokenScanU16Fn = size_t (*)(const uint16_t* tokens, size_t count, uint64_t bound);
using TokenScanU32Fn = size_t (*)(const uint32_t* tokens, size_t count, uint64_t bound);

struct TokenScanKernels {
  CpuIsa isa = CpuIsa::kScalar;
  TokenScanU16Fn scan_u16 = nullptr;
  TokenScanU32Fn scan_u32 = nullptr;
};

// The span functions of `isa`; Unavailable where this build or this CPU cannot run them.
StatusOr<TokenScanKernels> token_scan_kernels(CpuIsa isa);

// What the driver scans: `count` little-endian tokens of `token_bytes` (2 or 4) each.
struct TokenSpan {
  const void* data = nullptr;
  size_t token_bytes = 2;
  uint64_t count = 0;
};

// The index of the first token at or above `bound`, or nullopt when every token is below
// it. Chunks of `chunk_tokens` run on `executor` (the same answer for any chunking and
// thread count: the lowest offending index).
std::optional<uint64_t> find_token_at_or_above(const TokenSpan& tokens, uint64_t bound, const TokenScanKernels& kernels,
                                               Executor& executor, uint64_t chunk_tokens = uint64_t{1} << 20);

namespace internal {
// The per-ISA entry points (examples/data/token_scan_<isa>.cpp).
size_t token_scan_u16_scalar(const uint16_t* tokens, size_t count, uint64_t bound);
size_t token_scan_u32_scalar(const uint32_t* tokens, size_t count, uint64_t bound);
#if defined(STRATA_DATA_X86_KERNELS)
size_t token_scan_u16_avx2(const uint16_t* tokens, size_t count, uint64_t bound);
size_t token_scan_u32_avx2(const uint32_t* tokens, size_t count, uint64_t bound);
size_t token_scan_u16_avx512(const uint16_t* tokens, size_t count, uint64_t bound);
size_t token_scan_u32_avx512(const uint32_t* tokens, size_t count, uint64_t bound);
#endif
}  // namespace internal

}  // namespace strata::data
