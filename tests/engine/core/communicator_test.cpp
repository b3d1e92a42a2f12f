#include "engine/core/communicator.h"

#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/core/gpu.h"
#include "engine/core/host_communicator.h"
#include "tests/support/test_support.h"

#if defined(STRATA_HAVE_CUDA)
#include "engine/core/nccl_communicator.h"
#endif

namespace strata {
namespace {

using std::chrono::milliseconds;

// ---------------------------------------------------------------------------
// Ranks as threads: one CPU device, stream and communicator each.
// ---------------------------------------------------------------------------

struct Rank {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<HostCommunicator> communicator;
};

class Ranks {
 public:
  static StatusOr<std::unique_ptr<Ranks>> create(int world_size, milliseconds timeout = milliseconds(60000)) {
    auto ranks = std::make_unique<Ranks>();
    STRATA_ASSIGN_OR_RETURN(HostCommunicatorGroup group,
                            HostCommunicatorGroup::create({.world_size = world_size, .timeout = timeout}));
    ranks->group.emplace(std::move(group));
    for (int rank = 0; rank < world_size; ++rank) {
      Rank& entry = ranks->ranks.emplace_back();
      CpuDeviceOptions options;
      options.ordinal = rank;
      options.budget_bytes = size_t{64} << 20;
      options.compute.threads = 2;
      STRATA_ASSIGN_OR_RETURN(entry.device, create_cpu_device(options));
      STRATA_ASSIGN_OR_RETURN(entry.stream, entry.device->create_stream("collectives"));
      STRATA_ASSIGN_OR_RETURN(entry.communicator, ranks->group->communicator(rank, *entry.device));
    }
    return ranks;
  }

  int world_size() const { return static_cast<int>(ranks.size()); }
  Rank& operator[](int rank) { return ranks[static_cast<size_t>(rank)]; }

  // Runs `body(rank)` on one thread per rank and returns each rank's status.
  std::vector<Status> run(const std::function<Status(int)>& body) {
    std::vector<Status> statuses(ranks.size());
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world_size(); ++rank)
      threads.emplace_back([&, rank] { statuses[static_cast<size_t>(rank)] = body(rank); });
    for (std::thread& thread : threads) thread.join();
    return statuses;
  }

  std::optional<HostCommunicatorGroup> group;
  std::vector<Rank> ranks;
};

// ---------------------------------------------------------------------------
// Data and the serial reference.
// ---------------------------------------------------------------------------

// A value for (rank, index, salt) with varied signs, exponents and low mantissa bits, so
// that rounding and summation order matter.
float test_value(int rank, size_t index, uint32_t salt) {
  uint64_t x = (static_cast<uint64_t>(rank) << 40) ^ (static_cast<uint64_t>(index) << 8) ^ salt;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  x *= 0xc4ceb9fe1a85ec53ULL;
  x ^= x >> 33;
  const float mantissa = 1.0f + static_cast<float>(x & 0xffffff) / 16777216.0f;
  const int exponent = static_cast<int>((x >> 24) % 9) - 4;
  const float sign = (x >> 40) & 1 ? -1.0f : 1.0f;
  return sign * std::ldexp(mantissa, exponent);
}

// Fills `count` elements of `dtype` (values rounded to the dtype).
void fill(void* data, DType dtype, size_t count, int rank, uint32_t salt) {
  for (size_t i = 0; i < count; ++i) store_from_float(data, dtype, i, test_value(rank, i, salt));
}

// w(x) of communicator.h.
float wire_value(const void* data, DType dtype, DType wire, size_t index) {
  const float value = load_as_float(data, dtype, index);
  if (wire == dtype) return value;
  const uint16_t rounded = wire == DType::kBFloat16 ? float_to_bf16_bits(value) : float_to_fp16_bits(value);
  return wire == DType::kBFloat16 ? bf16_bits_to_float(rounded) : fp16_bits_to_float(rounded);
}

// The reduction of communicator.h, element by element: inputs[r] points at rank r's
// first element of the range.
std::vector<std::byte> reference_reduce(const std::vector<const std::byte*>& inputs, size_t count, DType dtype,
                                        DType wire, ReduceOp op) {
  std::vector<std::byte> out(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) {
    float accumulated = wire_value(inputs[0], dtype, wire, i);
    for (size_t rank = 1; rank < inputs.size(); ++rank) {
      const float value = wire_value(inputs[rank], dtype, wire, i);
      if (op == ReduceOp::kMax) {
        if (std::isnan(value) || value > accumulated) accumulated = std::isnan(accumulated) ? accumulated : value;
      } else {
        accumulated = accumulated + value;
      }
    }
    if (op == ReduceOp::kMean) accumulated = accumulated / static_cast<float>(inputs.size());
    store_from_float(out.data(), dtype, i, accumulated);
  }
  return out;
}

std::string first_difference(const void* actual, const void* expected, DType dtype, size_t count) {
  for (size_t i = 0; i < count; ++i) {
    const size_t bytes = dtype_size(dtype);
    if (std::memcmp(static_cast<const std::byte*>(actual) + i * bytes, static_cast<const std::byte*>(expected) + i * bytes,
                    bytes) != 0)
      return "element " + std::to_string(i) + " of " + std::to_string(count) + ": got " +
             std::to_string(load_as_float(actual, dtype, i)) + ", expected " +
             std::to_string(load_as_float(expected, dtype, i));
  }
  return "";
}

#define EXPECT_SAME_BYTES(actual, expected, dtype, count, what)                           \
  do {                                                                                    \
    const std::string difference = first_difference(actual, expected, dtype, count);      \
    EXPECT_TRUE(difference.empty()) << what << ": " << difference;                        \
  } while (0)

// ---------------------------------------------------------------------------
// The grid: world sizes x dtypes x counts, every collective, checked against the
// reference and repeated for bit-identical results.
// ---------------------------------------------------------------------------

class HostCollectivesTest : public ::testing::TestWithParam<std::tuple<int, DType, size_t>> {};

// Every result of one pass, per rank, for the repeat comparison.
using PassResults = std::vector<std::vector<std::vector<std::byte>>>;

TEST_P(HostCollectivesTest, MatchesSerialReferenceAndRepeatsBitForBit) {
  // Plain variables, not a structured binding: the lambdas below capture them (clang 14).
  const int world = std::get<0>(GetParam());
  const DType dtype = std::get<1>(GetParam());
  const size_t count = std::get<2>(GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(world));
  const size_t element = dtype_size(dtype);
  const size_t total = count * static_cast<size_t>(world);

  // Per rank: a send buffer of `total` elements, a receive buffer of `total`, and an
  // in-place buffer of `total`.
  struct Buffers {
    DeviceBuffer send, recv, in_place;
  };
  std::vector<Buffers> buffers(static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    Device& device = *(*ranks)[rank].device;
    STRATA_ASSERT_OK_AND_ASSIGN(buffers[rank].send, device.allocate(total * element, "send"));
    STRATA_ASSERT_OK_AND_ASSIGN(buffers[rank].recv, device.allocate(total * element, "recv"));
    STRATA_ASSERT_OK_AND_ASSIGN(buffers[rank].in_place, device.allocate(total * element, "in place"));
    fill(buffers[rank].send.data(), dtype, total, rank, 1);
  }
  const auto send_of = [&](int rank) { return static_cast<const std::byte*>(buffers[rank].send.data()); };

  const auto run_pass = [&](PassResults& results) {
    results.assign(static_cast<size_t>(world), {});
    const std::vector<Status> statuses = ranks->run([&](int rank) -> Status {
      Rank& me = (*ranks)[rank];
      Buffers& mine = buffers[rank];
      Stream& stream = *me.stream;
      std::vector<std::vector<std::byte>>& out = results[rank];
      const auto snapshot = [&](const DeviceBuffer& buffer, size_t elements) -> Status {
        STRATA_RETURN_IF_ERROR(stream.synchronize());
        const auto* data = static_cast<const std::byte*>(buffer.data());
        out.emplace_back(data, data + elements * element);
        return Status::Ok();
      };
      const auto reset_in_place = [&]() -> Status {
        STRATA_RETURN_IF_ERROR(stream.synchronize());
        fill(mine.in_place.data(), dtype, total, rank, 2);
        return Status::Ok();
      };
      HostCommunicator& comm = *me.communicator;
      const size_t offset = static_cast<size_t>(rank) * count * element;
      std::byte* in_place = static_cast<std::byte*>(mine.in_place.data());

      // 0: all_gather of the first `count` elements.
      STRATA_RETURN_IF_ERROR(comm.all_gather(mine.send.data(), mine.recv.data(), count, dtype, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.recv, total));
      // 1: all_gather in place.
      STRATA_RETURN_IF_ERROR(reset_in_place());
      STRATA_RETURN_IF_ERROR(comm.all_gather(in_place + offset, in_place, count, dtype, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.in_place, total));
      // 2, 3: reduce_scatter sum and mean.
      STRATA_RETURN_IF_ERROR(comm.reduce_scatter(mine.send.data(), mine.recv.data(), count, dtype, {}, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.recv, count));
      STRATA_RETURN_IF_ERROR(
          comm.reduce_scatter(mine.send.data(), mine.recv.data(), count, dtype, {.op = ReduceOp::kMean}, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.recv, count));
      // 4: reduce_scatter in place.
      STRATA_RETURN_IF_ERROR(reset_in_place());
      STRATA_RETURN_IF_ERROR(comm.reduce_scatter(in_place, in_place + offset, count, dtype, {}, stream));
      STRATA_RETURN_IF_ERROR(stream.synchronize());
      out.emplace_back(in_place + offset, in_place + offset + count * element);
      // 5, 6: all_reduce sum and max over `count` elements.
      STRATA_RETURN_IF_ERROR(comm.all_reduce(mine.send.data(), mine.recv.data(), count, dtype, {}, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.recv, count));
      STRATA_RETURN_IF_ERROR(
          comm.all_reduce(mine.send.data(), mine.recv.data(), count, dtype, {.op = ReduceOp::kMax}, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.recv, count));
      // 7: all_reduce in place over all `total` elements.
      STRATA_RETURN_IF_ERROR(reset_in_place());
      STRATA_RETURN_IF_ERROR(comm.all_reduce(in_place, in_place, total, dtype, {}, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.in_place, total));
      // 8: broadcast from the last rank; non-roots pass no send buffer.
      const int root = world - 1;
      STRATA_RETURN_IF_ERROR(
          comm.broadcast(rank == root ? mine.send.data() : nullptr, mine.recv.data(), count, dtype, root, stream));
      STRATA_RETURN_IF_ERROR(snapshot(mine.recv, count));
      STRATA_RETURN_IF_ERROR(comm.barrier(stream));
      return stream.synchronize();
    });
    for (int rank = 0; rank < world; ++rank) STRATA_EXPECT_OK(statuses[rank]);
  };

  PassResults first;
  run_pass(first);
  if (::testing::Test::HasFailure()) return;

  // The reference, from the send buffers (unchanged) and the in-place fill (salt 2).
  std::vector<std::vector<std::byte>> in_place_inputs(static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    in_place_inputs[rank].resize(total * element);
    fill(in_place_inputs[rank].data(), dtype, total, rank, 2);
  }
  std::vector<std::byte> gathered(total * element), gathered_in_place(total * element);
  for (int rank = 0; rank < world; ++rank) {
    std::memcpy(gathered.data() + rank * count * element, send_of(rank), count * element);
    std::memcpy(gathered_in_place.data() + rank * count * element, in_place_inputs[rank].data() + rank * count * element,
                count * element);
  }
  std::vector<const std::byte*> whole(static_cast<size_t>(world)), whole_in_place(static_cast<size_t>(world));
  for (int rank = 0; rank < world; ++rank) {
    whole[rank] = send_of(rank);
    whole_in_place[rank] = in_place_inputs[rank].data();
  }
  const std::vector<std::byte> all_reduce_sum = reference_reduce(whole, count, dtype, dtype, ReduceOp::kSum);
  const std::vector<std::byte> all_reduce_max = reference_reduce(whole, count, dtype, dtype, ReduceOp::kMax);
  const std::vector<std::byte> all_reduce_in_place = reference_reduce(whole_in_place, total, dtype, dtype, ReduceOp::kSum);

  for (int rank = 0; rank < world; ++rank) {
    const std::vector<std::vector<std::byte>>& got = first[rank];
    ASSERT_EQ(got.size(), 9u);
    std::vector<const std::byte*> slice(static_cast<size_t>(world)), slice_in_place(static_cast<size_t>(world));
    for (int other = 0; other < world; ++other) {
      slice[other] = send_of(other) + rank * count * element;
      slice_in_place[other] = in_place_inputs[other].data() + rank * count * element;
    }
    const std::string who = "rank " + std::to_string(rank) + ": ";
    EXPECT_SAME_BYTES(got[0].data(), gathered.data(), dtype, total, who + "all_gather");
    EXPECT_SAME_BYTES(got[1].data(), gathered_in_place.data(), dtype, total, who + "all_gather in place");
    EXPECT_SAME_BYTES(got[2].data(), reference_reduce(slice, count, dtype, dtype, ReduceOp::kSum).data(), dtype, count,
                      who + "reduce_scatter sum");
    EXPECT_SAME_BYTES(got[3].data(), reference_reduce(slice, count, dtype, dtype, ReduceOp::kMean).data(), dtype, count,
                      who + "reduce_scatter mean");
    EXPECT_SAME_BYTES(got[4].data(), reference_reduce(slice_in_place, count, dtype, dtype, ReduceOp::kSum).data(), dtype,
                      count, who + "reduce_scatter in place");
    EXPECT_SAME_BYTES(got[5].data(), all_reduce_sum.data(), dtype, count, who + "all_reduce sum");
    EXPECT_SAME_BYTES(got[6].data(), all_reduce_max.data(), dtype, count, who + "all_reduce max");
    EXPECT_SAME_BYTES(got[7].data(), all_reduce_in_place.data(), dtype, total, who + "all_reduce in place");
    EXPECT_SAME_BYTES(got[8].data(), send_of(world - 1), dtype, count, who + "broadcast");
  }

  // Twice more: the same bits every time, whatever the threads' timing.
  for (int repeat = 0; repeat < 2; ++repeat) {
    PassResults again;
    run_pass(again);
    EXPECT_EQ(again, first) << "repeat " << repeat << " differs from the first pass";
  }
}

INSTANTIATE_TEST_SUITE_P(Grid, HostCollectivesTest,
                         ::testing::Combine(::testing::Values(1, 2, 3, 4),
                                            ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                                            ::testing::Values(size_t{1}, size_t{7}, size_t{4097})),
                         [](const ::testing::TestParamInfo<HostCollectivesTest::ParamType>& info) {
                           return "world" + std::to_string(std::get<0>(info.param)) + "_" +
                                  std::string(dtype_name(std::get<1>(info.param))) + "_count" +
                                  std::to_string(std::get<2>(info.param));
                         });

// ---------------------------------------------------------------------------
// Reductions in detail.
// ---------------------------------------------------------------------------

// Large enough that each rank's slice fans out over its device's executor.
TEST(HostCommunicatorTest, LargeReductionsFanOutWithTheSameBits) {
#if defined(STRATA_SANITIZER_THREAD)
  constexpr size_t kCount = 40'000;
#else
  constexpr size_t kCount = 100'003;
#endif
  constexpr int kWorld = 3;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  std::vector<DeviceBuffer> send(kWorld), recv(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    STRATA_ASSERT_OK_AND_ASSIGN(send[rank], (*ranks)[rank].device->allocate(kCount * kWorld * 4, "send"));
    STRATA_ASSERT_OK_AND_ASSIGN(recv[rank], (*ranks)[rank].device->allocate(kCount * kWorld * 4, "recv"));
    fill(send[rank].data(), DType::kFloat32, kCount * kWorld, rank, 3);
  }
  const std::vector<Status> statuses = ranks->run([&](int rank) -> Status {
    Rank& me = (*ranks)[rank];
    STRATA_RETURN_IF_ERROR(
        me.communicator->reduce_scatter(send[rank].data(), recv[rank].data(), kCount, DType::kFloat32, {}, *me.stream));
    STRATA_RETURN_IF_ERROR(me.stream->synchronize());
    std::vector<const std::byte*> slice(kWorld);
    for (int other = 0; other < kWorld; ++other)
      slice[other] = static_cast<const std::byte*>(send[other].data()) + rank * kCount * 4;
    const std::vector<std::byte> expected = reference_reduce(slice, kCount, DType::kFloat32, DType::kFloat32, ReduceOp::kSum);
    if (!first_difference(recv[rank].data(), expected.data(), DType::kFloat32, kCount).empty())
      return InternalError("rank " + std::to_string(rank) + " reduce_scatter: " +
                           first_difference(recv[rank].data(), expected.data(), DType::kFloat32, kCount));
    STRATA_RETURN_IF_ERROR(me.communicator->all_reduce(send[rank].data(), recv[rank].data(), kCount * kWorld,
                                                       DType::kFloat32, {.op = ReduceOp::kMean}, *me.stream));
    STRATA_RETURN_IF_ERROR(me.stream->synchronize());
    std::vector<const std::byte*> whole(kWorld);
    for (int other = 0; other < kWorld; ++other) whole[other] = static_cast<const std::byte*>(send[other].data());
    const std::vector<std::byte> mean = reference_reduce(whole, kCount * kWorld, DType::kFloat32, DType::kFloat32, ReduceOp::kMean);
    if (!first_difference(recv[rank].data(), mean.data(), DType::kFloat32, kCount * kWorld).empty())
      return InternalError("rank " + std::to_string(rank) + " all_reduce mean: " +
                           first_difference(recv[rank].data(), mean.data(), DType::kFloat32, kCount * kWorld));
    return Status::Ok();
  });
  for (const Status& status : statuses) STRATA_EXPECT_OK(status);
}

class WireDtypeTest : public ::testing::TestWithParam<DType> {};

TEST_P(WireDtypeTest, Fp32DataRoundedToTheWireThenSummedInFp32) {
  const DType wire = GetParam();
  constexpr int kWorld = 3;
  constexpr size_t kCount = 4097;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  std::vector<DeviceBuffer> send(kWorld), scattered(kWorld), reduced(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    Device& device = *(*ranks)[rank].device;
    STRATA_ASSERT_OK_AND_ASSIGN(send[rank], device.allocate(kCount * kWorld * 4, "send"));
    STRATA_ASSERT_OK_AND_ASSIGN(scattered[rank], device.allocate(kCount * 4, "scattered"));
    STRATA_ASSERT_OK_AND_ASSIGN(reduced[rank], device.allocate(kCount * kWorld * 4, "reduced"));
    fill(send[rank].data(), DType::kFloat32, kCount * kWorld, rank, 4);  // full fp32 mantissas
  }
  const std::vector<Status> statuses = ranks->run([&](int rank) -> Status {
    Rank& me = (*ranks)[rank];
    STRATA_RETURN_IF_ERROR(me.communicator->reduce_scatter(send[rank].data(), scattered[rank].data(), kCount,
                                                           DType::kFloat32, {.wire_dtype = wire}, *me.stream));
    STRATA_RETURN_IF_ERROR(me.communicator->all_reduce(send[rank].data(), reduced[rank].data(), kCount * kWorld,
                                                       DType::kFloat32, {.op = ReduceOp::kMean, .wire_dtype = wire},
                                                       *me.stream));
    return me.stream->synchronize();
  });
  for (const Status& status : statuses) STRATA_ASSERT_OK(status);

  std::vector<const std::byte*> whole(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) whole[rank] = static_cast<const std::byte*>(send[rank].data());
  const std::vector<std::byte> mean = reference_reduce(whole, kCount * kWorld, DType::kFloat32, wire, ReduceOp::kMean);
  for (int rank = 0; rank < kWorld; ++rank) {
    std::vector<const std::byte*> slice(kWorld);
    for (int other = 0; other < kWorld; ++other) slice[other] = whole[other] + rank * kCount * 4;
    const std::vector<std::byte> sum = reference_reduce(slice, kCount, DType::kFloat32, wire, ReduceOp::kSum);
    EXPECT_SAME_BYTES(scattered[rank].data(), sum.data(), DType::kFloat32, kCount, "reduce_scatter");
    EXPECT_SAME_BYTES(reduced[rank].data(), mean.data(), DType::kFloat32, kCount * kWorld, "all_reduce mean");
    // The wire really rounded: the fp32-wire sum differs somewhere.
    const std::vector<std::byte> exact = reference_reduce(slice, kCount, DType::kFloat32, DType::kFloat32, ReduceOp::kSum);
    EXPECT_NE(std::memcmp(scattered[rank].data(), exact.data(), kCount * 4), 0);
  }
}

INSTANTIATE_TEST_SUITE_P(Wires, WireDtypeTest, ::testing::Values(DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

TEST(HostCommunicatorTest, MaxPropagatesNaN) {
  constexpr int kWorld = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  std::vector<DeviceBuffer> data(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    STRATA_ASSERT_OK_AND_ASSIGN(data[rank], (*ranks)[rank].device->allocate(3 * 4, "data"));
    float* values = data[rank].as<float>();
    values[0] = rank == 0 ? std::nanf("") : 1.0f;  // NaN first
    values[1] = rank == 1 ? std::nanf("") : 5.0f;  // NaN last
    values[2] = rank == 0 ? -0.0f : -1.0f;
  }
  const std::vector<Status> statuses = ranks->run([&](int rank) -> Status {
    Rank& me = (*ranks)[rank];
    STRATA_RETURN_IF_ERROR(me.communicator->all_reduce(data[rank].data(), data[rank].data(), 3, DType::kFloat32,
                                                       {.op = ReduceOp::kMax}, *me.stream));
    return me.stream->synchronize();
  });
  for (const Status& status : statuses) STRATA_ASSERT_OK(status);
  for (int rank = 0; rank < kWorld; ++rank) {
    EXPECT_TRUE(std::isnan(data[rank].as<float>()[0]));
    EXPECT_TRUE(std::isnan(data[rank].as<float>()[1]));
    EXPECT_EQ(data[rank].as<float>()[2], 0.0f);
  }
}

TEST(HostCommunicatorTest, SeveralStreamsPerRankMatchBySequence) {
  // The engine gathers on one stream and reduce-scatters on another: matching is by the
  // order the rank issued them, whichever stream runs first.
  constexpr int kWorld = 3;
  constexpr size_t kCount = 33;
  constexpr int kRounds = 6;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  std::vector<std::unique_ptr<Stream>> second(kWorld);
  std::vector<DeviceBuffer> send(kWorld), gathered(kWorld), scattered(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    Device& device = *(*ranks)[rank].device;
    STRATA_ASSERT_OK_AND_ASSIGN(second[rank], device.create_stream("reduce"));
    STRATA_ASSERT_OK_AND_ASSIGN(send[rank], device.allocate(kCount * kWorld * 4, "send"));
    STRATA_ASSERT_OK_AND_ASSIGN(gathered[rank], device.allocate(kRounds * kCount * kWorld * kWorld * 4, "gathered"));
    STRATA_ASSERT_OK_AND_ASSIGN(scattered[rank], device.allocate(kRounds * kCount * 4, "scattered"));
    fill(send[rank].data(), DType::kFloat32, kCount * kWorld, rank, 5);
  }
  const std::vector<Status> statuses = ranks->run([&](int rank) -> Status {
    Rank& me = (*ranks)[rank];
    for (int round = 0; round < kRounds; ++round) {
      STRATA_RETURN_IF_ERROR(me.communicator->all_gather(
          send[rank].data(), gathered[rank].as<float>() + round * kCount * kWorld * kWorld, kCount * kWorld,
          DType::kFloat32, *me.stream));
      STRATA_RETURN_IF_ERROR(me.communicator->reduce_scatter(send[rank].data(), scattered[rank].as<float>() + round * kCount,
                                                             kCount, DType::kFloat32, {}, *second[rank]));
    }
    STRATA_RETURN_IF_ERROR(me.stream->synchronize());
    return second[rank]->synchronize();
  });
  for (const Status& status : statuses) STRATA_ASSERT_OK(status);
  for (int rank = 0; rank < kWorld; ++rank) {
    std::vector<const std::byte*> slice(kWorld);
    for (int other = 0; other < kWorld; ++other)
      slice[other] = static_cast<const std::byte*>(send[other].data()) + rank * kCount * 4;
    const std::vector<std::byte> sum = reference_reduce(slice, kCount, DType::kFloat32, DType::kFloat32, ReduceOp::kSum);
    for (int round = 0; round < kRounds; ++round) {
      EXPECT_SAME_BYTES(scattered[rank].as<float>() + round * kCount, sum.data(), DType::kFloat32, kCount, "round");
      for (int other = 0; other < kWorld; ++other)
        EXPECT_SAME_BYTES(gathered[rank].as<float>() + (round * kWorld + other) * kCount * kWorld, send[other].data(),
                          DType::kFloat32, kCount * kWorld, "gathered");
    }
  }
}

// ---------------------------------------------------------------------------
// Failures: errors, not hangs.
// ---------------------------------------------------------------------------

TEST(HostCommunicatorTest, RankThatNeverArrivesTimesOutNamingItAndTheOp) {
  constexpr int kWorld = 3;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld, milliseconds(1000)));
  std::vector<DeviceBuffer> data(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    STRATA_ASSERT_OK_AND_ASSIGN(data[rank], (*ranks)[rank].device->allocate(7 * kWorld * 4, "data"));
  }
  // Ranks 0 and 1 all-gather; rank 2 never does.
  const std::vector<Status> statuses = ranks->run([&](int rank) -> Status {
    if (rank == 2) return Status::Ok();
    Rank& me = (*ranks)[rank];
    STRATA_RETURN_IF_ERROR(me.communicator->all_gather(data[rank].data(), data[rank].data(), 7, DType::kFloat32, *me.stream));
    return me.stream->synchronize();
  });
  for (int rank = 0; rank < 2; ++rank) {
    const Status& status = statuses[rank];
    ASSERT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.to_string();
    EXPECT_NE(status.message().find("all_gather #0"), std::string::npos) << status.to_string();
    // "rank 2 of 3 did not arrive" ("ranks 1, 2 of 3" if rank 1 was too slow to start).
    EXPECT_NE(status.message().find("2 of 3 did not arrive"), std::string::npos) << status.to_string();
  }
  // The group is aborted: later operations fail at once, on every rank.
  Rank& late = (*ranks)[2];
  const Status later = late.communicator->barrier(*late.stream);
  EXPECT_EQ(later.code(), StatusCode::kDeadlineExceeded) << later.to_string();
  EXPECT_FALSE(late.communicator->async_error().ok());
}

TEST(HostCommunicatorTest, AbortFailsPendingOperations) {
  constexpr int kWorld = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  Rank& rank0 = (*ranks)[0];
  STRATA_ASSERT_OK(rank0.communicator->barrier(*rank0.stream));  // rank 1 never comes
  ranks->group->abort("operator pressed stop");
  const Status status = rank0.stream->synchronize();
  ASSERT_EQ(status.code(), StatusCode::kCancelled) << status.to_string();
  EXPECT_NE(status.message().find("operator pressed stop"), std::string::npos) << status.to_string();
  EXPECT_NE(status.message().find("barrier #0"), std::string::npos) << status.to_string();
  EXPECT_EQ(rank0.communicator->async_error().code(), StatusCode::kCancelled);
}

TEST(HostCommunicatorTest, DestroyedRankFailsTheOthersInsteadOfHanging) {
  constexpr int kWorld = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  // Both do one barrier; then rank 1 goes away and rank 0 issues another.
  for (int rank = 0; rank < kWorld; ++rank) STRATA_ASSERT_OK((*ranks)[rank].communicator->barrier(*(*ranks)[rank].stream));
  STRATA_ASSERT_OK((*ranks)[1].stream->synchronize());
  (*ranks)[1].communicator.reset();
  STRATA_ASSERT_OK((*ranks)[0].communicator->barrier(*(*ranks)[0].stream));
  const Status status = (*ranks)[0].stream->synchronize();
  ASSERT_EQ(status.code(), StatusCode::kUnavailable) << status.to_string();
  EXPECT_NE(status.message().find("barrier #1"), std::string::npos) << status.to_string();
  EXPECT_NE(status.message().find("rank 1's communicator was destroyed after it had issued 1"), std::string::npos)
      << status.to_string();
}

TEST(HostCommunicatorTest, CollectiveSkippedByAFailedStreamAbortsTheGroup) {
  constexpr int kWorld = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  Rank& rank1 = (*ranks)[1];
  // An earlier kernel on rank 1's stream fails, so the stream skips the barrier after it.
  STRATA_ASSERT_OK(rank1.stream->launch([](const LaunchContext&) { return InternalError("kernel exploded"); }));
  STRATA_ASSERT_OK(rank1.communicator->barrier(*rank1.stream));
  // Rank 0 learns at enqueue or at synchronize, depending on when rank 1's stream drops it.
  Status rank0_status = (*ranks)[0].communicator->barrier(*(*ranks)[0].stream);
  if (rank0_status.ok()) rank0_status = (*ranks)[0].stream->synchronize();
  ASSERT_EQ(rank0_status.code(), StatusCode::kCancelled) << rank0_status.to_string();
  EXPECT_NE(rank0_status.message().find("rank 1's barrier #0"), std::string::npos) << rank0_status.to_string();
  EXPECT_NE(rank1.stream->synchronize().message().find("kernel exploded"), std::string::npos);
}

TEST(HostCommunicatorTest, TwoRanksOnOneStreamIsAnErrorNotAHang) {
  STRATA_ASSERT_OK_AND_ASSIGN(HostCommunicatorGroup group, HostCommunicatorGroup::create({.world_size = 2}));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, create_cpu_device({}));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, device->create_stream("shared"));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostCommunicator> rank0, group.communicator(0, *device));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostCommunicator> rank1, group.communicator(1, *device));
  STRATA_ASSERT_OK(rank0->barrier(*stream));
  Status status = rank1->barrier(*stream);
  if (status.ok()) status = stream->synchronize();
  ASSERT_EQ(status.code(), StatusCode::kFailedPrecondition) << status.to_string();
  EXPECT_NE(status.message().find("same stream 'shared'"), std::string::npos) << status.to_string();
}

TEST(HostCommunicatorTest, MismatchedCollectivesNameBothCalls) {
  constexpr int kWorld = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  std::vector<DeviceBuffer> data(kWorld);
  for (int rank = 0; rank < kWorld; ++rank) {
    STRATA_ASSERT_OK_AND_ASSIGN(data[rank], (*ranks)[rank].device->allocate(16 * kWorld * 4, "data"));
  }
  const std::vector<Status> statuses = ranks->run([&](int rank) -> Status {
    Rank& me = (*ranks)[rank];
    const size_t count = rank == 0 ? 7 : 8;
    STRATA_RETURN_IF_ERROR(me.communicator->all_gather(data[rank].data(), data[rank].data(), count, DType::kFloat32, *me.stream));
    return me.stream->synchronize();
  });
  for (const Status& status : statuses) {
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find("all_gather(count 7, fp32)"), std::string::npos) << status.to_string();
    EXPECT_NE(status.message().find("all_gather(count 8, fp32)"), std::string::npos) << status.to_string();
  }
}

TEST(HostCommunicatorTest, RejectsBadArgumentsAndAbortsTheGroup) {
  constexpr int kWorld = 2;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld));
  Rank& rank0 = (*ranks)[0];
  DeviceBuffer buffer;
  STRATA_ASSERT_OK_AND_ASSIGN(buffer, rank0.device->allocate(64, "buffer"));
  const Status wrong_wire = rank0.communicator->all_reduce(buffer.data(), buffer.data(), 4, DType::kBFloat16,
                                                           {.wire_dtype = DType::kFloat32}, *rank0.stream);
  EXPECT_EQ(wrong_wire.code(), StatusCode::kInvalidArgument) << wrong_wire.to_string();
  EXPECT_NE(wrong_wire.message().find("bf16 data cannot travel as fp32"), std::string::npos) << wrong_wire.to_string();
  // Rank 1 learns why its next collective cannot run.
  Rank& rank1 = (*ranks)[1];
  const Status rank1_status = rank1.communicator->barrier(*rank1.stream);
  EXPECT_NE(rank1_status.message().find("bf16 data cannot travel as fp32"), std::string::npos) << rank1_status.to_string();
}

TEST(HostCommunicatorTest, GroupRules) {
  EXPECT_FALSE(HostCommunicatorGroup::create({.world_size = 0}).ok());
  STRATA_ASSERT_OK_AND_ASSIGN(HostCommunicatorGroup group, HostCommunicatorGroup::create({.world_size = 2}));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, create_cpu_device({}));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<HostCommunicator> rank0, group.communicator(0, *device));
  EXPECT_EQ(group.communicator(0, *device).status().code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(group.communicator(2, *device).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(rank0->rank(), 0);
  EXPECT_EQ(rank0->world_size(), 2);
  EXPECT_EQ(rank0->backend_name(), "host");
  // A stream of another device is refused.
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> other, create_cpu_device({}));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> foreign, other->create_stream("foreign"));
  EXPECT_EQ(rank0->barrier(*foreign).code(), StatusCode::kInvalidArgument);
}

TEST(CommunicatorTest, WireDtypeRules) {
  EXPECT_EQ(*resolve_wire_dtype(DType::kFloat32, {}), DType::kFloat32);
  EXPECT_EQ(*resolve_wire_dtype(DType::kFloat32, {.wire_dtype = DType::kBFloat16}), DType::kBFloat16);
  EXPECT_EQ(*resolve_wire_dtype(DType::kFloat32, {.wire_dtype = DType::kFloat16}), DType::kFloat16);
  EXPECT_EQ(*resolve_wire_dtype(DType::kBFloat16, {.wire_dtype = DType::kBFloat16}), DType::kBFloat16);
  EXPECT_FALSE(resolve_wire_dtype(DType::kBFloat16, {.wire_dtype = DType::kFloat16}).ok());
  EXPECT_FALSE(resolve_wire_dtype(DType::kFloat16, {.wire_dtype = DType::kFloat32}).ok());
}

// ---------------------------------------------------------------------------
// NcclCommunicator: the same reference, on every GPU of the machine (one process,
// one thread per rank). With one GPU this is a world of one.
// ---------------------------------------------------------------------------
// The test exists in every build (it skips with the reason where there is no CUDA or no
// GPU), so scripts/gpu-check can tell a missing test from a skipped one.

class NcclCollectivesTest : public ::testing::TestWithParam<DType> {};

TEST_P(NcclCollectivesTest, MatchesTheSerialReference) {
  if (!gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
#if !defined(STRATA_HAVE_CUDA)
  GTEST_SKIP() << "built without CUDA (STRATA_WITH_CUDA=OFF, or no nvcc or NCCL at configure time)";
#else
  const DType dtype = GetParam();
  const int world = discover_gpus().device_count;
  const size_t element = dtype_size(dtype);
  std::vector<std::unique_ptr<Device>> devices;
  std::vector<std::unique_ptr<Stream>> streams;
  std::vector<Device*> device_pointers;
  for (int rank = 0; rank < world; ++rank) {
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device,
                                create_cuda_device({.ordinal = rank, .budget_bytes = size_t{256} << 20}));
    STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, device->create_stream("nccl"));
    device_pointers.push_back(device.get());
    devices.push_back(std::move(device));
    streams.push_back(std::move(stream));
  }
  STRATA_ASSERT_OK_AND_ASSIGN(std::vector<std::unique_ptr<NcclCommunicator>> communicators,
                              NcclCommunicator::create_local(device_pointers, {.timeout = milliseconds(60000)}));

  for (const size_t count : {size_t{1}, size_t{7}, size_t{4097}}) {
    const size_t total = count * static_cast<size_t>(world);
    std::vector<std::vector<std::byte>> host_send(static_cast<size_t>(world));
    for (int rank = 0; rank < world; ++rank) {
      host_send[rank].resize(total * element);
      fill(host_send[rank].data(), dtype, total, rank, 7);
    }
    // Per rank, the downloaded results: all_gather, reduce_scatter sum, reduce_scatter
    // mean, all_reduce max, all_reduce sum, broadcast, fp32 reduce_scatter with bf16 wire.
    std::vector<std::vector<std::vector<std::byte>>> results(static_cast<size_t>(world));
    std::vector<Status> statuses(static_cast<size_t>(world));
    std::vector<std::thread> threads;
    for (int rank = 0; rank < world; ++rank) {
      threads.emplace_back([&, rank] {
        statuses[rank] = [&]() -> Status {
          Device& device = *devices[rank];
          Stream& stream = *streams[rank];
          NcclCommunicator& comm = *communicators[rank];
          STRATA_ASSIGN_OR_RETURN(DeviceBuffer send, device.allocate(total * element, "send"));
          STRATA_ASSIGN_OR_RETURN(DeviceBuffer recv, device.allocate(total * element, "recv"));
          STRATA_ASSIGN_OR_RETURN(DeviceBuffer fp32_send, device.allocate(total * 4, "fp32 send"));
          STRATA_ASSIGN_OR_RETURN(DeviceBuffer fp32_recv, device.allocate(count * 4, "fp32 recv"));
          std::vector<float> fp32_values(total);
          for (size_t i = 0; i < total; ++i) fp32_values[i] = test_value(rank, i, 8);
          STRATA_RETURN_IF_ERROR(device.copy_async(send.data(), host_send[rank].data(), total * element,
                                                   CopyKind::kHostToDevice, stream));
          STRATA_RETURN_IF_ERROR(
              device.copy_async(fp32_send.data(), fp32_values.data(), total * 4, CopyKind::kHostToDevice, stream));
          const auto download = [&](const DeviceBuffer& buffer, size_t bytes) -> Status {
            std::vector<std::byte> host(bytes);
            STRATA_RETURN_IF_ERROR(device.copy_async(host.data(), buffer.data(), bytes, CopyKind::kDeviceToHost, stream));
            STRATA_RETURN_IF_ERROR(stream.synchronize());
            results[rank].push_back(std::move(host));
            return Status::Ok();
          };
          STRATA_RETURN_IF_ERROR(comm.all_gather(send.data(), recv.data(), count, dtype, stream));
          STRATA_RETURN_IF_ERROR(download(recv, total * element));
          STRATA_RETURN_IF_ERROR(comm.reduce_scatter(send.data(), recv.data(), count, dtype, {}, stream));
          STRATA_RETURN_IF_ERROR(download(recv, count * element));
          STRATA_RETURN_IF_ERROR(comm.reduce_scatter(send.data(), recv.data(), count, dtype, {.op = ReduceOp::kMean}, stream));
          STRATA_RETURN_IF_ERROR(download(recv, count * element));
          STRATA_RETURN_IF_ERROR(comm.all_reduce(send.data(), recv.data(), total, dtype, {.op = ReduceOp::kMax}, stream));
          STRATA_RETURN_IF_ERROR(download(recv, total * element));
          STRATA_RETURN_IF_ERROR(comm.all_reduce(send.data(), recv.data(), total, dtype, {}, stream));
          STRATA_RETURN_IF_ERROR(download(recv, total * element));
          STRATA_RETURN_IF_ERROR(comm.broadcast(send.data(), recv.data(), count, dtype, world - 1, stream));
          STRATA_RETURN_IF_ERROR(download(recv, count * element));
          STRATA_RETURN_IF_ERROR(comm.reduce_scatter(fp32_send.data(), fp32_recv.data(), count, DType::kFloat32,
                                                     {.wire_dtype = DType::kBFloat16}, stream));
          STRATA_RETURN_IF_ERROR(download(fp32_recv, count * 4));
          STRATA_RETURN_IF_ERROR(comm.barrier(stream));
          STRATA_RETURN_IF_ERROR(stream.synchronize());
          return comm.async_error();
        }();
      });
    }
    for (std::thread& thread : threads) thread.join();
    for (const Status& status : statuses) STRATA_ASSERT_OK(status);

    std::vector<const std::byte*> whole(static_cast<size_t>(world));
    std::vector<std::vector<float>> fp32_inputs(static_cast<size_t>(world));
    for (int rank = 0; rank < world; ++rank) {
      whole[rank] = host_send[rank].data();
      for (size_t i = 0; i < total; ++i) fp32_inputs[rank].push_back(test_value(rank, i, 8));
    }
    std::vector<std::byte> gathered(total * element);
    for (int rank = 0; rank < world; ++rank)
      std::memcpy(gathered.data() + rank * count * element, host_send[rank].data(), count * element);
    // NCCL's native fp32 sum has its own order: compare it within rounding, the rest bit for bit.
    const bool native_sum = dtype == DType::kFloat32;
    const auto expect_close = [&](const std::vector<std::byte>& got, const std::vector<std::byte>& expected, size_t n,
                                  const std::string& what) {
      if (!native_sum) {
        EXPECT_SAME_BYTES(got.data(), expected.data(), dtype, n, what);
        return;
      }
      for (size_t i = 0; i < n; ++i) {
        const float a = load_as_float(got.data(), dtype, i), b = load_as_float(expected.data(), dtype, i);
        ASSERT_NEAR(a, b, 1e-5f * (std::fabs(b) + 1.0f)) << what << " element " << i;
      }
    };
    for (int rank = 0; rank < world; ++rank) {
      const auto& got = results[rank];
      ASSERT_EQ(got.size(), 7u);
      std::vector<const std::byte*> slice(static_cast<size_t>(world)), fp32_slice(static_cast<size_t>(world));
      for (int other = 0; other < world; ++other) {
        slice[other] = whole[other] + rank * count * element;
        fp32_slice[other] = reinterpret_cast<const std::byte*>(fp32_inputs[other].data() + rank * count);
      }
      const std::string who = "count " + std::to_string(count) + " rank " + std::to_string(rank) + ": ";
      EXPECT_SAME_BYTES(got[0].data(), gathered.data(), dtype, total, who + "all_gather");
      expect_close(got[1], reference_reduce(slice, count, dtype, dtype, ReduceOp::kSum), count, who + "reduce_scatter sum");
      expect_close(got[2], reference_reduce(slice, count, dtype, dtype, ReduceOp::kMean), count, who + "reduce_scatter mean");
      EXPECT_SAME_BYTES(got[3].data(), reference_reduce(whole, total, dtype, dtype, ReduceOp::kMax).data(), dtype, total,
                        who + "all_reduce max");
      expect_close(got[4], reference_reduce(whole, total, dtype, dtype, ReduceOp::kSum), total, who + "all_reduce sum");
      EXPECT_SAME_BYTES(got[5].data(), host_send[world - 1].data(), dtype, count, who + "broadcast");
      EXPECT_SAME_BYTES(got[6].data(),
                        reference_reduce(fp32_slice, count, DType::kFloat32, DType::kBFloat16, ReduceOp::kSum).data(),
                        DType::kFloat32, count, who + "fp32 reduce_scatter with a bf16 wire");
    }
  }
  STRATA_EXPECT_OK(NcclCommunicator::destroy_all(std::move(communicators)));
#endif  // STRATA_HAVE_CUDA
}

INSTANTIATE_TEST_SUITE_P(Dtypes, NcclCollectivesTest,
                         ::testing::Values(DType::kFloat32, DType::kBFloat16, DType::kFloat16),
                         [](const ::testing::TestParamInfo<DType>& info) { return std::string(dtype_name(info.param)); });

}  // namespace
}  // namespace strata
