#include "engine/local_cluster.h"

#include <algorithm>
#include <thread>

#include "engine/core/host_communicator.h"
#include "engine/core/log.h"
#include "engine/core/self_communicator.h"
#include "engine/core/thread.h"

#if defined(STRATA_HAVE_CUDA)
#include "engine/core/nccl_communicator.h"
#endif

namespace strata {

struct LocalCluster::HostGroups {
  std::vector<HostCommunicatorGroup> groups;
};

LocalCluster::~LocalCluster() {
  // Communicators go before the devices their streams belong to.
  gather_.clear();
  reduce_.clear();
  host_groups_.reset();
  devices_.clear();
}

StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::create(const LocalClusterOptions& options) {
  if (options.world_size < 1) return InvalidArgumentError("world size must be >= 1, got " + std::to_string(options.world_size));
  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  const int world = options.world_size;
  if (options.device == DeviceKind::kCpu) {
    const int threads = options.compute_threads > 0 ? options.compute_threads : std::max(1, available_cpu_count() / world);
    for (int r = 0; r < world; ++r) {
      CpuDeviceOptions device_options;
      device_options.ordinal = r;
      device_options.budget_bytes = options.device_budget_bytes;
      device_options.compute.threads = threads;
      device_options.matmul_precision = options.matmul_precision;
      STRATA_ASSIGN_OR_RETURN(auto device, create_cpu_device(device_options));
      cluster->devices_.push_back(std::move(device));
    }
    cluster->host_groups_ = std::make_unique<HostGroups>();
    for (int g = 0; g < 2; ++g) {
      HostCommunicatorOptions group_options;
      group_options.world_size = world;
      group_options.timeout = options.collective_timeout;
      STRATA_ASSIGN_OR_RETURN(auto group, HostCommunicatorGroup::create(group_options));
      cluster->host_groups_->groups.push_back(std::move(group));
    }
    for (int r = 0; r < world; ++r) {
      STRATA_ASSIGN_OR_RETURN(auto gather, cluster->host_groups_->groups[0].communicator(r, *cluster->devices_[static_cast<size_t>(r)]));
      STRATA_ASSIGN_OR_RETURN(auto reduce, cluster->host_groups_->groups[1].communicator(r, *cluster->devices_[static_cast<size_t>(r)]));
      cluster->gather_.push_back(std::move(gather));
      cluster->reduce_.push_back(std::move(reduce));
    }
    return cluster;
  }
#if defined(STRATA_HAVE_CUDA)
  for (int r = 0; r < world; ++r) {
    CudaDeviceOptions device_options;
    device_options.ordinal = r;
    device_options.budget_bytes = options.device_budget_bytes;
    device_options.matmul_precision = options.matmul_precision;
    STRATA_ASSIGN_OR_RETURN(auto device, create_cuda_device(device_options));
    cluster->devices_.push_back(std::move(device));
  }
  if (world == 1) {
    // One GPU: no NCCL communicator (its start-up, memory and proxy thread buy nothing
    // when there is no peer); SelfCommunicator gives the same results.
    cluster->gather_.push_back(std::make_unique<SelfCommunicator>(*cluster->devices_[0]));
    cluster->reduce_.push_back(std::make_unique<SelfCommunicator>(*cluster->devices_[0]));
    return cluster;
  }
  std::vector<Device*> devices;
  for (auto& d : cluster->devices_) devices.push_back(d.get());
  NcclCommunicatorOptions nccl_options;
  nccl_options.timeout = options.collective_timeout;
  for (int g = 0; g < 2; ++g) {
    STRATA_ASSIGN_OR_RETURN(auto comms, NcclCommunicator::create_local(devices, nccl_options));
    for (auto& c : comms) (g == 0 ? cluster->gather_ : cluster->reduce_).push_back(std::move(c));
  }
  return cluster;
#else
  return UnavailableError("CUDA ranks need a build with CUDA");
#endif
}

Status LocalCluster::run(const std::function<Status(int rank)>& body) {
  const int world = world_size();
  std::vector<Status> results(static_cast<size_t>(world));
  auto run_rank = [&](int rank) {
    Status status = body(rank);
    if (!status.ok()) {
      // Peers waiting in a collective for this rank must not wait forever.
      gather_[static_cast<size_t>(rank)]->abort("rank " + std::to_string(rank) + " failed: " + status.message());
      reduce_[static_cast<size_t>(rank)]->abort("rank " + std::to_string(rank) + " failed: " + status.message());
    }
    results[static_cast<size_t>(rank)] = std::move(status);
  };
  std::vector<std::thread> threads;
  for (int r = 1; r < world; ++r) {
    StatusOr<std::thread> thread = spawn_thread("strata:rank" + std::to_string(r), [&run_rank, r] { run_rank(r); });
    if (!thread.ok()) {
      // The ranks already running would wait for this one in their first collective.
      const Status failed = std::move(thread).status().with_context("while starting rank " + std::to_string(r) + " of " + std::to_string(world));
      for (size_t peer = 0; peer < static_cast<size_t>(world); ++peer) {
        gather_[peer]->abort("rank " + std::to_string(r) + " could not start: " + failed.message());
        reduce_[peer]->abort("rank " + std::to_string(r) + " could not start: " + failed.message());
      }
      for (auto& t : threads) t.join();
      return failed;
    }
    threads.push_back(*std::move(thread));
  }
  run_rank(0);
  for (auto& t : threads) t.join();
  // The root cause is usually the first rank that failed on its own; report the first
  // non-cancellation error, else the first error.
  for (const auto& s : results)
    if (!s.ok() && s.code() != StatusCode::kCancelled) return s;
  for (const auto& s : results)
    if (!s.ok()) return s;
  return {};
}

}  // namespace strata
