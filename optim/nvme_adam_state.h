// Adam state on NVMe: each group's fp32 master weights and both moments (and, when the
// caller spills them, its gradients) live in extents of an NvmeStore, and a step streams
// them through a small ring of pinned slots:
//
//        slot k+1: read group piece k+1  (NVMe -> pinned, io_uring)
//        slot k  : step piece k          (CPU Adam on the pinned state; the gradient from
//                                         the caller's host memory or read into the slot;
//                                         the parameter copy into the caller's host memory
//                                         or staged in the slot and handed to a sink)
//        slot k-1: write piece k-1 back  (pinned -> NVMe)
//
// A piece is a group, or a slice of one (DeepSpeed's sub_group_size): the pipeline never
// holds more than `pinned_budget_bytes` of staging, whatever the group sizes, so host
// memory is bounded by the budget and not by the model. With more than three slots, reads
// run further ahead (slots - 2 pieces in flight).
//
// The math is CpuAdam's, on the same values in the same order, so a step through NVMe
// is bit-identical to the same step on the state in memory.
//
// Errors from reads and writes (I/O errors, checksum mismatches) are returned by the
// step that issued them, after every transfer still in flight has finished (the staging
// is never freed under a transfer). State of pieces whose write-back failed is
// undefined until a successful step or store_group() rewrites it.
#pragma once

#include <cstddef>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "engine/core/dtype.h"
#include "offload/nvme_store.h"
#include "offload/pinned_arena.h"
#include "optim/cpu_adam.h"

namespace strata {

struct NvmeAdamStateOptions {
  std::string key_prefix = "optim";             // extents are "<prefix>/group<i>/{master,exp_avg,exp_avg_sq,grad<c>}"
  DType moment_type = DType::kFloat32;          // fp32, or bf16 (8 instead of 12 bytes per element on disk)
  size_t pinned_budget_bytes = size_t{192} << 20;  // the staging ring, in all
  unsigned slots = 3;                           // ring size, >= 3: read ahead, step, write back
  // Elements per piece (sub_group_size), rounded down to the store's granularity; 0 = the
  // largest the budget allows. A piece that does not fit the budget is an error.
  size_t piece_elements = 0;
  // Gradients kept in the store beside the state (the caller spills them with
  // store_gradient, a step reads them piece by piece), in this dtype; unset = every step
  // passes the gradients in host memory.
  std::optional<DType> stored_gradient_type;
  unsigned gradient_copies = 1;                 // stored gradient copies (2 when one step's land while the previous steps)
  // The parameter copy staged in the slot, in this dtype, and handed to the step's sink
  // piece by piece (a caller whose parameters are not in host memory); unset = none.
  std::optional<DType> staged_param_type;
};

// One group's gradient (read) and parameter copy (written), as for kernels::AdamBuffers.
struct AdamGroupIo {
  const void* grad = nullptr;          // in host memory; nullptr = the stored gradient copy below
  DType grad_type = DType::kBFloat16;
  void* param = nullptr;               // in host memory; nullptr = staged (see options) or none
  DType param_type = DType::kBFloat16;
  unsigned stored_gradient_copy = 0;   // which stored copy a step reads when grad is nullptr
};

// Elements [begin, end) of a group stepped with one plan (e.g. the tensors with weight
// decay and those without).
struct AdamPlanRun {
  size_t begin = 0;
  size_t end = 0;
  const AdamStepPlan* plan = nullptr;
};

// One group of a step: its io and its plan runs (which tile the group in order).
struct NvmeAdamGroupStep {
  size_t group = 0;
  AdamGroupIo io;
  std::span<const AdamPlanRun> runs;
};

// What a step tells its caller as it goes (on the stepping thread). Each may fail the step.
struct NvmeAdamStepSinks {
  // A piece's new parameters staged in the slot (staged_param_type): the slot is reused
  // once this returns, so write them out (or copy them) before returning.
  std::function<Status(size_t group, size_t begin, size_t end, const void* param)> staged_params;
  // Every piece of the group has been stepped (its state write-back may still be in flight).
  std::function<Status(size_t group)> group_stepped;
  // A piece's CPU Adam ran from begin to end (the compute, without the waits for I/O).
  std::function<void(size_t group, std::chrono::steady_clock::time_point begin, std::chrono::steady_clock::time_point end)> stepped;
  // A transfer of state finished: from submission to completion as seen by the pipeline.
  std::function<void(size_t group, bool write, std::chrono::steady_clock::time_point begin,
                      std::chrono::steady_clock::time_point end)> transfer_done;
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
  // ring in `arena`. A group of 0 elements holds no state (it keeps its index: an
  // engine's frozen group); storing or loading it is an error. Both must outlive the state. Errors name the budget that cannot
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
  // Pinned bytes one slot needs for `piece` elements with these options, and the
  // elements a piece must be a multiple of (so every array's offsets stay on the store's
  // transfer granularity): for sizing plans before the state exists.
  static size_t slot_bytes(const NvmeAdamStateOptions& options, size_t piece, size_t store_alignment);
  static size_t piece_alignment(const NvmeAdamStateOptions& options, size_t store_granularity);
  size_t slot_count() const { return slots_.size(); }

  // Writes a group's state from host arrays (initial weights and zero moments, or a
  // checkpoint), and reads it back (checkpoints, tests). Synchronous; a null array is
  // left as it is.
  Status store_group(size_t group, const float* master, const void* exp_avg, const void* exp_avg_sq);
  Status load_group(size_t group, float* master, void* exp_avg, void* exp_avg_sq);
  // The ranged forms, for shards larger than a caller's buffer: elements [first, first +
  // count) of one array (the master in fp32, a moment in moment_type). The store's rules
  // for ranged transfers apply to the byte range (nvme_store.h); an element count that is
  // a multiple of piece_alignment() always meets them.
  enum class Array { kMaster, kExpAvg, kExpAvgSq };
  Status store_range(size_t group, Array array, size_t first, size_t count, const void* values);
  Status load_range(size_t group, Array array, size_t first, size_t count, void* values);

  // One optimizer step over the groups in `order` (every group in index order when
  // empty), `io[g]` holding group g's gradient and parameter copy, written back before it
  // returns. A skipped plan touches nothing. Runs on the calling thread and `adam`'s workers.
  Status step(CpuAdam& adam, std::span<const AdamGroupIo> io, const AdamStepPlan& plan, std::span<const size_t> order = {});
  // The general form: the groups in the given order, each with its own io and plan runs,
  // pipelined across group boundaries. Runs whose plan skips are left untouched. The last
  // pieces' write-backs are left in flight, so that back-to-back calls keep the disk busy:
  // flush() waits for them (state access does too). Sinks that report transfers may be
  // called by a later call or flush(): they must outlive the state, not just this call.
  Status step_groups(CpuAdam& adam, std::span<const NvmeAdamGroupStep> groups, const NvmeAdamStepSinks& sinks = {});
  // Waits for every write-back in flight; returns the first error.
  Status flush();

  // The stored gradients (stored_gradient_type): a whole group's copy written from or
  // read into host memory (pinned and 4 KiB aligned for direct transfers), synchronously.
  // Safe to call from one other thread while a step runs on a different copy or group.
  Status store_gradient(size_t group, unsigned copy, const void* grad, size_t capacity_bytes = 0);
  Status load_gradient(size_t group, unsigned copy, void* grad, size_t capacity_bytes = 0);

  NvmeAdamStateStats stats() const { return stats_; }
  // Bytes of stored gradients written by store_gradient and read by load_gradient (the
  // reads by steps count in stats().bytes_read).
  uint64_t gradient_bytes_written() const { return gradient_bytes_written_.load(std::memory_order_relaxed); }
  uint64_t gradient_bytes_read() const { return gradient_bytes_read_.load(std::memory_order_relaxed); }

  // Only create() can make the key, so only create() constructs states.
  class ConstructionKey {
    friend class NvmeAdamState;
    ConstructionKey() = default;
  };
  NvmeAdamState(ConstructionKey, NvmeStore& store, std::vector<size_t> group_elements, const NvmeAdamStateOptions& options);

 private:
  struct GroupExtents {
    NvmeExtent master, exp_avg, exp_avg_sq;
    std::vector<NvmeExtent> gradients;  // stored gradient copies
  };
  struct Slot;
  struct Piece {
    size_t step_index = 0;  // into the step's groups
    size_t group = 0;
    size_t begin = 0;  // elements into the group
    size_t end = 0;
  };

  Status check_group_step(const NvmeAdamGroupStep& step) const;
  Status read_piece(const Piece& piece, const AdamGroupIo& io, Slot& slot);
  Status write_piece(const Piece& piece, Slot& slot);
  Status step_piece(CpuAdam& adam, const Piece& piece, const NvmeAdamGroupStep& step, Slot& slot, const NvmeAdamStepSinks& sinks);
  Status check_gradient_access(size_t group, unsigned copy, const char* what) const;
  Status check_group_has_state(size_t group) const;
  // Where elements [first, first + count) of one array of a group lie, for the ranged forms.
  struct ArrayRange {
    NvmeExtent extent;
    size_t offset = 0, bytes = 0;  // in the extent
    std::string what;              // "group G master elements [a, b)", for errors
  };
  StatusOr<ArrayRange> array_range(size_t group, Array array, size_t first, size_t count) const;
  // Waits for the slot's outstanding transfers; returns the first error.
  Status wait_slot(Slot& slot);

  NvmeStore& store_;
  std::vector<size_t> group_elements_;
  NvmeAdamStateOptions options_;
  size_t piece_elements_ = 0;
  std::vector<GroupExtents> extents_;
  std::vector<std::unique_ptr<Slot>> slots_;
  NvmeAdamStateStats stats_;
  // The latest step's transfer_done (write-backs a step leaves in flight report later).
  std::function<void(size_t, bool, std::chrono::steady_clock::time_point, std::chrono::steady_clock::time_point)> transfer_done_;
  size_t next_slot_ = 0;  // the slot the next step's first piece uses
  std::atomic<uint64_t> gradient_bytes_read_{0};
  std::atomic<uint64_t> gradient_bytes_written_{0};
};

}  // namespace strata
