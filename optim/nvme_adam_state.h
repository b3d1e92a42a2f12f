// Adam state on NVMe: each group's fp32 master weights and both moments live in extents
// of an NvmeStore, and a step streams them through a small ring of pinned slots:
//
//        slot k+1: read group piece k+1  (NVMe -> pinned, io_uring)
//        slot k  : step piece k          (CPU Adam on the pinned state, gradient and
//                                         parameter copy in the caller's host memory)
//        slot k-1: write piece k-1 back  (pinned -> NVMe)
//
// A piece is a group, or a slice of one when the pinned budget cannot hold a whole
// group in every slot: the pipeline never holds more than `pinned_budget_bytes` of
// staging, whatever the group sizes. With more than three slots, reads run further
// ahead (slots - 2 pieces in flight).
//
// The math is CpuAdam's, on the same values in the same order, so a step through NVMe
// is bit-identical to the same step on the state in memory.
//
// Errors from reads and writes (I/O errors, checksum mismatches) are returned by the
// step() that issued them, after every transfer still in flight has finished (the
// staging is never freed under a transfer). State of pieces whose write-back failed is
// undefined until a successful step or store_group() rewrites it.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "optim/cpu_adam.h"

namespace strata {

struct NvmeAdamStateOptions {
  std::string key_prefix = "optim";             // extents are "<prefix>/group<i>/{master,exp_avg,exp_avg_sq}"
  DType moment_type = DType::kFloat32;          // fp32, or bf16 (8 instead of 12 bytes per element on disk)
  size_t pinned_budget_bytes = size_t{192} << 20;  // the staging ring, in all
  unsigned slots = 3;                           // ring size, >= 3: read ahead, step, write back
};

// One group's gradient (read) and parameter copy (written), in host memory, as for
// kernels::AdamBuffers.
struct AdamGroupIo {
  const void* grad = nullptr;
  DType grad_type = DType::kBFloat16;
  void* param = nullptr;  // nullptr = no parameter copy
  DType param_type = DType::kBFloat16;
};

struct NvmeAdamStateStats {
  uint64_t steps = 0;              // step() calls that ran (skipped plans not counted)
  uint64_t pieces = 0;             // pieces stepped
  uint64_t bytes_read = 0;         // state bytes read from NVMe by steps
  uint64_t bytes_written = 0;      // state bytes written back by steps
  double read_wait_seconds = 0;    // time the stepping thread waited for a piece's reads
  double slot_wait_seconds = 0;    // time it waited for a slot's write-back before reusing it
  double compute_seconds = 0;      // time in CpuAdam::step
};

class NvmeAdamState {
 public:
  // Allocates the extents of `group_elements.size()` groups in `store` and the staging
  // ring in `arena`. Both must outlive the state. Errors name the budget that cannot
  // hold a piece, or the extent that cannot be allocated.
  static StatusOr<std::unique_ptr<NvmeAdamState>> create(NvmeStore& store, PinnedArena& arena, std::vector<size_t> group_elements,
                                                          const NvmeAdamStateOptions& options = {});
  ~NvmeAdamState();
  NvmeAdamState(const NvmeAdamState&) = delete;
  NvmeAdamState& operator=(const NvmeAdamState&) = delete;

  size_t groups() const { return group_elements_.size(); }
  size_t group_elements(size_t group) const { return group_elements_[group]; }
  // Elements per piece (the slot size): the largest aligned count the budget allows.
  size_t piece_elements() const { return piece_elements_; }
  DType moment_type() const { return options_.moment_type; }
  // Bytes of state per element on NVMe: 4 + 2 * moment size.
  size_t state_bytes_per_element() const { return 4 + 2 * dtype_size(options_.moment_type); }

  // Writes a group's state from host arrays (initial weights and zero moments, or a
  // checkpoint), and reads it back (checkpoints, tests). Synchronous.
  Status store_group(size_t group, const float* master, const void* exp_avg, const void* exp_avg_sq);
  Status load_group(size_t group, float* master, void* exp_avg, void* exp_avg_sq);

  // One optimizer step over the groups in `order` (every group in index order when
  // empty), `io[g]` holding group g's gradient and parameter copy. A skipped plan
  // touches nothing. Runs on the calling thread and `adam`'s workers.
  Status step(CpuAdam& adam, std::span<const AdamGroupIo> io, const AdamStepPlan& plan, std::span<const size_t> order = {});

  NvmeAdamStateStats stats() const { return stats_; }

  // Only create() can make the key, so only create() constructs states.
  class ConstructionKey {
    friend class NvmeAdamState;
    ConstructionKey() = default;
  };
  NvmeAdamState(ConstructionKey, NvmeStore& store, PinnedArena& arena, std::vector<size_t> group_elements,
                const NvmeAdamStateOptions& options);

 private:
  struct GroupExtents {
    NvmeExtent master, exp_avg, exp_avg_sq;
  };
  struct Slot;
  struct Piece {
    size_t group = 0;
    size_t begin = 0;  // elements into the group
    size_t end = 0;
  };

  Status read_piece(const Piece& piece, Slot& slot);
  Status write_piece(const Piece& piece, Slot& slot);
  // Waits for the slot's outstanding transfers; returns the first error.
  Status wait_slot(Slot& slot);

  NvmeStore& store_;
  PinnedArena& arena_;
  std::vector<size_t> group_elements_;
  NvmeAdamStateOptions options_;
  size_t piece_elements_ = 0;
  std::vector<GroupExtents> extents_;
  std::vector<std::unique_ptr<Slot>> slots_;
  NvmeAdamStateStats stats_;
};

}  // namespace strata
