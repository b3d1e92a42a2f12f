// Swapper: moves a shard's bytes between any two tiers asynchronously.
//
//   Device  <-> Device          Device::copy_async on the swapper's stream
//   Device  <-> Pinned / Host   Device::copy_async (the device picks its fastest path)
//   Pinned / Host <-> Pinned / Host   memcpy
//   Nvme    <-> Pinned / Host   NvmeStore straight into/out of the buffer when it is
//                               aligned and covers the 4 KiB-rounded size; otherwise
//                               through the staging ring
//   Nvme    <-> Device, Nvme <-> Nvme
//                               through the staging ring: `staging_buffers` pinned
//                               buffers (2 = double, 3 = triple buffering) carved from
//                               the PinnedArena once, holding `staging_bytes` in all.
//                               While one chunk crosses between staging and the device,
//                               the next chunks are already being read (or the previous
//                               ones written). Nothing is allocated per copy.
//
// copy() returns a ticket at once; a worker thread runs the copies in the order they
// were asked for (FIFO), each one to completion before the next starts. wait(ticket)
// returns that copy's Status; an error nobody waited for is returned by wait_all() (and
// logged by the destructor), never dropped.
//
// Thread-safety: copy(), wait(), done(), wait_all() and stats() may be called from any
// thread. The stream should belong to the swapper (a copy stream): the worker enqueues
// on it and waits for its own events.
#pragma once

#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/status.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "offload/tier.h"

namespace strata {

// Where a shard's bytes are (or go): a tier and an address in it.
struct TierLocation {
  Tier tier = Tier::kHost;
  void* data = nullptr;   // kDevice: device memory; kPinned / kHost: host memory
  size_t capacity = 0;    // kPinned / kHost: bytes at `data` that may be touched (0 = exactly the copy's size)
  NvmeExtent extent;      // kNvme: the extent
  size_t offset = 0;      // kNvme: byte offset in the extent

  static TierLocation device(void* data) { return {Tier::kDevice, data, 0, {}, 0}; }
  static TierLocation device(const DeviceBuffer& buffer) { return device(buffer.data()); }
  static TierLocation pinned(void* data, size_t capacity = 0) { return {Tier::kPinned, data, capacity, {}, 0}; }
  static TierLocation pinned(const PinnedBuffer& buffer) { return pinned(buffer.data(), buffer.capacity()); }
  static TierLocation host(void* data, size_t capacity = 0) { return {Tier::kHost, data, capacity, {}, 0}; }
  static TierLocation nvme(NvmeExtent extent, size_t offset = 0) { return {Tier::kNvme, nullptr, 0, extent, offset}; }
};

struct SwapperOptions {
  size_t staging_bytes = size_t{48} << 20;  // pinned staging for NVMe <-> device / NVMe / unaligned host, in all
  unsigned staging_buffers = 3;             // the ring: 2 = double buffering, 3 = triple buffering
};

// What the swapper works with; a member may be null when no copy needs it.
struct SwapperResources {
  Device* device = nullptr;     // for Tier::kDevice
  Stream* stream = nullptr;     // the swapper's stream on `device`
  PinnedArena* arena = nullptr; // where the staging ring comes from (needed with `store`)
  NvmeStore* store = nullptr;   // for Tier::kNvme
};

struct SwapTicket {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
};

struct SwapperStats {
  uint64_t copies = 0;          // copies finished
  uint64_t failed_copies = 0;   // of which failed
  uint64_t bytes = 0;           // bytes moved by successful copies
  uint64_t staged_chunks = 0;   // chunks that went through the staging ring
  uint64_t direct_nvme = 0;     // NVMe transfers straight into/out of the caller's buffer
  size_t staging_chunk_bytes = 0;  // the ring's chunk size (0 = no ring)
};

class Swapper {
 public:
  static StatusOr<std::unique_ptr<Swapper>> create(const SwapperOptions& options, const SwapperResources& resources);
  ~Swapper();
  Swapper(const Swapper&) = delete;
  Swapper& operator=(const Swapper&) = delete;

  // Queues a copy of `bytes` from `src` to `dst`. Arguments that cannot work (a tier
  // without its resource, null addresses) are refused at once; the rest fails at wait().
  StatusOr<SwapTicket> copy(const TierLocation& src, const TierLocation& dst, size_t bytes);
  // Blocks until the copy has finished; returns its Status (every waiter sees it until a
  // wait_all() hands errors over and forgets them).
  Status wait(SwapTicket ticket);
  bool done(SwapTicket ticket) const;
  // Blocks until every copy asked for so far has finished; returns the first error no
  // wait(ticket) has returned (naming how many more there are) and forgets all errors.
  Status wait_all();
  SwapperStats stats() const;

  // Only create() can make the key, so only create() constructs swappers.
  class ConstructionKey {
    friend class Swapper;
    ConstructionKey() = default;
  };
  Swapper(ConstructionKey, const SwapperOptions& options, const SwapperResources& resources);

 private:
  struct Job {
    uint64_t id = 0;
    TierLocation src;
    TierLocation dst;
    size_t bytes = 0;
  };
  struct Slot;
  struct ErrorRecord {
    Status status;
    bool claimed = false;
  };

  void run();
  Status execute(const Job& job);
  Status copy_host_or_device(const Job& job);
  Status copy_nvme_direct(const Job& job);
  Status copy_staged(const Job& job);
  bool nvme_direct_possible(const TierLocation& host, size_t bytes) const;

  SwapperOptions options_;
  SwapperResources resources_;
  std::vector<std::unique_ptr<Slot>> slots_;
  size_t chunk_bytes_ = 0;
  std::unique_ptr<Event> host_event_;  // for copies between host and device memory

  mutable std::mutex mutex_;
  std::condition_variable work_available_;
  std::condition_variable job_finished_;
  std::deque<Job> queue_;
  uint64_t next_id_ = 1;
  uint64_t finished_below_ = 1;  // every job with id < this has finished (jobs finish in order)
  std::map<uint64_t, ErrorRecord> errors_;
  SwapperStats stats_;
  bool stopping_ = false;
  std::thread worker_;
};

}  // namespace strata
