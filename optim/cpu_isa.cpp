#include "optim/cpu_isa.h"

#include <string>

#if defined(__x86_64__) || defined(__i386__)
#include <cpuid.h>
#endif

namespace strata {

std::string_view cpu_isa_name(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return "scalar";
    case CpuIsa::kAvx2: return "avx2";
    case CpuIsa::kAvx512: return "avx512";
  }
  return "?";
}

StatusOr<CpuIsa> parse_cpu_isa(std::string_view text) {
  if (text == "scalar") return CpuIsa::kScalar;
  if (text == "avx2") return CpuIsa::kAvx2;
  if (text == "avx512") return CpuIsa::kAvx512;
  return InvalidArgumentError("unknown CPU instruction set '" + std::string(text) + "': expected avx512, avx2 or scalar");
}

namespace {

CpuFeatures probe_cpu_features() {
  CpuFeatures features;
#if defined(__x86_64__) || defined(__i386__)
  unsigned eax = 0, ebx = 0, ecx = 0, edx = 0;
  if (__get_cpuid(1, &eax, &ebx, &ecx, &edx) == 0) return features;
  const bool osxsave = (ecx & (1u << 27)) != 0;
  const bool avx = (ecx & (1u << 28)) != 0;
  const bool f16c = (ecx & (1u << 29)) != 0;
  if (!osxsave || !avx) return features;
  // XCR0: which register state the OS saves on a context switch.
  unsigned xcr0_low = 0, xcr0_high = 0;
  __asm__ volatile("xgetbv" : "=a"(xcr0_low), "=d"(xcr0_high) : "c"(0));
  const bool os_saves_ymm = (xcr0_low & 0x6u) == 0x6u;             // SSE and AVX state
  const bool os_saves_zmm = (xcr0_low & 0xe6u) == 0xe6u;           // plus opmask, ZMM0-15 high, ZMM16-31
  if (__get_cpuid_count(7, 0, &eax, &ebx, &ecx, &edx) == 0) return features;
  const bool avx2 = (ebx & (1u << 5)) != 0;
  const bool avx512f = (ebx & (1u << 16)) != 0;
  const bool avx512dq = (ebx & (1u << 17)) != 0;
  const bool avx512bw = (ebx & (1u << 30)) != 0;
  const bool avx512vl = (ebx & (1u << 31)) != 0;
  const unsigned max_subleaf = eax;
  features.avx2_f16c = os_saves_ymm && avx2 && f16c;
  features.avx512 = features.avx2_f16c && os_saves_zmm && avx512f && avx512dq && avx512bw && avx512vl;
  if (features.avx512 && max_subleaf >= 1 && __get_cpuid_count(7, 1, &eax, &ebx, &ecx, &edx) != 0)
    features.avx512_bf16 = (eax & (1u << 5)) != 0;
#endif
  return features;
}

}  // namespace

const CpuFeatures& cpu_features() {
  static const CpuFeatures features = probe_cpu_features();
  return features;
}

bool cpu_isa_supported(CpuIsa isa) {
  switch (isa) {
    case CpuIsa::kScalar: return true;
#if defined(STRATA_OPTIM_X86_KERNELS)
    case CpuIsa::kAvx2: return cpu_features().avx2_f16c;
    case CpuIsa::kAvx512: return cpu_features().avx512;
#else
    case CpuIsa::kAvx2:
    case CpuIsa::kAvx512: return false;
#endif
  }
  return false;
}

CpuIsa best_cpu_isa() {
  if (cpu_isa_supported(CpuIsa::kAvx512)) return CpuIsa::kAvx512;
  if (cpu_isa_supported(CpuIsa::kAvx2)) return CpuIsa::kAvx2;
  return CpuIsa::kScalar;
}

}  // namespace strata
