// Inputs staged and losses read without draining the device (examples/lm/host_staging.h).
// The stream is held by a gate (a stream task waiting for the test): a call that drained
// the stream would never return and the test would hang until CTest stops it, so these
// tests fail, not pass, when the host waits for the device.
#include "examples/lm/host_staging.h"

#include <gtest/gtest.h>

#include <cstring>
#include <vector>

#include "tests/support/test_support.h"

namespace strata::lm {
namespace {

// Holds `stream` at this point until the gate opens.
Status hold(Stream& stream, testing::Gate& gate) {
  return stream.enqueue_host([&gate] {
    gate.wait();
    return Status();
  });
}

struct Fixture {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  DeviceBuffer lse, chunk;  // one micro-batch's loss pieces on the device
  Status init(size_t rows = 1, size_t chunks = 1) {
    STRATA_ASSIGN_OR_RETURN(device, create_cpu_device({}));
    STRATA_ASSIGN_OR_RETURN(stream, device->create_stream("test compute"));
    STRATA_ASSIGN_OR_RETURN(lse, device->allocate(rows * 4, "lse"));
    STRATA_ASSIGN_OR_RETURN(chunk, device->allocate(rows * chunks * 4, "chunk losses"));
    return {};
  }
};

// The loss pieces of `rows` rows over `chunks` chunks, and the sum the host must report.
struct Pieces {
  std::vector<float> loss_lse, chunk_losses;
  std::vector<int32_t> target_chunk;
  double sum = 0.0;
};
Pieces make_pieces(size_t rows, size_t chunks, float base) {
  Pieces p;
  for (size_t r = 0; r < rows; ++r) {
    p.loss_lse.push_back(base + 0.25f * float(r));
    p.target_chunk.push_back(r % 5 == 3 ? -1 : static_cast<int32_t>(r % chunks));
  }
  for (size_t i = 0; i < rows * chunks; ++i) p.chunk_losses.push_back(base * 0.5f + 0.001f * float(i));
  for (size_t r = 0; r < rows; ++r) {
    if (p.target_chunk[r] < 0) continue;
    p.sum += double(p.loss_lse[r]) + double(p.chunk_losses[size_t(p.target_chunk[r]) * rows + r]);
  }
  return p;
}

// Device copies of `p`'s pieces, written in stream order (so they may be overwritten by the
// next micro-batch's pieces after a queue()).
Status upload(Fixture& f, const Pieces& p) {
  STRATA_RETURN_IF_ERROR(f.device->copy_async(f.lse.data(), p.loss_lse.data(), p.loss_lse.size() * 4, CopyKind::kHostToDevice, *f.stream));
  return f.device->copy_async(f.chunk.data(), p.chunk_losses.data(), p.chunk_losses.size() * 4, CopyKind::kHostToDevice, *f.stream);
}

TEST(HostStagingTest, QueuedLossesReturnWhileTheStreamIsHeldAndSumOnceItMovesOn) {
  constexpr size_t kRows = 37, kChunks = 3;
  Fixture f;
  STRATA_ASSERT_OK(f.init(kRows, kChunks));
  LossReadback readback(*f.device);
  const Pieces first = make_pieces(kRows, kChunks, 2.0f), second = make_pieces(kRows, kChunks, 7.0f);
  testing::Gate gate;  // after the stream: it opens when destroyed, so a failed assertion cannot leave the stream held
  STRATA_ASSERT_OK(hold(*f.stream, gate));
  // Two micro-batches through the same device buffers, queued while nothing has run.
  STRATA_ASSERT_OK(upload(f, first));
  STRATA_ASSERT_OK_AND_ASSIGN(const LossTicket a, readback.queue(*f.stream, {f.lse.as<float>(), f.chunk.as<float>(), kRows, kChunks, first.target_chunk}));
  STRATA_ASSERT_OK(upload(f, second));
  STRATA_ASSERT_OK_AND_ASSIGN(const LossTicket b, readback.queue(*f.stream, {f.lse.as<float>(), f.chunk.as<float>(), kRows, kChunks, second.target_chunk}));
  EXPECT_EQ(readback.in_flight(), 2u);
  gate.open();
  STRATA_ASSERT_OK_AND_ASSIGN(const double sum_a, readback.take(a));
  STRATA_ASSERT_OK_AND_ASSIGN(const double sum_b, readback.take(b));
  EXPECT_EQ(sum_a, first.sum);  // the same additions in the same order: the same bits
  EXPECT_EQ(sum_b, second.sum);
  EXPECT_EQ(readback.in_flight(), 0u);
}

TEST(HostStagingTest, ATicketIsTakenOnceAndRecordsAreReused) {
  constexpr size_t kRows = 7, kChunks = 2;
  Fixture f;
  STRATA_ASSERT_OK(f.init(kRows, kChunks));
  LossReadback readback(*f.device);
  for (int round = 0; round < 4; ++round) {
    const Pieces p = make_pieces(kRows, kChunks, 1.0f + float(round));
    STRATA_ASSERT_OK(upload(f, p));
    STRATA_ASSERT_OK_AND_ASSIGN(const LossTicket t, readback.queue(*f.stream, {f.lse.as<float>(), f.chunk.as<float>(), kRows, kChunks, p.target_chunk}));
    STRATA_ASSERT_OK_AND_ASSIGN(const double sum, readback.take(t));
    EXPECT_EQ(sum, p.sum);
    EXPECT_FALSE(readback.take(t).ok()) << "a ticket taken twice";
  }
  EXPECT_EQ(readback.records(), 1u);  // one micro-batch in flight at a time: one record
  const Pieces p = make_pieces(kRows, kChunks, 1.0f);
  const std::vector<int32_t> bad(kRows, int32_t(kChunks));
  EXPECT_FALSE(readback.queue(*f.stream, {f.lse.as<float>(), f.chunk.as<float>(), kRows, kChunks, bad}).ok()) << "a target chunk past the last";
  EXPECT_FALSE(readback.queue(*f.stream, {f.lse.as<float>(), f.chunk.as<float>(), kRows, kChunks, std::span(p.target_chunk).first(3)}).ok());
  EXPECT_FALSE(readback.take(LossTicket{}).ok());
}

TEST(HostStagingTest, TwoFillsAreStagedWhileTheStreamIsHeldAndEachCopyReadsItsOwnFill) {
  Fixture f;
  STRATA_ASSERT_OK(f.init());
  constexpr size_t kBytes = 4099;  // not a page multiple
  STRATA_ASSERT_OK_AND_ASSIGN(UploadStaging staging, UploadStaging::create(*f.device, kBytes, "test inputs"));
  STRATA_ASSERT_OK_AND_ASSIGN(DeviceBuffer first, f.device->allocate(kBytes, "first"));
  STRATA_ASSERT_OK_AND_ASSIGN(DeviceBuffer second, f.device->allocate(kBytes, "second"));
  testing::Gate gate;  // after the stream: it opens when destroyed, so a failed assertion cannot leave the stream held
  STRATA_ASSERT_OK(hold(*f.stream, gate));
  for (auto [target, value] : {std::pair{&first, 0x11}, std::pair{&second, 0x22}}) {
    STRATA_ASSERT_OK_AND_ASSIGN(std::byte * fill, staging.begin_fill());  // must not wait: the stream is held
    std::memset(fill, value, kBytes);
    STRATA_ASSERT_OK(f.device->copy_async(target->data(), fill, kBytes, CopyKind::kHostToDevice, *f.stream));
    STRATA_ASSERT_OK(staging.end_fill(*f.stream));
  }
  gate.open();
  // The third fill reuses the first: it waits for the first fill's copy, then may be written.
  STRATA_ASSERT_OK_AND_ASSIGN(std::byte * third, staging.begin_fill());
  std::memset(third, 0x33, kBytes);
  STRATA_ASSERT_OK(f.stream->synchronize());
  std::vector<unsigned char> host(kBytes);
  std::memcpy(host.data(), first.data(), kBytes);  // CpuDevice memory is host memory
  EXPECT_EQ(host.front(), 0x11);
  EXPECT_EQ(host.back(), 0x11);
  std::memcpy(host.data(), second.data(), kBytes);
  EXPECT_EQ(host.front(), 0x22);
  EXPECT_EQ(host.back(), 0x22);
}

}  // namespace
}  // namespace strata::lm
