#include "offload/pinned_arena.h"

#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <optional>

#include "engine/core/check.h"
#include "engine/core/log.h"
#include "offload/offload_util.h"
#include "offload/range_allocator.h"

namespace strata {

using offload_internal::format_bytes;
using offload_internal::round_up;

namespace {

constexpr size_t kHugePageBytes = size_t{2} << 20;

std::string memlock_limit_text() {
  rlimit limit{};
  if (::getrlimit(RLIMIT_MEMLOCK, &limit) != 0) return "unknown";
  if (limit.rlim_cur == RLIM_INFINITY) return "unlimited";
  return format_bytes(limit.rlim_cur);
}

}  // namespace

std::string_view pinned_locking_name(PinnedLocking locking) {
  switch (locking) {
    case PinnedLocking::kNone: return "none";
    case PinnedLocking::kMlock: return "mlock";
    case PinnedLocking::kGpuPinned: return "cuda";
  }
  return "?";
}

PinnedBuffer& PinnedBuffer::operator=(PinnedBuffer&& other) noexcept {
  if (this != &other) {
    reset();
    arena_ = std::exchange(other.arena_, nullptr);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
    region_index_ = std::exchange(other.region_index_, -1);
    region_offset_ = std::exchange(other.region_offset_, 0);
  }
  return *this;
}

void PinnedBuffer::reset() noexcept {
  if (arena_ != nullptr && data_ != nullptr) {
    arena_->release(static_cast<size_t>(static_cast<char*>(data_) - static_cast<char*>(arena_->data())), capacity_);
  }
  arena_ = nullptr;
  data_ = nullptr;
  bytes_ = 0;
  capacity_ = 0;
  region_index_ = -1;
  region_offset_ = 0;
}

size_t PinnedArena::carvable_bytes(size_t bytes) {
  const size_t asked = round_up(bytes, kAlignment);
  return asked + asked / kColourMinBytes * kColourGapBytes;
}

StatusOr<std::unique_ptr<PinnedArena>> PinnedArena::create(const PinnedArenaOptions& options) {
  if (options.bytes == 0) return InvalidArgumentError("pinned arena: the size must be at least one byte");
  const size_t asked = round_up(options.bytes, kAlignment);
  if (options.budget_bytes > asked) {
    return InvalidArgumentError("pinned arena: budget " + format_bytes(options.budget_bytes) +
                                " exceeds the arena's size " + format_bytes(asked));
  }
  const size_t bytes = carvable_bytes(options.bytes);
  auto arena = std::make_unique<PinnedArena>(ConstructionKey());
  arena->bytes_ = bytes;
  // The budget counts capacities; the colouring room is the arena's own overhead.
  arena->budget_bytes_ = options.budget_bytes == 0 ? asked : options.budget_bytes;

  if (Status mapped = arena->map(options.try_huge_pages); !mapped.ok()) return mapped;
  // A forked child (a data loader) must not inherit, and the kernel must not copy at
  // fork, memory that is pinned for DMA.
  if (::madvise(arena->base_, arena->mapped_bytes_, MADV_DONTFORK) != 0) {
    STRATA_LOG(kDebug) << "pinned arena: madvise(MADV_DONTFORK) refused: " << std::strerror(errno);
  }
  if (options.lock) arena->lock_pages(options.register_with_gpu);

  void* const base = arena->base_;
  for (size_t offset = 0; offset < bytes; offset += kMaxRegionBytes) {
    arena->regions_.push_back(
        PinnedRegion{static_cast<char*>(base) + offset, std::min(kMaxRegionBytes, bytes - offset)});
  }
  // Buffers may straddle region boundaries: the I/O engine cuts a transfer at them into
  // fixed transfers of one region each, so no arena space is lost to the regions.
  arena->allocator_ = std::make_unique<internal::RangeAllocator>(
      bytes, kAlignment, internal::RangeColouring{.gap_bytes = kColourGapBytes, .min_bytes = kColourMinBytes});
  STRATA_LOG(kDebug) << "pinned arena: " << format_bytes(bytes) << ", locking " << pinned_locking_name(arena->locking_)
                     << ", " << arena->regions_.size() << " io_uring region(s)";
  return arena;
}

// Maps bytes_ of anonymous memory: huge pages first where asked and the size warrants
// them, then transparent huge pages, then small pages.
Status PinnedArena::map(bool try_huge_pages) {
  const size_t bytes = bytes_;
  void* base = MAP_FAILED;
  if (try_huge_pages && bytes >= kHugePageBytes) {
    const size_t huge_bytes = round_up(bytes, kHugePageBytes);
    base = ::mmap(nullptr, huge_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_HUGETLB, -1, 0);
    if (base != MAP_FAILED) {
      mapped_bytes_ = huge_bytes;
      page_kind_ = PinnedPageKind::kHugeTlb;
    } else {
      STRATA_LOG(kDebug) << "pinned arena: MAP_HUGETLB refused (" << std::strerror(errno)
                         << "); using transparent huge pages where the kernel grants them";
      // A 2 MiB multiple lets the kernel back the whole mapping with transparent huge pages.
      base = ::mmap(nullptr, huge_bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base != MAP_FAILED) {
        mapped_bytes_ = huge_bytes;
        if (::madvise(base, huge_bytes, MADV_HUGEPAGE) == 0) {
          page_kind_ = PinnedPageKind::kTransparent;
        } else {
          STRATA_LOG(kDebug) << "pinned arena: madvise(MADV_HUGEPAGE) refused: " << std::strerror(errno);
        }
      }
    }
  }
  if (base == MAP_FAILED) {
    base = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    if (base == MAP_FAILED) {
      return Status::FromErrno(errno, "pinned arena: mmap of " + format_bytes(bytes));
    }
    mapped_bytes_ = bytes;
  }
  base_ = base;
  return Status::Ok();
}

// Page-locks the mapping: registered with the GPU where asked and one is present, else
// mlock. A refusal leaves the arena usable (pageable, slower for DMA) with one warning.
void PinnedArena::lock_pages(bool register_with_gpu) {
  std::string refusals;
  if (register_with_gpu && gpu_available()) {
    StatusOr<HostRegistration> registration = register_host_memory_with_gpu(base_, mapped_bytes_);
    if (registration.ok()) {
      gpu_registration_ = std::move(registration).value();
      locking_ = PinnedLocking::kGpuPinned;
    } else {
      refusals = "cudaHostRegister: " + registration.status().message() + "; ";
    }
  }
  if (locking_ == PinnedLocking::kNone) {
    // The raw syscall: AddressSanitizer replaces mlock() with a no-op that reports
    // success, which would hide a refusal in sanitizer builds.
    if (::syscall(SYS_mlock, base_, mapped_bytes_) == 0) {
      locking_ = PinnedLocking::kMlock;
    } else {
      const int error = errno;
      refusals += std::string("mlock: ") + std::strerror(error) + " (errno " + std::to_string(error) + ")";
    }
  }
  if (locking_ == PinnedLocking::kNone) {
    // One warning per arena: the arena stays usable, only slower for DMA.
    STRATA_LOG(kWarn) << "pinned arena: could not page-lock " << format_bytes(mapped_bytes_) << " ("
                      << refusals << "; RLIMIT_MEMLOCK " << memlock_limit_text()
                      << "): continuing with pageable memory, so NVMe and GPU transfers from it may be slower";
  }
}

PinnedArena::PinnedArena(ConstructionKey) {}

PinnedArena::~PinnedArena() {
  {
    std::lock_guard<std::mutex> lock(mutex_);
    if (live_buffers_ != 0) {
      STRATA_LOG(kError) << "pinned arena destroyed while " << live_buffers_ << " buffer(s) holding "
                         << format_bytes(in_use_bytes_) << " are alive (buffers must not outlive their arena)";
    }
  }
  gpu_registration_.reset();
  if (base_ != nullptr) ::munmap(base_, mapped_bytes_);
}

bool PinnedArena::contains(const void* data, size_t bytes) const {
  const auto* begin = static_cast<const char*>(base_);
  const auto* p = static_cast<const char*>(data);
  return p >= begin && p <= begin + bytes_ && bytes <= static_cast<size_t>(begin + bytes_ - p);
}

StatusOr<PinnedBuffer> PinnedArena::allocate(size_t bytes, std::string_view purpose) {
  if (bytes == 0) return PinnedBuffer();
  std::lock_guard<std::mutex> lock(mutex_);
  const size_t capacity = bytes > bytes_ ? 0 : round_up(bytes, kAlignment);
  std::optional<size_t> offset;
  if (capacity != 0 && in_use_bytes_ + capacity <= budget_bytes_) offset = allocator_->allocate(capacity);
  if (!offset) {
    ++failed_allocations_;
    const bool over_budget = capacity == 0 || in_use_bytes_ + capacity > budget_bytes_;
    return OutOfMemoryError("pinned arena: cannot allocate " + format_bytes(bytes) + " for '" + std::string(purpose) +
                            "': " + (over_budget ? "over budget" : "no free range large enough") + " (budget " +
                            format_bytes(budget_bytes_) + ", in use " + format_bytes(in_use_bytes_) + ", high-water " +
                            format_bytes(high_water_bytes_) + ", largest free range " +
                            format_bytes(allocator_->largest_free()) + ")");
  }
  in_use_bytes_ += capacity;
  high_water_bytes_ = std::max(high_water_bytes_, in_use_bytes_);
  ++live_buffers_;
  ++allocation_count_;
  PinnedBuffer buffer;
  buffer.arena_ = this;
  buffer.data_ = static_cast<char*>(base_) + *offset;
  buffer.bytes_ = bytes;
  buffer.capacity_ = capacity;
  buffer.region_index_ = static_cast<int>(*offset / kMaxRegionBytes);
  buffer.region_offset_ = *offset % kMaxRegionBytes;
  return buffer;
}

void PinnedArena::release(size_t offset, size_t capacity) noexcept {
  std::lock_guard<std::mutex> lock(mutex_);
  allocator_->free(offset, capacity);
  in_use_bytes_ -= capacity;
  --live_buffers_;
}

PinnedArenaStats PinnedArena::stats() const {
  std::lock_guard<std::mutex> lock(mutex_);
  PinnedArenaStats stats;
  stats.arena_bytes = bytes_;
  stats.budget_bytes = budget_bytes_;
  stats.in_use_bytes = in_use_bytes_;
  stats.high_water_bytes = high_water_bytes_;
  stats.largest_free_bytes = allocator_->largest_free();
  stats.live_buffers = live_buffers_;
  stats.allocation_count = allocation_count_;
  stats.failed_allocations = failed_allocations_;
  stats.locking = locking_;
  stats.page_kind = page_kind_;
  return stats;
}

}  // namespace strata
