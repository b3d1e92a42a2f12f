#include "offload/pinned_arena.h"

#include <linux/capability.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstring>
#include <set>
#include <thread>
#include <vector>

#include "engine/core/log.h"
#include "tests/offload/offload_test_util.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::fill_pattern;
using testing::first_pattern_mismatch;

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

bool have_capability(int capability) {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return false;
  return (data[capability / 32].effective & (1u << (capability % 32))) != 0;
}

// Drops a capability from this process's effective and permitted sets (in a child).
bool drop_capability(int capability) {
  __user_cap_header_struct header{_LINUX_CAPABILITY_VERSION_3, 0};
  __user_cap_data_struct data[2] = {};
  if (::syscall(SYS_capget, &header, data) != 0) return false;
  data[capability / 32].effective &= ~(1u << (capability % 32));
  data[capability / 32].permitted &= ~(1u << (capability % 32));
  return ::syscall(SYS_capset, &header, data) == 0;
}

TEST(PinnedArenaTest, CreatesAlignedLockedArena) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 8 * kMiB + 100}));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(arena->data()) % PinnedArena::kAlignment, 0u);
  // The size asked for, 4 KiB rounded, plus colouring room: one gap per MiB.
  EXPECT_EQ(arena->size(), 8 * kMiB + 4096 + 8 * PinnedArena::kColourGapBytes);
  EXPECT_EQ(arena->size(), PinnedArena::carvable_bytes(8 * kMiB + 100));
  rlimit limit{};
  ASSERT_EQ(::getrlimit(RLIMIT_MEMLOCK, &limit), 0);
  if (have_capability(CAP_IPC_LOCK) || limit.rlim_cur == RLIM_INFINITY || limit.rlim_cur >= 16 * kMiB) {
    EXPECT_TRUE(arena->locked()) << "locking is allowed here, so the arena must be locked";
  }
  ASSERT_EQ(arena->regions().size(), 1u);
  EXPECT_EQ(arena->regions()[0].data, arena->data());
  EXPECT_EQ(arena->regions()[0].bytes, arena->size());
  EXPECT_TRUE(arena->contains(arena->data(), arena->size()));
  EXPECT_FALSE(arena->contains(arena->data(), arena->size() + 1));
}

TEST(PinnedArenaTest, RejectsEmptyArenaAndOversizedBudget) {
  auto empty = PinnedArena::create({.bytes = 0});
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.status().code(), StatusCode::kInvalidArgument);
  auto budget = PinnedArena::create({.bytes = kMiB, .budget_bytes = 2 * kMiB});
  ASSERT_FALSE(budget.ok());
  EXPECT_NE(budget.status().message().find("exceeds the arena's size"), std::string::npos) << budget.status().to_string();
}

class PinnedArenaSizeTest : public ::testing::TestWithParam<size_t> {};

TEST_P(PinnedArenaSizeTest, AllocationsAreAlignedAndHoldTheirBytes) {
  const size_t bytes = GetParam();
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 16 * kMiB}));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer first, arena->allocate(bytes, "first"));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer second, arena->allocate(bytes, "second"));
  for (PinnedBuffer* buffer : {&first, &second}) {
    EXPECT_EQ(buffer->size(), bytes);
    EXPECT_EQ(buffer->capacity(), (bytes + 4095) / 4096 * 4096);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer->data()) % 4096, 0u);
    EXPECT_TRUE(arena->contains(buffer->data(), buffer->capacity()));
    ASSERT_GE(buffer->region_index(), 0);
    EXPECT_EQ(static_cast<char*>(arena->regions()[static_cast<size_t>(buffer->region_index())].data) +
                  buffer->region_offset(),
              buffer->data());
  }
  // The two buffers do not overlap: each keeps its own pattern.
  fill_pattern(first.data(), first.capacity(), 1);
  fill_pattern(second.data(), second.capacity(), 2);
  EXPECT_EQ(first_pattern_mismatch(first.data(), first.capacity(), 1), -1);
  EXPECT_EQ(first_pattern_mismatch(second.data(), second.capacity(), 2), -1);
  const PinnedArenaStats stats = arena->stats();
  EXPECT_EQ(stats.in_use_bytes, first.capacity() + second.capacity());
  EXPECT_EQ(stats.live_buffers, 2u);
  first.reset();
  second.reset();
  EXPECT_EQ(arena->stats().in_use_bytes, 0u);
  EXPECT_EQ(arena->stats().high_water_bytes, stats.in_use_bytes);
}

INSTANTIATE_TEST_SUITE_P(Sizes, PinnedArenaSizeTest,
                         ::testing::Values(size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, 3 * kMiB + 5),
                         [](const ::testing::TestParamInfo<size_t>& info) { return std::to_string(info.param); });

TEST(PinnedArenaTest, ZeroBytesGivesAnEmptyBuffer) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = kMiB}));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer buffer, arena->allocate(0, "nothing"));
  EXPECT_TRUE(buffer.empty());
  EXPECT_EQ(arena->stats().live_buffers, 0u);
}

TEST(PinnedArenaTest, ExhaustedBudgetNamesRequestBudgetInUseAndHighWater) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = kMiB, .budget_bytes = 256 * kKiB}));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer held, arena->allocate(200 * kKiB, "held"));
  fill_pattern(held.data(), held.size(), 7);
  auto refused = arena->allocate(100 * kKiB, "staging buffer 3");
  ASSERT_FALSE(refused.ok());
  const std::string text = refused.status().message();
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  EXPECT_NE(text.find("cannot allocate 102400 bytes"), std::string::npos) << text;
  EXPECT_NE(text.find("'staging buffer 3'"), std::string::npos) << text;
  EXPECT_NE(text.find("budget 262144 bytes"), std::string::npos) << text;
  EXPECT_NE(text.find("in use 204800 bytes"), std::string::npos) << text;
  EXPECT_NE(text.find("high-water 204800 bytes"), std::string::npos) << text;
  EXPECT_EQ(arena->stats().failed_allocations, 1u);
  // The refusal left the earlier buffer alone.
  EXPECT_EQ(first_pattern_mismatch(held.data(), held.size(), 7), -1);
  held.reset();
  STRATA_EXPECT_OK(arena->allocate(256 * kKiB, "whole budget"));
}

TEST(PinnedArenaTest, FreedNeighboursCoalesce) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 256 * kKiB, .try_huge_pages = false}));
  std::vector<PinnedBuffer> buffers;
  for (int i = 0; i < 4; ++i) {
    STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer buffer, arena->allocate(64 * kKiB, "quarter"));
    buffers.push_back(std::move(buffer));
  }
  EXPECT_FALSE(arena->allocate(4096, "no room").ok());
  buffers[1].reset();
  buffers[2].reset();
  EXPECT_EQ(arena->stats().largest_free_bytes, 128 * kKiB);
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer half, arena->allocate(128 * kKiB, "half"));
  EXPECT_EQ(half.data(), static_cast<char*>(arena->data()) + 64 * kKiB);
}

TEST(PinnedArenaTest, MovedBufferReleasesOnce) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = kMiB}));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer a, arena->allocate(4096, "a"));
  PinnedBuffer b = std::move(a);
  EXPECT_TRUE(a.empty());  // NOLINT(bugprone-use-after-move): moved-from is empty by contract
  EXPECT_FALSE(b.empty());
  PinnedBuffer c;
  c = std::move(b);
  EXPECT_EQ(arena->stats().live_buffers, 1u);
  c.reset();
  EXPECT_EQ(arena->stats().live_buffers, 0u);
  EXPECT_EQ(arena->stats().in_use_bytes, 0u);
}

// A large arena, not locked (only address space is used), split into 1 GiB io_uring
// regions; buffers pack across region boundaries (none of the arena is lost to them).
TEST(PinnedArenaTest, RegionsOfAtMostOneGibAndBuffersPackAcrossThem) {
  const size_t gib = PinnedArena::kMaxRegionBytes;
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 2 * gib + gib / 2, .lock = false}));
  ASSERT_EQ(arena->regions().size(), 3u);
  EXPECT_EQ(arena->regions()[0].bytes, gib);
  EXPECT_EQ(arena->regions()[1].bytes, gib);
  EXPECT_EQ(arena->regions()[2].bytes, arena->size() - 2 * gib);  // half a GiB and the colouring room
  EXPECT_FALSE(arena->locked());
  // With its colouring gap, this buffer ends one page short of the first region's end.
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer almost, arena->allocate(gib - 8192, "almost a region"));
  EXPECT_EQ(almost.region_index(), 0);
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer straddling, arena->allocate(8192, "straddles"));
  EXPECT_EQ(straddling.region_index(), 0);
  EXPECT_EQ(straddling.region_offset(), gib - 4096);
  // The rest of the arena is one free range, and a buffer of the rest of the budget fits.
  EXPECT_EQ(arena->stats().largest_free_bytes, arena->size() - gib - 4096);
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer tail, arena->allocate(gib + gib / 2, "the rest, across regions 1 and 2"));
  EXPECT_EQ(tail.region_index(), 1);
  EXPECT_EQ(tail.region_offset(), 4096u);
}

TEST(PinnedArenaTest, ConcurrentAllocationsStayWithinBudget) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 4 * kMiB}));
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&arena, t] {
      for (int i = 0; i < 200; ++i) {
        auto buffer = arena->allocate(static_cast<size_t>(4096 * (1 + (i + t) % 16)), "churn");
        if (buffer.ok()) fill_pattern(buffer->data(), 64, static_cast<uint64_t>(t));
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const PinnedArenaStats stats = arena->stats();
  EXPECT_EQ(stats.in_use_bytes, 0u);
  EXPECT_LE(stats.high_water_bytes, 4 * kMiB);
  EXPECT_EQ(stats.largest_free_bytes, arena->size());
}

// An optimizer group's master weights and moments, a ring of staging slots: equal 2^k-byte
// buffers carved one after another. Packed tightly they would all start at the same
// address modulo 2^k, so streams walking them in step would collide in the caches' sets
// and the DRAM banks; coloured, no two start at the same address modulo 2 MiB.
TEST(PinnedArenaTest, EqualPowerOfTwoBuffersStartAtDistinctAddressesModuloTwoMiB) {
  for (const size_t bytes : {kMiB, 4 * kMiB, 16 * kMiB}) {
    constexpr int kBuffers = 5;
    // Exactly the bytes asked for: the arena's colouring room holds the gaps.
    STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = kBuffers * bytes, .lock = false}));
    std::vector<PinnedBuffer> buffers;
    std::set<uintptr_t> residues;
    for (int i = 0; i < kBuffers; ++i) {
      STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer buffer, arena->allocate(bytes, "state " + std::to_string(i)));
      const auto address = reinterpret_cast<uintptr_t>(buffer.data());
      EXPECT_EQ(address % PinnedArena::kAlignment, 0u);
      residues.insert(address % (2 * kMiB));
      buffers.push_back(std::move(buffer));
    }
    EXPECT_EQ(residues.size(), static_cast<size_t>(kBuffers)) << bytes << "-byte buffers";
    // The budget counts what was asked for, not the gaps.
    EXPECT_EQ(arena->stats().in_use_bytes, kBuffers * bytes);
  }
}

// With CAP_IPC_LOCK dropped and RLIMIT_MEMLOCK lowered (in a child, so the test process
// keeps its limits), the kernel refuses mlock: the arena must still work, unlocked, after
// exactly one warning.
TEST(PinnedArenaTest, RefusedLockingFallsBackWithOneWarning) {
  std::string child_stderr;
  const std::string result = testing::run_in_child(
      [] {
        set_log_level(LogLevel::kInfo);
        if (!drop_capability(CAP_IPC_LOCK)) return std::string("capset failed: ") + std::strerror(errno);
        rlimit limit{64 * 1024, 64 * 1024};
        if (::setrlimit(RLIMIT_MEMLOCK, &limit) != 0) return std::string("setrlimit failed");
        auto arena = PinnedArena::create({.bytes = 4 * kMiB});
        if (!arena.ok()) return "create failed: " + arena.status().to_string();
        if ((*arena)->locked()) return std::string("arena claims to be locked");
        auto buffer = (*arena)->allocate(kMiB + 1, "after refusal");
        if (!buffer.ok()) return "allocate failed: " + buffer.status().to_string();
        fill_pattern(buffer->data(), buffer->size(), 3);
        if (first_pattern_mismatch(buffer->data(), buffer->size(), 3) != -1) return std::string("data mismatch");
        return std::string("ok");
      },
      &child_stderr);
  ASSERT_EQ(result, "ok") << child_stderr;
  size_t warnings = 0;
  for (size_t at = child_stderr.find("could not page-lock"); at != std::string::npos;
       at = child_stderr.find("could not page-lock", at + 1)) {
    ++warnings;
  }
  EXPECT_EQ(warnings, 1u) << child_stderr;
  EXPECT_NE(child_stderr.find("RLIMIT_MEMLOCK 65536 bytes"), std::string::npos) << child_stderr;
}

}  // namespace
}  // namespace strata
