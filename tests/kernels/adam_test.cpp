// The Adam op on every device present (the CPU twin on a CpuDevice, the CUDA kernel on a
// CudaDevice) against the scalar reference, and the per-step scalars.
#include "kernels/adam.h"

#include <gtest/gtest.h>

#include <cmath>
#include <string>
#include <vector>

#include "engine/core/gpu.h"
#include "tests/optim/adam_test_data.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::AdamShardData;

std::vector<DeviceKind> devices_present() {
  std::vector<DeviceKind> kinds{DeviceKind::kCpu};
  if (gpu_available()) kinds.push_back(DeviceKind::kCuda);
  return kinds;
}

StatusOr<std::unique_ptr<Device>> make_device(DeviceKind kind) {
  if (kind == DeviceKind::kCpu) return create_cpu_device({.budget_bytes = size_t{256} << 20, .compute = {.threads = 2}});
  return create_cuda_device({.budget_bytes = size_t{256} << 20});
}

struct DeviceShard {
  DeviceBuffer grad, master, exp_avg, exp_avg_sq, param;
};

// Copies `data` to `device`, steps it there with `scalars`, and copies the state back.
Status step_on_device(Device& device, Stream& stream, AdamShardData& data, const kernels::AdamStepScalars& scalars) {
  const size_t n = data.count;
  DeviceShard d;
  STRATA_ASSIGN_OR_RETURN(d.grad, device.allocate(data.grad.size(), "adam test grad"));
  STRATA_ASSIGN_OR_RETURN(d.master, device.allocate(n * 4, "adam test master"));
  STRATA_ASSIGN_OR_RETURN(d.exp_avg, device.allocate(data.exp_avg.size(), "adam test exp_avg"));
  STRATA_ASSIGN_OR_RETURN(d.exp_avg_sq, device.allocate(data.exp_avg_sq.size(), "adam test exp_avg_sq"));
  STRATA_ASSIGN_OR_RETURN(d.param, device.allocate(data.param.size(), "adam test param"));
  STRATA_RETURN_IF_ERROR(device.copy_async(d.grad.data(), data.grad.data(), data.grad.size(), CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(d.master.data(), data.master.data(), n * 4, CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(d.exp_avg.data(), data.exp_avg.data(), data.exp_avg.size(), CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(d.exp_avg_sq.data(), data.exp_avg_sq.data(), data.exp_avg_sq.size(), CopyKind::kHostToDevice, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(d.param.data(), data.param.data(), data.param.size(), CopyKind::kHostToDevice, stream));
  kernels::AdamBuffers b = data.buffers();
  b.grad = d.grad.data();
  b.master = d.master.as<float>();
  b.exp_avg = d.exp_avg.data();
  b.exp_avg_sq = d.exp_avg_sq.data();
  b.param = data.write_param ? d.param.data() : nullptr;
  STRATA_RETURN_IF_ERROR(kernels::adam_step(stream, b, scalars));
  STRATA_RETURN_IF_ERROR(device.copy_async(data.master.data(), d.master.data(), n * 4, CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(data.exp_avg.data(), d.exp_avg.data(), data.exp_avg.size(), CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(data.exp_avg_sq.data(), d.exp_avg_sq.data(), data.exp_avg_sq.size(), CopyKind::kDeviceToHost, stream));
  STRATA_RETURN_IF_ERROR(device.copy_async(data.param.data(), d.param.data(), data.param.size(), CopyKind::kDeviceToHost, stream));
  return stream.synchronize();
}

// Every device computes the reference's bits: the element function uses separately
// rounded operations everywhere (NaN payloads aside, which the comparison ignores).
TEST(AdamKernelTest, MatchesTheScalarReferenceOnEveryDevice) {
  const kernels::AdamHyperparams hypers[] = {
      {.lr = 1e-3, .weight_decay = 0.0},
      {.lr = 3e-4, .beta1 = 0.8, .beta2 = 0.95, .weight_decay = 0.1, .decay = kernels::AdamWeightDecay::kDecoupled},
      {.lr = 1e-2, .weight_decay = 0.01, .decay = kernels::AdamWeightDecay::kL2},
  };
  const kernels::GradientScaling scalings[] = {{}, {.loss_scale = 1024.0f, .clip_coefficient = 0.5f}};
  for (DeviceKind kind : devices_present()) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(kind));
    STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("adam"));
    uint32_t seed = 0;
    for (size_t n : {size_t{1}, size_t{7}, size_t{55}, size_t{4097}, size_t{300001}})
      for (DType grad : {DType::kBFloat16, DType::kFloat16, DType::kFloat32})
        for (DType moment : {DType::kFloat32, DType::kBFloat16})
          for (int param = 0; param < 4; ++param) {  // none, bf16, fp16, fp32
            ++seed;
            const DType param_type = param == 2 ? DType::kFloat16 : param == 3 ? DType::kFloat32 : DType::kBFloat16;
            AdamShardData got = AdamShardData::random(n, grad, moment, param != 0, param_type, seed);
            AdamShardData want = got;
            auto scalars = kernels::adam_step_scalars(hypers[seed % 3], 1 + seed % 5, scalings[seed % 2]);
            STRATA_ASSERT_OK(scalars);
            STRATA_ASSERT_OK(step_on_device(*device, *stream, got, *scalars));
            kernels::adam_step_cpu_range(want.buffers(), *scalars, 0, n);
            const auto diff = testing::compare_shards(got, want);
            ASSERT_EQ(diff.max_ulps, 0u) << device->description() << " n=" << n << " grad " << dtype_name(grad) << " moments "
                                         << dtype_name(moment) << " param " << param << " at " << diff.where;
          }
  }
}

TEST(AdamKernelTest, GpuKernelRunsWhereAGpuExists) {
  if (!gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(DeviceKind::kCuda));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("adam"));
  // Several steps of a bf16-moment shard stay bit-identical to the reference.
  AdamShardData got = AdamShardData::random(1 << 20, DType::kBFloat16, DType::kBFloat16, true, DType::kBFloat16, 99);
  AdamShardData want = got;
  for (int64_t step = 1; step <= 5; ++step) {
    auto scalars = kernels::adam_step_scalars({.lr = 1e-3 * static_cast<double>(step), .weight_decay = 0.01}, step);
    STRATA_ASSERT_OK(scalars);
    STRATA_ASSERT_OK(step_on_device(*device, *stream, got, *scalars));
    kernels::adam_step_cpu_range(want.buffers(), *scalars, 0, want.count);
  }
  EXPECT_EQ(testing::compare_shards(got, want).max_ulps, 0u);
}

TEST(AdamKernelTest, StepScalarsFollowTheBiasCorrectionsAndDecayModes) {
  const kernels::AdamHyperparams adamw{.lr = 1e-3, .beta1 = 0.9, .beta2 = 0.999, .eps = 1e-8, .weight_decay = 0.1};
  STRATA_ASSERT_OK_AND_ASSIGN(auto first, kernels::adam_step_scalars(adamw, 1, {.loss_scale = 4.0f, .clip_coefficient = 0.5f}));
  EXPECT_FLOAT_EQ(first.step_size, static_cast<float>(1e-3 / (1 - 0.9)));
  EXPECT_FLOAT_EQ(first.inv_sqrt_bias_correction2, static_cast<float>(1 / std::sqrt(1 - 0.999)));
  EXPECT_EQ(first.grad_scale, 0.125f);
  EXPECT_FLOAT_EQ(first.decay_factor, static_cast<float>(1 - 1e-3 * 0.1));
  EXPECT_EQ(first.l2_weight_decay, 0.0f);
  EXPECT_EQ(first.one_minus_beta1, static_cast<float>(1 - 0.9));
  STRATA_ASSERT_OK_AND_ASSIGN(auto late, kernels::adam_step_scalars(adamw, 100000, {}));
  EXPECT_FLOAT_EQ(late.step_size, 1e-3f);  // both corrections vanish
  EXPECT_FLOAT_EQ(late.inv_sqrt_bias_correction2, 1.0f);
  kernels::AdamHyperparams adam = adamw;
  adam.decay = kernels::AdamWeightDecay::kL2;
  STRATA_ASSERT_OK_AND_ASSIGN(auto l2, kernels::adam_step_scalars(adam, 1, {}));
  EXPECT_EQ(l2.decay_factor, 1.0f);
  EXPECT_FLOAT_EQ(l2.l2_weight_decay, 0.1f);
  EXPECT_EQ(kernels::adam_weight_decay_name(adam.decay), "adam");
}

TEST(AdamKernelTest, RejectsBadHyperparametersWithTheirNames) {
  auto expect_error = [](const kernels::AdamHyperparams& h, int64_t step, const kernels::GradientScaling& s, const char* name) {
    auto scalars = kernels::adam_step_scalars(h, step, s);
    ASSERT_FALSE(scalars.ok()) << name;
    EXPECT_EQ(scalars.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(scalars.status().message().find(name), std::string::npos) << scalars.status().message();
  };
  expect_error({.lr = -1.0}, 1, {}, "lr");
  expect_error({.beta1 = 1.0}, 1, {}, "beta1");
  expect_error({.beta2 = -0.1}, 1, {}, "beta2");
  expect_error({.eps = 0.0}, 1, {}, "eps");
  expect_error({.weight_decay = NAN}, 1, {}, "weight_decay");
  expect_error({}, 0, {}, "step");
  expect_error({}, 1, {.loss_scale = 0.0f}, "loss_scale");
  expect_error({}, 1, {.clip_coefficient = INFINITY}, "clip_coefficient");
}

TEST(AdamKernelTest, CountsTheBytesOfAFusedStep) {
  kernels::AdamBuffers b;
  b.grad_type = DType::kBFloat16;
  b.moment_type = DType::kFloat32;
  b.param = &b;  // any non-null pointer: a bf16 copy is written
  b.param_type = DType::kBFloat16;
  EXPECT_EQ(kernels::adam_bytes_per_element(b), 28u);  // the figure of shared/tools/adam_stream_limit.cpp
  b.moment_type = DType::kBFloat16;
  EXPECT_EQ(kernels::adam_bytes_per_element(b), 20u);
  b.param = nullptr;
  b.grad_type = DType::kFloat32;
  EXPECT_EQ(kernels::adam_bytes_per_element(b), 20u);
}

}  // namespace
}  // namespace strata
