// PinnedArena: one page-locked host allocation that serves both NVMe DMA (io_uring
// registered buffers, O_DIRECT) and GPU DMA (cudaHostRegister).
//
// Why we mmap ourselves instead of cudaHostAlloc: memory from cudaHostAlloc cannot be
// registered with io_uring on some kernels, while an anonymous mapping we own can be
// registered with both. The arena is:
//   - an anonymous mmap, 4 KiB aligned (2 MiB huge pages where granted: MAP_HUGETLB if
//     the pool has pages, else madvise(MADV_HUGEPAGE) for transparent huge pages),
//   - MADV_DONTFORK, so that a fork (a data-loader child) does not copy pinned memory,
//   - page-locked: cudaHostRegister when a GPU is in use (which pins for DMA), mlock
//     otherwise; where locking is refused (RLIMIT_MEMLOCK without CAP_IPC_LOCK) the arena
//     stays usable, unlocked, after one warning,
//   - carved by a best-fit free-list allocator with coalescing under a byte budget into
//     move-only PinnedBuffers with 4 KiB aligned sizes,
//   - coloured: every buffer of at least kColourMinBytes is followed by a kColourGapBytes
//     gap, so equal buffers of 2^k bytes carved one after another (an optimizer group's
//     master weights and moments, a ring of staging slots) do not start at addresses
//     congruent modulo 2^k or modulo 2 MiB. Starts stay 4 KiB aligned, as O_DIRECT and
//     io_uring fixed buffers need. Five streams whose starts were congruent modulo
//     256 MiB ran CPU Adam at ~0.2x the speed of the same streams 4 KiB apart
//     (docs/benchmarks.md, "Buffer placement"). The arena maps room for the gaps on top of
//     the size asked for (1/256 of it), so whatever fitted without colouring still fits,
//     and the budget counts buffers' capacities, not their gaps.
//
// For io_uring the arena exposes its memory as regions of at most 1 GiB (the kernel's cap
// per registered buffer). A PinnedBuffer may straddle two regions (IoEngine cuts a
// transfer at region boundaries into one fixed transfer per region), so packing buffers
// into the arena loses nothing to the region size.
//
// Thread-safety: allocate(), stats() and PinnedBuffer destruction may run concurrently
// from any threads. The arena must outlive every PinnedBuffer it hands out.
#pragma once

#include <cstddef>
#include <cstdint>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "engine/core/gpu.h"
#include "engine/core/status.h"

namespace strata {

namespace internal {
class RangeAllocator;
}  // namespace internal

struct PinnedArenaOptions {
  size_t bytes = 0;              // bytes to carve, rounded up to 4 KiB (the mapping adds the colouring room and rounds to 2 MiB for huge pages)
  bool lock = true;              // page-lock the arena (cudaHostRegister with a GPU, mlock without)
  bool register_with_gpu = true; // use cudaHostRegister where a GPU is present
  bool try_huge_pages = true;    // MAP_HUGETLB if granted, else madvise(MADV_HUGEPAGE)
  size_t budget_bytes = 0;       // cap on bytes handed out by allocate(); 0 = the whole arena
};

// How the arena's pages are held in memory.
enum class PinnedLocking : uint8_t {
  kNone,       // pageable (locking not asked for, or refused)
  kMlock,      // mlock'ed
  kGpuPinned,  // cudaHostRegister'ed (page-locked and mapped for the GPU's DMA engines)
};
std::string_view pinned_locking_name(PinnedLocking locking);  // "none" | "mlock" | "cuda"

// How the arena's pages are backed.
enum class PinnedPageKind : uint8_t {
  kSmall,         // 4 KiB pages
  kTransparent,   // madvise(MADV_HUGEPAGE) accepted (the kernel may back it with 2 MiB pages)
  kHugeTlb,       // MAP_HUGETLB 2 MiB pages
};

struct PinnedArenaStats {
  size_t arena_bytes = 0;          // the carvable bytes: the size asked for plus the colouring room
  size_t budget_bytes = 0;         // the cap on bytes handed out
  size_t in_use_bytes = 0;         // bytes held by live PinnedBuffers (4 KiB rounded)
  size_t high_water_bytes = 0;     // the most in_use_bytes ever reached
  size_t largest_free_bytes = 0;   // the largest free range
  uint64_t live_buffers = 0;       // PinnedBuffers alive now
  uint64_t allocation_count = 0;   // successful allocations
  uint64_t failed_allocations = 0; // allocations refused (budget or fragmentation)
  PinnedLocking locking = PinnedLocking::kNone;
  PinnedPageKind page_kind = PinnedPageKind::kSmall;
};

// A piece of the arena to register with io_uring as one fixed buffer.
struct PinnedRegion {
  void* data = nullptr;
  size_t bytes = 0;
};

class PinnedArena;

// Move-only owner of one allocation from a PinnedArena; the destructor gives it back.
class PinnedBuffer {
 public:
  PinnedBuffer() = default;
  PinnedBuffer(const PinnedBuffer&) = delete;
  PinnedBuffer& operator=(const PinnedBuffer&) = delete;
  PinnedBuffer(PinnedBuffer&& other) noexcept { *this = std::move(other); }
  PinnedBuffer& operator=(PinnedBuffer&& other) noexcept;
  ~PinnedBuffer() { reset(); }

  void* data() const { return data_; }
  template <class T>
  T* as() const { return static_cast<T*>(data_); }
  // The bytes asked for.
  size_t size() const { return bytes_; }
  // The bytes held: size() rounded up to 4 KiB. O_DIRECT transfers may use all of them.
  size_t capacity() const { return capacity_; }
  bool empty() const { return data_ == nullptr; }
  PinnedArena* arena() const { return arena_; }
  // The index of the arena region (io_uring fixed buffer) holding data(), and data()'s
  // offset in it. A buffer larger than one region starts in region_index() and runs on
  // into the following ones.
  int region_index() const { return region_index_; }
  size_t region_offset() const { return region_offset_; }
  // Returns the memory to the arena now.
  void reset() noexcept;

 private:
  friend class PinnedArena;
  PinnedArena* arena_ = nullptr;
  void* data_ = nullptr;
  size_t bytes_ = 0;
  size_t capacity_ = 0;
  int region_index_ = -1;
  size_t region_offset_ = 0;
};

class PinnedArena {
 public:
  static constexpr size_t kAlignment = 4096;                 // every buffer's start and capacity
  static constexpr size_t kMaxRegionBytes = size_t{1} << 30; // the kernel's cap per io_uring fixed buffer
  static constexpr size_t kColourGapBytes = 4096;            // unused bytes after each coloured buffer
  static constexpr size_t kColourMinBytes = size_t{1} << 20; // buffers of at least this size are coloured

  // The carvable size of an arena created with `bytes`: 4 KiB rounded, plus room for the
  // colouring gap of as many coloured buffers as fit in it.
  static size_t carvable_bytes(size_t bytes);

  static StatusOr<std::unique_ptr<PinnedArena>> create(const PinnedArenaOptions& options);

  // Only create() can make the key, so only create() constructs arenas.
  class ConstructionKey {
    friend class PinnedArena;
    ConstructionKey() = default;
  };
  explicit PinnedArena(ConstructionKey);
  ~PinnedArena();
  PinnedArena(const PinnedArena&) = delete;
  PinnedArena& operator=(const PinnedArena&) = delete;

  void* data() { return base_; }
  const void* data() const { return base_; }
  // The carvable bytes (carvable_bytes() of the size asked for).
  size_t size() const { return bytes_; }
  // True when the pages are page-locked (mlock or cudaHostRegister).
  bool locked() const { return locking_ != PinnedLocking::kNone; }
  PinnedLocking locking() const { return locking_; }
  PinnedPageKind page_kind() const { return page_kind_; }
  // True when [data, data + bytes) lies inside the arena.
  bool contains(const void* data, size_t bytes) const;

  // Hands out `bytes` (rounded up to 4 KiB) under the budget. `purpose` names the
  // allocation in errors. Zero bytes gives an empty buffer. Fails with kOutOfMemory
  // naming the request, the budget, the bytes in use, the high-water mark and the
  // largest free block.
  StatusOr<PinnedBuffer> allocate(size_t bytes, std::string_view purpose);

  PinnedArenaStats stats() const;

  // The arena in pieces of at most kMaxRegionBytes, in address order, for
  // io_uring_register_buffers: region i is fixed buffer i.
  const std::vector<PinnedRegion>& regions() const { return regions_; }

 private:
  friend class PinnedBuffer;
  void release(size_t offset, size_t capacity) noexcept;
  // The steps of create(): map bytes_ (base_, mapped_bytes_, page_kind_), then page-lock it.
  Status map(bool try_huge_pages);
  void lock_pages(bool register_with_gpu);

  void* base_ = nullptr;
  size_t bytes_ = 0;
  size_t mapped_bytes_ = 0;
  PinnedLocking locking_ = PinnedLocking::kNone;
  PinnedPageKind page_kind_ = PinnedPageKind::kSmall;
  HostRegistration gpu_registration_;
  std::vector<PinnedRegion> regions_;

  mutable std::mutex mutex_;
  std::unique_ptr<internal::RangeAllocator> allocator_;  // guarded by mutex_
  size_t budget_bytes_ = 0;
  size_t in_use_bytes_ = 0;      // guarded by mutex_
  size_t high_water_bytes_ = 0;  // guarded by mutex_
  uint64_t live_buffers_ = 0;    // guarded by mutex_
  uint64_t allocation_count_ = 0;
  uint64_t failed_allocations_ = 0;
};

}  // namespace strata
