// The CPU Adam against PyTorch's torch.optim.AdamW / torch.optim.Adam over 100 steps on
// random data: the C++ side writes the initial parameters and every step's raw gradients
// into a temporary directory, tests/optim/adam_torch_reference.py runs PyTorch on them
// with Debian's /usr/bin/python3 (python3-torch), and the final parameters and moments
// must agree to a relative error ||a - b|| / ||b|| below 1e-6.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "optim/cpu_adam.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

constexpr const char* kPython = "/usr/bin/python3";
constexpr double kMaxRelativeError = 1e-6;
constexpr int kSteps = 100;
constexpr size_t kElements = 10007;

struct TorchCase {
  const char* name;
  kernels::AdamWeightDecay decay;
  DType grad_type;
  double beta1, beta2, eps, weight_decay;
  float loss_scale;      // raw gradients are the true ones times this (a power of two)
  double max_grad_norm;  // 0 = no clipping
  float grad_magnitude;  // standard deviation of the true gradients
};

std::string torch_unavailable_reason() {
  // Appended in place: GCC 12 warns (-Warray-bounds, a false positive) on a temporary's
  // operator+ here.
  const std::string python(kPython);
  std::string command = python;
  command += " -c 'import torch, numpy' >/dev/null 2>&1";
  if (std::system(command.c_str()) == 0) return "";
  std::string reason = python;
  reason += " cannot import torch and numpy (install Debian's python3-torch)";
  return reason;
}

template <class T>
void write_raw(const std::filesystem::path& path, const std::vector<T>& values) {
  std::ofstream out(path, std::ios::binary);
  out.write(reinterpret_cast<const char*>(values.data()), static_cast<std::streamsize>(values.size() * sizeof(T)));
  ASSERT_TRUE(out.good()) << "writing " << path;
}

std::vector<float> read_raw(const std::filesystem::path& path, size_t count) {
  std::vector<float> values(count);
  std::ifstream in(path, std::ios::binary);
  in.read(reinterpret_cast<char*>(values.data()), static_cast<std::streamsize>(count * sizeof(float)));
  EXPECT_TRUE(in.good()) << "reading " << count << " floats from " << path;
  return values;
}

double relative_error(const std::vector<float>& got, const std::vector<float>& want) {
  double diff = 0, norm = 0;
  for (size_t i = 0; i < want.size(); ++i) {
    const double d = static_cast<double>(got[i]) - static_cast<double>(want[i]);
    diff += d * d;
    norm += static_cast<double>(want[i]) * static_cast<double>(want[i]);
  }
  return std::sqrt(diff) / std::sqrt(norm);
}

// A learning rate that changes every call: linear warm-up over 10 steps, then decay.
double learning_rate(int step) { return 1e-3 * std::min(1.0, step / 10.0) * (1.0 - 0.5 * step / kSteps); }

// One case's inputs, kept for the C++ run after PyTorch's.
struct PreparedCase {
  TorchCase c;
  std::filesystem::path dir;
  std::vector<float> master;
  std::vector<uint16_t> grads16;
  std::vector<float> grads32;
};

void prepare_case(const TorchCase& c, const std::filesystem::path& dir, bool torch_foreach, PreparedCase* prepared) {
  std::filesystem::create_directories(dir);
  std::mt19937 rng(2024);
  std::normal_distribution<float> normal(0.0f, 1.0f);
  std::vector<float> master(kElements);
  for (auto& x : master) x = normal(rng);
  // Raw gradients as the backward pass leaves them: true gradient times the loss scale,
  // rounded to the gradient dtype. Written out as fp32 (exact for bf16 and fp16 values).
  std::vector<uint16_t> grads16(c.grad_type == DType::kFloat32 ? 0 : kSteps * kElements);
  std::vector<float> grads32(kSteps * kElements);
  for (size_t i = 0; i < grads32.size(); ++i) {
    const float raw = normal(rng) * c.grad_magnitude * c.loss_scale;
    if (c.grad_type == DType::kFloat32) {
      grads32[i] = raw;
    } else {
      store_from_float(grads16.data(), c.grad_type, i, raw);
      grads32[i] = load_as_float(grads16.data(), c.grad_type, i);
    }
  }
  write_raw(dir / "master.f32", master);
  write_raw(dir / "grads.f32", grads32);
  {
    std::ostringstream config;
    config.precision(17);
    config << "{\"n\": " << kElements << ", \"steps\": " << kSteps << ", \"optimizer\": \""
           << (c.decay == kernels::AdamWeightDecay::kDecoupled ? "adamw" : "adam") << "\", \"beta1\": " << c.beta1
           << ", \"beta2\": " << c.beta2 << ", \"eps\": " << c.eps << ", \"weight_decay\": " << c.weight_decay
           << ", \"loss_scale\": " << c.loss_scale << ", \"max_grad_norm\": " << c.max_grad_norm
           << ", \"foreach\": " << (torch_foreach ? "true" : "false") << ", \"lr\": [";
    for (int step = 1; step <= kSteps; ++step) config << (step > 1 ? ", " : "") << learning_rate(step);
    config << "]}";
    std::ofstream out(dir / "config.json");
    out << config.str();
  }
  *prepared = PreparedCase{c, dir, std::move(master), std::move(grads16), std::move(grads32)};
}

void check_case(PreparedCase& p) {
  const TorchCase& c = p.c;
  std::vector<float>& master = p.master;
  const std::vector<uint16_t>& grads16 = p.grads16;
  const std::vector<float>& grads32 = p.grads32;
  // The same steps through the CPU Adam, as the engine drives it: statistics, plan, step.
  STRATA_ASSERT_OK_AND_ASSIGN(CpuAdam adam, CpuAdam::create({.threads = 2}));
  std::vector<float> exp_avg(kElements, 0.0f), exp_avg_sq(kElements, 0.0f), param_copy(kElements);
  for (int step = 1; step <= kSteps; ++step) {
    const void* grad = c.grad_type == DType::kFloat32 ? static_cast<const void*>(grads32.data() + (step - 1) * kElements)
                                                      : static_cast<const void*>(grads16.data() + (step - 1) * kElements);
    STRATA_ASSERT_OK_AND_ASSIGN(GradientStats stats, adam.gradient_stats(grad, c.grad_type, kElements));
    const kernels::AdamHyperparams hyper{.lr = learning_rate(step), .beta1 = c.beta1, .beta2 = c.beta2, .eps = c.eps,
                                         .weight_decay = c.weight_decay, .decay = c.decay};
    STRATA_ASSERT_OK_AND_ASSIGN(AdamStepPlan plan,
                                plan_adam_step(hyper, step, stats, {.loss_scale = c.loss_scale, .max_grad_norm = c.max_grad_norm}));
    ASSERT_FALSE(plan.skip);
    kernels::AdamBuffers buffers;
    buffers.grad = grad;
    buffers.grad_type = c.grad_type;
    buffers.master = master.data();
    buffers.exp_avg = exp_avg.data();
    buffers.exp_avg_sq = exp_avg_sq.data();
    buffers.moment_type = DType::kFloat32;
    buffers.param = param_copy.data();
    buffers.param_type = DType::kFloat32;
    buffers.count = kElements;
    STRATA_ASSERT_OK(adam.step(buffers, plan));
  }

  const double master_error = relative_error(master, read_raw(p.dir / "master.out.f32", kElements));
  const double exp_avg_error = relative_error(exp_avg, read_raw(p.dir / "exp_avg.out.f32", kElements));
  const double exp_avg_sq_error = relative_error(exp_avg_sq, read_raw(p.dir / "exp_avg_sq.out.f32", kElements));
  std::printf("%s (%s, %s): relative error master %.3g exp_avg %.3g exp_avg_sq %.3g\n", c.name, cpu_isa_name(adam.isa()).data(),
              dtype_name(c.grad_type).data(), master_error, exp_avg_error, exp_avg_sq_error);
  EXPECT_LT(master_error, kMaxRelativeError) << c.name;
  EXPECT_LT(exp_avg_error, kMaxRelativeError) << c.name;
  EXPECT_LT(exp_avg_sq_error, kMaxRelativeError) << c.name;
  EXPECT_EQ(param_copy, master) << "the fp32 parameter copy is the master weights";
}

using kernels::AdamWeightDecay;
const TorchCase kCases[] = {
    {"adamw", AdamWeightDecay::kDecoupled, DType::kFloat32, 0.9, 0.999, 1e-8, 0.01, 1.0f, 0.0, 1e-2f},
    {"adam_l2", AdamWeightDecay::kL2, DType::kFloat32, 0.9, 0.999, 1e-8, 0.01, 1.0f, 0.0, 1e-2f},
    {"adamw_bf16_scaled_clipped", AdamWeightDecay::kDecoupled, DType::kBFloat16, 0.9, 0.95, 1e-8, 0.1, 1024.0f, 1.0, 2e-2f},
    {"adam_fp16_scaled_clipped", AdamWeightDecay::kL2, DType::kFloat16, 0.8, 0.99, 1e-6, 0.001, 256.0f, 0.5, 1e-2f},
};

// All cases in one Python run (importing torch takes seconds); PyTorch's single-tensor
// and foreach implementations alternate between cases.
TEST(AdamTorchReferenceTest, HundredStepsAgreeWithPyTorch) {
  if (const std::string reason = torch_unavailable_reason(); !reason.empty()) GTEST_SKIP() << reason;
  testing::TempDir dir;
  std::vector<PreparedCase> prepared(std::size(kCases));
  std::string command = std::string(kPython) + " " + (testing::source_dir() / "tests/optim/adam_torch_reference.py").string();
  for (size_t i = 0; i < std::size(kCases); ++i) {
    const std::filesystem::path case_dir = dir.path() / kCases[i].name;
    prepare_case(kCases[i], case_dir, /*torch_foreach=*/i % 2 == 1, &prepared[i]);
    command.append(" ").append(case_dir.string());
  }
  command.append(" 2>").append((dir.path() / "stderr.txt").string());
  const int rc = std::system(command.c_str());
  if (rc != 0) {
    std::ifstream err(dir.path() / "stderr.txt");
    std::stringstream text;
    text << err.rdbuf();
    FAIL() << command << " exited with " << rc << ":\n" << text.str();
  }
  for (PreparedCase& p : prepared) check_case(p);
}

}  // namespace
}  // namespace strata
