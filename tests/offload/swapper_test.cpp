#include "offload/swapper.h"

#include <fcntl.h>
#include <unistd.h>

#include <thread>
#include <tuple>
#include <vector>

#include "tests/offload/offload_test_util.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::fill_pattern;
using testing::first_pattern_mismatch;

constexpr size_t kKiB = 1024;
constexpr size_t kMiB = 1024 * 1024;

bool contains(const std::string& text, const std::string& part) { return text.find(part) != std::string::npos; }

// A CPU device, its copy stream, a pinned arena, an NVMe store and a swapper whose
// staging ring is three 1 MiB buffers (so a few MiB already take several chunks).
struct Rig {
  testing::TempDir dir;
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<PinnedArena> arena;
  std::unique_ptr<NvmeStore> store;
  std::unique_ptr<Swapper> swapper;
  std::string skip_reason;

  Status init(IoEngineKind engine = IoEngineKind::kAuto, SwapperOptions swapper_options = {3 * kMiB, 3}) {
    CpuDeviceOptions device_options;
    device_options.budget_bytes = 64 * kMiB;
    device_options.compute.threads = 1;
    STRATA_ASSIGN_OR_RETURN(device, create_cpu_device(device_options));
    STRATA_ASSIGN_OR_RETURN(stream, device->create_stream("swapper copies"));
    STRATA_ASSIGN_OR_RETURN(arena, PinnedArena::create({.bytes = 64 * kMiB}));
    NvmeStoreOptions store_options;
    store_options.nvme_path = dir.str() + "/nvme";
    store_options.io.kind = engine;
    store_options.io.queue_depth = 8;
    store_options.growth_bytes = 8 * kMiB;
    STRATA_ASSIGN_OR_RETURN(store, NvmeStore::open(store_options));
    STRATA_RETURN_IF_ERROR(store->io_engine().register_buffers(*arena).status());
    STRATA_ASSIGN_OR_RETURN(swapper, Swapper::create(swapper_options, {device.get(), stream.get(), arena.get(), store.get()}));
    return Status::Ok();
  }
};

#define INIT_RIG_OR_SKIP(rig, ...)                                                               \
  Rig rig;                                                                                       \
  {                                                                                              \
    Status rig_status = rig.init(__VA_ARGS__);                                                   \
    if (rig_status.code() == StatusCode::kUnavailable) GTEST_SKIP() << rig_status.message();     \
    STRATA_ASSERT_OK(rig_status);                                                                \
  }

// Storage for one end of a copy, in any tier.
struct Place {
  TierLocation location;
  DeviceBuffer device_buffer;
  PinnedBuffer pinned_buffer;
  testing::AlignedMemory host_memory;
};

enum class Where { kDevice, kPinned, kHostAligned, kHostUnaligned, kNvme };
std::string where_name(Where where) {
  switch (where) {
    case Where::kDevice: return "device";
    case Where::kPinned: return "pinned";
    case Where::kHostAligned: return "host";
    case Where::kHostUnaligned: return "host_unaligned";
    case Where::kNvme: return "nvme";
  }
  return "?";
}

StatusOr<Place> make_place(Rig& rig, Where where, size_t bytes, const std::string& key) {
  Place place;
  switch (where) {
    case Where::kDevice: {
      STRATA_ASSIGN_OR_RETURN(place.device_buffer, rig.device->allocate(bytes, key));
      place.location = TierLocation::device(place.device_buffer);
      break;
    }
    case Where::kPinned: {
      STRATA_ASSIGN_OR_RETURN(place.pinned_buffer, rig.arena->allocate(bytes, key));
      place.location = TierLocation::pinned(place.pinned_buffer);
      break;
    }
    case Where::kHostAligned:
      place.host_memory = testing::aligned_memory(bytes + 4096);
      place.location = TierLocation::host(place.host_memory.get(), (bytes + 4095) / 4096 * 4096);
      break;
    case Where::kHostUnaligned:
      place.host_memory = testing::aligned_memory(bytes + 4096);
      place.location = TierLocation::host(place.host_memory.get() + 3);  // exactly `bytes`, odd address
      break;
    case Where::kNvme: {
      STRATA_ASSIGN_OR_RETURN(NvmeExtent extent, rig.store->allocate(key, bytes));
      place.location = TierLocation::nvme(extent);
      break;
    }
  }
  return place;
}

// Puts `bytes` of pattern `seed` into a place, without the swapper where it can.
Status put(Rig& rig, Place& place, size_t bytes, uint64_t seed) {
  std::vector<char> pattern(bytes);
  fill_pattern(pattern.data(), bytes, seed);
  switch (place.location.tier) {
    case Tier::kPinned:
    case Tier::kHost:
      std::memcpy(place.location.data, pattern.data(), bytes);
      return Status::Ok();
    case Tier::kNvme:
      return rig.store->write(place.location.extent, pattern.data(), bytes);
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(rig.device->copy_async(place.location.data, pattern.data(), bytes,
                                                    CopyKind::kHostToDevice, *rig.stream));
      return rig.stream->synchronize();
  }
  return InternalError("bad tier");
}

// Reads a place back into host memory, without the swapper where it can.
StatusOr<std::vector<char>> get(Rig& rig, Place& place, size_t bytes) {
  std::vector<char> out(bytes);
  switch (place.location.tier) {
    case Tier::kPinned:
    case Tier::kHost:
      std::memcpy(out.data(), place.location.data, bytes);
      break;
    case Tier::kNvme:
      STRATA_RETURN_IF_ERROR(rig.store->read(place.location.extent, out.data(), bytes));
      break;
    case Tier::kDevice:
      STRATA_RETURN_IF_ERROR(rig.device->copy_async(out.data(), place.location.data, bytes, CopyKind::kDeviceToHost,
                                                    *rig.stream));
      STRATA_RETURN_IF_ERROR(rig.stream->synchronize());
      break;
  }
  return out;
}

using PairParam = std::tuple<Where, Where, size_t>;
class SwapperPairTest : public ::testing::TestWithParam<PairParam> {};

// Every tier to every tier, at sizes that do and do not fill a block and that take
// several staging chunks; the data compared byte for byte; the staging ring never grows.
TEST_P(SwapperPairTest, CopiesBetweenTiers) {
  const auto [from, to, bytes] = GetParam();
  INIT_RIG_OR_SKIP(rig);
  STRATA_ASSERT_OK_AND_ASSIGN(Place src, make_place(rig, from, bytes, "src"));
  STRATA_ASSERT_OK_AND_ASSIGN(Place dst, make_place(rig, to, bytes, "dst"));
  STRATA_ASSERT_OK(put(rig, src, bytes, bytes + 1));
  const PinnedArenaStats arena_before = rig.arena->stats();
  STRATA_ASSERT_OK_AND_ASSIGN(SwapTicket ticket, rig.swapper->copy(src.location, dst.location, bytes));
  STRATA_ASSERT_OK(rig.swapper->wait(ticket));
  EXPECT_TRUE(rig.swapper->done(ticket));
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<char> back, get(rig, dst, bytes));
  EXPECT_EQ(first_pattern_mismatch(back.data(), bytes, bytes + 1), -1);
  // The source is untouched.
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<char> source, get(rig, src, bytes));
  EXPECT_EQ(first_pattern_mismatch(source.data(), bytes, bytes + 1), -1);

  const SwapperStats stats = rig.swapper->stats();
  EXPECT_EQ(stats.copies, 1u);
  EXPECT_EQ(stats.bytes, bytes);
  const bool nvme_involved = from == Where::kNvme || to == Where::kNvme;
  const Where other = from == Where::kNvme ? to : from;
  const bool staged = nvme_involved && (other == Where::kDevice || other == Where::kNvme || other == Where::kHostUnaligned);
  EXPECT_EQ(stats.staged_chunks, staged ? (bytes + kMiB - 1) / kMiB : 0u);
  EXPECT_EQ(stats.direct_nvme, nvme_involved && !staged ? 1u : 0u);
  // Bounded: the copy allocated nothing from the arena.
  const PinnedArenaStats arena_after = rig.arena->stats();
  EXPECT_EQ(arena_after.in_use_bytes, arena_before.in_use_bytes);
  EXPECT_EQ(arena_after.allocation_count, arena_before.allocation_count);
}

std::string pair_name(const ::testing::TestParamInfo<PairParam>& info) {
  const auto& [from, to, bytes] = info.param;
  return where_name(from) + "_to_" + where_name(to) + "_" + std::to_string(bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, SwapperPairTest,
    ::testing::Combine(::testing::Values(Where::kDevice, Where::kPinned, Where::kHostAligned, Where::kHostUnaligned, Where::kNvme),
                       ::testing::Values(Where::kDevice, Where::kPinned, Where::kHostAligned, Where::kHostUnaligned, Where::kNvme),
                       ::testing::Values(size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, 3 * kMiB + 5)),
    pair_name);

TEST(SwapperTest, DoubleBufferingAndThePsyncEngineWork) {
  INIT_RIG_OR_SKIP(rig, IoEngineKind::kPsync, SwapperOptions{2 * kMiB, 2});
  const size_t bytes = 5 * kMiB + 7;
  STRATA_ASSERT_OK_AND_ASSIGN(Place device, make_place(rig, Where::kDevice, bytes, "device"));
  STRATA_ASSERT_OK_AND_ASSIGN(Place nvme, make_place(rig, Where::kNvme, bytes, "nvme"));
  STRATA_ASSERT_OK_AND_ASSIGN(Place back, make_place(rig, Where::kDevice, bytes, "back"));
  STRATA_ASSERT_OK(put(rig, device, bytes, 31));
  STRATA_ASSERT_OK_AND_ASSIGN(SwapTicket out, rig.swapper->copy(device.location, nvme.location, bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(SwapTicket in, rig.swapper->copy(nvme.location, back.location, bytes));
  STRATA_ASSERT_OK(rig.swapper->wait(in));  // copies run in order: `out` is done too
  EXPECT_TRUE(rig.swapper->done(out));
  STRATA_ASSERT_OK(rig.swapper->wait(out));
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<char> got, get(rig, back, bytes));
  EXPECT_EQ(first_pattern_mismatch(got.data(), bytes, 31), -1);
  EXPECT_EQ(rig.swapper->stats().staged_chunks, 12u);
  EXPECT_EQ(rig.swapper->stats().staging_chunk_bytes, kMiB);
}

// A range of an extent (from a checksum block boundary to the extent's end) moves
// through the ring to the device.
TEST(SwapperTest, RangesOfAnExtentMoveThroughTheRing) {
  INIT_RIG_OR_SKIP(rig);
  const size_t extent_bytes = 6 * kMiB + 9;
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, rig.store->allocate("big", extent_bytes));
  std::vector<char> pattern(extent_bytes);
  fill_pattern(pattern.data(), extent_bytes, 5);
  STRATA_ASSERT_OK(rig.store->write(extent, pattern.data(), extent_bytes));
  const size_t tail = extent_bytes - 2 * kMiB;
  STRATA_ASSERT_OK_AND_ASSIGN(DeviceBuffer device, rig.device->allocate(tail, "tail"));
  STRATA_ASSERT_OK_AND_ASSIGN(SwapTicket ticket, rig.swapper->copy(TierLocation::nvme(extent, 2 * kMiB),
                                                                   TierLocation::device(device), tail));
  STRATA_ASSERT_OK(rig.swapper->wait(ticket));
  std::vector<char> got(tail);
  STRATA_ASSERT_OK(rig.device->copy_async(got.data(), device.data(), got.size(), CopyKind::kDeviceToHost, *rig.stream));
  STRATA_ASSERT_OK(rig.stream->synchronize());
  EXPECT_EQ(std::memcmp(got.data(), pattern.data() + 2 * kMiB, got.size()), 0);
  // A range that ends inside a checksum block is refused by the store, at the wait.
  const Status cut = rig.swapper->wait(*rig.swapper->copy(TierLocation::nvme(extent, 2 * kMiB),
                                                          TierLocation::device(device), kMiB + 9));
  EXPECT_EQ(cut.code(), StatusCode::kInvalidArgument) << cut.to_string();
  EXPECT_TRUE(contains(cut.message(), "must start on a multiple of 1048576 bytes")) << cut.to_string();
}

// A failed copy reports the store's error (naming the extent) at its wait, leaves the
// ring clean, and the next copy works.
TEST(SwapperTest, FailuresArriveAtTheWaitAndTheNextCopyWorks) {
  INIT_RIG_OR_SKIP(rig);
  const size_t bytes = 2 * kMiB + 1;
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent never_written, rig.store->allocate("never written", bytes));
  STRATA_ASSERT_OK_AND_ASSIGN(Place device, make_place(rig, Where::kDevice, bytes, "device"));
  STRATA_ASSERT_OK_AND_ASSIGN(SwapTicket failing,
                              rig.swapper->copy(TierLocation::nvme(never_written), device.location, bytes));
  const Status status = rig.swapper->wait(failing);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kFailedPrecondition);
  EXPECT_TRUE(contains(status.message(), "extent 'never written'")) << status.to_string();
  EXPECT_TRUE(contains(status.to_string(), "swapper: copy " + std::to_string(failing.id))) << status.to_string();

  // Device memory outside any allocation: the device refuses; the error is kept for
  // wait_all() because nobody waits for this ticket.
  STRATA_ASSERT_OK_AND_ASSIGN(Place pinned, make_place(rig, Where::kPinned, bytes, "pinned"));
  std::vector<char> not_device(bytes);
  STRATA_ASSERT_OK(rig.swapper->copy(pinned.location, TierLocation::device(not_device.data()), bytes));
  const Status all = rig.swapper->wait_all();
  EXPECT_FALSE(all.ok());
  EXPECT_TRUE(contains(all.to_string(), "to device")) << all.to_string();
  STRATA_EXPECT_OK(rig.swapper->wait_all());

  STRATA_ASSERT_OK(put(rig, pinned, bytes, 17));
  STRATA_ASSERT_OK_AND_ASSIGN(Place nvme, make_place(rig, Where::kNvme, bytes, "fine"));
  STRATA_ASSERT_OK(rig.swapper->wait(*rig.swapper->copy(pinned.location, nvme.location, bytes)));
  STRATA_ASSERT_OK(rig.swapper->wait(*rig.swapper->copy(nvme.location, device.location, bytes)));
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<char> got, get(rig, device, bytes));
  EXPECT_EQ(first_pattern_mismatch(got.data(), bytes, 17), -1);
  EXPECT_EQ(rig.swapper->stats().failed_copies, 2u);
}

TEST(SwapperTest, CorruptedExtentSurfacesAsDataLoss) {
  INIT_RIG_OR_SKIP(rig);
  const size_t bytes = 3 * kMiB;
  STRATA_ASSERT_OK_AND_ASSIGN(Place nvme, make_place(rig, Where::kNvme, bytes, "shard"));
  STRATA_ASSERT_OK(put(rig, nvme, bytes, 3));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, rig.store->info(nvme.location.extent));
  {
    const int fd = ::open(rig.store->file_path().c_str(), O_RDWR);
    ASSERT_GE(fd, 0);
    ASSERT_EQ(::pwrite(fd, "#", 1, static_cast<off_t>(info.file_offset + 2 * kMiB + 1)), 1);
    ::close(fd);
  }
  STRATA_ASSERT_OK_AND_ASSIGN(Place device, make_place(rig, Where::kDevice, bytes, "device"));
  const Status status = rig.swapper->wait(*rig.swapper->copy(nvme.location, device.location, bytes));
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "checksum mismatch in extent 'shard'")) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "at file offset " + std::to_string(info.file_offset + 2 * kMiB)))
      << status.to_string();
}

TEST(SwapperTest, RefusesWhatCannotWork) {
  testing::TempDir dir;
  EXPECT_EQ(Swapper::create({kMiB, 1}, {}).status().code(), StatusCode::kInvalidArgument);
  STRATA_ASSERT_OK_AND_ASSIGN(auto plain, Swapper::create({}, {}));
  std::vector<char> a(10), b(10);
  auto to_device = plain->copy(TierLocation::host(a.data()), TierLocation::device(b.data()), 10);
  EXPECT_TRUE(contains(to_device.status().message(), "has no device")) << to_device.status().to_string();
  auto to_nvme = plain->copy(TierLocation::host(a.data()), TierLocation::nvme(NvmeExtent{1}), 10);
  EXPECT_TRUE(contains(to_nvme.status().message(), "has no NVMe store")) << to_nvme.status().to_string();
  auto too_small = plain->copy(TierLocation::host(a.data(), 5), TierLocation::host(b.data()), 10);
  EXPECT_EQ(too_small.status().code(), StatusCode::kInvalidArgument);
  STRATA_ASSERT_OK(plain->wait(*plain->copy(TierLocation::host(a.data()), TierLocation::host(b.data()), 10)));
  EXPECT_EQ(plain->wait(SwapTicket{99}).code(), StatusCode::kInvalidArgument);

  NvmeStoreOptions options;
  options.nvme_path = dir.str();
  STRATA_ASSERT_OK_AND_ASSIGN(auto store, NvmeStore::open(options));
  auto no_arena = Swapper::create({}, {nullptr, nullptr, nullptr, store.get()});
  EXPECT_TRUE(contains(no_arena.status().message(), "needs a pinned arena")) << no_arena.status().to_string();
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 4 * kMiB}));
  auto tiny = Swapper::create({64 * kKiB, 2}, {nullptr, nullptr, arena.get(), store.get()});
  EXPECT_TRUE(contains(tiny.status().message(), "less than one")) << tiny.status().to_string();
  auto over_budget = Swapper::create({8 * kMiB, 2}, {nullptr, nullptr, arena.get(), store.get()});
  EXPECT_EQ(over_budget.status().code(), StatusCode::kOutOfMemory) << over_budget.status().to_string();
}

// Copies asked for from several threads and waited for from others. Under
// ThreadSanitizer this is the swapper's race check.
TEST(SwapperTest, ConcurrentCopiesAndWaits) {
  INIT_RIG_OR_SKIP(rig);
  constexpr int kThreads = 3;
  constexpr size_t kBytes = kMiB + 4097;
  std::vector<std::string> errors(kThreads);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto fail = [&](const std::string& what) { errors[t] = what; };
      auto device = make_place(rig, Where::kDevice, kBytes, "device" + std::to_string(t));
      auto nvme = make_place(rig, Where::kNvme, kBytes, "nvme" + std::to_string(t));
      auto pinned = make_place(rig, Where::kPinned, kBytes, "pinned" + std::to_string(t));
      if (!device.ok() || !nvme.ok() || !pinned.ok()) return fail("setup");
      for (int round = 0; round < 3; ++round) {
        const uint64_t seed = static_cast<uint64_t>(t * 100 + round);
        fill_pattern(pinned->location.data, kBytes, seed);
        auto a = rig.swapper->copy(pinned->location, device->location, kBytes);
        auto b = rig.swapper->copy(device->location, nvme->location, kBytes);
        if (!a.ok() || !b.ok()) return fail("copy refused");
        // Wait for the later ticket from another thread.
        Status later;
        std::thread waiter([&] { later = rig.swapper->wait(*b); });
        Status earlier = rig.swapper->wait(*a);
        waiter.join();
        if (!earlier.ok() || !later.ok()) return fail(earlier.to_string() + later.to_string());
        std::memset(pinned->location.data, 0, kBytes);
        auto c = rig.swapper->copy(nvme->location, pinned->location, kBytes);
        if (!c.ok()) return fail("copy refused");
        Status back = rig.swapper->wait(*c);
        if (!back.ok()) return fail(back.to_string());
        if (first_pattern_mismatch(pinned->location.data, kBytes, seed) != -1) return fail("mismatch");
      }
    });
  }
  for (auto& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  STRATA_EXPECT_OK(rig.swapper->wait_all());
}

}  // namespace
}  // namespace strata
