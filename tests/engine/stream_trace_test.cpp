// StreamTrace on every device present (CUDA skipped with the reason where there is no
// GPU): intervals follow the streams' work (order and containment, never durations),
// collect() does not wait for the device, and the event pool stays bounded. Streams are
// held on gates the test opens, never on time.
#include "engine/stream_trace.h"

#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <future>
#include <mutex>
#include <ostream>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/gpu.h"
#include "tests/support/test_support.h"

namespace strata {

// Test names print "cpu" / "cuda" rather than a byte dump.
void PrintTo(DeviceKind kind, std::ostream* os) { *os << device_kind_name(kind); }

namespace {

using testing::Gate;

// The device and two streams; declared before the gates of a test, so the gates open
// (their destructors run) before the streams drain.
struct Rig {
  explicit Rig(DeviceKind kind) {
    auto created = kind == DeviceKind::kCpu ? create_cpu_device({.budget_bytes = size_t{1} << 20, .compute = {.threads = 1}})
                                            : create_cuda_device({.budget_bytes = size_t{1} << 20});
    EXPECT_TRUE(created.ok()) << created.status().to_string();
    device = *std::move(created);
    auto a = device->create_stream("a");
    auto b = device->create_stream("b");
    EXPECT_TRUE(a.ok() && b.ok());
    first = *std::move(a);
    second = *std::move(b);
  }
  ~Rig() {
    first.reset();
    second.reset();
  }
  std::unique_ptr<Device> device;
  std::unique_ptr<Stream> first, second;
  Tracer tracer{0};
};

class StreamTraceTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && !gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  }
  // How far a traced time may stray from the host's clock: none on the CPU device (its
  // worker reads that clock); on CUDA the anchor's error, which cuda_device.h bounds to
  // tens of microseconds. An error bound, not a duration of the work.
  static TraceClock::duration slack() {
    return GetParam() == DeviceKind::kCpu ? TraceClock::duration::zero() : TraceClock::duration(std::chrono::microseconds(500));
  }
};

// Runs `call` on another thread and says whether it returned within a deadline that only
// bounds a failure. A call that waits for the stream `gate` holds would never return: past
// the deadline the gate opens, so the test fails instead of hanging.
Status without_waiting_for(Gate& gate, std::string_view what, const std::function<Status()>& call) {
  auto done = std::async(std::launch::async, call);
  if (done.wait_for(std::chrono::seconds(30)) == std::future_status::ready) return done.get();
  gate.open();
  (void)done.get();
  return DeadlineExceededError(std::string(what) + " waited for the gated stream's work");
}

Status collect_without_waiting(StreamTrace& trace, Gate& gate) {
  return without_waiting_for(gate, "collect()", [&trace] { return trace.collect(); });
}

TEST_P(StreamTraceTest, AnIntervalHoldsTheWorkBetweenOpenAndCloseAndIsCollectedWithoutWaiting) {
  Rig rig(GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(auto trace, StreamTrace::create(*rig.device, rig.tracer));
  TraceClock::time_point work_begin, work_end;  // written by the stream, read after it finished
  Gate gate;
  STRATA_ASSERT_OK_AND_ASSIGN(StreamTrace::Opened opened, trace->open(*rig.first));
  STRATA_ASSERT_OK(rig.first->enqueue_host([&]() -> Status {
    work_begin = TraceClock::now();
    gate.wait();
    work_end = TraceClock::now();
    return {};
  }));
  STRATA_ASSERT_OK(trace->close(std::move(opened), Stage::kH2D, 7, "g7"));

  STRATA_ASSERT_OK(collect_without_waiting(*trace, gate));
  EXPECT_TRUE(rig.tracer.intervals().empty());
  EXPECT_EQ(trace->stats().pending, 1u);

  gate.open();
  STRATA_ASSERT_OK(rig.first->synchronize());
  STRATA_ASSERT_OK(trace->collect());
  const std::vector<TraceInterval> intervals = rig.tracer.intervals();
  ASSERT_EQ(intervals.size(), 1u);
  EXPECT_EQ(intervals[0].stage, Stage::kH2D);
  EXPECT_EQ(intervals[0].group, 7);
  EXPECT_EQ(intervals[0].label, "g7");
  EXPECT_LE(intervals[0].begin, work_begin + slack());
  EXPECT_GE(intervals[0].end + slack(), work_end);
  EXPECT_EQ(trace->stats().pending, 0u);
  EXPECT_EQ(trace->stats().resolved, 1u);
}

// A stream held at a gate keeps its intervals pending while another stream's complete:
// collect() takes what has finished, in each stream's order, and the rest later. The free
// stream's intervals enclose no host function: on CUDA a host function that blocks holds
// back the host functions of other streams too (this case never finished on an H200 while
// the free stream's intervals each held one).
TEST_P(StreamTraceTest, CompletedIntervalsAreCollectedInStreamOrderWhileAnotherStreamIsHeld) {
  Rig rig(GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(auto trace, StreamTrace::create(*rig.device, rig.tracer));
  Gate gate;
  STRATA_ASSERT_OK(trace->traced(*rig.first, Stage::kAllGather, 0, "held", [&] {
    return rig.first->enqueue_host([&]() -> Status {
      gate.wait();
      return {};
    });
  }));
  for (int g = 1; g <= 3; ++g) STRATA_ASSERT_OK(trace->traced(*rig.second, Stage::kD2H, g, "free", [] { return Status(); }));
  STRATA_ASSERT_OK(without_waiting_for(gate, "the free stream's synchronize()", [&] { return rig.second->synchronize(); }));
  STRATA_ASSERT_OK(collect_without_waiting(*trace, gate));
  std::vector<TraceInterval> intervals = rig.tracer.intervals();
  ASSERT_EQ(intervals.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(intervals[static_cast<size_t>(i)].group, i + 1);
    if (i > 0) {
      EXPECT_LE(intervals[static_cast<size_t>(i) - 1].end, intervals[static_cast<size_t>(i)].begin + slack());
    }
  }
  gate.open();
  STRATA_ASSERT_OK(rig.first->synchronize());
  STRATA_ASSERT_OK(trace->collect());
  intervals = rig.tracer.intervals();
  ASSERT_EQ(intervals.size(), 4u);
  EXPECT_EQ(intervals[3].stage, Stage::kAllGather);
}

TEST_P(StreamTraceTest, EventsReturnToThePoolSoItNeverGrowsPastTwoPerIntervalInFlight) {
  Rig rig(GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(auto trace, StreamTrace::create(*rig.device, rig.tracer, {.max_events = 64}));
  constexpr int kIntervals = 200;
  for (int i = 0; i < kIntervals; ++i) {
    STRATA_ASSERT_OK(trace->traced(*rig.first, Stage::kCompute, i, {}, [&] { return rig.first->enqueue_host([] { return Status(); }); }));
    STRATA_ASSERT_OK(rig.first->synchronize());
    STRATA_ASSERT_OK(trace->collect());
  }
  const StreamTraceStats stats = trace->stats();
  EXPECT_EQ(stats.events_created, 2u);
  EXPECT_EQ(stats.resolved, static_cast<uint64_t>(kIntervals));
  EXPECT_EQ(stats.dropped, 0u);
  EXPECT_EQ(rig.tracer.intervals().size(), static_cast<size_t>(kIntervals));
}

// With every event of the pool in flight behind a held stream, a new interval is dropped
// and counted instead of waited for; once the stream moves, tracing resumes.
TEST_P(StreamTraceTest, AnExhaustedPoolDropsIntervalsInsteadOfWaiting) {
  Rig rig(GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(auto trace, StreamTrace::create(*rig.device, rig.tracer, {.max_events = 4}));
  Gate gate;
  STRATA_ASSERT_OK(rig.first->enqueue_host([&]() -> Status {
    gate.wait();
    return {};
  }));
  auto nothing = [] { return Status(); };
  for (int i = 0; i < 2; ++i) STRATA_ASSERT_OK(trace->traced(*rig.first, Stage::kH2D, i, {}, nothing));
  // The pool is spent: a third interval (begin and end) and an open one find no event.
  STRATA_ASSERT_OK(trace->traced(*rig.first, Stage::kH2D, 2, {}, nothing));
  STRATA_ASSERT_OK_AND_ASSIGN(StreamTrace::Opened opened, trace->open(*rig.second));
  STRATA_ASSERT_OK(trace->close(std::move(opened), Stage::kD2H, 3, {}));
  StreamTraceStats stats = trace->stats();
  EXPECT_EQ(stats.events_created, 4u);
  EXPECT_EQ(stats.pending, 2u);
  EXPECT_EQ(stats.dropped, 2u);

  gate.open();
  STRATA_ASSERT_OK(rig.first->synchronize());
  STRATA_ASSERT_OK(trace->traced(*rig.second, Stage::kD2H, 4, {}, nothing));  // collects to find its events
  STRATA_ASSERT_OK(rig.second->synchronize());
  STRATA_ASSERT_OK(trace->collect());
  stats = trace->stats();
  EXPECT_EQ(stats.events_created, 4u);
  EXPECT_EQ(stats.resolved, 3u);
  EXPECT_EQ(stats.pending, 0u);
  std::vector<int> groups;
  for (const auto& iv : rig.tracer.intervals()) groups.push_back(iv.group);
  EXPECT_EQ(groups, (std::vector<int>{0, 1, 4}));
}

// An interval opened and never closed (its use failed) gives its event back; one whose
// events the stream skipped after an error is dropped, the error left to the stream. (A
// CUDA stream skips only host functions after an error; its events still complete.)
// CPU only, not a case of each device: gpu-check fails a GPU run on any skipped case.
TEST(StreamTraceCpuTest, UnclosedAndSkippedIntervalsGiveTheirEventsBack) {
  Rig rig(DeviceKind::kCpu);
  STRATA_ASSERT_OK_AND_ASSIGN(auto trace, StreamTrace::create(*rig.device, rig.tracer, {.max_events = 2}));
  {
    STRATA_ASSERT_OK_AND_ASSIGN(StreamTrace::Opened forgotten, trace->open(*rig.first));
  }
  STRATA_ASSERT_OK(trace->traced(*rig.first, Stage::kReduceScatter, 0, {}, [&] {
    return rig.first->enqueue_host([] { return IoError("peer lost"); });
  }));
  EXPECT_EQ(rig.first->synchronize().code(), StatusCode::kIoError);
  STRATA_ASSERT_OK(trace->collect());
  StreamTraceStats stats = trace->stats();
  EXPECT_EQ(stats.events_created, 2u);
  EXPECT_EQ(stats.dropped, 1u);
  EXPECT_EQ(stats.pending, 0u);
  EXPECT_TRUE(rig.tracer.intervals().empty());
  STRATA_ASSERT_OK(trace->traced(*rig.first, Stage::kReduceScatter, 1, {}, [] { return Status(); }));
  STRATA_ASSERT_OK(rig.first->synchronize());
  STRATA_ASSERT_OK(trace->collect());
  EXPECT_EQ(rig.tracer.intervals().size(), 1u);
}

TEST_P(StreamTraceTest, APoolTooSmallForOneIntervalIsRefused) {
  Rig rig(GetParam());
  const auto refused = StreamTrace::create(*rig.device, rig.tracer, {.max_events = 1});
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(refused.status().message().find("max_events"), std::string::npos);
}

INSTANTIATE_TEST_SUITE_P(Devices, StreamTraceTest, ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const auto& info) { return std::string(device_kind_name(info.param)); });

}  // namespace
}  // namespace strata
