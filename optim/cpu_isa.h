// The instruction sets the CPU optimizer can run, probed once at run time from CPUID
// (and XGETBV, so a vector ISA counts only where the OS saves its registers).
//
// The SIMD kernels are compiled for their ISA file by file (optim/CMakeLists.txt), never
// for the whole project, and chosen here when the program runs: one binary runs on any
// x86-64, at the best speed the CPU offers.
#pragma once

#include <cstdint>
#include <string_view>

#include "engine/core/status.h"

namespace strata {

enum class CpuIsa : uint8_t {
  kScalar,  // portable C++: the reference
  kAvx2,    // AVX2 + F16C (8 lanes)
  kAvx512,  // AVX-512 F/BW/VL/DQ (16 lanes), AVX512-BF16 conversions where present
};

std::string_view cpu_isa_name(CpuIsa isa);  // "scalar" | "avx2" | "avx512"
StatusOr<CpuIsa> parse_cpu_isa(std::string_view text);

struct CpuFeatures {
  bool avx2_f16c = false;    // AVX2 and F16C, with the OS saving YMM state
  bool avx512 = false;       // AVX-512 F, BW, VL and DQ, with the OS saving ZMM state
  bool avx512_bf16 = false;  // AVX512-BF16 (VCVTNEPS2BF16) on top of avx512
};

// The probe, run once per process and cached. All false off x86.
const CpuFeatures& cpu_features();
// True when this build has the kernels of `isa` and the CPU can run them.
bool cpu_isa_supported(CpuIsa isa);
// The fastest supported ISA.
CpuIsa best_cpu_isa();

}  // namespace strata
