// The memory-bound ops' table (examples/profile/kernel_ops): the bytes `strata-bench kernels`
// counts per element, and the profile's rate for an op (its own median, else all ops').
#include "examples/profile/kernel_ops.h"

#include <gtest/gtest.h>

#include "examples/lm/memory_bound_work.h"

namespace strata::profile {
namespace {

MachineProfile with_kernels(std::vector<KernelRate> kernels) {
  MachineProfile p;
  p.compute.memory_bytes_per_s = 7e9;
  p.compute.kernels = std::move(kernels);
  return p;
}

TEST(KernelOps, EveryOpADecoderDeclaresIsInTheTable) {
  for (const lm::DecoderOps ops : {lm::DecoderOps::kGpt2, lm::DecoderOps::kLlama}) {
    const lm::MemoryBoundWork work =
        lm::decoder_memory_bound_work({.layers = 2, .hidden = 8, .query_width = 8, .kv_width = 4, .mlp_width = 32, .vocab = 50}, ops);
    for (const auto* list : {&work.block_forward, &work.block_backward, &work.head_forward, &work.head_backward})
      for (const lm::MemoryOp& op : *list) EXPECT_TRUE(memory_op_accesses(op.op).has_value()) << op.op;
  }
}

TEST(KernelOps, AccessesCountReadsAndWrites) {
  EXPECT_EQ(memory_op_accesses("gelu fwd"), 2.0);
  EXPECT_EQ(memory_op_accesses("swiglu bwd"), 5.0);
  EXPECT_EQ(memory_op_accesses("cross-entropy fwd"), 1.0);
  EXPECT_EQ(memory_op_accesses("residual add"), 3.0);
  EXPECT_FALSE(memory_op_accesses("gelu").has_value());
}

TEST(KernelOps, AnOpsRateIsTheMedianOfItsOwnMeasurements) {
  const MachineProfile p = with_kernels({{.model = "a", .op = "gelu fwd", .shape = "", .kind = "memory", .rate_per_s = 1e9},
                                         {.model = "b", .op = "gelu fwd", .shape = "", .kind = "memory", .rate_per_s = 3e9},
                                         {.model = "a", .op = "layernorm fwd", .shape = "", .kind = "memory", .rate_per_s = 9e9}});
  EXPECT_DOUBLE_EQ(memory_op_rate(p, "gelu fwd"), 2e9);
  EXPECT_DOUBLE_EQ(memory_op_rate(p, "layernorm fwd"), 9e9);
}

TEST(KernelOps, AnOpTheProfileDidNotTimeStreamsAtTheMedianOnAGpu) {
  const MachineProfile p = with_kernels({{.model = "a", .op = "gelu fwd", .shape = "", .kind = "memory", .rate_per_s = 1e9}});
  EXPECT_DOUBLE_EQ(memory_op_rate(p, "residual add"), 7e9);
  EXPECT_DOUBLE_EQ(memory_op_rate(with_kernels({}), "gelu fwd"), 7e9);  // a datasheet profile lists no ops
}

TEST(KernelOps, AnOpTheProfileDidNotTimeStreamsAtTheHostCopyRateOnTheCpuDevice) {
  MachineProfile p = with_kernels({{.model = "a", .op = "gelu fwd", .shape = "", .kind = "memory", .rate_per_s = 1e9}});
  p.copy = {.host_copy = true, .pinned = true, .h2d_bytes_per_s = 11e9, .d2h_bytes_per_s = 12e9};
  EXPECT_DOUBLE_EQ(memory_op_rate(p, "residual add"), 12e9);
  EXPECT_DOUBLE_EQ(memory_op_rate(p, "gelu fwd"), 1e9);  // a timed op keeps its own rate
  EXPECT_DOUBLE_EQ(streaming_rate(p), 12e9);
}

}  // namespace
}  // namespace strata::profile
