#include "offload/nvme_store.h"

#include <dlfcn.h>
#include <fcntl.h>
#include <sys/mount.h>
#include <sys/resource.h>
#include <unistd.h>

#include <csignal>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/core/check.h"
#include "offload/checksum.h"
#include "tests/offload/offload_test_util.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::aligned_memory;
using testing::fill_pattern;
using testing::first_pattern_mismatch;

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

using testing::contains;

NvmeStoreOptions store_options(const std::string& path, IoEngineKind kind = IoEngineKind::kAuto) {
  NvmeStoreOptions options;
  options.nvme_path = path;
  options.io.kind = kind;
  options.io.queue_depth = 8;
  options.growth_bytes = 4 * kMiB;
  return options;
}

// ---------------------------------------------------------------------------------------
// The checksum matches the reference xxHash64 (the system's libxxhash, where installed).
// ---------------------------------------------------------------------------------------
TEST(ChecksumTest, MatchesReferenceXxhash64) {
  EXPECT_EQ(xxhash64("", 0), 0xEF46DB3751D8E999ULL);  // the published empty-input value
  void* library = ::dlopen("libxxhash.so.0", RTLD_NOW | RTLD_LOCAL);
  if (library == nullptr) GTEST_SKIP() << "no system libxxhash to compare with: " << ::dlerror();
  using Reference = unsigned long long (*)(const void*, size_t, unsigned long long);
  auto reference = reinterpret_cast<Reference>(::dlsym(library, "XXH64"));
  ASSERT_NE(reference, nullptr);
  std::vector<unsigned char> data(5000);
  fill_pattern(data.data(), data.size(), 1);
  // Around the 32-byte stripe, the 96 bytes where the two-stripe prefetching loop starts, and pages.
  for (size_t bytes : {0, 1, 3, 4, 7, 8, 31, 32, 33, 63, 64, 95, 96, 97, 100, 127, 128, 159, 160, 161, 4095, 4096, 4097, 5000}) {
    for (uint64_t seed : {0ULL, 42ULL}) {
      for (size_t shift : {0, 3}) {
        if (shift + bytes > data.size()) continue;
        EXPECT_EQ(xxhash64(data.data() + shift, bytes, seed), reference(data.data() + shift, bytes, seed))
            << bytes << " bytes, seed " << seed << ", shift " << shift;
      }
    }
  }
  ::dlclose(library);
}

// ---------------------------------------------------------------------------------------
// Round trips: engines x buffer kinds x sizes, data compared byte for byte.
// ---------------------------------------------------------------------------------------
enum class BufferKind {
  kRegistered,   // a PinnedBuffer from an arena registered with the engine (fixed buffers)
  kUnregistered, // aligned heap memory the engine does not know (plain SQEs)
  kUnaligned,    // odd-address heap memory (the store's bounce path)
};
std::string buffer_label(BufferKind kind) {
  switch (kind) {
    case BufferKind::kRegistered: return "registered";
    case BufferKind::kUnregistered: return "unregistered";
    case BufferKind::kUnaligned: return "unaligned";
  }
  return "?";
}

using RoundTripParam = std::tuple<IoEngineKind, BufferKind, size_t>;
class NvmeStoreRoundTripTest : public ::testing::TestWithParam<RoundTripParam> {};

TEST_P(NvmeStoreRoundTripTest, WriteThenReadBackVerified) {
  const auto [kind, buffer_kind, bytes] = GetParam();
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str() + "/nvme", kind));
  EXPECT_EQ(store->io_engine().kind(), kind);
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 16 * kMiB}));
  STRATA_ASSERT_OK(store->io_engine().register_buffers(*arena));

  // Two extents, so that the second's write cannot disturb the first's bytes.
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent first, store->allocate("first", bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent second, store->allocate("second", bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, store->info(first));
  EXPECT_FALSE(info.readable);
  EXPECT_EQ(info.file_offset % store->alignment(), 0u);
  EXPECT_EQ(info.disk_bytes, (bytes + 4095) / 4096 * 4096);

  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer pinned_out, arena->allocate(bytes, "out"));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer pinned_in, arena->allocate(bytes, "in"));
  testing::AlignedMemory heap_out = aligned_memory(bytes + 4096);
  testing::AlignedMemory heap_in = aligned_memory(bytes + 4096);
  char* out = nullptr;
  char* in = nullptr;
  size_t capacity = 0;
  switch (buffer_kind) {
    case BufferKind::kRegistered:
      out = pinned_out.as<char>();
      in = pinned_in.as<char>();
      capacity = pinned_out.capacity();
      break;
    case BufferKind::kUnregistered:
      out = heap_out.get();
      in = heap_in.get();
      capacity = (bytes + 4095) / 4096 * 4096;
      break;
    case BufferKind::kUnaligned:
      out = heap_out.get() + 1;
      in = heap_in.get() + 1;
      capacity = bytes;
      break;
  }
  fill_pattern(out, bytes, 100 + bytes);
  STRATA_ASSERT_OK(store->write(first, out, bytes, 0, capacity));
  fill_pattern(out, bytes, 200 + bytes);
  STRATA_ASSERT_OK(store->write(second, out, bytes, 0, capacity));

  std::memset(in, 0, bytes);
  STRATA_ASSERT_OK(store->read(first, in, bytes, 0, capacity));
  EXPECT_EQ(first_pattern_mismatch(in, bytes, 100 + bytes), -1);
  STRATA_ASSERT_OK(store->read(second, in, bytes, 0, capacity));
  EXPECT_EQ(first_pattern_mismatch(in, bytes, 200 + bytes), -1);
  STRATA_ASSERT_OK_AND_ASSIGN(info, store->info(first));
  EXPECT_TRUE(info.readable);

  const NvmeStoreStats stats = store->stats();
  EXPECT_EQ(stats.bytes_written, 2 * bytes);
  EXPECT_EQ(stats.bytes_read, 2 * bytes);
  EXPECT_EQ(stats.checksum_failures, 0u);
  EXPECT_EQ(stats.bounce_transfers, buffer_kind == BufferKind::kUnaligned ? 4u : 0u);
  const IoEngineStats io = store->io_engine().stats();
  if (buffer_kind == BufferKind::kRegistered && kind == IoEngineKind::kIoUring) {
    EXPECT_EQ(io.fixed_transfers, io.transfers);
  } else if (buffer_kind == BufferKind::kUnregistered) {
    EXPECT_EQ(io.fixed_transfers, 0u);
  }
}

std::string round_trip_name(const ::testing::TestParamInfo<RoundTripParam>& info) {
  const auto& [kind, buffer, bytes] = info.param;
  return std::string(io_engine_kind_name(kind)) + "_" + buffer_label(buffer) + "_" + std::to_string(bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, NvmeStoreRoundTripTest,
    ::testing::Combine(::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kPsync),
                       ::testing::Values(BufferKind::kRegistered, BufferKind::kUnregistered, BufferKind::kUnaligned),
                       ::testing::Values(size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, 3 * kMiB + 5)),
    round_trip_name);

// ---------------------------------------------------------------------------------------
// Extents: names, ranges, free and reuse, growth, reuse of a file a finished run left.
// ---------------------------------------------------------------------------------------
TEST(NvmeStoreTest, ExtentsAreNamedFreedAndReused) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str()));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent a, store->allocate("layer0.master", 3 * kMiB));
  auto duplicate = store->allocate("layer0.master", 4096);
  ASSERT_FALSE(duplicate.ok());
  EXPECT_EQ(duplicate.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(contains(duplicate.status().message(), "'layer0.master'")) << duplicate.status().to_string();
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent found, store->find("layer0.master"));
  EXPECT_EQ(found.id, a.id);
  EXPECT_EQ(store->find("nope").status().code(), StatusCode::kNotFound);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo a_info, store->info(a));
  STRATA_ASSERT_OK(store->free(a));
  EXPECT_EQ(store->info(a).status().code(), StatusCode::kNotFound);
  // The space comes back: a new extent of the same size lands where the old one was.
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent b, store->allocate("layer1.master", 3 * kMiB));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo b_info, store->info(b));
  EXPECT_EQ(b_info.file_offset, a_info.file_offset);
  EXPECT_EQ(store->stats().extents, 1u);
}

TEST(NvmeStoreTest, FileGrowsAsExtentsNeedRoom) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str());
  options.growth_bytes = kMiB;
  OPEN_STORE_OR_SKIP(store, options);
  EXPECT_EQ(store->stats().file_bytes, 0u);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent a, store->allocate("a", 3 * kMiB + 1));
  EXPECT_EQ(store->stats().file_bytes, 3 * kMiB + 4096);
  EXPECT_EQ(std::filesystem::file_size(store->file_path()), 3 * kMiB + 4096);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent b, store->allocate("b", 10));
  EXPECT_EQ(store->stats().file_bytes, 4 * kMiB + 4096);
  (void)a;
  (void)b;
}

TEST(NvmeStoreTest, RangedTransfersFollowTheChecksumBlocks) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str());
  options.checksum_block_bytes = 64 * kKiB;
  OPEN_STORE_OR_SKIP(store, options);
  const size_t bytes = 256 * kKiB + 100;
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("ranged", bytes));
  testing::AlignedMemory whole = aligned_memory(bytes + 4096);
  fill_pattern(whole.get(), bytes, 77);
  // Written in three pieces, out of order, the last one ending at the extent's end.
  STRATA_ASSERT_OK(store->write(extent, whole.get() + 128 * kKiB, 128 * kKiB, 128 * kKiB));
  STRATA_ASSERT_OK(store->write(extent, whole.get() + 256 * kKiB, 100, 256 * kKiB, 4096));
  // Reading a range that includes a block never written is refused, naming the bytes.
  std::vector<char> some(64 * kKiB);
  const Status not_written = store->read(extent, some.data(), 64 * kKiB, 64 * kKiB);
  EXPECT_EQ(not_written.code(), StatusCode::kFailedPrecondition) << not_written.to_string();
  EXPECT_TRUE(contains(not_written.message(), "bytes [65536, 131072) hold no valid data")) << not_written.to_string();
  STRATA_ASSERT_OK(store->write(extent, whole.get(), 128 * kKiB, 0));
  testing::AlignedMemory back = aligned_memory(bytes + 4096);
  STRATA_ASSERT_OK(store->read(extent, back.get() + 64 * kKiB, 128 * kKiB, 64 * kKiB));
  STRATA_ASSERT_OK(store->read(extent, back.get(), 64 * kKiB, 0));
  STRATA_ASSERT_OK(store->read(extent, back.get() + 192 * kKiB, 64 * kKiB + 100, 192 * kKiB, 64 * kKiB + 4096));
  EXPECT_EQ(first_pattern_mismatch(back.get(), bytes, 77), -1);
  // Ranges that cut a checksum block are refused with the rule named.
  const Status misaligned = store->read(extent, back.get(), 4096, 4096);
  EXPECT_EQ(misaligned.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(misaligned.message(), "multiple of 65536")) << misaligned.to_string();
  const Status past_end = store->write(extent, whole.get(), 64 * kKiB, 256 * kKiB);
  EXPECT_TRUE(contains(past_end.message(), "past the extent's end")) << past_end.to_string();
}

// A checksum block need only be a multiple of 4 KiB: 132 KiB blocks (not a power of two)
// take ranges on their boundaries and refuse ranges that cut one.
TEST(NvmeStoreTest, ChecksumBlocksThatAreNotAPowerOfTwoTakeRangesOnTheirBoundaries) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str());
  const size_t block = 132 * kKiB;
  options.checksum_block_bytes = block;
  OPEN_STORE_OR_SKIP(store, options);
  const size_t bytes = 3 * block + 100;
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("odd blocks", bytes));
  testing::AlignedMemory whole = aligned_memory(bytes + 4096);
  fill_pattern(whole.get(), bytes, 5);
  for (size_t at = 0; at < bytes; at += block)
    STRATA_ASSERT_OK(store->write(extent, whole.get() + at, std::min(block, bytes - at), at, block + 4096));
  testing::AlignedMemory back = aligned_memory(bytes + 4096);
  STRATA_ASSERT_OK(store->read(extent, back.get() + block, 2 * block, block));
  STRATA_ASSERT_OK(store->read(extent, back.get(), block, 0));
  STRATA_ASSERT_OK(store->read(extent, back.get() + 3 * block, 100, 3 * block, 4096));
  EXPECT_EQ(first_pattern_mismatch(back.get(), bytes, 5), -1);
  const Status cut = store->read(extent, back.get(), 128 * kKiB, 0);
  EXPECT_EQ(cut.code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(contains(cut.message(), "multiple of 135168")) << cut.to_string();
}

TEST(NvmeStoreTest, FilesAFinishedRunLeftAreReused) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str() + "/scratch");
  options.initial_bytes = 2 * kMiB;
  std::string file_path;
  {
    OPEN_STORE_OR_SKIP(store, options);
    file_path = store->file_path();
    EXPECT_EQ(store->stats().file_bytes, 2 * kMiB);
    STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("x", 3 * kMiB));
    std::vector<char> data(3 * kMiB, 'q');
    STRATA_ASSERT_OK(store->write(extent, data.data(), data.size()));
  }
  const uint64_t left = std::filesystem::file_size(file_path);
  EXPECT_GE(left, 3 * kMiB);
  options.initial_bytes = 0;
  OPEN_STORE_OR_SKIP(again, options);
  EXPECT_EQ(again->file_path(), file_path);
  EXPECT_EQ(again->stats().file_bytes, left);  // the old file's space, now free
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent reused, again->allocate("y", 3 * kMiB));
  EXPECT_EQ(again->stats().file_bytes, left);  // no growth needed
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, again->info(reused));
  EXPECT_FALSE(info.readable);  // nothing of the old run is trusted
}

// ---------------------------------------------------------------------------------------
// nvme_path that cannot be created or written, or is held by another live process.
// ---------------------------------------------------------------------------------------
TEST(NvmeStoreTest, PathUnderARegularFileCannotBeCreated) {
  testing::TempDir dir;
  const std::string file = dir.str() + "/a-file";
  std::ofstream(file) << "not a directory";
  const std::string path = file + "/nvme";
  auto store = NvmeStore::open(store_options(path));
  ASSERT_FALSE(store.ok());
  EXPECT_TRUE(contains(store.status().message(), "cannot create nvme_path '" + path + "'")) << store.status().to_string();
  EXPECT_TRUE(contains(store.status().message(), "Not a directory")) << store.status().to_string();
  // The file in the way is untouched.
  std::ifstream in(file);
  std::string text;
  std::getline(in, text);
  EXPECT_EQ(text, "not a directory");

  auto on_file = NvmeStore::open(store_options(file));
  ASSERT_FALSE(on_file.ok());
  EXPECT_TRUE(contains(on_file.status().message(), "'" + file + "' exists but is not a directory"))
      << on_file.status().to_string();
}

// Root ignores permission bits, so "not writable" is a read-only mount: a tmpfs in a
// private mount namespace of a child, written by a first run, then remounted read-only.
TEST(NvmeStoreTest, ReadOnlyPathIsRefusedAndItsDataKept) {
  testing::TempDir dir;
  const std::string mount_point = dir.str() + "/mnt";
  std::filesystem::create_directories(mount_point);
  const std::string result = testing::run_in_child([&]() -> std::string {
    const std::string why = testing::mount_private_tmpfs(mount_point, "16m");
    if (!why.empty()) return "skip: " + why;
    std::string file_path;
    std::vector<char> data(64 * kKiB);
    fill_pattern(data.data(), data.size(), 8);
    {
      auto store = NvmeStore::open(store_options(mount_point + "/nvme"));
      if (!store.ok()) return "first open failed: " + store.status().to_string();
      file_path = (*store)->file_path();
      auto extent = (*store)->allocate("kept", data.size());
      if (!extent.ok()) return "allocate failed: " + extent.status().to_string();
      Status written = (*store)->write(*extent, data.data(), data.size());
      if (!written.ok()) return "write failed: " + written.to_string();
    }
    if (::mount(nullptr, mount_point.c_str(), nullptr, MS_REMOUNT | MS_RDONLY, nullptr) != 0) {
      return std::string("skip: remount read-only: ") + std::strerror(errno);
    }
    auto refused = NvmeStore::open(store_options(mount_point + "/nvme"));
    if (refused.ok()) return std::string("opened a read-only nvme_path");
    std::string report = refused.status().message();
    // Earlier data intact: the file still holds what the first run wrote.
    std::vector<char> back(data.size());
    const int fd = ::open(file_path.c_str(), O_RDONLY);
    const bool intact = fd >= 0 && ::pread(fd, back.data(), back.size(), 0) == static_cast<ssize_t>(back.size()) &&
                        back == data;
    if (fd >= 0) ::close(fd);
    auto fresh = NvmeStore::open(store_options(mount_point + "/fresh"));
    return report + "\n" + (intact ? "intact" : "damaged") + "\n" + (fresh.ok() ? "fresh opened" : fresh.status().message());
  });
  RecordProperty("child_report", result);
  if (result.rfind("skip: ", 0) == 0) GTEST_SKIP() << result;
  EXPECT_TRUE(contains(result, "nvme_path '" + mount_point + "/nvme' is not writable")) << result;
  EXPECT_TRUE(contains(result, "Read-only file system")) << result;
  EXPECT_TRUE(contains(result, "\nintact\n")) << result;
  EXPECT_TRUE(contains(result, "cannot create nvme_path '" + mount_point + "/fresh'")) << result;
}

TEST(NvmeStoreTest, SecondStoreOnTheSamePathAndRankIsRefused) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(first, store_options(dir.str()));
  auto second = NvmeStore::open(store_options(dir.str()));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(contains(second.status().message(), "nvme_path '" + dir.str() + "' is in use")) << second.status().to_string();
  EXPECT_TRUE(contains(second.status().message(), "pid " + std::to_string(::getpid()))) << second.status().to_string();
  // Another rank has its own lock and file.
  NvmeStoreOptions rank1 = store_options(dir.str());
  rank1.rank = 1;
  OPEN_STORE_OR_SKIP(other_rank, rank1);
  EXPECT_NE(other_rank->file_path(), first->file_path());
}

// The lock is the data file's own: deleting every other file in nvme_path (the pid file
// included) does not let a second store write into the first one's data.
TEST(NvmeStoreTest, DeletingTheSideFilesDoesNotUnlockTheDataFile) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(first, store_options(dir.str()));
  int removed = 0;
  for (const auto& entry : std::filesystem::directory_iterator(dir.path())) {
    if (entry.path().string() == first->file_path()) continue;
    std::filesystem::remove(entry.path());
    ++removed;
  }
  EXPECT_GE(removed, 1);  // the pid file
  auto second = NvmeStore::open(store_options(dir.str()));
  ASSERT_FALSE(second.ok());
  EXPECT_EQ(second.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(contains(second.status().message(), "nvme_path '" + dir.str() + "' is in use")) << second.status().to_string();
  EXPECT_TRUE(contains(second.status().message(), first->file_path())) << second.status().to_string();
  EXPECT_TRUE(contains(second.status().message(), "pid unknown")) << second.status().to_string();
}

TEST(NvmeStoreTest, SecondLiveProcessIsRefusedWithItsPid) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/shared";
  int to_child[2];
  int from_child[2];
  ASSERT_EQ(::pipe(to_child), 0);
  ASSERT_EQ(::pipe(from_child), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(to_child[1]);
    ::close(from_child[0]);
    auto store = NvmeStore::open(store_options(path, IoEngineKind::kPsync));
    const char ready = store.ok() ? 'y' : 'n';
    (void)!::write(from_child[1], &ready, 1);
    char done = 0;
    (void)!::read(to_child[0], &done, 1);  // hold the lock until the parent says so
    ::_exit(0);
  }
  ::close(to_child[0]);
  ::close(from_child[1]);
  char ready = 0;
  ASSERT_EQ(::read(from_child[0], &ready, 1), 1);
  ASSERT_EQ(ready, 'y');
  auto refused = NvmeStore::open(store_options(path));
  const char done = 'x';
  (void)!::write(to_child[1], &done, 1);
  int wstatus = 0;
  ::waitpid(child, &wstatus, 0);
  ::close(to_child[1]);
  ::close(from_child[0]);
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kAlreadyExists);
  EXPECT_TRUE(contains(refused.status().message(), "nvme_path '" + path + "' is in use by another live process"))
      << refused.status().to_string();
  EXPECT_TRUE(contains(refused.status().message(), "pid " + std::to_string(child))) << refused.status().to_string();
  // Once the holder has exited, the path is ours.
  OPEN_STORE_OR_SKIP(store, store_options(path));
  EXPECT_TRUE(store != nullptr);
}

// ---------------------------------------------------------------------------------------
// A disk that fills up, a write that fails half way, a corrupted extent.
// ---------------------------------------------------------------------------------------

// A 4 MiB tmpfs: the first extent fits; a second that needs more than the disk has is
// refused at allocation, naming the bytes and the free space; the first stays readable.
TEST(NvmeStoreTest, FullDiskRefusesGrowthAndKeepsEarlierExtents) {
  testing::TempDir dir;
  const std::string mount_point = dir.str() + "/small";
  std::filesystem::create_directories(mount_point);
  const std::string result = testing::run_in_child([&]() -> std::string {
    const std::string why = testing::mount_private_tmpfs(mount_point, "4m");
    if (!why.empty()) return "skip: " + why;
    NvmeStoreOptions options = store_options(mount_point);
    options.growth_bytes = 64 * kKiB;
    auto store = NvmeStore::open(options);
    if (!store.ok()) return "open failed: " + store.status().to_string();
    std::vector<char> data(kMiB + 3);
    fill_pattern(data.data(), data.size(), 12);
    auto first = (*store)->allocate("first", data.size());
    if (!first.ok()) return "first allocate failed: " + first.status().to_string();
    Status written = (*store)->write(*first, data.data(), data.size());
    if (!written.ok()) return "first write failed: " + written.to_string();
    auto second = (*store)->allocate("second", 8 * kMiB);
    std::string report = second.ok() ? "second allocated" : second.status().message();
    std::vector<char> back(data.size());
    Status read = (*store)->read(*first, back.data(), back.size());
    report += "\n" + std::string(read.ok() && back == data ? "first intact" : "first damaged: " + read.to_string());
    return report + "\ndirect " + std::to_string((*store)->direct_io());
  });
  RecordProperty("child_report", result);
  if (result.rfind("skip: ", 0) == 0) GTEST_SKIP() << result;
  EXPECT_TRUE(contains(result, "the disk under '" + mount_point + "' cannot hold")) << result;
  EXPECT_TRUE(contains(result, "for extent 'second' (8388608 bytes")) << result;
  EXPECT_TRUE(contains(result, "No space left on device")) << result;
  EXPECT_TRUE(contains(result, "free")) << result;
  EXPECT_TRUE(contains(result, "\nfirst intact")) << result;
}

TEST(NvmeStoreTest, AStoreAskedToRemoveItsFilesLeavesNoneBehind) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str() + "/scratch");
  options.initial_bytes = 2 * kMiB;
  options.remove_files_on_close = true;
  std::string file_path;
  {
    OPEN_STORE_OR_SKIP(store, options);
    file_path = store->file_path();
    EXPECT_TRUE(std::filesystem::exists(file_path));
  }
  EXPECT_FALSE(std::filesystem::exists(file_path));
  EXPECT_TRUE(std::filesystem::is_empty(dir.str() + "/scratch"));
}

// An 8 MiB tmpfs: room is the free space, under the nearest folder that exists, plus the
// blocks of the file a finished run left for the same rank (the store reuses it), and
// not another rank's.
TEST(NvmeStoreTest, RoomCountsTheFileAFinishedRunLeftForTheSameRank) {
  testing::TempDir dir;
  const std::string mount_point = dir.str() + "/small";
  std::filesystem::create_directories(mount_point);
  const std::string result = testing::run_in_child([&]() -> std::string {
    const std::string why = testing::mount_private_tmpfs(mount_point, "8m");
    if (!why.empty()) return "skip: " + why;
    auto empty = NvmeStore::room_bytes(mount_point + "/not/yet", 0);
    if (!empty.ok()) return "room of an empty disk failed: " + empty.status().to_string();
    {
      NvmeStoreOptions options = store_options(mount_point + "/not/yet");
      options.initial_bytes = 6 * kMiB;
      auto store = NvmeStore::open(options);
      if (!store.ok()) return "open failed: " + store.status().to_string();
    }
    auto rank0 = NvmeStore::room_bytes(mount_point + "/not/yet", 0);
    auto rank1 = NvmeStore::room_bytes(mount_point + "/not/yet", 1);
    if (!rank0.ok() || !rank1.ok()) return "room after the run failed";
    return "empty " + std::to_string(*empty) + " rank0 " + std::to_string(*rank0) + " rank1 " + std::to_string(*rank1);
  });
  RecordProperty("child_report", result);
  if (result.rfind("skip: ", 0) == 0) GTEST_SKIP() << result;
  unsigned long long empty = 0, rank0 = 0, rank1 = 0;
  ASSERT_EQ(std::sscanf(result.c_str(), "empty %llu rank0 %llu rank1 %llu", &empty, &rank0, &rank1), 3) << result;
  EXPECT_EQ(empty, 8 * kMiB);
  // The left file's 6 MiB count for rank 0 (its folders and lock file take a few pages).
  EXPECT_GE(rank0, empty - 64 * kKiB) << result;
  EXPECT_LE(rank0, empty) << result;
  EXPECT_LE(rank1, 2 * kMiB) << result;
}

// RLIMIT_FSIZE (in a child) makes a write stop half way, honestly: the kernel writes up
// to the limit (a short write), then refuses the rest with EFBIG. The failed extent is
// not readable; the extent written before keeps its data and checksums; after the limit
// is lifted the same extent can be written again.
TEST(NvmeStoreTest, WriteFailingHalfWayLeavesEarlierExtentsIntact) {
  for (IoEngineKind kind : {IoEngineKind::kIoUring, IoEngineKind::kPsync}) {
    SCOPED_TRACE(std::string(io_engine_kind_name(kind)));
    testing::TempDir dir;
    const std::string result = testing::run_in_child([&]() -> std::string {
      std::signal(SIGXFSZ, SIG_IGN);
      NvmeStoreOptions options = store_options(dir.str(), kind);
      options.initial_bytes = 8 * kMiB;
      auto opened = NvmeStore::open(options);
      if (!opened.ok()) return "skip: " + opened.status().to_string();
      NvmeStore& store = **opened;
      auto arena = PinnedArena::create({.bytes = 4 * kMiB});
      if (!arena.ok()) return "arena failed";
      (void)store.io_engine().register_buffers(**arena);
      auto buffer = (*arena)->allocate(2 * kMiB, "data");
      if (!buffer.ok()) return "buffer failed";
      auto first = store.allocate("first", kMiB);
      auto second = store.allocate("second", 2 * kMiB);
      if (!first.ok() || !second.ok()) return "allocate failed";
      fill_pattern(buffer->data(), kMiB, 1);
      Status ok_write = store.write(*first, buffer->data(), kMiB);
      if (!ok_write.ok()) return "first write failed: " + ok_write.to_string();
      STRATA_CHECK(store.info(*second)->file_offset == kMiB);
      rlimit limit{};
      ::getrlimit(RLIMIT_FSIZE, &limit);
      rlimit lowered{2 * kMiB, limit.rlim_max};
      ::setrlimit(RLIMIT_FSIZE, &lowered);
      fill_pattern(buffer->data(), 2 * kMiB, 2);
      Status failed = store.write(*second, buffer->data(), 2 * kMiB);
      ::setrlimit(RLIMIT_FSIZE, &limit);
      std::string report = failed.ok() ? "second write succeeded" : failed.to_string();
      report += "\nshort " + std::to_string(store.io_engine().stats().short_transfers);
      report += "\nsecond readable " + std::to_string(store.info(*second)->readable);
      Status read_second = store.read(*second, buffer->data(), 2 * kMiB);
      report += "\nread second: " + read_second.message();
      Status read_first = store.read(*first, buffer->data(), kMiB);
      report += std::string("\nfirst ") +
                (read_first.ok() && first_pattern_mismatch(buffer->data(), kMiB, 1) == -1 ? "intact" : "damaged " + read_first.to_string());
      fill_pattern(buffer->data(), 2 * kMiB, 3);
      Status retry = store.write(*second, buffer->data(), 2 * kMiB);
      std::memset(buffer->data(), 0, 2 * kMiB);
      Status reread = store.read(*second, buffer->data(), 2 * kMiB);
      report += std::string("\nretry ") +
                (retry.ok() && reread.ok() && first_pattern_mismatch(buffer->data(), 2 * kMiB, 3) == -1 ? "ok" : "failed");
      return report;
    });
    RecordProperty(std::string("child_report_") + std::string(io_engine_kind_name(kind)), result);
    if (result.rfind("skip: ", 0) == 0) {
      EXPECT_EQ(kind, IoEngineKind::kIoUring) << result;  // only io_uring may be missing
      continue;
    }
    EXPECT_TRUE(contains(result, "File too large")) << result;
    EXPECT_TRUE(contains(result, "write of extent 'second' bytes [0, 2097152) at file offset 1048576")) << result;
    EXPECT_TRUE(contains(result, "\nshort 1")) << result;
    EXPECT_TRUE(contains(result, "\nsecond readable 0")) << result;
    EXPECT_TRUE(contains(result, "hold no valid data")) << result;
    EXPECT_TRUE(contains(result, "\nfirst intact")) << result;
    EXPECT_TRUE(contains(result, "\nretry ok")) << result;
  }
}

TEST(NvmeStoreTest, CorruptedExtentIsDetectedByItsChecksum) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str()));
  const size_t bytes = 2 * kMiB + 10;
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent good, store->allocate("good", bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent bad, store->allocate("bad", bytes));
  std::vector<char> data(bytes);
  fill_pattern(data.data(), bytes, 4);
  STRATA_ASSERT_OK(store->write(good, data.data(), bytes));
  STRATA_ASSERT_OK(store->write(bad, data.data(), bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, store->info(bad));
  // Flip one byte in the second checksum block of "bad", behind the store's back.
  const uint64_t flipped_at = info.file_offset + kMiB + 5000;
  {
    const int fd = ::open(store->file_path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    char byte = 0;
    ASSERT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(flipped_at)), 1);
    byte = static_cast<char>(byte ^ 0x40);
    ASSERT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(flipped_at)), 1);
    ::close(fd);
  }
  std::vector<char> back(bytes);
  const Status corrupted = store->read(bad, back.data(), bytes);
  ASSERT_FALSE(corrupted.ok());
  EXPECT_EQ(corrupted.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(contains(corrupted.message(), "checksum mismatch in extent 'bad' of " + store->file_path())) << corrupted.to_string();
  EXPECT_TRUE(contains(corrupted.message(), "at file offset " + std::to_string(info.file_offset + kMiB)))
      << corrupted.to_string();
  EXPECT_EQ(store->stats().checksum_failures, 1u);
  // The untouched blocks of the same extent, and the other extent, read fine.
  STRATA_ASSERT_OK(store->read(bad, back.data(), kMiB, 0));
  EXPECT_EQ(std::memcmp(back.data(), data.data(), kMiB), 0);
  STRATA_ASSERT_OK(store->read(good, back.data(), bytes));
  EXPECT_EQ(back, data);
}

TEST(NvmeStoreTest, ChecksumsCanBeTurnedOff) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str());
  options.checksums = false;
  OPEN_STORE_OR_SKIP(store, options);
  EXPECT_FALSE(store->checksums());
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("plain", 3 * 4096));
  std::vector<char> data(3 * 4096, 'a');
  STRATA_ASSERT_OK(store->write(extent, data.data(), data.size()));
  // Without checksums, 4 KiB ranges are fine, and a flipped byte goes unnoticed.
  STRATA_ASSERT_OK(store->write(extent, data.data(), 4096, 4096));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, store->info(extent));
  {
    const int fd = ::open(store->file_path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, "b", 1, static_cast<off_t>(info.file_offset + 10)), 1);
    ::close(fd);
  }
  std::vector<char> back(data.size());
  STRATA_ASSERT_OK(store->read(extent, back.data(), back.size()));
  EXPECT_EQ(back[10], 'b');
}

// Several threads, each with its own extents, writing and reading through one store at
// once. Under ThreadSanitizer this is the store's race check.
TEST(NvmeStoreTest, ConcurrentWritersAndReaders) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str()));
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 8 * kMiB}));
  STRATA_ASSERT_OK(store->io_engine().register_buffers(*arena));
  constexpr int kThreads = 4;
  constexpr size_t kBytes = 256 * kKiB + 17;
  std::vector<std::thread> threads;
  std::vector<std::string> errors(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto out = arena->allocate(kBytes, "out");
      auto in = arena->allocate(kBytes, "in");
      if (!out.ok() || !in.ok()) {
        errors[t] = "arena";
        return;
      }
      for (int round = 0; round < 4; ++round) {
        std::string key = "t";
        key += std::to_string(t);
        key += "r";
        key += std::to_string(round);
        auto extent = store->allocate(key, kBytes);
        if (!extent.ok()) {
          errors[t] = extent.status().to_string();
          return;
        }
        fill_pattern(out->data(), kBytes, static_cast<uint64_t>(t * 10 + round));
        auto write = store->write_async(*extent, out->data(), kBytes, 0, out->capacity());
        Status written = write.ok() ? store->wait(*write) : write.status();
        Status read = written.ok() ? store->read(*extent, in->data(), kBytes, 0, in->capacity()) : written;
        if (!read.ok()) {
          errors[t] = read.to_string();
          return;
        }
        if (first_pattern_mismatch(in->data(), kBytes, static_cast<uint64_t>(t * 10 + round)) != -1) {
          errors[t] = "mismatch in " + key;
          return;
        }
        if (round % 2 == 0) {
          Status freed = store->free(*extent);
          if (!freed.ok()) errors[t] = freed.to_string();
        }
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  EXPECT_EQ(store->stats().extents, static_cast<uint64_t>(kThreads * 2));
}

// The pool has one thread, held by a read of an empty pipe: the store's write is queued
// behind it, so it is certainly in flight when free() is called.
TEST(NvmeStoreTest, CannotFreeAnExtentWithTransfersInFlight) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str(), IoEngineKind::kPsync);
  options.io.psync_threads = 1;
  OPEN_STORE_OR_SKIP(store, options);
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile pipe_file, store->io_engine().register_file(fds[0], "blocking pipe"));
  char byte = 0;
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket blocker,
                              store->io_engine().submit({IoOp::kRead, pipe_file, &byte, 1, kIoStreamOffset, nullptr}));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("busy", 64 * kKiB));
  std::vector<char> data(64 * kKiB, 'z');
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket, store->write_async(extent, data.data(), data.size()));
  const Status freed = store->free(extent);
  EXPECT_EQ(freed.code(), StatusCode::kFailedPrecondition) << freed.to_string();
  EXPECT_TRUE(contains(freed.message(), "cannot free extent 'busy' while 1 transfer(s) on it are in flight"))
      << freed.to_string();
  ASSERT_EQ(::write(fds[1], "!", 1), 1);
  STRATA_ASSERT_OK(store->io_engine().wait(blocker));
  STRATA_ASSERT_OK(store->wait(ticket));
  STRATA_ASSERT_OK(store->free(extent));
  EXPECT_EQ(store->stats().extents, 0u);
  STRATA_ASSERT_OK(store->io_engine().unregister_file(pipe_file));
  ::close(fds[0]);
  ::close(fds[1]);
}


// ---------------------------------------------------------------------------------------
// Faults injected under the store (IoEngineOptions::faults): every error names the
// extent, the byte range, the operation and the data file; the extent whose write failed
// is unreadable until rewritten, the others keep their bytes.
// ---------------------------------------------------------------------------------------

class NvmeStoreFaultTest : public ::testing::TestWithParam<IoEngineKind> {};

TEST_P(NvmeStoreFaultTest, FailedWriteNamesTheExtentAndFileAndLeavesOtherExtentsReadable) {
  for (int error_number : {EIO, ENOSPC}) {
    SCOPED_TRACE(std::strerror(error_number));
    testing::TempDir dir;
    IoFaultRule rule;
    rule.match.op = IoOp::kWrite;
    rule.match.file_contains = ".swap";
    rule.match.first = 2;  // the second extent's write
    rule.error_number = error_number;
    auto injector = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{rule});
    NvmeStoreOptions options = store_options(dir.str(), GetParam());
    options.io.faults = injector;
    OPEN_STORE_OR_SKIP(store, options);
    std::vector<unsigned char> data(256 * kKiB), back(256 * kKiB);
    fill_pattern(data.data(), data.size(), 3);
    STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent good, store->allocate("good", data.size()));
    STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent bad, store->allocate("bad", data.size()));
    STRATA_ASSERT_OK(store->write(good, data.data(), data.size()));
    const Status failed = store->write(bad, data.data(), data.size());
    ASSERT_FALSE(failed.ok());
    const std::string text = failed.to_string();
    EXPECT_TRUE(contains(text, "write of 262144 bytes at offset ")) << text;
    EXPECT_TRUE(contains(text, " to " + store->file_path() + ": " + std::strerror(error_number))) << text;
    EXPECT_TRUE(contains(text, "nvme store: write of extent 'bad' bytes [0, 262144)")) << text;
    EXPECT_TRUE(contains(text, "those bytes of the extent are not readable")) << text;
    const Status unreadable = store->read(bad, back.data(), back.size());
    EXPECT_EQ(unreadable.code(), StatusCode::kFailedPrecondition) << unreadable.to_string();
    EXPECT_TRUE(contains(unreadable.message(), "extent 'bad'")) << unreadable.to_string();
    STRATA_ASSERT_OK(store->read(good, back.data(), back.size()));
    EXPECT_EQ(back, data);
    // Rewritten (the rule hit only the second write), the extent reads back.
    STRATA_ASSERT_OK(store->write(bad, data.data(), data.size()));
    STRATA_ASSERT_OK(store->read(bad, back.data(), back.size()));
    EXPECT_EQ(back, data);
  }
}

TEST_P(NvmeStoreFaultTest, FailedReadNamesTheExtentAndFileAndShortReadsStillVerify) {
  testing::TempDir dir;
  IoFaultRule eio;
  eio.match.op = IoOp::kRead;
  eio.match.first = 1;
  eio.error_number = EIO;
  IoFaultRule short_reads;
  short_reads.match.op = IoOp::kRead;
  short_reads.match.first = 2;
  short_reads.match.count = 0;
  short_reads.action = IoFaultAction::kShort;
  auto injector = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{eio, short_reads});
  NvmeStoreOptions options = store_options(dir.str(), GetParam());
  options.io.faults = injector;
  OPEN_STORE_OR_SKIP(store, options);
  std::vector<unsigned char> data(3 * kMiB), back(3 * kMiB);
  fill_pattern(data.data(), data.size(), 4);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("weights", data.size()));
  STRATA_ASSERT_OK(store->write(extent, data.data(), data.size()));
  const Status failed = store->read(extent, back.data(), back.size());
  ASSERT_FALSE(failed.ok());
  EXPECT_EQ(failed.code(), StatusCode::kIoError);
  EXPECT_TRUE(contains(failed.to_string(), "from " + store->file_path() + ": Input/output error")) << failed.to_string();
  EXPECT_TRUE(contains(failed.to_string(), "nvme store: read of extent 'weights' bytes [0, 3145728)")) << failed.to_string();
  // The next reads come back 4 KiB at a time and every checksum block still verifies.
  STRATA_ASSERT_OK(store->read(extent, back.data(), back.size()));
  EXPECT_EQ(back, data);
  EXPECT_GT(store->io_engine().stats().short_transfers, 100u);
}

INSTANTIATE_TEST_SUITE_P(Engines, NvmeStoreFaultTest, ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kPsync),
                         [](const ::testing::TestParamInfo<IoEngineKind>& info) {
                           return std::string(io_engine_kind_name(info.param));
                         });

}  // namespace
}  // namespace strata
