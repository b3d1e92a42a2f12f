// RangeAllocator: a best-fit free-list allocator over the byte range [0, capacity),
// shared by the pinned arena (offsets into the mapping) and the NVMe store (offsets
// into a rank's file). Internal to offload/.
//
// Free ranges are kept twice: by offset (to coalesce neighbours on free) and by size (to
// pick the smallest range that fits, which keeps large ranges whole).
//
// Colouring (optional, RangeColouring): every allocation of at least `min_bytes` takes
// `gap_bytes` more than asked, left unused after it. Packed back to back, buffers of an
// equal size S then start (S + gap) apart instead of S apart, so when S is a power of two
// their starts are not congruent modulo S (nor modulo 2 MiB): with a 4 KiB gap, up to
// 512 consecutive equal buffers start at distinct addresses modulo 2 MiB. Streams that
// walk such buffers in step (CPU Adam's master, moments, gradient and parameter copy)
// otherwise hit the same cache sets and DRAM banks at once; docs/benchmarks.md ("Buffer
// placement") has the measurement. The gap is a function of the size alone, so free()
// gives back exactly what allocate() took.
//
// Not thread-safe: the owner guards it.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace strata::internal {

// How allocations are spread over addresses (see the header comment). The default
// packs them tightly (for file offsets, where nothing aliases).
struct RangeColouring {
  size_t gap_bytes = 0;  // unused bytes after each coloured allocation (a multiple of the alignment); 0 = none
  size_t min_bytes = 0;  // allocations of at least this many bytes are coloured
};

class RangeAllocator {
 public:
  // `alignment` must be a power of two; capacity, every size and the colouring gap are
  // multiples of it.
  RangeAllocator(size_t capacity, size_t alignment, RangeColouring colouring = {});

  // Returns the offset of `bytes` (a multiple of the alignment, > 0) or nothing when no
  // free range can hold footprint(bytes).
  std::optional<size_t> allocate(size_t bytes);
  // Gives back a range returned by allocate(bytes) (the same `bytes`).
  void free(size_t offset, size_t bytes);
  // The bytes allocate(bytes) takes from the free ranges: `bytes` plus the colouring gap
  // where it applies.
  size_t footprint(size_t bytes) const;
  // Extends the range to `new_capacity` (>= capacity()); the new tail is free.
  void grow(size_t new_capacity);

  size_t capacity() const { return capacity_; }
  size_t free_bytes() const { return free_bytes_; }
  // The largest free range (an allocation whose footprint() is up to this size succeeds).
  size_t largest_free() const;
  // The free range that ends at capacity(), 0 bytes if the tail is in use.
  size_t free_tail_bytes() const;

 private:
  void insert_free(size_t offset, size_t bytes);
  void erase_free(std::map<size_t, size_t>::iterator it);

  void release(size_t offset, size_t bytes);

  size_t capacity_;
  size_t alignment_;
  RangeColouring colouring_;
  size_t free_bytes_ = 0;
  std::map<size_t, size_t> free_by_offset_;           // offset -> bytes
  std::set<std::pair<size_t, size_t>> free_by_size_;  // (bytes, offset)
};

}  // namespace strata::internal
