// What the device-op tests of tests/kernels share (transformer_ops_test.cpp,
// rmsnorm_rope_swiglu_gqa_test.cpp): the targets (device kind x dtype), random inputs rounded to the
// device dtype, the relative error they are judged by, and a Harness that owns a device,
// a stream and a BlasContext and moves test tensors in and out.
#pragma once

#include <cmath>
#include <cstdint>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include <gtest/gtest.h>

#include "engine/core/check.h"
#include "engine/core/device.h"
#include "engine/core/dtype.h"
#include "kernels/blas_context.h"

namespace strata::test_ops {

using kernels::BlasContext;

struct Target {
  DeviceKind kind;
  DType dtype;
};

inline std::string target_name(const ::testing::TestParamInfo<Target>& info) {
  return std::string(device_kind_name(info.param.kind)) + "_" + std::string(dtype_name(info.param.dtype));
}

inline std::vector<double> random_vector(size_t n, std::mt19937& rng, double scale = 1.0, double offset = 0.0) {
  std::normal_distribution<double> dist(offset, scale);
  std::vector<double> v(n);
  for (auto& x : v) x = dist(rng);
  return v;
}

// The value a double has once stored as `dtype`.
inline std::vector<double> rounded(const std::vector<double>& values, DType dtype) {
  std::vector<double> out(values.size());
  std::vector<uint8_t> bytes(dtype_size(dtype));
  for (size_t i = 0; i < values.size(); ++i) {
    store_from_float(bytes.data(), dtype, 0, static_cast<float>(values[i]));
    out[i] = load_as_float(bytes.data(), dtype, 0);
  }
  return out;
}

inline std::vector<double> plus(const std::vector<double>& a, const std::vector<double>& b) {
  std::vector<double> out(a.size());
  for (size_t i = 0; i < a.size(); ++i) out[i] = a[i] + b[i];
  return out;
}

inline double relative_error(const std::vector<double>& got, const std::vector<double>& want) {
  double diff = 0.0;
  double norm = 0.0;
  for (size_t i = 0; i < want.size(); ++i) {
    diff += (got[i] - want[i]) * (got[i] - want[i]);
    norm += want[i] * want[i];
  }
  if (norm == 0.0) return std::sqrt(diff);
  return std::sqrt(diff) / std::sqrt(norm);
}

// How big a Harness's device is: the tiny-shape tests take the defaults; the
// model-shape tests (model_shapes_test.cpp) need gigabytes and every core.
struct HarnessOptions {
  size_t cpu_budget_bytes = size_t{256} << 20;
  int cpu_threads = 2;  // 0 = every core
  size_t cuda_budget_bytes = size_t{1} << 30;
};

// A device, a stream and a BlasContext, with helpers to move test tensors in and out.
class Harness {
 public:
  explicit Harness(Target target, const HarnessOptions& options = {}) : target_(target) {
    if (target.kind == DeviceKind::kCpu) {
      auto device = create_cpu_device(
          {.budget_bytes = options.cpu_budget_bytes, .compute = {.threads = options.cpu_threads}});
      STRATA_CHECK_OK(device);
      device_ = std::move(device).value();
    } else {
      auto device = create_cuda_device({.budget_bytes = options.cuda_budget_bytes});
      STRATA_CHECK_OK(device);
      device_ = std::move(device).value();
    }
    auto stream = device_->create_stream("kernel ops test");
    STRATA_CHECK_OK(stream);
    stream_ = std::move(stream).value();
    auto blas = BlasContext::create(*device_);
    STRATA_CHECK_OK(blas);
    blas_ = std::make_unique<BlasContext>(std::move(blas).value());
  }

  DType dtype() const { return target_.dtype; }
  Stream& stream() { return *stream_; }
  BlasContext& blas() { return *blas_; }
  Device& device() { return *device_; }

  // Tolerance for outputs in the compute dtype, and for fp32 outputs (grads, stats).
  double tolerance() const { return target_.dtype == DType::kBFloat16 ? 2e-2 : 2e-5; }
  double fp32_tolerance() const { return target_.dtype == DType::kBFloat16 ? 1e-2 : 2e-5; }

  DeviceBuffer put(const std::vector<double>& values, DType type) {
    std::vector<uint8_t> bytes(values.size() * dtype_size(type));
    for (size_t i = 0; i < values.size(); ++i) store_from_float(bytes.data(), type, i, static_cast<float>(values[i]));
    return put_bytes(bytes.data(), bytes.size());
  }
  DeviceBuffer put(const std::vector<double>& values) { return put(values, dtype()); }
  DeviceBuffer put_ints(const std::vector<int32_t>& values) { return put_bytes(values.data(), values.size() * 4); }
  // A buffer whose every byte is 0xFF: NaN as fp32 and as bf16.
  DeviceBuffer nans(size_t count, DType type) {
    auto buffer = device_->allocate(count * dtype_size(type), "test output");
    STRATA_CHECK_OK(buffer);
    STRATA_CHECK_OK(device_->memset_async(buffer->data(), 0xFF, buffer->size(), *stream_));
    return std::move(buffer).value();
  }
  DeviceBuffer nans(size_t count) { return nans(count, dtype()); }

  std::vector<double> get(const DeviceBuffer& buffer, size_t count, DType type) {
    std::vector<uint8_t> bytes(count * dtype_size(type));
    STRATA_CHECK_OK(device_->copy_async(bytes.data(), buffer.data(), bytes.size(), CopyKind::kDeviceToHost, *stream_));
    STRATA_CHECK_OK(stream_->synchronize());
    std::vector<double> out(count);
    for (size_t i = 0; i < count; ++i) out[i] = load_as_float(bytes.data(), type, i);
    return out;
  }
  std::vector<double> get(const DeviceBuffer& buffer, size_t count) { return get(buffer, count, dtype()); }
  std::vector<uint8_t> get_bytes(const DeviceBuffer& buffer) {
    std::vector<uint8_t> bytes(buffer.size());
    STRATA_CHECK_OK(device_->copy_async(bytes.data(), buffer.data(), bytes.size(), CopyKind::kDeviceToHost, *stream_));
    STRATA_CHECK_OK(stream_->synchronize());
    return bytes;
  }

 private:
  DeviceBuffer put_bytes(const void* data, size_t bytes) {
    auto buffer = device_->allocate(bytes, "test input");
    STRATA_CHECK_OK(buffer);
    STRATA_CHECK_OK(device_->copy_async(buffer->data(), data, bytes, CopyKind::kHostToDevice, *stream_));
    STRATA_CHECK_OK(stream_->synchronize());  // the host bytes die when the caller returns
    return std::move(buffer).value();
  }

  Target target_;
  std::unique_ptr<Device> device_;
  std::unique_ptr<Stream> stream_;
  std::unique_ptr<BlasContext> blas_;
};

}  // namespace strata::test_ops
