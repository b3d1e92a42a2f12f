// The Device/Stream/Event contract on every device present: the CPU device always, the
// CUDA device when a GPU is there (skipped with the reason otherwise). Tests that block a
// stream do it on a gate the test opens, never on time.
#include "engine/core/device.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <ctime>
#include <condition_variable>
#include <cstdint>
#include <cstring>
#include <mutex>
#include <ostream>
#include <string>
#include <thread>
#include <vector>

#include "engine/core/cpu_device.h"
#if defined(STRATA_HAVE_CUDA)
#include "engine/core/cuda_device.h"
#endif
#include "engine/core/gpu.h"
#include "tests/support/test_support.h"

namespace strata {

// Test names and failure messages print "cpu" / "cuda" rather than a byte dump.
void PrintTo(DeviceKind kind, std::ostream* os) { *os << device_kind_name(kind); }

namespace {

#if defined(STRATA_SANITIZER_ADDRESS) || defined(STRATA_SANITIZER_THREAD)
constexpr int kManyTasks = 300;
#else
constexpr int kManyTasks = 3000;
#endif

using testing::Gate;
using testing::OpenOnExit;

// A flag one thread sets (opens) and another waits for: a gate by another name.
using Signal = testing::Gate;

std::vector<uint8_t> pattern(size_t bytes, uint32_t seed) {
  std::vector<uint8_t> data(bytes);
  uint32_t x = seed * 2654435761u + 1;
  for (auto& byte : data) {
    x = x * 1664525u + 1013904223u;
    byte = static_cast<uint8_t>(x >> 24);
  }
  return data;
}

class DeviceTest : public ::testing::TestWithParam<DeviceKind> {
 protected:
  void SetUp() override {
    if (GetParam() == DeviceKind::kCuda && !gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  }

  static StatusOr<std::unique_ptr<Device>> make_device(size_t budget_bytes) {
    if (GetParam() == DeviceKind::kCpu) return create_cpu_device({.budget_bytes = budget_bytes, .compute = {.threads = 2}});
    return create_cuda_device({.budget_bytes = budget_bytes});
  }
  static bool is_cpu() { return GetParam() == DeviceKind::kCpu; }
};

TEST_P(DeviceTest, ManyTasksOnOneStreamRunInEnqueueOrder) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("ordered"));

  // Host functions only.
  std::vector<int> order;  // touched only by the stream until synchronize returns
  for (int i = 0; i < kManyTasks; ++i) {
    STRATA_ASSERT_OK(stream->enqueue_host([&order, i]() -> Status {
      order.push_back(i);
      return {};
    }));
  }
  STRATA_ASSERT_OK(stream->synchronize());
  ASSERT_EQ(order.size(), static_cast<size_t>(kManyTasks));
  for (int i = 0; i < kManyTasks; ++i) ASSERT_EQ(order[i], i);

  // Memsets, copies and host functions interleaved: each copy must see the memset just
  // before it and not a later one.
  constexpr size_t kSlot = 256;
  constexpr int kRounds = 64;
  STRATA_ASSERT_OK_AND_ASSIGN(auto scratch, device->allocate(kSlot, "scratch"));
  std::vector<uint8_t> host(kSlot * kRounds, 0xEE);
  std::vector<int> marks;
  for (int round = 0; round < kRounds; ++round) {
    STRATA_ASSERT_OK(device->memset_async(scratch.data(), round, kSlot, *stream));
    STRATA_ASSERT_OK(device->copy_async(host.data() + round * kSlot, scratch.data(), kSlot, CopyKind::kDeviceToHost, *stream));
    STRATA_ASSERT_OK(stream->enqueue_host([&marks, round]() -> Status {
      marks.push_back(round);
      return {};
    }));
  }
  STRATA_ASSERT_OK(stream->synchronize());
  for (int round = 0; round < kRounds; ++round) {
    for (size_t i = 0; i < kSlot; ++i) ASSERT_EQ(host[round * kSlot + i], round) << "round " << round << " byte " << i;
  }
  ASSERT_EQ(marks.size(), static_cast<size_t>(kRounds));
  for (int round = 0; round < kRounds; ++round) EXPECT_EQ(marks[round], round);
}

TEST_P(DeviceTest, WaitOnEventHoldsBackTheOtherStreamUntilTheEventCompletes) {
  constexpr size_t kBytes = 64 << 10;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto producer, device->create_stream("producer"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto consumer, device->create_stream("consumer"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto produced, device->create_event());
  STRATA_ASSERT_OK_AND_ASSIGN(auto consumed, device->create_event());
  STRATA_ASSERT_OK_AND_ASSIGN(auto source, device->allocate(kBytes, "source"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto target, device->allocate(kBytes, "target"));
  const std::vector<uint8_t> expected = pattern(kBytes, 1);
  STRATA_ASSERT_OK(device->copy_async(source.data(), expected.data(), kBytes, CopyKind::kHostToDevice, *consumer));
  STRATA_ASSERT_OK(device->memset_async(target.data(), 0, kBytes, *consumer));
  STRATA_ASSERT_OK(consumer->synchronize());

  Gate gate;
  std::atomic<bool> producer_released{false};
  std::atomic<bool> consumer_saw_release{false};
  {
    OpenOnExit opener(gate);
    STRATA_ASSERT_OK(producer->enqueue_host([&]() -> Status {
      gate.wait();
      producer_released = true;
      return {};
    }));
    STRATA_ASSERT_OK(producer->record(*produced));
    STRATA_ASSERT_OK(consumer->wait(*produced));
    STRATA_ASSERT_OK(device->copy_async(target.data(), source.data(), kBytes, CopyKind::kDeviceToDevice, *consumer));
    STRATA_ASSERT_OK(consumer->enqueue_host([&]() -> Status {
      consumer_saw_release = producer_released.load();
      return {};
    }));
    STRATA_ASSERT_OK(consumer->record(*consumed));

    // The producer is held at the gate, so nothing after the wait may have run.
    STRATA_ASSERT_OK_AND_ASSIGN(bool produced_done, produced->query());
    EXPECT_FALSE(produced_done);
    STRATA_ASSERT_OK_AND_ASSIGN(bool consumed_done, consumed->query());
    EXPECT_FALSE(consumed_done);
    if (is_cpu()) {
      // CPU "device memory" is host memory: the copy's target must still be untouched.
      const auto* bytes = target.as<const uint8_t>();
      EXPECT_TRUE(std::all_of(bytes, bytes + kBytes, [](uint8_t b) { return b == 0; }));
    }
    gate.open();
  }
  STRATA_ASSERT_OK(consumed->synchronize());
  EXPECT_TRUE(consumer_saw_release.load());
  std::vector<uint8_t> got(kBytes);
  STRATA_ASSERT_OK(device->copy_async(got.data(), target.data(), kBytes, CopyKind::kDeviceToHost, *consumer));
  STRATA_ASSERT_OK(consumer->synchronize());
  EXPECT_EQ(got, expected);
  STRATA_ASSERT_OK(device->synchronize());
}

TEST_P(DeviceTest, EventNeverRecordedIsCompleteAndReRecordMovesIt) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto blocked, device->create_stream("blocked"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto idle, device->create_stream("idle"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto event, device->create_event());

  STRATA_ASSERT_OK_AND_ASSIGN(bool fresh_done, event->query());
  EXPECT_TRUE(fresh_done);
  STRATA_EXPECT_OK(event->synchronize());
  bool ran_after_wait = false;
  STRATA_ASSERT_OK(idle->wait(*event));
  STRATA_ASSERT_OK(idle->enqueue_host([&]() -> Status {
    ran_after_wait = true;
    return {};
  }));
  STRATA_ASSERT_OK(idle->synchronize());
  EXPECT_TRUE(ran_after_wait);

  Gate gate;
  {
    OpenOnExit opener(gate);
    STRATA_ASSERT_OK(blocked->enqueue_host([&]() -> Status {
      gate.wait();
      return {};
    }));
    STRATA_ASSERT_OK(blocked->record(*event));
    STRATA_ASSERT_OK_AND_ASSIGN(bool blocked_done, event->query());
    EXPECT_FALSE(blocked_done);
    // Recording again on the idle stream moves the event there.
    STRATA_ASSERT_OK(idle->record(*event));
    STRATA_ASSERT_OK(event->synchronize());
    STRATA_ASSERT_OK_AND_ASSIGN(bool moved_done, event->query());
    EXPECT_TRUE(moved_done);
  }
  STRATA_ASSERT_OK(device->synchronize());
}

TEST_P(DeviceTest, BudgetIsAHardCapAndTheErrorNamesRequestAndHighWater) {
  constexpr size_t kMiB = size_t{1} << 20;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(8 * kMiB));
  STRATA_ASSERT_OK_AND_ASSIGN(auto empty, device->allocate(0, "nothing"));
  EXPECT_TRUE(empty.empty());
  EXPECT_EQ(empty.size(), 0u);

  STRATA_ASSERT_OK_AND_ASSIGN(auto first, device->allocate(4 * kMiB, "first buffer"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto second, device->allocate(3 * kMiB, "second buffer"));
  EXPECT_EQ(first.size(), 4 * kMiB);
  const MemoryStats before = device->memory_stats();
  EXPECT_EQ(before.budget_bytes, 8 * kMiB);
  EXPECT_GE(before.in_use_bytes, 7 * kMiB);
  EXPECT_GE(before.reserved_bytes, before.in_use_bytes);
  EXPECT_GE(before.high_water_bytes, before.reserved_bytes);
  EXPECT_EQ(before.allocation_count, 2u);

  auto refused = device->allocate(2 * kMiB, "third buffer");
  ASSERT_FALSE(refused.ok());
  EXPECT_EQ(refused.status().code(), StatusCode::kOutOfMemory);
  const std::string& message = refused.status().message();
  EXPECT_NE(message.find(std::to_string(2 * kMiB) + " bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("'third buffer'"), std::string::npos) << message;
  EXPECT_NE(message.find("budget of " + std::to_string(8 * kMiB) + " bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("in use " + std::to_string(before.in_use_bytes) + " bytes"), std::string::npos) << message;
  EXPECT_NE(message.find("high-water " + std::to_string(before.high_water_bytes) + " bytes"), std::string::npos) << message;
  EXPECT_EQ(device->memory_stats().failed_allocations, 1u);

  // A single request larger than the whole budget is refused too.
  auto huge = device->allocate(64 * kMiB, "huge buffer");
  ASSERT_FALSE(huge.ok());
  EXPECT_NE(huge.status().message().find("'huge buffer'"), std::string::npos);

  // Freeing makes room; the high-water mark stays.
  first.reset();
  EXPECT_LE(device->memory_stats().in_use_bytes, before.in_use_bytes - 4 * kMiB);
  STRATA_ASSERT_OK_AND_ASSIGN(auto third, device->allocate(2 * kMiB, "third buffer"));
  const MemoryStats after = device->memory_stats();
  EXPECT_EQ(after.high_water_bytes, before.high_water_bytes);
  EXPECT_LE(after.reserved_bytes, after.budget_bytes);
  EXPECT_EQ(after.allocation_count, 3u);
  EXPECT_EQ(after.failed_allocations, 2u);

  // Moving a buffer moves ownership; releasing everything returns the bytes.
  DeviceBuffer moved = std::move(third);
  EXPECT_TRUE(third.empty());  // NOLINT(bugprone-use-after-move): moved-from state is specified
  EXPECT_EQ(moved.size(), 2 * kMiB);
  moved.reset();
  second.reset();
  EXPECT_EQ(device->memory_stats().in_use_bytes, 0u);
  STRATA_ASSERT_OK(device->release_cached_memory());
  EXPECT_EQ(device->memory_stats().reserved_bytes, 0u);
  EXPECT_EQ(device->memory_stats().high_water_bytes, before.high_water_bytes);
}

TEST_P(DeviceTest, AllocationsAreAligned) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{32} << 20));
  std::vector<DeviceBuffer> buffers;
  for (size_t bytes : {size_t{1}, size_t{3}, size_t{255}, size_t{257}, size_t{4097}, size_t{3} << 20}) {
    STRATA_ASSERT_OK_AND_ASSIGN(auto buffer, device->allocate(bytes, "aligned"));
    EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 256, 0u) << bytes;
    EXPECT_EQ(buffer.size(), bytes);
    EXPECT_EQ(buffer.device(), device.get());
    buffers.push_back(std::move(buffer));
  }
}

TEST_P(DeviceTest, CopiesAreExactInEveryDirection) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{32} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("copies"));
  uint32_t seed = 10;
  for (size_t bytes : {size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, size_t{3} << 20}) {
    SCOPED_TRACE("bytes=" + std::to_string(bytes));
    const std::vector<uint8_t> source = pattern(bytes, seed++);
    STRATA_ASSERT_OK_AND_ASSIGN(auto first, device->allocate(bytes, "copy first"));
    STRATA_ASSERT_OK_AND_ASSIGN(auto second, device->allocate(bytes, "copy second"));
    std::vector<uint8_t> back(bytes, 0);
    std::vector<uint8_t> host_copy(bytes, 0);
    STRATA_ASSERT_OK(device->copy_async(first.data(), source.data(), bytes, CopyKind::kHostToDevice, *stream));
    STRATA_ASSERT_OK(device->copy_async(second.data(), first.data(), bytes, CopyKind::kDeviceToDevice, *stream));
    STRATA_ASSERT_OK(device->copy_async(back.data(), second.data(), bytes, CopyKind::kDeviceToHost, *stream));
    STRATA_ASSERT_OK(device->copy_async(host_copy.data(), back.data(), bytes, CopyKind::kHostToHost, *stream));
    STRATA_ASSERT_OK(stream->synchronize());
    EXPECT_EQ(back, source);
    EXPECT_EQ(host_copy, source);

    // A partial memset then a copy of a sub-range.
    STRATA_ASSERT_OK(device->memset_async(second.data(), 0x5A, bytes / 2, *stream));
    STRATA_ASSERT_OK(device->copy_async(back.data(), second.data(), bytes, CopyKind::kDeviceToHost, *stream));
    STRATA_ASSERT_OK(stream->synchronize());
    for (size_t i = 0; i < bytes; ++i) ASSERT_EQ(back[i], i < bytes / 2 ? 0x5A : source[i]) << "byte " << i;
  }
  // A zero-byte copy is a no-op.
  STRATA_ASSERT_OK(device->copy_async(nullptr, nullptr, 0, CopyKind::kHostToDevice, *stream));
}

TEST_P(DeviceTest, HostFunctionErrorSurfacesAtTheNextStreamSynchronize) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("failing"));
  bool later_ran = false;
  STRATA_ASSERT_OK(stream->enqueue_host([]() -> Status { return IoError("write of extent 17 failed"); }));
  STRATA_ASSERT_OK(stream->enqueue_host([&]() -> Status {
    later_ran = true;
    return {};
  }));
  const Status status = stream->synchronize();
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kIoError);
  EXPECT_EQ(status.message(), "write of extent 17 failed");
  EXPECT_NE(status.to_string().find("failing"), std::string::npos) << status.to_string();
  EXPECT_FALSE(later_ran) << "work after an error must be skipped until the error is reported";

  // Reported once; afterwards the stream runs again.
  STRATA_EXPECT_OK(stream->synchronize());
  bool after_report_ran = false;
  STRATA_ASSERT_OK(stream->enqueue_host([&]() -> Status {
    after_report_ran = true;
    return {};
  }));
  STRATA_ASSERT_OK(stream->synchronize());
  EXPECT_TRUE(after_report_ran);
}

TEST_P(DeviceTest, KernelErrorIsReported) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("kernels"));
  Device* seen_device = nullptr;
  const Status launched = stream->launch([&](const LaunchContext& ctx) -> Status {
    seen_device = ctx.device;
    if (ctx.native_stream == nullptr && ctx.executor == nullptr) return InternalError("no executor and no native stream");
    return DataLossError("checksum mismatch in kernel");
  });
  // A CPU kernel runs later on the stream's worker, a CUDA launcher at once: the error
  // comes back at the next synchronize or from launch itself.
  const Status status = is_cpu() ? stream->synchronize() : launched;
  if (is_cpu()) STRATA_EXPECT_OK(launched);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kDataLoss) << status.to_string();
  EXPECT_EQ(seen_device, device.get());
  STRATA_EXPECT_OK(stream->synchronize());
}

TEST_P(DeviceTest, ErrorSurfacesAtEventSynchronizeOnlyForWorkBeforeTheEvent) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("evented"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto before, device->create_event());
  STRATA_ASSERT_OK_AND_ASSIGN(auto after, device->create_event());
  STRATA_ASSERT_OK(stream->enqueue_host([]() -> Status { return {}; }));
  STRATA_ASSERT_OK(stream->record(*before));
  STRATA_ASSERT_OK(stream->enqueue_host([]() -> Status { return ResourceExhaustedError("queue full"); }));
  STRATA_ASSERT_OK(stream->record(*after));

  STRATA_EXPECT_OK(before->synchronize());
  const Status status = after->synchronize();
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(status.message(), "queue full");
  // Reported by the event: the stream has nothing left to report.
  STRATA_EXPECT_OK(stream->synchronize());
  STRATA_EXPECT_OK(device->synchronize());
}

TEST_P(DeviceTest, DeviceSynchronizeReportsErrorsOfEveryStreamIncludingDestroyedOnes) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto alive, device->create_stream("alive"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto doomed, device->create_stream("doomed"));
  STRATA_ASSERT_OK(alive->enqueue_host([]() -> Status { return IoError("alive stream failure"); }));
  STRATA_ASSERT_OK(doomed->enqueue_host([]() -> Status { return DataLossError("doomed stream failure"); }));
  doomed.reset();  // drains; its error is kept for the device
  const Status status = device->synchronize();
  ASSERT_FALSE(status.ok());
  const std::string text = status.to_string();
  EXPECT_NE(text.find("alive stream failure"), std::string::npos) << text;
  EXPECT_NE(text.find("doomed stream failure"), std::string::npos) << text;
  EXPECT_NE(text.find("1 more stream(s) of"), std::string::npos) << text;
  STRATA_EXPECT_OK(device->synchronize());
  STRATA_EXPECT_OK(alive->synchronize());
}

TEST_P(DeviceTest, DestroyingAStreamWithQueuedWorkDrainsIt) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("drained"));
  Gate gate;
  Signal first_started;
  int ran = 0;  // written by the stream only; read after its destructor returned
  STRATA_ASSERT_OK(stream->enqueue_host([&]() -> Status {
    first_started.open();
    gate.wait();
    return {};
  }));
  for (int i = 0; i < kManyTasks; ++i) {
    STRATA_ASSERT_OK(stream->enqueue_host([&ran]() -> Status {
      ++ran;
      return {};
    }));
  }
  first_started.wait();
  // The stream is held at the gate with all the counting tasks queued behind it; destroy
  // it from another thread while the gate opens.
  std::thread destroyer([&] { stream.reset(); });
  gate.open();
  destroyer.join();
  EXPECT_EQ(ran, kManyTasks);
  STRATA_EXPECT_OK(device->synchronize());
}

TEST_P(DeviceTest, StreamsAndEventsOfAnotherDeviceAreRefused) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto other, create_cpu_device({.ordinal = 1, .budget_bytes = size_t{1} << 20, .compute = {.threads = 1}}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("mine"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto foreign_stream, other->create_stream("theirs"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto foreign_event, other->create_event());
  EXPECT_EQ(stream->record(*foreign_event).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(stream->wait(*foreign_event).code(), StatusCode::kInvalidArgument);
  STRATA_ASSERT_OK_AND_ASSIGN(auto buffer, device->allocate(64, "buffer"));
  uint8_t host[64] = {};
  EXPECT_EQ(device->copy_async(buffer.data(), host, 64, CopyKind::kHostToDevice, *foreign_stream).code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(device->memset_async(buffer.data(), 0, 64, *foreign_stream).code(), StatusCode::kInvalidArgument);
}

TEST_P(DeviceTest, ConcurrentAllocationsNeverPassTheBudget) {
  constexpr size_t kBudget = size_t{1} << 20;
  constexpr size_t kBlock = size_t{96} << 10;  // 10 fit, the 11th does not
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(kBudget));
  std::atomic<int> refused{0};
  std::atomic<int> granted{0};
  std::vector<std::thread> threads;
  for (int t = 0; t < 4; ++t) {
    threads.emplace_back([&] {
      std::vector<DeviceBuffer> held;
      for (int i = 0; i < 100; ++i) {
        auto buffer = device->allocate(kBlock, "contended");
        if (buffer.ok()) {
          ++granted;
          held.push_back(std::move(buffer).value());
        } else {
          ++refused;
          EXPECT_EQ(buffer.status().code(), StatusCode::kOutOfMemory);
        }
        EXPECT_LE(device->memory_stats().reserved_bytes, kBudget);
        if (held.size() > 2) held.erase(held.begin());
      }
    });
  }
  for (auto& thread : threads) thread.join();
  const MemoryStats stats = device->memory_stats();
  EXPECT_EQ(stats.in_use_bytes, 0u);
  EXPECT_LE(stats.high_water_bytes, kBudget);
  EXPECT_EQ(stats.allocation_count, static_cast<uint64_t>(granted.load()));
  EXPECT_EQ(stats.failed_allocations, static_cast<uint64_t>(refused.load()));
  EXPECT_EQ(granted.load() + refused.load(), 400);
}

// A timing event's time is when its stream reached it: the event before a task is no
// later than the task's start, the event after it no earlier than its end. The CPU
// device reads the clock on the stream's worker (exact); the CUDA device converts the
// GPU's timestamp through its anchor, which CudaDevice documents to be within tens of
// microseconds: kCudaAnchorSlack bounds that error, not a duration of the work.
TEST_P(DeviceTest, TimingEventsTellWhenTheStreamReachedThemWithoutBlocking) {
  constexpr auto kCudaAnchorSlack = std::chrono::microseconds(500);
  const auto slack = is_cpu() ? TimingEvent::Clock::duration::zero() : TimingEvent::Clock::duration(kCudaAnchorSlack);
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("timed"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto before, device->create_timing_event());
  STRATA_ASSERT_OK_AND_ASSIGN(auto after, device->create_timing_event());
  TimingEvent::Clock::time_point task_begin, task_end;  // written by the stream, read after it finished
  Gate gate;
  {
    OpenOnExit opener(gate);
    STRATA_ASSERT_OK(stream->record(*before));
    STRATA_ASSERT_OK(stream->enqueue_host([&]() -> Status {
      task_begin = TimingEvent::Clock::now();
      gate.wait();
      task_end = TimingEvent::Clock::now();
      return {};
    }));
    STRATA_ASSERT_OK(stream->record(*after));
    // The task is held at the gate: the event after it has no time yet, and asking does not wait.
    STRATA_ASSERT_OK_AND_ASSIGN(auto pending, after->completion_time());
    EXPECT_FALSE(pending.has_value());
    gate.open();
  }
  STRATA_ASSERT_OK(after->synchronize());
  STRATA_ASSERT_OK_AND_ASSIGN(auto reached_before, before->completion_time());
  STRATA_ASSERT_OK_AND_ASSIGN(auto reached_after, after->completion_time());
  ASSERT_TRUE(reached_before.has_value());
  ASSERT_TRUE(reached_after.has_value());
  EXPECT_LE(*reached_before, task_begin + slack);
  EXPECT_GE(*reached_after + slack, task_end);
  EXPECT_LE(*reached_before, *reached_after);
  // A timing event is an event: another stream can wait on it.
  STRATA_ASSERT_OK_AND_ASSIGN(auto other, device->create_stream("waiter"));
  STRATA_ASSERT_OK(other->wait(*after));
  STRATA_ASSERT_OK(other->synchronize());
  STRATA_ASSERT_OK(device->synchronize());
}

TEST_P(DeviceTest, TimingQuestionsToTheWrongEventAreErrors) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, make_device(size_t{16} << 20));
  STRATA_ASSERT_OK_AND_ASSIGN(auto never_recorded, device->create_timing_event());
  const auto unrecorded = never_recorded->completion_time();
  ASSERT_FALSE(unrecorded.ok());
  EXPECT_EQ(unrecorded.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(unrecorded.status().message().find("never recorded"), std::string::npos) << unrecorded.status().to_string();
  // A plain event keeps no time: asking it is refused, not answered with a made-up one.
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("plain"));
  STRATA_ASSERT_OK_AND_ASSIGN(std::unique_ptr<Event> plain, device->create_event());
  STRATA_ASSERT_OK(stream->record(*plain));
  STRATA_ASSERT_OK(stream->synchronize());
  auto* as_timing = dynamic_cast<TimingEvent*>(plain.get());
  if (as_timing != nullptr) {
    const auto untimed = as_timing->completion_time();
    ASSERT_FALSE(untimed.ok());
    EXPECT_NE(untimed.status().message().find("create_timing_event"), std::string::npos) << untimed.status().to_string();
  }
}

INSTANTIATE_TEST_SUITE_P(Devices, DeviceTest, ::testing::Values(DeviceKind::kCpu, DeviceKind::kCuda),
                         [](const auto& info) { return std::string(device_kind_name(info.param)); });

// ---------------------------------------------------------------------------------------
// CPU-device specifics.

TEST(CpuDeviceTest, CopyStreamCompletesWhileAKernelBlocksTheComputeStream) {
  constexpr size_t kBytes = size_t{1} << 20;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{16} << 20, .compute = {.threads = 2}}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto compute, device->create_stream("compute"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto copy, device->create_stream("copy"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto computed, device->create_event());
  STRATA_ASSERT_OK_AND_ASSIGN(auto activations, device->allocate(kBytes, "activations"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto staged, device->allocate(kBytes, "staged"));
  Gate gate;
  Signal kernel_started;
  {
    OpenOnExit opener(gate);
    // The kernel fills its buffer through the executor, then blocks until released.
    auto* out = activations.as<uint32_t>();
    STRATA_ASSERT_OK(compute->launch([&, out](const LaunchContext& ctx) -> Status {
      if (ctx.executor == nullptr || ctx.native_stream != nullptr || ctx.device != device.get()) {
        return InternalError("unexpected launch context");
      }
      ctx.executor->parallel_for(0, kBytes / 4, 4096, [out](size_t lo, size_t hi) {
        for (size_t i = lo; i < hi; ++i) out[i] = static_cast<uint32_t>(i);
      });
      kernel_started.open();
      gate.wait();
      return {};
    }));
    STRATA_ASSERT_OK(compute->record(*computed));
    kernel_started.wait();

    const std::vector<uint8_t> source = pattern(kBytes, 3);
    std::vector<uint8_t> back(kBytes, 0);
    STRATA_ASSERT_OK(device->copy_async(staged.data(), source.data(), kBytes, CopyKind::kHostToDevice, *copy));
    STRATA_ASSERT_OK(device->copy_async(back.data(), staged.data(), kBytes, CopyKind::kDeviceToHost, *copy));
    STRATA_ASSERT_OK(copy->synchronize());  // returns although the compute stream is blocked
    EXPECT_EQ(back, source);
    STRATA_ASSERT_OK_AND_ASSIGN(bool compute_done, computed->query());
    EXPECT_FALSE(compute_done) << "the kernel is still held at the gate";
    gate.open();
  }
  STRATA_ASSERT_OK(compute->synchronize());
  const auto* values = activations.as<const uint32_t>();
  for (size_t i = 0; i < kBytes / 4; ++i) ASSERT_EQ(values[i], i);
}

// After an error the CPU stream skips its later tasks, the timing event's stamp among
// them: the event completes without a time, and says so (kCancelled) instead of giving one.
TEST(CpuDeviceTest, ATimingEventSkippedAfterAnErrorHasNoTime) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{1} << 20, .compute = {.threads = 1}}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("failing"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto event, device->create_timing_event());
  STRATA_ASSERT_OK(stream->enqueue_host([]() -> Status { return IoError("read of extent 3 failed"); }));
  STRATA_ASSERT_OK(stream->record(*event));
  const Status failure = event->synchronize();
  EXPECT_EQ(failure.code(), StatusCode::kIoError) << failure.to_string();
  const auto time = event->completion_time();
  ASSERT_FALSE(time.ok());
  EXPECT_EQ(time.status().code(), StatusCode::kCancelled) << time.status().to_string();
  // Recorded again once the error is reported, it has one.
  STRATA_ASSERT_OK(stream->record(*event));
  STRATA_ASSERT_OK(event->synchronize());
  STRATA_ASSERT_OK_AND_ASSIGN(auto recorded, event->completion_time());
  EXPECT_TRUE(recorded.has_value());
}

TEST(CpuDeviceTest, SynchronizeFromAStreamTaskIsRefusedNotADeadlock) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{1} << 20, .compute = {.threads = 1}}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("self"));
  Stream* self = stream.get();
  Device* owner = device.get();
  STRATA_ASSERT_OK(stream->enqueue_host([self]() -> Status { return self->synchronize(); }));
  Status from_task = stream->synchronize();
  EXPECT_EQ(from_task.code(), StatusCode::kFailedPrecondition) << from_task.to_string();
  STRATA_ASSERT_OK(stream->enqueue_host([owner]() -> Status { return owner->synchronize(); }));
  from_task = stream->synchronize();
  EXPECT_EQ(from_task.code(), StatusCode::kFailedPrecondition) << from_task.to_string();
}

TEST(CpuDeviceTest, CopiesOutsideLiveAllocationsAreRefused) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{1} << 20, .compute = {.threads = 1}}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("checked"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto buffer, device->allocate(1000, "small"));
  std::vector<uint8_t> host(4096);
  // Past the end of the allocation (it is rounded to 1024 bytes).
  const Status overrun = device->copy_async(buffer.data(), host.data(), 4096, CopyKind::kHostToDevice, *stream);
  EXPECT_EQ(overrun.code(), StatusCode::kInvalidArgument) << overrun.to_string();
  // A host pointer where a device pointer belongs.
  const Status wrong_kind = device->copy_async(host.data(), buffer.data(), 64, CopyKind::kHostToDevice, *stream);
  EXPECT_EQ(wrong_kind.code(), StatusCode::kInvalidArgument) << wrong_kind.to_string();
  const Status overlap = device->copy_async(buffer.as<uint8_t>() + 8, buffer.data(), 64, CopyKind::kDeviceToDevice, *stream);
  EXPECT_EQ(overlap.code(), StatusCode::kInvalidArgument) << overlap.to_string();
  STRATA_EXPECT_OK(stream->synchronize());
}

TEST(CpuDeviceTest, LargeAllocationsArePageAlignedAndDescriptionNamesTheBudget) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{8} << 20, .compute = {.threads = 1}}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto buffer, device->allocate(CpuDevice::kLargeThreshold + 1, "large"));
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % CpuDevice::kLargeAlignment, 0u);
  EXPECT_EQ(device->kind(), DeviceKind::kCpu);
  EXPECT_NE(device->description().find("cpu:0"), std::string::npos) << device->description();
  EXPECT_NE(device->description().find(std::to_string(size_t{8} << 20)), std::string::npos) << device->description();
}

#if defined(STRATA_HAVE_CUDA)
// The caching allocator's size classes (a pure function: runs without a GPU).
TEST(CudaDeviceTest, BlockSizesWasteLittleAndKeepExactMiBSizes) {
  for (size_t bytes : {size_t{1}, size_t{511}, size_t{512}, size_t{513}, size_t{4097}, size_t{100000}, size_t{1} << 20,
                       (size_t{1} << 20) + 1, size_t{3} << 20, (size_t{300} << 20) + 7, size_t{5} << 30}) {
    const size_t block = CudaDevice::block_size_for(bytes);
    EXPECT_GE(block, bytes);
    EXPECT_EQ(block % 512, 0u) << bytes;
    EXPECT_LE(block - bytes, std::max(bytes / 8, size_t{512})) << bytes;
    EXPECT_LE(block - bytes, size_t{2} << 20) << bytes;
    EXPECT_EQ(CudaDevice::block_size_for(block), block) << "a block size is its own class: " << bytes;
  }
  EXPECT_EQ(CudaDevice::block_size_for(size_t{3} << 20), size_t{3} << 20);
  EXPECT_EQ(CudaDevice::block_size_for(size_t{4} << 20), size_t{4} << 20);
}
#endif

// OpenBLAS has no TF32 or bf16 mode: the CPU device refuses them, naming the key, rather
// than computing in fp32 under a setting that says otherwise.
TEST(CpuDeviceTest, RefusesAReducedMatmulPrecision) {
  for (MatmulPrecision precision : {MatmulPrecision::kTf32, MatmulPrecision::kBf16}) {
    auto device = create_cpu_device({.budget_bytes = size_t{8} << 20, .matmul_precision = precision});
    ASSERT_FALSE(device.ok());
    EXPECT_EQ(device.status().code(), StatusCode::kInvalidArgument);
    EXPECT_NE(device.status().message().find("strata.matmul_precision is \"" + std::string(matmul_precision_name(precision))),
              std::string::npos) << device.status().to_string();
  }
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{8} << 20}));
  EXPECT_EQ(device->matmul_precision(), MatmulPrecision::kFp32);
}

// The yield policy (cuda_device.h): a thread waiting on an event or a stream for ~0.2 s
// of GPU work sleeps, so its CPU time is a small part of the wait (spinning makes them equal).
TEST(CudaDeviceTest, AThreadWaitingForTheGpuSleepsInsteadOfSpinning) {
  if (!gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
  const size_t bytes = size_t{1} << 30;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cuda_device({.budget_bytes = bytes + (size_t{64} << 20)}));
  STRATA_ASSERT_OK_AND_ASSIGN(auto stream, device->create_stream("busy"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto event, device->create_event());
  STRATA_ASSERT_OK_AND_ASSIGN(auto buffer, device->allocate(bytes, "busy work"));
  auto thread_cpu_seconds = [] {
    timespec t{};
    clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
    return static_cast<double>(t.tv_sec) + static_cast<double>(t.tv_nsec) * 1e-9;
  };
  auto busy_work = [&] {
    // 1 GiB memsets at a few TB/s: ~0.3 ms each, 600 of them a few hundred ms.
    for (int i = 0; i < 600; ++i) STRATA_ASSERT_OK(device->memset_async(buffer.data(), i & 0xff, bytes, *stream));
  };
  for (const char* wait : {"event", "stream"}) {
    busy_work();
    STRATA_ASSERT_OK(stream->record(*event));
    const auto wall_start = std::chrono::steady_clock::now();
    const double cpu_start = thread_cpu_seconds();
    STRATA_ASSERT_OK(std::string(wait) == "event" ? event->synchronize() : stream->synchronize());
    const double cpu = thread_cpu_seconds() - cpu_start;
    const double wall = std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
    ASSERT_GT(wall, 0.02) << wait << ": the busy work finished before the wait began; nothing was measured";
    EXPECT_LT(cpu, 0.3 * wall) << wait << " wait: " << cpu << " s of CPU in " << wall << " s (the thread spins)";
  }
}

// A framework's stream (torch's current one) joined with the device's own, both ways,
// through the wrapper adopt_stream gives; the wrapper's end leaves the stream to its owner.
TEST(CudaDeviceTest, AnAdoptedStreamIsOrderedBothWaysAndStaysItsOwners) {
  if (!gpu_available()) GTEST_SKIP() << "no GPU: " << discover_gpus().reason;
#if defined(STRATA_HAVE_CUDA)
  const size_t bytes = size_t{64} << 20;
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cuda_device({.budget_bytes = 4 * bytes}));
  cudaStream_t native = nullptr;
  ASSERT_EQ(cudaStreamCreateWithFlags(&native, cudaStreamNonBlocking), cudaSuccess);
  STRATA_ASSERT_OK_AND_ASSIGN(auto own, device->create_stream("own"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto event, device->create_event());
  STRATA_ASSERT_OK_AND_ASSIGN(auto a, device->allocate(bytes, "a"));
  STRATA_ASSERT_OK_AND_ASSIGN(auto b, device->allocate(bytes, "b"));
  std::vector<uint8_t> host(bytes);
  {
    STRATA_ASSERT_OK_AND_ASSIGN(auto adopted, device->adopt_stream(native, "framework"));
    EXPECT_EQ(adopted->native_handle(), static_cast<void*>(native));
    // The device's stream writes, the adopted one reads after an event.
    for (int i = 0; i < 50; ++i) STRATA_ASSERT_OK(device->memset_async(a.data(), i, bytes, *own));
    STRATA_ASSERT_OK(device->memset_async(a.data(), 7, bytes, *own));
    STRATA_ASSERT_OK(own->record(*event));
    STRATA_ASSERT_OK(adopted->wait(*event));
    STRATA_ASSERT_OK(device->copy_async(host.data(), a.data(), bytes, CopyKind::kDeviceToHost, *adopted));
    STRATA_ASSERT_OK(adopted->synchronize());
    EXPECT_EQ(std::count(host.begin(), host.end(), uint8_t{7}), static_cast<std::ptrdiff_t>(bytes));
    // The adopted stream writes, the device's reads after an event.
    for (int i = 0; i < 50; ++i) STRATA_ASSERT_OK(device->memset_async(b.data(), i, bytes, *adopted));
    STRATA_ASSERT_OK(device->memset_async(b.data(), 9, bytes, *adopted));
    STRATA_ASSERT_OK(adopted->record(*event));
    STRATA_ASSERT_OK(own->wait(*event));
    STRATA_ASSERT_OK(device->copy_async(host.data(), b.data(), bytes, CopyKind::kDeviceToHost, *own));
    STRATA_ASSERT_OK(own->synchronize());
    EXPECT_EQ(std::count(host.begin(), host.end(), uint8_t{9}), static_cast<std::ptrdiff_t>(bytes));
  }
  EXPECT_EQ(cudaStreamQuery(native), cudaSuccess) << "the wrapper destroyed a stream it does not own";
  EXPECT_EQ(cudaStreamDestroy(native), cudaSuccess);
  // The legacy default stream (a handle of 0, torch's default) is adopted too.
  STRATA_EXPECT_OK(device->adopt_stream(nullptr, "default").status());
#endif
}

// The CPU device's callers compute on their own thread: there is no native stream to adopt.
TEST(CpuDeviceTest, HasNoNativeStreamToAdopt) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto device, create_cpu_device({.budget_bytes = size_t{8} << 20}));
  auto adopted = device->adopt_stream(nullptr, "framework");
  ASSERT_FALSE(adopted.ok());
  EXPECT_EQ(adopted.status().code(), StatusCode::kUnimplemented);
  EXPECT_NE(adopted.status().message().find("no native streams"), std::string::npos) << adopted.status().to_string();
}

// Runs on every machine (scripts/gpu-check fails on a GPU machine where a gpu-labelled
// test skips): with a GPU the factory makes the device, without one it says why not.
TEST(CudaDeviceFactoryTest, CreatesTheDeviceOrIsUnavailableWithTheReason) {
  auto device = create_cuda_device({});
  if (gpu_available()) {
    STRATA_ASSERT_OK(device.status());
    EXPECT_EQ((*device)->kind(), DeviceKind::kCuda);
    return;
  }
  ASSERT_FALSE(device.ok());
  EXPECT_EQ(device.status().code(), StatusCode::kUnavailable);
  EXPECT_NE(device.status().message().find(discover_gpus().reason), std::string::npos) << device.status().to_string();
}

}  // namespace
}  // namespace strata
