// The ranks of one process: a device, a gather communicator and a reduce communicator
// per rank, and a way to run one function per rank.
//
// Thread ranks (the default): all world_size ranks live in this process, each on its own
// thread. On the CPU device they share HostCommunicator groups; on CUDA, one GPU per rank
// with NCCL communicators (one process driving several GPUs), or a SelfCommunicator
// for a world of one GPU (no NCCL).
//
// Process ranks (options.process_group set, from process_group_from_env() when the
// launcher's WORLD_SIZE > 1): this process is one rank of a multi-process world. create()
// joins the TCP rendezvous, makes one device (CPU; or the GPU LOCAL_RANK names) and the
// gather and reduce communicators for this process's global rank over it — Gloo on the
// CPU device (engine/core/gloo_communicator.h), NCCL on CUDA — and run(body) calls
// body(global rank) once, on the caller's thread. Ranks are always global: device(rank)
// and the communicators take the global rank, of this process's ranks only.
//
// Programs (train_gpt, strata-bench step) and tests build their ranks through this.
#pragma once

#include <chrono>
#include <functional>
#include <memory>
#include <optional>
#include <vector>

#include "engine/core/communicator.h"
#include "engine/core/device.h"
#include "engine/core/rendezvous.h"

namespace strata {

struct LocalClusterOptions {
  int world_size = 1;
  DeviceKind device = DeviceKind::kCpu;
  size_t device_budget_bytes = size_t{1} << 30;  // per rank; for CUDA 0 = the GPU's free memory
  int compute_threads = 0;                       // CPU device: executor threads per rank; 0 = cores / world size
  int device_thread_nice = kCpuDeviceThreadNice;  // CPU device: its threads' nice value (CpuDeviceOptions::thread_nice)
  MatmulPrecision matmul_precision = MatmulPrecision::kFp32;  // fp32 GEMMs (the CPU device takes only kFp32)
  std::chrono::milliseconds collective_timeout{std::chrono::minutes(10)};  // host and NCCL communicators (thread ranks)
  // Process ranks: this process's place in a multi-process world (world_size above is
  // then ignored; the rendezvous gives it). nullopt = thread ranks. Its
  // collective_timeout (STRATA_COLLECTIVE_TIMEOUT_S, default 60 s) is how long a Gloo or
  // NCCL collective waits for a peer before naming it lost.
  std::optional<RendezvousOptions> process_group;
};

class LocalCluster {
 public:
  static StatusOr<std::unique_ptr<LocalCluster>> create(const LocalClusterOptions& options);
  // The launcher's process group: rendezvous_options_from_env(lookup) when it gives a
  // WORLD_SIZE above 1, else nullopt (thread ranks). Errors name the bad variable.
  static StatusOr<std::optional<RendezvousOptions>> process_group_from_env(const EnvLookup& lookup = process_env_lookup);
  ~LocalCluster();

  int world_size() const { return world_size_; }
  // This process's ranks: [first_rank(), first_rank() + local_ranks()).
  int first_rank() const { return first_rank_; }
  int local_ranks() const { return static_cast<int>(devices_.size()); }
  // Process ranks: the joined rendezvous (one thread at a time, like the rank's body);
  // nullptr for thread ranks.
  Rendezvous* rendezvous() { return rendezvous_ ? &*rendezvous_ : nullptr; }
  Device& device(int rank) { return *devices_[index(rank)]; }
  Communicator& gather_communicator(int rank) { return *gather_[index(rank)]; }
  Communicator& reduce_communicator(int rank) { return *reduce_[index(rank)]; }

  // Runs body(rank) for every rank of this process, each on its own thread (the first on
  // the caller's), and returns the first failure by rank order. A rank that fails aborts
  // its communicators, so the others — threads here or processes elsewhere — fail too
  // instead of waiting for it.
  Status run(const std::function<Status(int rank)>& body);

 private:
  LocalCluster() = default;
  size_t index(int rank) const { return static_cast<size_t>(rank - first_rank_); }
  static Status create_process_rank(const LocalClusterOptions& options, LocalCluster& cluster);
  int world_size_ = 1;
  int first_rank_ = 0;
  std::optional<Rendezvous> rendezvous_;
  std::vector<std::unique_ptr<Device>> devices_;
  std::vector<std::unique_ptr<Communicator>> gather_;
  std::vector<std::unique_ptr<Communicator>> reduce_;
  struct HostGroups;
  std::unique_ptr<HostGroups> host_groups_;
};

}  // namespace strata
