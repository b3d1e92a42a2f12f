// The shard store: where this rank's parameter shard copies live (device memory, pinned
// or pageable host memory, or NVMe extents: one copy, or two in delayed mode indexed by
// version parity; a frozen group has one), and the one place that branches on the
// parameter tier.
//
// The fetcher asks it where a version lives (source); the optimizer asks where to write
// new values in place (host_copy: the host tiers) and hands it values staged elsewhere
// (write: to the device or NVMe); start-up and checkpoint loads store fp32 values
// (store_values) and checkpoints read them back (load_values). The optimizer state's tiers are the optimizer stage's.
#pragma once

#include <memory>
#include <span>
#include <vector>

#include "engine/core/device.h"
#include "engine/core/file.h"
#include "engine/engine_options.h"
#include "engine/partition.h"
#include "engine/trace.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"

namespace strata::engine_internal {

// Where one copy of a group's shard is.
struct ParamSource {
  Tier tier = Tier::kPinned;
  const void* host = nullptr;     // kPinned / kHost
  const void* device = nullptr;   // kDevice
  NvmeExtent extent;              // kNvme
};

struct ShardStoreContext {
  const EngineOptions* options = nullptr;
  Device* device = nullptr;
  Stream* stream = nullptr;       // for host<->device copies of whole shards (start-up, updates)
  PinnedArena* arena = nullptr;
  NvmeStore* nvme = nullptr;
  Tracer* tracer = nullptr;
  const std::vector<GroupLayout>* layouts = nullptr;  // every group, by id
};

class ShardStore {
 public:
  explicit ShardStore(const ShardStoreContext& context) : ctx_(context), copies_(context.layouts->size()) {}

  // Group g's copies: two in delayed mode (by version parity), else one. A frozen group
  // never changes, so one copy serves every version.
  int copies(int g) const {
    return ctx_.options->overlap == OverlapMode::kDelayed && group_layout(g).trainable ? 2 : 1;
  }
  int copy_of(int g, int64_t version) const { return copies(g) == 1 ? 0 : static_cast<int>(version % 2); }
  size_t param_bytes(size_t elements) const { return elements * dtype_size(ctx_.options->param_dtype); }

  // Allocates group g's copies; their values are undefined until store_values() writes them.
  Status allocate_group(int g);
  ParamSource source(int g, int64_t version);
  // The copy the optimizer writes in place: host_copy for the host tiers, device_copy for
  // the device tier (the device Adam); nullptr for the other tiers.
  void* host_copy(int g, int copy);
  void* device_copy(int g, int copy);
  // Where CPU Adam writes copy `copy`'s new values in place: the host copy, or the device
  // copy on a device whose memory is the host's (the CPU device), so that no staging copy
  // follows the update; nullptr otherwise (the values are staged and handed to write()).
  void* host_writable_copy(int g, int copy);
  // Elements [begin, begin + count) of copy `copy` from host memory (the device and NVMe
  // tiers); synchronous. `capacity` bytes at `values` may be read (0 = exactly the bytes).
  Status write(int g, int copy, size_t begin, size_t count, const void* values, size_t capacity);
  // fp32 values converted to the parameter dtype into elements [first, first + size) of
  // copy `copy` (an NVMe copy's range follows the store's ranged-transfer rules).
  Status store_values(int g, int copy, size_t first, std::span<const float> values);
  // Elements [first, first + size) of copy `copy` as fp32 values (exact: every parameter
  // dtype widens to fp32); synchronous. For checkpoints of the stale copy in delayed mode.
  Status load_values(int g, int copy, size_t first, std::span<float> values);

 private:
  StatusOr<AlignedBuffer> staging_buffer(int g, size_t bytes) const;
  static void convert_from_float(const float* values, DType dtype, size_t count, void* out);

  // One group's copies, in the parameter tier's form (one vector is used).
  struct Copies {
    std::vector<DeviceBuffer> device;  // kDevice
    std::vector<PinnedBuffer> host;    // kPinned / kHost
    std::vector<NvmeExtent> nvme;      // kNvme
  };
  const GroupLayout& group_layout(int g) const { return (*ctx_.layouts)[static_cast<size_t>(g)]; }
  ShardStoreContext ctx_;
  std::vector<Copies> copies_;  // by group
};

}  // namespace strata::engine_internal
