// SelfCommunicator (a world of one, no NCCL) against HostCommunicator's world of one on the
// CPU device, bit for bit, on every device kind (the CUDA case skips without a GPU).
#include "engine/core/self_communicator.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <functional>
#include <optional>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "engine/core/gpu.h"
#include "engine/core/host_communicator.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

StatusOr<std::unique_ptr<Device>> make_device(DeviceKind kind) {
  if (kind == DeviceKind::kCpu) return create_cpu_device({.budget_bytes = size_t{16} << 20, .compute = {.threads = 1}});
  return create_cuda_device({.budget_bytes = size_t{64} << 20});
}

// fp32 inputs that round differently through bf16 and fp16 (ties, subnormals, overflow, NaN).
std::vector<float> awkward_floats(size_t n) {
  std::mt19937 rng(5);
  std::normal_distribution<float> dist(0.0f, 1000.0f);
  std::vector<float> v(n);
  for (auto& x : v) x = dist(rng);
  const float specials[] = {1.0f + 1.0f / 256.0f, 65520.0f, -7e-8f, std::numeric_limits<float>::quiet_NaN(), 3.0e38f, -0.0f};
  for (size_t i = 0; i < std::size(specials) && i < n; ++i) v[i] = specials[i];
  return v;
}

// Runs one collective through `comm` on its device: input bytes in, output bytes out.
using Op = std::function<Status(Communicator& comm, const void* send, void* recv, Stream& stream)>;
std::vector<std::byte> run(Communicator& comm, const std::vector<std::byte>& input, size_t out_bytes, const Op& op,
                           bool in_place) {
  Device& device = comm.device();
  auto stream = device.create_stream("self").value();
  auto send = device.allocate(std::max(input.size(), out_bytes), "send").value();
  auto recv = device.allocate(std::max(input.size(), out_bytes), "recv").value();
  EXPECT_TRUE(device.copy_async(send.data(), input.data(), input.size(), CopyKind::kHostToDevice, *stream).ok());
  void* out = in_place ? send.data() : recv.data();
  const Status status = op(comm, send.data(), out, *stream);
  EXPECT_TRUE(status.ok()) << status.to_string();
  std::vector<std::byte> result(out_bytes);
  EXPECT_TRUE(device.copy_async(result.data(), out, out_bytes, CopyKind::kDeviceToHost, *stream).ok());
  EXPECT_TRUE(stream->synchronize().ok());
  return result;
}

// Bit-equal element by element, except that any NaN matches any NaN (CUDA's conversions
// canonicalize NaN payloads; communicator.h promises NaN, not its bits).
::testing::AssertionResult same_values(const std::vector<std::byte>& got, const std::vector<std::byte>& want, DType dtype) {
  if (got.size() != want.size()) return ::testing::AssertionFailure() << "sizes differ";
  const size_t element = dtype_size(dtype);
  for (size_t i = 0; i < got.size() / element; ++i) {
    if (std::memcmp(got.data() + i * element, want.data() + i * element, element) == 0) continue;
    const float g = load_as_float(got.data(), dtype, i), w = load_as_float(want.data(), dtype, i);
    if (std::isnan(g) && std::isnan(w)) continue;
    return ::testing::AssertionFailure() << "element " << i << ": got " << g << ", want " << w;
  }
  return ::testing::AssertionSuccess();
}

class SelfCommunicatorTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && !gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  }
};

TEST_P(SelfCommunicatorTest, GivesTheBitsOfAHostCommunicatorOfOneRank) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(GetParam()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto host_device, make_device(DeviceKind::kCpu));
  STRATA_ASSERT_OK_AND_ASSIGN(HostCommunicatorGroup group, HostCommunicatorGroup::create({.world_size = 1}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto reference, group.communicator(0, *host_device));
  SelfCommunicator self(*device);
  EXPECT_EQ(self.world_size(), 1);
  EXPECT_EQ(self.backend_name(), "self");

  for (size_t count : {size_t{1}, size_t{7}, size_t{4097}}) {
    const std::vector<float> floats = awkward_floats(count);
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      std::vector<std::byte> input(count * dtype_size(dtype));
      for (size_t i = 0; i < count; ++i) store_from_float(input.data(), dtype, i, floats[i]);
      std::vector<std::optional<DType>> wires{std::nullopt};
      if (dtype == DType::kFloat32) wires = {std::nullopt, DType::kBFloat16, DType::kFloat16};
      for (const auto& wire : wires) {
        for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax}) {
          const ReduceOptions options{.op = op, .wire_dtype = wire};
          const std::string what = std::string(dtype_name(dtype)) + " " + std::string(reduce_op_name(op)) + " wire " +
                                   (wire ? std::string(dtype_name(*wire)) : "=data") + " n=" + std::to_string(count);
          const Op reduce_scatter = [&](Communicator& c, const void* s, void* r, Stream& st) {
            return c.reduce_scatter(s, r, count, dtype, options, st);
          };
          const Op all_reduce = [&](Communicator& c, const void* s, void* r, Stream& st) {
            return c.all_reduce(s, r, count, dtype, options, st);
          };
          for (bool in_place : {false, true}) {
            const auto want = run(*reference, input, input.size(), reduce_scatter, in_place);
            EXPECT_TRUE(same_values(run(self, input, input.size(), reduce_scatter, in_place), want, dtype)) << "reduce_scatter " << what;
            EXPECT_TRUE(same_values(run(self, input, input.size(), all_reduce, in_place),
                                    run(*reference, input, input.size(), all_reduce, in_place), dtype))
                << "all_reduce " << what;
          }
        }
      }
      const Op all_gather = [&](Communicator& c, const void* s, void* r, Stream& st) { return c.all_gather(s, r, count, dtype, st); };
      const Op broadcast = [&](Communicator& c, const void* s, void* r, Stream& st) { return c.broadcast(s, r, count, dtype, 0, st); };
      EXPECT_EQ(run(self, input, input.size(), all_gather, false), input);
      EXPECT_EQ(run(self, input, input.size(), broadcast, false), input);
    }
  }
}

TEST_P(SelfCommunicatorTest, FailsAfterAbortWithTheReason) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(GetParam()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("self"));
  SelfCommunicator self(*device);
  STRATA_EXPECT_OK(self.barrier(*stream));
  STRATA_EXPECT_OK(self.async_error());
  EXPECT_FALSE(self.broadcast(nullptr, nullptr, 0, DType::kFloat32, 1, *stream).ok()) << "root 1 in a world of 1";
  self.abort("rank 0 failed: out of memory");
  const Status status = self.barrier(*stream);
  ASSERT_FALSE(status.ok());
  EXPECT_NE(status.message().find("rank 0 failed: out of memory"), std::string::npos) << status.to_string();
  EXPECT_FALSE(self.async_error().ok());
}

INSTANTIATE_TEST_SUITE_P(Devices, SelfCommunicatorTest, ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const ::testing::TestParamInfo<DeviceKind>& info) { return std::string(device_kind_name(info.param)); });

}  // namespace
}  // namespace strata
