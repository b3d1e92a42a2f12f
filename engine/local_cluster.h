// The ranks of one process: a device, a gather communicator and a reduce communicator
// per rank, and a way to run one function per rank on its own thread.
//
// On the CPU device, ranks are threads sharing HostCommunicator groups; on CUDA, one
// GPU per rank with NCCL communicators (one process driving several GPUs), or
// SelfCommunicators for a world of one GPU (no NCCL). Programs
// (train_gpt, strata-bench step) and tests build their ranks through this.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <vector>

#include "engine/core/communicator.h"
#include "engine/core/device.h"

namespace strata {

struct LocalClusterOptions {
  int world_size = 1;
  DeviceKind device = DeviceKind::kCpu;
  size_t device_budget_bytes = size_t{1} << 30;  // per rank; for CUDA 0 = the GPU's free memory
  int compute_threads = 0;                       // CPU device: executor threads per rank; 0 = cores / world size
  MatmulPrecision matmul_precision = MatmulPrecision::kFp32;  // fp32 GEMMs (the CPU device takes only kFp32)
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(10)};  // host and NCCL communicators
};

class LocalCluster {
 public:
  static StatusOr<std::unique_ptr<LocalCluster>> create(const LocalClusterOptions& options);
  ~LocalCluster();

  int world_size() const { return static_cast<int>(devices_.size()); }
  Device& device(int rank) { return *devices_[static_cast<size_t>(rank)]; }
  Communicator& gather_communicator(int rank) { return *gather_[static_cast<size_t>(rank)]; }
  Communicator& reduce_communicator(int rank) { return *reduce_[static_cast<size_t>(rank)]; }

  // Runs body(rank) for every rank, each on its own thread (rank 0 on the caller's), and
  // returns the first failure by rank order. A rank that fails aborts the communicators,
  // so the others fail too instead of waiting for it.
  Status run(const std::function<Status(int rank)>& body);

 private:
  LocalCluster() = default;
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<std::unique_ptr<Communicator>> gather_;
  std::vector<std::unique_ptr<Communicator>> reduce_;
  struct HostGroups;
  std::unique_ptr<HostGroups> host_groups_;
};

}  // namespace strata
