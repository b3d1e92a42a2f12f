// The NVMe store's checksums, computed and verified beside the I/O (IoRequest::verify):
// with many transfers in flight on several threads, a corrupted block is named exactly
// as before (extent, file, offset, stored and read checksums), no other transfer is lost
// or held up, and no bytes reach a caller before they have verified.
#include <fcntl.h>
#include <unistd.h>

#include <algorithm>
#include <barrier>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/core/check.h"
#include "offload/checksum.h"
#include "offload/nvme_store.h"
#include "tests/offload/offload_test_util.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::aligned_memory;
using testing::fill_pattern;
using testing::first_pattern_mismatch;

constexpr size_t kKiB = 1024;
constexpr size_t kBlock = 64 * kKiB;  // the checksum block of these tests

using testing::contains;

std::string hex64(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(value));
  return text;
}

// Engine kind x verifier threads (0: the checks run where completions are reaped).
using IntegrityParam = std::tuple<IoEngineKind, unsigned>;

NvmeStoreOptions store_options(const std::string& path, const IntegrityParam& param) {
  NvmeStoreOptions options;
  options.nvme_path = path;
  options.checksum_block_bytes = kBlock;
  options.growth_bytes = 4 << 20;
  options.io.kind = std::get<0>(param);
  options.io.queue_depth = 8;
  options.io.verify_threads = std::get<1>(param);
  return options;
}

// Flips one byte of the data file behind the store's back; returns the block's checksum
// after the flip.
uint64_t corrupt_byte(const NvmeStore& store, uint64_t file_offset, uint64_t block_start, size_t block_bytes) {
  const int fd = ::open(store.file_path().c_str(), O_RDWR | O_CLOEXEC);
  EXPECT_GE(fd, 0);
  char byte = 0;
  EXPECT_EQ(::pread(fd, &byte, 1, static_cast<off_t>(file_offset)), 1);
  byte = static_cast<char>(byte ^ 0x20);
  EXPECT_EQ(::pwrite(fd, &byte, 1, static_cast<off_t>(file_offset)), 1);
  std::vector<char> block(block_bytes);
  EXPECT_EQ(::pread(fd, block.data(), block_bytes, static_cast<off_t>(block_start)), static_cast<ssize_t>(block_bytes));
  ::close(fd);
  return xxhash64(block.data(), block_bytes);
}

class NvmeStoreIntegrityTest : public ::testing::TestWithParam<IntegrityParam> {};

// 48 blocks read one request each by four threads at once, queue depth 8, one block
// corrupted on disk: its read fails naming the extent, the file, the offset and both
// checksums; every other read completes with its bytes; nothing is left behind.
TEST_P(NvmeStoreIntegrityTest, OneCorruptBlockAmongManyReadsInFlightIsNamedAndNoOtherReadIsLost) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str(), GetParam()));
  constexpr size_t kBlocks = 48;
  constexpr size_t kBad = 29;
  constexpr size_t kBytes = kBlocks * kBlock;
  auto data = aligned_memory(kBytes);
  auto back = aligned_memory(kBytes);
  fill_pattern(data.get(), kBytes, 21);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("weights", kBytes));
  STRATA_ASSERT_OK(store->write(extent, data.get(), kBytes));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, store->info(extent));
  const uint64_t bad_start = info.file_offset + kBad * kBlock;
  const uint64_t read_sum = corrupt_byte(*store, bad_start + 777, bad_start, kBlock);
  const uint64_t stored_sum = xxhash64(data.get() + kBad * kBlock, kBlock);

  constexpr size_t kThreads = 4;
  std::vector<Status> results(kBlocks);
  std::vector<std::thread> threads;
  for (size_t t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      std::vector<std::pair<size_t, IoTicket>> tickets;
      for (size_t b = t; b < kBlocks; b += kThreads) {
        StatusOr<IoTicket> ticket = store->read_async(extent, back.get() + b * kBlock, kBlock, b * kBlock);
        if (!ticket.ok()) {
          results[b] = ticket.status();
          continue;
        }
        tickets.emplace_back(b, *ticket);
      }
      for (const auto& [b, ticket] : tickets) results[b] = store->wait(ticket);
    });
  }
  for (std::thread& thread : threads) thread.join();

  for (size_t b = 0; b < kBlocks; ++b) {
    if (b == kBad) continue;
    EXPECT_TRUE(results[b].ok()) << "block " << b << ": " << results[b].to_string();
    EXPECT_EQ(std::memcmp(back.get() + b * kBlock, data.get() + b * kBlock, kBlock), 0) << "block " << b;
  }
  const Status& bad = results[kBad];
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad.to_string();
  const std::string text = bad.to_string();
  EXPECT_TRUE(contains(text, "checksum mismatch in extent 'weights' of " + store->file_path())) << text;
  EXPECT_TRUE(contains(text, "at file offset " + std::to_string(bad_start))) << text;
  EXPECT_TRUE(contains(text, "(extent bytes [" + std::to_string(kBad * kBlock) + ", " +
                                 std::to_string((kBad + 1) * kBlock) + "))"))
      << text;
  EXPECT_TRUE(contains(text, "stored " + hex64(stored_sum) + ", read " + hex64(read_sum))) << text;
  EXPECT_EQ(store->stats().checksum_failures, 1u);
  EXPECT_EQ(store->stats().bytes_read, (kBlocks - 1) * kBlock);
  // Every read and the write went through the verify stage; no error is left unclaimed.
  EXPECT_EQ(store->io_engine().stats().verified_requests, kBlocks + 1);
  STRATA_EXPECT_OK(store->wait_all());
}

// Four threads write their own extents at once; between the writes and the reads one
// block of one extent is corrupted on disk. Every read of that extent fails naming it,
// the other extents read back intact, also while the failing reads are in flight.
TEST_P(NvmeStoreIntegrityTest, BlockCorruptedBetweenWriteAndReadIsCaughtWhileOthersReadOn) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str(), GetParam()));
  constexpr int kThreads = 4;
  constexpr int kVictim = 2;
  constexpr int kRounds = 3;
  constexpr size_t kBytes = 16 * kBlock + 3000;  // a short last block
  std::vector<NvmeExtent> extents(kThreads);
  for (int t = 0; t < kThreads; ++t) {
    STRATA_ASSERT_OK_AND_ASSIGN(extents[t], store->allocate("part" + std::to_string(t), kBytes));
  }
  std::barrier written(kThreads + 1);
  std::barrier corrupted(kThreads + 1);
  std::vector<std::string> errors(kThreads);
  std::vector<int> failed_reads(kThreads, 0);
  std::vector<std::thread> threads;
  for (int t = 0; t < kThreads; ++t) {
    threads.emplace_back([&, t] {
      auto out = aligned_memory(kBytes);
      auto in = aligned_memory(kBytes);
      fill_pattern(out.get(), kBytes, static_cast<uint64_t>(100 + t));
      // Half the blocks in one request, the rest one request per block, all in flight.
      std::vector<IoTicket> tickets;
      auto submit = [&](StatusOr<IoTicket> ticket) {
        if (ticket.ok()) tickets.push_back(*ticket);
        if (!ticket.ok() && errors[t].empty()) errors[t] = ticket.status().to_string();
      };
      submit(store->write_async(extents[t], out.get(), 8 * kBlock, 0));
      for (size_t b = 8; b * kBlock < kBytes; ++b) {
        const size_t length = std::min(kBlock, kBytes - b * kBlock);
        submit(store->write_async(extents[t], out.get() + b * kBlock, length, b * kBlock));
      }
      for (IoTicket ticket : tickets) {
        const Status status = store->wait(ticket);
        if (!status.ok() && errors[t].empty()) errors[t] = status.to_string();
      }
      written.arrive_and_wait();
      corrupted.arrive_and_wait();
      for (int round = 0; round < kRounds; ++round) {
        std::memset(in.get(), 0, kBytes);
        const Status read = store->read(extents[t], in.get(), kBytes);
        if (t == kVictim) {
          if (read.code() == StatusCode::kDataLoss && contains(read.message(), "extent 'part2'")) ++failed_reads[t];
        } else if (!read.ok()) {
          errors[t] = read.to_string();
        } else if (first_pattern_mismatch(in.get(), kBytes, static_cast<uint64_t>(100 + t)) != -1) {
          errors[t] = "bytes differ in part" + std::to_string(t);
        }
      }
    });
  }
  written.arrive_and_wait();
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, store->info(extents[kVictim]));
  const uint64_t block_start = info.file_offset + 5 * kBlock;
  corrupt_byte(*store, block_start + 4096, block_start, kBlock);
  corrupted.arrive_and_wait();
  for (std::thread& thread : threads) thread.join();
  for (int t = 0; t < kThreads; ++t) EXPECT_EQ(errors[t], "") << "thread " << t;
  EXPECT_EQ(failed_reads[kVictim], kRounds);
  EXPECT_EQ(store->stats().checksum_failures, static_cast<uint64_t>(kRounds));
}

// A read into memory the store cannot reach directly goes through a bounce buffer: when
// a block fails its checksum, not one byte of the bad read reaches the caller's memory.
TEST_P(NvmeStoreIntegrityTest, CorruptBlockIsNeverCopiedOutOfTheBounceBuffer) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str(), GetParam()));
  constexpr size_t kBytes = 4 * kBlock;
  std::vector<char> data(kBytes);
  fill_pattern(data.data(), kBytes, 7);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("moments", kBytes));
  STRATA_ASSERT_OK(store->write(extent, data.data(), kBytes));
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtentInfo info, store->info(extent));
  corrupt_byte(*store, info.file_offset + 3 * kBlock + 1, info.file_offset + 3 * kBlock, kBlock);
  std::vector<char> storage(kBytes + 1, '#');
  char* unaligned = storage.data() + 1;  // never 4 KiB aligned: a bounce buffer
  const Status bad = store->read(extent, unaligned, kBytes);
  EXPECT_EQ(bad.code(), StatusCode::kDataLoss) << bad.to_string();
  EXPECT_EQ(std::count(storage.begin(), storage.end(), '#'), static_cast<std::ptrdiff_t>(kBytes + 1));
  // The blocks before the bad one read fine through the same path.
  STRATA_ASSERT_OK(store->read(extent, unaligned, 3 * kBlock));
  EXPECT_EQ(std::memcmp(unaligned, data.data(), 3 * kBlock), 0);
  EXPECT_GT(store->stats().bounce_transfers, 0u);
}

// A write's checksums, now computed after submission, are those of the bytes written: a
// caller may reuse its (unaligned, so copied) source as soon as write_async returns, and
// an aligned source written many blocks deep reads back verified.
TEST_P(NvmeStoreIntegrityTest, WriteChecksumsAreOfTheBytesWritten) {
  testing::TempDir dir;
  OPEN_STORE_OR_SKIP(store, store_options(dir.str(), GetParam()));
  constexpr size_t kBytes = 32 * kBlock;
  std::vector<char> storage(kBytes + 1);
  char* unaligned = storage.data() + 1;
  fill_pattern(unaligned, kBytes, 8);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent copied, store->allocate("copied", kBytes));
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket, store->write_async(copied, unaligned, kBytes));
  std::memset(unaligned, 0x5a, kBytes);  // the store took its copy
  STRATA_ASSERT_OK(store->wait(ticket));
  auto back = aligned_memory(kBytes);
  STRATA_ASSERT_OK(store->read(copied, back.get(), kBytes));
  EXPECT_EQ(first_pattern_mismatch(back.get(), kBytes, 8), -1);

  auto direct = aligned_memory(kBytes);
  fill_pattern(direct.get(), kBytes, 9);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent deep, store->allocate("deep", kBytes));
  std::vector<IoTicket> tickets;
  for (size_t b = 0; b < kBytes / kBlock; ++b) {
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket block_ticket,
                                store->write_async(deep, direct.get() + b * kBlock, kBlock, b * kBlock));
    tickets.push_back(block_ticket);
  }
  for (IoTicket block_ticket : tickets) STRATA_ASSERT_OK(store->wait(block_ticket));
  std::memset(back.get(), 0, kBytes);
  STRATA_ASSERT_OK(store->read(deep, back.get(), kBytes));
  EXPECT_EQ(first_pattern_mismatch(back.get(), kBytes, 9), -1);
  EXPECT_EQ(store->stats().checksum_failures, 0u);
}

// With checksums off and buffers the store reaches directly there is nothing to verify:
// no request takes the verify stage.
TEST_P(NvmeStoreIntegrityTest, PlainTransfersSkipTheVerifyStage) {
  testing::TempDir dir;
  NvmeStoreOptions options = store_options(dir.str(), GetParam());
  options.checksums = false;
  OPEN_STORE_OR_SKIP(store, options);
  constexpr size_t kBytes = 8 * kBlock;
  auto data = aligned_memory(kBytes);
  auto back = aligned_memory(kBytes);
  fill_pattern(data.get(), kBytes, 10);
  STRATA_ASSERT_OK_AND_ASSIGN(NvmeExtent extent, store->allocate("plain", kBytes));
  STRATA_ASSERT_OK(store->write(extent, data.get(), kBytes));
  STRATA_ASSERT_OK(store->read(extent, back.get(), kBytes));
  EXPECT_EQ(std::memcmp(back.get(), data.get(), kBytes), 0);
  EXPECT_EQ(store->io_engine().stats().verified_requests, 0u);
}

std::string integrity_name(const ::testing::TestParamInfo<IntegrityParam>& info) {
  return std::string(io_engine_kind_name(std::get<0>(info.param))) + "_verifiers" + std::to_string(std::get<1>(info.param));
}

INSTANTIATE_TEST_SUITE_P(Engines, NvmeStoreIntegrityTest,
                         ::testing::Combine(::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kPsync),
                                            ::testing::Values(0u, 1u, 2u)),
                         integrity_name);

}  // namespace
}  // namespace strata
