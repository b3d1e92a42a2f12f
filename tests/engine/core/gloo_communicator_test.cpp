#include "engine/core/gloo_communicator.h"

#include <sys/wait.h>
#include <unistd.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <optional>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/host_communicator.h"
#include "tests/support/test_support.h"

extern char** environ;

namespace strata {
namespace {

using std::chrono::milliseconds;
using Clock = std::chrono::steady_clock;

// ---------------------------------------------------------------------------
// Ranks as threads of this process, each with its own Rendezvous and GlooCommunicator
// over 127.0.0.1, and (for comparison) a HostCommunicator of the same world.
// ---------------------------------------------------------------------------

RendezvousOptions loopback_options(int rank, int world_size, uint16_t port) {
  RendezvousOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.local_rank = rank;
  options.master_addr = "127.0.0.1";
  options.master_port = port;
  options.timeout = milliseconds(60000);
  return options;
}

struct Rank {
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> gloo_stream;
  std::unique_ptr<Stream> host_stream;
  std::optional<Rendezvous> rendezvous;
  std::unique_ptr<GlooCommunicator> gloo;
  std::unique_ptr<HostCommunicator> host;
};

// Runs body(rank) on one thread per rank; returns each rank's status.
std::vector<Status> run_ranks(int world_size, const std::function<Status(int)>& body) {
  std::vector<Status> statuses(static_cast<size_t>(world_size));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < world_size; ++rank)
    threads.emplace_back([&, rank] { statuses[static_cast<size_t>(rank)] = body(rank); });
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

class Ranks {
 public:
  static StatusOr<std::unique_ptr<Ranks>> create(int world_size, milliseconds timeout) {
    auto ranks = std::make_unique<Ranks>();
    ranks->ranks.resize(static_cast<size_t>(world_size));
    STRATA_ASSIGN_OR_RETURN(Rendezvous root, Rendezvous::start(loopback_options(0, world_size, 0)));
    const uint16_t port = root.port();
    ranks->ranks[0].rendezvous.emplace(std::move(root));
    STRATA_ASSIGN_OR_RETURN(HostCommunicatorGroup group, HostCommunicatorGroup::create({.world_size = world_size}));
    for (Status& status : run_ranks(world_size, [&](int rank) -> Status {
           Rank& entry = ranks->ranks[static_cast<size_t>(rank)];
           if (rank != 0) {
             STRATA_ASSIGN_OR_RETURN(Rendezvous rendezvous, Rendezvous::start(loopback_options(rank, world_size, port)));
             entry.rendezvous.emplace(std::move(rendezvous));
           }
           STRATA_RETURN_IF_ERROR(entry.rendezvous->join());
           CpuDeviceOptions options;
           options.ordinal = rank;
           options.budget_bytes = size_t{64} << 20;
           options.compute.threads = 1;
           STRATA_ASSIGN_OR_RETURN(entry.device, create_cpu_device(options));
           STRATA_ASSIGN_OR_RETURN(entry.gloo_stream, entry.device->create_stream("gloo"));
           STRATA_ASSIGN_OR_RETURN(entry.host_stream, entry.device->create_stream("host"));
           STRATA_ASSIGN_OR_RETURN(entry.gloo, GlooCommunicator::create(*entry.rendezvous, *entry.device, {.timeout = timeout}));
           return Status::Ok();
         }))
      STRATA_RETURN_IF_ERROR(status);
    for (int rank = 0; rank < world_size; ++rank) {
      Rank& entry = ranks->ranks[static_cast<size_t>(rank)];
      STRATA_ASSIGN_OR_RETURN(entry.host, group.communicator(rank, *entry.device));
    }
    return ranks;
  }
  ~Ranks() {
    // Communicators before the devices their streams belong to.
    for (Rank& rank : ranks) {
      rank.gloo.reset();
      rank.host.reset();
      rank.gloo_stream.reset();
      rank.host_stream.reset();
    }
  }
  Rank& operator[](int rank) { return ranks[static_cast<size_t>(rank)]; }
  std::vector<Rank> ranks;
};

// A value for (rank, index, salt) with varied signs, exponents and low mantissa bits, so
// that rounding and summation order matter.
float test_value(int rank, size_t index, uint32_t salt) {
  uint64_t x = (static_cast<uint64_t>(rank) << 40) ^ (static_cast<uint64_t>(index) << 8) ^ salt;
  x ^= x >> 33;
  x *= 0xff51afd7ed558ccdULL;
  x ^= x >> 33;
  const float mantissa = 1.0f + static_cast<float>(x & 0xffffff) / 16777216.0f;
  const int exponent = static_cast<int>((x >> 24) % 9) - 4;
  const float sign = (x >> 40) & 1 ? -1.0f : 1.0f;
  return sign * std::ldexp(mantissa, exponent);
}

std::vector<std::byte> filled(DType dtype, size_t count, int rank, uint32_t salt) {
  std::vector<std::byte> data(count * dtype_size(dtype));
  for (size_t i = 0; i < count; ++i) store_from_float(data.data(), dtype, i, test_value(rank, i, salt));
  return data;
}

struct ReductionCase {
  DType dtype;
  std::optional<DType> wire;
};

const ReductionCase kReductionCases[] = {{DType::kFloat32, std::nullopt},
                                         {DType::kFloat32, DType::kBFloat16},
                                         {DType::kFloat32, DType::kFloat16},
                                         {DType::kBFloat16, std::nullopt},
                                         {DType::kFloat16, std::nullopt}};
const size_t kCounts[] = {1, 7, 22, 55, 4097};
enum class Placement { kSeparate, kInPlace };

// Runs the same collective through Gloo and HostCommunicator on one rank; `issue` gets
// the communicator, its stream and the buffers.
using Issue = std::function<Status(Communicator&, Stream&, std::byte* send, std::byte* recv)>;
Status compare_on_rank(Rank& rank, std::vector<std::byte> send, size_t recv_bytes, size_t recv_offset_in_send,
                       Placement placement, const Issue& issue, const std::string& what) {
  std::vector<std::byte> gloo_send = send;
  std::vector<std::byte> host_send = send;
  std::vector<std::byte> gloo_recv(recv_bytes), host_recv(recv_bytes);
  std::byte* gloo_out = placement == Placement::kInPlace ? gloo_send.data() + recv_offset_in_send : gloo_recv.data();
  std::byte* host_out = placement == Placement::kInPlace ? host_send.data() + recv_offset_in_send : host_recv.data();
  STRATA_RETURN_IF_ERROR(issue(*rank.gloo, *rank.gloo_stream, gloo_send.data(), gloo_out));
  STRATA_RETURN_IF_ERROR(issue(*rank.host, *rank.host_stream, host_send.data(), host_out));
  STRATA_RETURN_IF_ERROR(rank.gloo_stream->synchronize());
  STRATA_RETURN_IF_ERROR(rank.host_stream->synchronize());
  if (std::memcmp(gloo_out, host_out, recv_bytes) != 0)
    return InternalError("rank " + std::to_string(rank.gloo->rank()) + ": " + what + ": Gloo and HostCommunicator differ");
  return Status::Ok();
}

Status every_collective_on_rank(Rank& rank, int world) {
  const int me = rank.gloo->rank();
  const size_t n = static_cast<size_t>(world);
  uint32_t salt = 1;
  for (size_t count : kCounts) {
    for (DType dtype : {DType::kFloat32, DType::kBFloat16, DType::kFloat16}) {
      const size_t element = dtype_size(dtype);
      const std::string suffix = " of " + std::to_string(count) + " " + std::string(dtype_name(dtype));
      STRATA_RETURN_IF_ERROR(compare_on_rank(
          rank, filled(dtype, count, me, ++salt), n * count * element, 0, Placement::kSeparate,
          [&](Communicator& c, Stream& s, std::byte* send, std::byte* recv) { return c.all_gather(send, recv, count, dtype, s); },
          "all_gather" + suffix));
      STRATA_RETURN_IF_ERROR(compare_on_rank(
          rank, filled(dtype, count, me, ++salt), count * element, 0, Placement::kSeparate,
          [&](Communicator& c, Stream& s, std::byte* send, std::byte* recv) {
            return c.broadcast(send, recv, count, dtype, world - 1, s);
          },
          "broadcast" + suffix));
    }
    for (const ReductionCase& reduction : kReductionCases) {
      const size_t element = dtype_size(reduction.dtype);
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMean, ReduceOp::kMax}) {
        const ReduceOptions options{.op = op, .wire_dtype = reduction.wire};
        for (Placement placement : {Placement::kSeparate, Placement::kInPlace}) {
          const std::string suffix = " of " + std::to_string(count) + " " + std::string(dtype_name(reduction.dtype)) +
                                     " " + std::string(reduce_op_name(op)) + " wire " +
                                     std::string(dtype_name(reduction.wire.value_or(reduction.dtype))) +
                                     (placement == Placement::kInPlace ? " in place" : "");
          STRATA_RETURN_IF_ERROR(compare_on_rank(
              rank, filled(reduction.dtype, n * count, me, ++salt), count * element, static_cast<size_t>(me) * count * element,
              placement,
              [&](Communicator& c, Stream& s, std::byte* send, std::byte* recv) {
                return c.reduce_scatter(send, recv, count, reduction.dtype, options, s);
              },
              "reduce_scatter" + suffix));
          STRATA_RETURN_IF_ERROR(compare_on_rank(
              rank, filled(reduction.dtype, count, me, ++salt), count * element, 0, placement,
              [&](Communicator& c, Stream& s, std::byte* send, std::byte* recv) {
                return c.all_reduce(send, recv, count, reduction.dtype, options, s);
              },
              "all_reduce" + suffix));
        }
      }
    }
  }
  STRATA_RETURN_IF_ERROR(rank.gloo->barrier(*rank.gloo_stream));
  return rank.gloo_stream->synchronize();
}

class GlooCommunicatorWorldTest : public ::testing::TestWithParam<int> {};

TEST_P(GlooCommunicatorWorldTest, EveryCollectiveIsBitIdenticalToHostCommunicator) {
  const int world = GetParam();
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(world, milliseconds(60000)));
  EXPECT_EQ((*ranks)[0].gloo->backend_name(), "gloo");
  EXPECT_EQ((*ranks)[0].gloo->listen_address(), "127.0.0.1");
  for (const Status& status : run_ranks(world, [&](int rank) { return every_collective_on_rank((*ranks)[rank], world); }))
    STRATA_EXPECT_OK(status);
}

INSTANTIATE_TEST_SUITE_P(Worlds, GlooCommunicatorWorldTest, ::testing::Values(1, 2, 3));

// ---------------------------------------------------------------------------
// Failures: a lost rank is named, within the timeout; abort ends waits.
// ---------------------------------------------------------------------------

// Every rank but `absent` all-reduces; returns their statuses (absent's is OK).
std::vector<Status> all_reduce_without(Ranks& ranks, int world, int absent, const std::function<void()>& absent_does) {
  std::vector<std::vector<float>> data(static_cast<size_t>(world), std::vector<float>(1000, 1.0f));
  return run_ranks(world, [&](int rank) -> Status {
    if (rank == absent) {
      absent_does();
      return Status::Ok();
    }
    Rank& entry = ranks[rank];
    float* buffer = data[static_cast<size_t>(rank)].data();
    STRATA_RETURN_IF_ERROR(entry.gloo->all_reduce(buffer, buffer, 1000, DType::kFloat32, {}, *entry.gloo_stream));
    return entry.gloo_stream->synchronize();
  });
}

TEST(GlooCommunicatorTest, RankThatLeavesMidCollectiveIsNamedLongBeforeTheTimeout) {
  constexpr int kWorld = 3;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld, milliseconds(30000)));
  const auto start = Clock::now();
  const std::vector<Status> statuses = all_reduce_without(*ranks, kWorld, 2, [&] {
    std::this_thread::sleep_for(milliseconds(200));  // the others are waiting in the collective by now
    (*ranks)[2].gloo.reset();                          // its connections close, as when a process exits
  });
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  for (int rank : {0, 1}) {
    const Status& status = statuses[static_cast<size_t>(rank)];
    ASSERT_EQ(status.code(), StatusCode::kUnavailable) << status.to_string();
    EXPECT_NE(status.message().find("rank 2 closed its connection during all_reduce #0"), std::string::npos)
        << status.to_string();
    EXPECT_EQ((*ranks)[rank].gloo->async_error().code(), StatusCode::kUnavailable);
  }
  // A failed communicator refuses later operations at once.
  float value = 0;
  const Status later = (*ranks)[0].gloo->all_reduce(&value, &value, 1, DType::kFloat32, {}, *(*ranks)[0].gloo_stream);
  EXPECT_FALSE(later.ok());
}

TEST(GlooCommunicatorTest, RankThatNeverArrivesTimesOutNamingIt) {
  constexpr int kWorld = 3;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(kWorld, milliseconds(1000)));
  const auto start = Clock::now();
  const std::vector<Status> statuses =
      all_reduce_without(*ranks, kWorld, 1, [] { std::this_thread::sleep_for(milliseconds(1500)); });
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  for (int rank : {0, 2}) {
    const Status& status = statuses[static_cast<size_t>(rank)];
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find("rank 1"), std::string::npos) << status.to_string();
  }
  EXPECT_EQ(statuses[0].code(), StatusCode::kDeadlineExceeded) << statuses[0].to_string();
}

TEST(GlooCommunicatorTest, AbortEndsThisRanksWait) {
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(2, milliseconds(30000)));
  const auto start = Clock::now();
  // Rank 0 waits in the collective for rank 1, which aborts rank 0 instead of coming.
  const std::vector<Status> statuses = all_reduce_without(*ranks, 2, 1, [&] {
    std::this_thread::sleep_for(milliseconds(200));
    (*ranks)[0].gloo->abort("test abort");
  });
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  EXPECT_EQ(statuses[0].code(), StatusCode::kCancelled) << statuses[0].to_string();
  EXPECT_NE(statuses[0].message().find("test abort"), std::string::npos) << statuses[0].to_string();
  EXPECT_EQ((*ranks)[0].gloo->async_error().code(), StatusCode::kCancelled);
}

TEST(GlooCommunicatorTest, AbortedRankFailsItsWaitingPeersAtOnce) {
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Ranks> ranks, Ranks::create(2, milliseconds(30000)));
  const auto start = Clock::now();
  const std::vector<Status> statuses = all_reduce_without(*ranks, 2, 0, [&] {
    std::this_thread::sleep_for(milliseconds(200));
    (*ranks)[0].gloo->abort("test abort");
  });
  EXPECT_LT(Clock::now() - start, std::chrono::seconds(10));
  ASSERT_EQ(statuses[1].code(), StatusCode::kUnavailable) << statuses[1].to_string();
  EXPECT_NE(statuses[1].message().find("rank 0 closed its connection during all_reduce #0"), std::string::npos)
      << statuses[1].to_string();
}

TEST(GlooCommunicatorTest, CreateRejectsAnUnjoinedRendezvous) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous rendezvous, Rendezvous::start(loopback_options(0, 2, 0)));
  CpuDeviceOptions options;
  options.budget_bytes = size_t{1} << 20;
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, create_cpu_device(options));
  const StatusOr<std::unique_ptr<GlooCommunicator>> communicator = GlooCommunicator::create(rendezvous, *device);
  ASSERT_FALSE(communicator.ok());
  EXPECT_EQ(communicator.status().code(), StatusCode::kFailedPrecondition);
}

// ---------------------------------------------------------------------------
// Two processes: this binary re-executes itself as rank 1, which all-reduces once and
// then exits without a word in the middle of the second collective.
// ---------------------------------------------------------------------------

constexpr const char* kChildVariable = "STRATA_GLOO_TEST_CHILD";
constexpr size_t kProcessCount = 4097;

// Both ranks' inputs are known to both: the expected sum is computed locally.
std::vector<float> process_input(int rank) {
  std::vector<float> data(kProcessCount);
  for (size_t i = 0; i < kProcessCount; ++i) data[i] = test_value(rank, i, 77);
  return data;
}

Status all_reduce_once(GlooCommunicator& communicator, Stream& stream, std::vector<float>* data) {
  STRATA_RETURN_IF_ERROR(communicator.all_reduce(data->data(), data->data(), data->size(), DType::kFloat32, {}, stream));
  STRATA_RETURN_IF_ERROR(stream.synchronize());
  const std::vector<float> first = process_input(0), second = process_input(1);
  for (size_t i = 0; i < data->size(); ++i)
    if (const float expected = first[i] + second[i]; std::memcmp(&(*data)[i], &expected, sizeof(float)) != 0)
      return InternalError("element " + std::to_string(i) + " differs from rank 0 + rank 1");
  return Status::Ok();
}

// The child's side of TwoProcessesReduceAndALostProcessIsNamed; skipped unless run as that child.
TEST(GlooCommunicatorChildProcess, ReduceOnceThenExit) {
  if (std::getenv(kChildVariable) == nullptr) GTEST_SKIP() << "runs only as the child of TwoProcessesReduceAndALostProcessIsNamed";
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env());
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous rendezvous, Rendezvous::create(options));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Device> device, create_cpu_device({}));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Stream> stream, device->create_stream("gloo"));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<GlooCommunicator> gloo, GlooCommunicator::create(rendezvous, *device));
  std::vector<float> data = process_input(1);
  STRATA_ASSERT_OK(all_reduce_once(*gloo, *stream, &data));
  std::this_thread::sleep_for(milliseconds(300));  // rank 0 is waiting in the second all_reduce by now
  ::_exit(0);                                       // no destructor, no goodbye: as a killed process
}

TEST(GlooCommunicatorTest, TwoProcessesReduceAndALostProcessIsNamed) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous rendezvous, Rendezvous::start(loopback_options(0, 2, 0)));
  std::vector<std::string> environment = {"RANK=1", "WORLD_SIZE=2", "LOCAL_RANK=1", "MASTER_ADDR=127.0.0.1",
                                          "MASTER_PORT=" + std::to_string(rendezvous.port()),
                                          std::string(kChildVariable) + "=1"};
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const std::string name = text.substr(0, text.find('='));
    if (name != "RANK" && name != "WORLD_SIZE" && name != "LOCAL_RANK" && name != "MASTER_ADDR" &&
        name != "MASTER_PORT" && name != kChildVariable)
      environment.push_back(text);
  }
  std::vector<char*> envp;
  for (std::string& entry : environment) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::string program = "/proc/self/exe";
  std::string filter = "--gtest_filter=GlooCommunicatorChildProcess.ReduceOnceThenExit";
  std::vector<char*> argv = {program.data(), filter.data(), nullptr};
  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    ::execve(program.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }

  Status status = rendezvous.join();
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> stream;
  std::unique_ptr<GlooCommunicator> gloo;
  if (status.ok()) {
    StatusOr<std::unique_ptr<Device>> made = create_cpu_device({});
    status = made.status();
    if (made.ok()) device = *std::move(made);
  }
  if (status.ok()) {
    StatusOr<std::unique_ptr<Stream>> made = device->create_stream("gloo");
    status = made.status();
    if (made.ok()) stream = *std::move(made);
  }
  if (status.ok()) {
    StatusOr<std::unique_ptr<GlooCommunicator>> made =
        GlooCommunicator::create(rendezvous, *device, {.timeout = milliseconds(30000)});
    status = made.status();
    if (made.ok()) gloo = *std::move(made);
  }
  std::vector<float> data = process_input(0);
  const Status first = status.ok() ? all_reduce_once(*gloo, *stream, &data) : status;
  const auto start = Clock::now();
  const Status second = first.ok() ? all_reduce_once(*gloo, *stream, &data) : first;
  const auto waited = Clock::now() - start;

  int wait_status = 0;
  ASSERT_EQ(::waitpid(child, &wait_status, 0), child);
  STRATA_ASSERT_OK(first);
  ASSERT_EQ(second.code(), StatusCode::kUnavailable) << second.to_string();
  EXPECT_NE(second.message().find("rank 1 closed its connection during all_reduce #1"), std::string::npos)
      << second.to_string();
  EXPECT_LT(waited, std::chrono::seconds(10));
  ASSERT_TRUE(WIFEXITED(wait_status)) << "child status " << wait_status;
  EXPECT_EQ(WEXITSTATUS(wait_status), 0) << "the child process's test failed (its output is above)";
  gloo.reset();
  stream.reset();
}

}  // namespace
}  // namespace strata
