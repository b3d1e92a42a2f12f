// What the model families declare for their device memory on CUDA, computed without a GPU
// (the plans are pure functions of the shapes and the device kind).
#include "examples/lm/model_memory.h"

#include <gtest/gtest.h>

#include <string>
#include <utility>
#include <vector>

#include "examples/gpt/gpt_model.h"
#include "examples/llama/llama_model.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

constexpr size_t kMiB = size_t{1} << 20;

size_t line_bytes(const std::vector<std::pair<std::string, size_t>>& lines, const std::string& name) {
  for (const auto& [what, bytes] : lines)
    if (what == name) return bytes;
  return 0;
}

// NVIDIA's advice for Hopper is a 32 MiB cuBLAS workspace; with 4 MiB cuBLAS picks slower
// kernels for large GEMMs. Both families declare it, so it comes out of the device budget.
TEST(ModelMemoryTest, CudaPlansDeclareA32MiBCublasWorkspace) {
  gpt::GptModelOptions gpt;
  STRATA_ASSERT_OK_AND_ASSIGN(gpt.config, gpt::gpt_preset("tiny"));
  STRATA_ASSERT_OK_AND_ASSIGN(gpt::GptActivationPlan gpt_plan, gpt::plan_gpt_activations(gpt, DeviceKind::kCuda));
  EXPECT_EQ(line_bytes(gpt_plan.lines, "cuBLAS workspace"), 32 * kMiB) << gpt_plan.text();
  EXPECT_GE(gpt_plan.device_bytes, 32 * kMiB);

  llama::LlamaModelOptions llama;
  STRATA_ASSERT_OK_AND_ASSIGN(llama.config, llama::llama_preset("llama-tiny"));
  llama.seq_len = 16;
  STRATA_ASSERT_OK_AND_ASSIGN(llama::LlamaActivationPlan llama_plan, llama::plan_llama_activations(llama, DeviceKind::kCuda));
  EXPECT_EQ(line_bytes(llama_plan.lines, "cuBLAS workspace"), 32 * kMiB) << llama_plan.text();

  // The vocabulary head has its own IEEE-fp32 handle (lm::ModelBlas), whose workspace is
  // declared too, so strata.matmul_precision can apply to the blocks without the budget
  // missing the second handle.
  EXPECT_EQ(line_bytes(gpt_plan.lines, "cuBLAS workspace (vocabulary head, IEEE fp32)"), 4 * kMiB) << gpt_plan.text();
  EXPECT_EQ(line_bytes(llama_plan.lines, "cuBLAS workspace (vocabulary head, IEEE fp32)"), 4 * kMiB) << llama_plan.text();
  EXPECT_GE(gpt_plan.device_bytes, 36 * kMiB);

  // The CPU device has no cuBLAS: no workspace there.
  STRATA_ASSERT_OK_AND_ASSIGN(gpt::GptActivationPlan cpu_plan, gpt::plan_gpt_activations(gpt, DeviceKind::kCpu));
  EXPECT_EQ(line_bytes(cpu_plan.lines, "cuBLAS workspace"), 0u);
}

}  // namespace
}  // namespace strata
