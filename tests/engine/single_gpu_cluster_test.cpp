// LocalCluster's communicators for a world of one: one GPU gets SelfCommunicators (no NCCL
// communicator), CPU ranks keep HostCommunicator. The CUDA case skips without a GPU.
#include "engine/local_cluster.h"

#include <gtest/gtest.h>

#include <string>

#include "engine/core/gpu.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

TEST(SingleGpuClusterTest, AWorldOfOneGpuHasNoNcclCommunicator) {
  if (!gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create({.world_size = 1, .device = DeviceKind::kCuda,
                                                                  .device_budget_bytes = size_t{64} << 20}));
  EXPECT_EQ(cluster->gather_communicator(0).backend_name(), "self");
  EXPECT_EQ(cluster->reduce_communicator(0).backend_name(), "self");
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, cluster->device(0).create_stream("barrier"));
  STRATA_EXPECT_OK(cluster->run([&](int rank) { return cluster->gather_communicator(rank).barrier(*stream); }));
}

TEST(SingleGpuClusterTest, CpuRanksKeepTheirHostCommunicators) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto cluster, LocalCluster::create({.world_size = 1, .device = DeviceKind::kCpu,
                                                                  .device_budget_bytes = size_t{8} << 20}));
  EXPECT_NE(cluster->gather_communicator(0).backend_name(), "self");
}

}  // namespace
}  // namespace strata
