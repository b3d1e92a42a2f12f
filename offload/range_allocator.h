// RangeAllocator: a best-fit free-list allocator over the byte range [0, capacity),
// shared by the pinned arena (offsets into the mapping) and the NVMe store (offsets
// into a rank's file). Internal to offload/.
//
// Free ranges are kept twice: by offset (to coalesce neighbours on free) and by size (to
// pick the smallest range that fits, which keeps large ranges whole).
//
// Not thread-safe: the owner guards it.
#pragma once

#include <cstddef>
#include <map>
#include <optional>
#include <set>
#include <utility>

namespace strata::internal {

class RangeAllocator {
 public:
  // `alignment` must be a power of two; capacity and every size are multiples of it.
  RangeAllocator(size_t capacity, size_t alignment);

  // Returns the offset of `bytes` (a multiple of the alignment, > 0) or nothing when no
  // free range can hold them.
  std::optional<size_t> allocate(size_t bytes);
  // Gives back a range returned by allocate().
  void free(size_t offset, size_t bytes);
  // Extends the range to `new_capacity` (>= capacity()); the new tail is free.
  void grow(size_t new_capacity);

  size_t capacity() const { return capacity_; }
  size_t free_bytes() const { return free_bytes_; }
  // The largest free range (an allocation of up to this size succeeds).
  size_t largest_free() const;
  // The free range that ends at capacity(), 0 bytes if the tail is in use.
  size_t free_tail_bytes() const;

 private:
  void insert_free(size_t offset, size_t bytes);
  void erase_free(std::map<size_t, size_t>::iterator it);

  size_t capacity_;
  size_t alignment_;
  size_t free_bytes_ = 0;
  std::map<size_t, size_t> free_by_offset_;           // offset -> bytes
  std::set<std::pair<size_t, size_t>> free_by_size_;  // (bytes, offset)
};

}  // namespace strata::internal
