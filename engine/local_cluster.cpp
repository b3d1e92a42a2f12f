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
#if defined(STRATA_HAVE_GLOO)
#include "engine/core/gloo_communicator.h"
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
  rendezvous_.reset();
}

StatusOr<std::optional<RendezvousOptions>> LocalCluster::process_group_from_env(const EnvLookup& lookup) {
  STRATA_ASSIGN_OR_RETURN(RendezvousOptions options, rendezvous_options_from_env(lookup));
  if (options.world_size <= 1) return std::optional<RendezvousOptions>();
  return std::optional<RendezvousOptions>(std::move(options));
}

Status LocalCluster::create_process_rank(const LocalClusterOptions& options, LocalCluster& cluster) {
  const RendezvousOptions& group = *options.process_group;
  const std::string who = "process rank " + std::to_string(group.rank) + " of " + std::to_string(group.world_size);
  STRATA_ASSIGN_OR_RETURN(Rendezvous rendezvous, Rendezvous::create(group));
  cluster.rendezvous_.emplace(std::move(rendezvous));
  cluster.world_size_ = group.world_size;
  cluster.first_rank_ = group.rank;
  Rendezvous& joined = *cluster.rendezvous_;
  if (options.device == DeviceKind::kCpu) {
#if defined(STRATA_HAVE_GLOO)
    CpuDeviceOptions device_options;
    device_options.ordinal = group.rank;
    device_options.budget_bytes = options.device_budget_bytes;
    device_options.matmul_precision = options.matmul_precision;
    device_options.thread_nice = options.device_thread_nice;
    // The ranks of one node share its cores (all ranks on one node, as a launcher on one
    // machine starts them; a multi-node launch should set compute_threads).
    device_options.compute.threads =
        options.compute_threads > 0 ? options.compute_threads : std::max(1, available_cpu_count() / group.world_size);
    STRATA_ASSIGN_OR_RETURN(auto device, create_cpu_device(device_options));
    cluster.devices_.push_back(std::move(device));
    const GlooCommunicatorOptions gloo_options{.timeout = group.collective_timeout};
    for (auto* communicators : {&cluster.gather_, &cluster.reduce_}) {
      StatusOr<std::unique_ptr<GlooCommunicator>> made = GlooCommunicator::create(joined, *cluster.devices_.front(), gloo_options);
      if (!made.ok()) return std::move(made).status().with_context(who + ": creating its Gloo communicators");
      communicators->push_back(*std::move(made));
    }
    return Status::Ok();
#else
    return UnavailableError(who + ": CPU-device ranks that are processes need a build with Gloo (apt-get install "
                            "libgloo-dev, then reconfigure); or run the ranks as threads of one process (--world-size N "
                            "without WORLD_SIZE in the environment)");
#endif
  }
#if defined(STRATA_HAVE_CUDA)
  CudaDeviceOptions device_options;
  device_options.ordinal = group.local_rank;
  device_options.budget_bytes = options.device_budget_bytes;
  device_options.matmul_precision = options.matmul_precision;
  STRATA_ASSIGN_OR_RETURN(auto device, create_cuda_device(device_options));
  cluster.devices_.push_back(std::move(device));
  const NcclCommunicatorOptions nccl_options{.timeout = group.collective_timeout};
  for (auto* communicators : {&cluster.gather_, &cluster.reduce_}) {
    StatusOr<std::unique_ptr<NcclCommunicator>> made =
        NcclCommunicator::create_from_rendezvous(*cluster.devices_.front(), joined, nccl_options);
    if (!made.ok()) return std::move(made).status().with_context(who + ": creating its NCCL communicators");
    communicators->push_back(*std::move(made));
  }
  return Status::Ok();
#else
  return UnavailableError(who + ": CUDA ranks need a build with CUDA");
#endif
}

StatusOr<std::unique_ptr<LocalCluster>> LocalCluster::create(const LocalClusterOptions& options) {
  if (options.world_size < 1) return InvalidArgumentError("world size must be >= 1, got " + std::to_string(options.world_size));
  std::unique_ptr<LocalCluster> cluster(new LocalCluster());
  if (options.process_group) {
    STRATA_RETURN_IF_ERROR(create_process_rank(options, *cluster));
    return cluster;
  }
  const int world = options.world_size;
  cluster->world_size_ = world;
  if (options.device == DeviceKind::kCpu) {
    const int threads = options.compute_threads > 0 ? options.compute_threads : std::max(1, available_cpu_count() / world);
    for (int r = 0; r < world; ++r) {
      CpuDeviceOptions device_options;
      device_options.ordinal = r;
      device_options.budget_bytes = options.device_budget_bytes;
      device_options.compute.threads = threads;
      device_options.matmul_precision = options.matmul_precision;
      device_options.thread_nice = options.device_thread_nice;
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
  if (rendezvous_) {
    Status status = body(first_rank_);
    if (!status.ok()) {
      // Peers waiting in a collective for this process must not wait for their deadline.
      gather_.front()->abort("rank " + std::to_string(first_rank_) + " failed: " + status.message());
      reduce_.front()->abort("rank " + std::to_string(first_rank_) + " failed: " + status.message());
    }
    return status;
  }
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
