// The cast op on every device present, against the scalar conversions.
#include "kernels/cast.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <random>
#include <string>
#include <vector>

#include "engine/core/gpu.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

StatusOr<std::unique_ptr<Device>> make_device(DeviceKind kind) {
  if (kind == DeviceKind::kCpu) return create_cpu_device({.budget_bytes = size_t{64} << 20, .compute = {.threads = 2}});
  return create_cuda_device({.budget_bytes = size_t{64} << 20});
}

// `count` fp32 values cast to `to` on the device and back to fp32: the 16-bit bits and the
// fp32 bits that came back.
struct RoundTrip {
  std::vector<uint16_t> narrow;
  std::vector<uint32_t> wide;
};
StatusOr<RoundTrip> cast_there_and_back(Device& device, Stream& stream, const float* input, size_t count, DType to) {
  STRATA_ASSIGN_OR_RETURN(auto src, device.allocate(count * 4, "cast src"));
  STRATA_ASSIGN_OR_RETURN(auto mid, device.allocate(count * 2, "cast mid"));
  STRATA_ASSIGN_OR_RETURN(auto back, device.allocate(count * 4, "cast back"));
  RoundTrip got{std::vector<uint16_t>(count), std::vector<uint32_t>(count)};
  STRATA_RETURN_IF_ERROR(device.copy_async(src.data(), input, count * 4, CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(kernels::cast(stream, src.data(), DType::kFloat32, mid.data(), to, count));
  STRATA_RETURN_IF_ERROR(kernels::cast(stream, mid.data(), to, back.data(), DType::kFloat32, count));
  STRATA_RETURN_IF_ERROR(device.copy_async(got.narrow.data(), mid.data(), count * 2, CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(got.wide.data(), back.data(), count * 4, CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(stream.synchronize());
  return got;
}

// One case per device kind, the CUDA one everywhere: where there is no GPU it skips with
// the reason, so scripts/gpu-check sees it exist (and fails on a GPU machine if it skips).
class CastTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && !gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  }
};

TEST_P(CastTest, MatchesScalarConversion) {
  std::mt19937 rng(7);
  std::normal_distribution<float> dist(0.0f, 100.0f);
  {
    const DeviceKind kind = GetParam();
    STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(kind));
    STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("cast"));
    for (size_t n : {size_t{1}, size_t{7}, size_t{55}, size_t{4097}, size_t{300001}}) {
      std::vector<float> input(n);
      for (auto& x : input) x = dist(rng);
      input[0] = 65520.0f;  // rounds to fp16 infinity
      for (DType to : {DType::kBFloat16, DType::kFloat16}) {
        STRATA_ASSERT_OK_AND_ASSIGN(const RoundTrip got, cast_there_and_back(*device, *stream, input.data(), n, to));
        for (size_t i = 0; i < n; ++i) {
          const uint16_t want = to == DType::kBFloat16 ? float_to_bf16_bits(input[i]) : float_to_fp16_bits(input[i]);
          ASSERT_EQ(got.narrow[i], want) << device_kind_name(kind) << " " << dtype_name(to) << " n=" << n << " i=" << i;
          const float want_back = to == DType::kBFloat16 ? bf16_bits_to_float(want) : fp16_bits_to_float(want);
          ASSERT_EQ(got.wide[i], std::bit_cast<uint32_t>(want_back)) << "i=" << i;
        }
      }
    }
  }
}

// The values where a vectorized conversion can go wrong: NaNs with payloads (quietened),
// infinities, subnormals, exact ties (to even), the largest finite values (to infinity),
// negative zero. The CPU keeps a NaN's payload as the scalar conversion does; CUDA's
// conversions give the canonical NaN, so there a NaN need only stay one. The run is cast
// from several offsets into it (0, 1, 5 and 15 values), so each value reaches several
// lanes of the span functions' vector loops, and their scalar tails.
TEST_P(CastTest, SpecialValuesConvertAsTheScalarConversionsDo) {
  const std::vector<uint32_t> special = {
      0x7fc00000u, 0xffc00001u, 0x7f800001u, 0x7fbfffffu,  // NaNs, quiet and signalling, with payloads
      0x7f800000u, 0xff800000u,                            // infinities
      0x00000001u, 0x807fffffu, 0x00400000u, 0x00008000u,  // subnormals
      0x3f808000u, 0x3f818000u, 0xbf808000u, 0x3f807fffu,  // bf16 ties to even, and just below
      0x7f7fffffu, 0xff7f8000u, 0x477ff000u, 0x477fefffu,  // largest finite: to bf16 / fp16 infinity and not
      0x80000000u, 0x00000000u, 0x33000000u, 0x38800000u,  // signed zeros, fp16 subnormal edges
  };
  std::vector<float> input;
  for (size_t repeat = 0; repeat < 17; ++repeat)
    for (uint32_t bits : special) input.push_back(std::bit_cast<float>(bits));
  const size_t n = input.size();
  const DeviceKind kind = GetParam();
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(kind));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("cast"));
  for (DType to : {DType::kBFloat16, DType::kFloat16}) {
    for (size_t offset : {size_t{0}, size_t{1}, size_t{5}, size_t{15}}) {
      const size_t count = n - offset;
      STRATA_ASSERT_OK_AND_ASSIGN(const RoundTrip got, cast_there_and_back(*device, *stream, input.data() + offset, count, to));
      for (size_t i = 0; i < count; ++i) {
        const float x = input[offset + i];
        if (std::isnan(x) && kind == DeviceKind::kCuda) {  // CUDA's conversions give the canonical NaN, not the payload
          const uint16_t magnitude = got.narrow[i] & 0x7fffu;
          EXPECT_GT(magnitude, to == DType::kBFloat16 ? 0x7f80u : 0x7c00u) << "a NaN stays a NaN";
          continue;
        }
        const uint16_t want = to == DType::kBFloat16 ? float_to_bf16_bits(x) : float_to_fp16_bits(x);
        ASSERT_EQ(got.narrow[i], want) << device_kind_name(kind) << " " << dtype_name(to) << " offset " << offset << " input 0x" << std::hex
                                  << std::bit_cast<uint32_t>(x);
        const float want_back = to == DType::kBFloat16 ? bf16_bits_to_float(want) : fp16_bits_to_float(want);
        ASSERT_EQ(got.wide[i], std::bit_cast<uint32_t>(want_back)) << dtype_name(to) << " back from 0x" << std::hex << want;
      }
    }
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, CastTest, ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const ::testing::TestParamInfo<DeviceKind>& info) { return std::string(device_kind_name(info.param)); });

}  // namespace
}  // namespace strata
