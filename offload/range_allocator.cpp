#include "offload/range_allocator.h"

#include <algorithm>

#include "engine/core/check.h"

namespace strata::internal {

RangeAllocator::RangeAllocator(size_t capacity, size_t alignment, RangeColouring colouring)
    : capacity_(capacity), alignment_(alignment), colouring_(colouring) {
  STRATA_CHECK(alignment_ != 0 && (alignment_ & (alignment_ - 1)) == 0);
  STRATA_CHECK(capacity_ % alignment_ == 0);
  STRATA_CHECK(colouring_.gap_bytes % alignment_ == 0);
  if (capacity_ > 0) insert_free(0, capacity_);
}

void RangeAllocator::insert_free(size_t offset, size_t bytes) {
  free_by_offset_.emplace(offset, bytes);
  free_by_size_.emplace(bytes, offset);
  free_bytes_ += bytes;
}

void RangeAllocator::erase_free(std::map<size_t, size_t>::iterator it) {
  free_by_size_.erase({it->second, it->first});
  free_bytes_ -= it->second;
  free_by_offset_.erase(it);
}

size_t RangeAllocator::footprint(size_t bytes) const {
  const bool coloured = colouring_.gap_bytes > 0 && bytes >= colouring_.min_bytes;
  return coloured ? bytes + colouring_.gap_bytes : bytes;
}

std::optional<size_t> RangeAllocator::allocate(size_t request) {
  STRATA_CHECK(request > 0 && request % alignment_ == 0);
  const size_t bytes = footprint(request);
  // Best fit: the smallest free range that can hold the request.
  const auto it = free_by_size_.lower_bound({bytes, 0});
  if (it == free_by_size_.end()) return std::nullopt;
  const auto [size, offset] = *it;
  erase_free(free_by_offset_.find(offset));
  if (size > bytes) insert_free(offset + bytes, size - bytes);
  return offset;
}

void RangeAllocator::free(size_t offset, size_t bytes) {
  STRATA_CHECK(bytes > 0);
  release(offset, footprint(bytes));
}

void RangeAllocator::release(size_t offset, size_t bytes) {
  STRATA_CHECK(bytes > 0 && offset + bytes <= capacity_);
  size_t start = offset;
  size_t end = offset + bytes;
  auto next = free_by_offset_.lower_bound(offset);
  STRATA_CHECK(next == free_by_offset_.end() || next->first >= end);  // no double free
  if (next != free_by_offset_.end() && next->first == end) {
    end += next->second;
    erase_free(next);
  }
  auto after = free_by_offset_.lower_bound(offset);
  if (after != free_by_offset_.begin()) {
    auto prev = std::prev(after);
    STRATA_CHECK(prev->first + prev->second <= start);  // no double free
    if (prev->first + prev->second == start) {
      start = prev->first;
      erase_free(prev);
    }
  }
  insert_free(start, end - start);
}

void RangeAllocator::grow(size_t new_capacity) {
  STRATA_CHECK(new_capacity >= capacity_ && new_capacity % alignment_ == 0);
  if (new_capacity == capacity_) return;
  const size_t old = capacity_;
  capacity_ = new_capacity;
  release(old, new_capacity - old);
}

size_t RangeAllocator::largest_free() const {
  return free_by_size_.empty() ? 0 : free_by_size_.rbegin()->first;
}

size_t RangeAllocator::free_tail_bytes() const {
  if (free_by_offset_.empty()) return 0;
  const auto& [offset, size] = *free_by_offset_.rbegin();
  return offset + size == capacity_ ? size : 0;
}

}  // namespace strata::internal
