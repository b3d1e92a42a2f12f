#include "offload/io_engine.h"

#include <fcntl.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include <cstddef>

#include <atomic>
#include <chrono>
#include <deque>
#include <mutex>
#include <thread>
#include <tuple>
#include <vector>

#include "engine/core/log.h"
#include "engine/core/file.h"
#include "engine/core/thread.h"
#include "tests/offload/offload_test_util.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::aligned_memory;
using testing::fill_pattern;
using testing::first_pattern_mismatch;

constexpr size_t kMiB = 1024 * 1024;

StatusOr<std::unique_ptr<IoEngine>> make_engine(IoEngineKind kind, unsigned queue_depth = 8,
                                                size_t max_request_bytes = size_t{1} << 30) {
  IoEngineOptions options;
  options.kind = kind;
  options.queue_depth = queue_depth;
  options.max_request_bytes = max_request_bytes;
  return IoEngine::create(options);
}

StatusOr<std::unique_ptr<IoEngine>> make_engine(const IoEngineOptions& options) { return IoEngine::create(options); }

// io_uring tests skip (with the reason) where the kernel refuses io_uring.
#define MAKE_ENGINE_OR_SKIP(var, ...)                                                   \
  auto var##_or = make_engine(__VA_ARGS__);                                             \
  if (!var##_or.ok() && var##_or.status().code() == StatusCode::kUnavailable)           \
    GTEST_SKIP() << "io_uring unavailable: " << var##_or.status().message();            \
  STRATA_ASSERT_OK(var##_or);                                                           \
  std::unique_ptr<IoEngine> var = std::move(var##_or).value()

enum class BufferKind { kRegistered, kUnregistered };
enum class FileMode { kDirect, kBuffered };


std::string engine_label(IoEngineKind kind) { return std::string(io_engine_kind_name(kind)); }

using RoundTripParam = std::tuple<IoEngineKind, BufferKind, FileMode, size_t>;

class IoEngineRoundTripTest : public ::testing::TestWithParam<RoundTripParam> {};

// Writes a pattern and reads it back, byte for byte, through each engine, with buffers
// inside and outside the registered regions, with and without O_DIRECT, at sizes that do
// and do not fill a 4 KiB block. The 64 KiB request cap splits larger sizes into several
// transfers kept 4 deep.
TEST_P(IoEngineRoundTripTest, WriteThenReadBack) {
  const auto [kind, buffer_kind, mode, bytes] = GetParam();
  testing::TempDir dir;
  const std::string path = dir.str() + "/data";
  const int flags = O_RDWR | O_CREAT | O_CLOEXEC | (mode == FileMode::kDirect ? O_DIRECT : 0);
  File file(::open(path.c_str(), flags, 0644), path);
  if (file.fd() < 0 && mode == FileMode::kDirect && errno == EINVAL) GTEST_SKIP() << "O_DIRECT refused on " << path;
  ASSERT_GE(file.fd(), 0) << std::strerror(errno);
  // O_DIRECT moves whole 4 KiB blocks; buffered I/O moves the exact size.
  const size_t io_bytes = mode == FileMode::kDirect ? (bytes + 4095) / 4096 * 4096 : bytes;

  MAKE_ENGINE_OR_SKIP(engine, kind, 4, 64 * 1024);
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 16 * kMiB}));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer pinned_out, arena->allocate(io_bytes, "out"));
  STRATA_ASSERT_OK_AND_ASSIGN(PinnedBuffer pinned_in, arena->allocate(io_bytes, "in"));
  testing::AlignedMemory plain_out = aligned_memory(io_bytes);
  testing::AlignedMemory plain_in = aligned_memory(io_bytes);
  void* out = buffer_kind == BufferKind::kRegistered ? pinned_out.data() : plain_out.get();
  void* in = buffer_kind == BufferKind::kRegistered ? pinned_in.data() : plain_in.get();
  STRATA_ASSERT_OK_AND_ASSIGN(bool registered, engine->register_buffers(*arena));
  EXPECT_EQ(registered, kind == IoEngineKind::kIoUring);

  fill_pattern(out, io_bytes, bytes);
  std::memset(in, 0xEE, io_bytes);
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket write, engine->submit({IoOp::kWrite, io_file, out, io_bytes, 0, nullptr}));
  STRATA_ASSERT_OK(engine->wait(write));
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket read, engine->submit({IoOp::kRead, io_file, in, io_bytes, 0, nullptr}));
  STRATA_ASSERT_OK(engine->wait(read));
  EXPECT_EQ(first_pattern_mismatch(in, bytes, bytes), -1);

  const IoEngineStats stats = engine->stats();
  EXPECT_EQ(stats.requests, 2u);
  EXPECT_EQ(stats.bytes_written, io_bytes);
  EXPECT_EQ(stats.bytes_read, io_bytes);
  const uint64_t pieces = (io_bytes + 64 * 1024 - 1) / (64 * 1024);
  EXPECT_GE(stats.transfers, 2 * pieces);
  if (buffer_kind == BufferKind::kRegistered && registered) {
    EXPECT_EQ(stats.fixed_transfers, 2 * pieces);
  } else {
    EXPECT_EQ(stats.fixed_transfers, 0u);
  }
  STRATA_ASSERT_OK(engine->unregister_file(io_file));
}

std::string round_trip_name(const ::testing::TestParamInfo<RoundTripParam>& info) {
  const auto& [kind, buffer, mode, bytes] = info.param;
  return engine_label(kind) + (buffer == BufferKind::kRegistered ? "_registered" : "_plain") +
         (mode == FileMode::kDirect ? "_direct_" : "_buffered_") + std::to_string(bytes);
}

INSTANTIATE_TEST_SUITE_P(
    Grid, IoEngineRoundTripTest,
    ::testing::Combine(::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kPsync),
                       ::testing::Values(BufferKind::kRegistered, BufferKind::kUnregistered),
                       ::testing::Values(FileMode::kDirect, FileMode::kBuffered),
                       ::testing::Values(size_t{1}, size_t{4095}, size_t{4096}, size_t{4097}, 3 * kMiB + 5)),
    round_trip_name);

class IoEngineKindTest : public ::testing::TestWithParam<IoEngineKind> {};

// Two regions that touch in memory: a request across both is split at the boundary, and
// each half uses its own fixed buffer (io_uring; the pool registers nothing).
TEST_P(IoEngineKindTest, RequestAcrossTwoRegionsIsSplit) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/data";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path);
  ASSERT_GE(file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, GetParam(), 8);
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 2 * kMiB}));
  char* base = static_cast<char*>(arena->data());
  const PinnedRegion halves[2] = {{base + kMiB, kMiB}, {base, kMiB}};  // out of address order on purpose
  STRATA_ASSERT_OK_AND_ASSIGN(bool registered, engine->register_buffers(halves));
  fill_pattern(base, 2 * kMiB, 11);
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  // Starts 4 KiB before the boundary and ends 4 KiB after it.
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket write,
                              engine->submit({IoOp::kWrite, io_file, base + kMiB - 4096, 8192, 0, nullptr}));
  STRATA_ASSERT_OK(engine->wait(write));
  std::vector<char> back(8192);
  ASSERT_EQ(::pread(file.fd(), back.data(), back.size(), 0), 8192);
  EXPECT_EQ(std::memcmp(back.data(), base + kMiB - 4096, 8192), 0);
  EXPECT_EQ(registered, GetParam() == IoEngineKind::kIoUring);
  EXPECT_EQ(engine->stats().transfers, registered ? 2u : 1u);
  if (registered) {
    EXPECT_EQ(engine->stats().fixed_transfers, 2u);
    EXPECT_EQ(engine->registered_region(base, 4096), 1);
    EXPECT_EQ(engine->registered_region(base + kMiB, 4096), 0);
    EXPECT_EQ(engine->registered_region(base + kMiB - 4096, 8192), -1);
  }
}

// A read past the end of the file is an error naming the file, not a silent short read.
TEST_P(IoEngineKindTest, ReadPastEndOfFileIsAnError) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/short";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path);
  ASSERT_GE(file.fd(), 0);
  ASSERT_EQ(::pwrite(file.fd(), "abcd", 4, 0), 4);
  MAKE_ENGINE_OR_SKIP(engine, GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  std::vector<char> in(100);
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket read, engine->submit({IoOp::kRead, io_file, in.data(), in.size(), 0, nullptr}));
  const Status status = engine->wait(read);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_NE(status.message().find("end of file"), std::string::npos) << status.to_string();
  EXPECT_NE(status.message().find(path), std::string::npos) << status.to_string();
  // The 4 bytes that were there arrived (a short read, then end of file).
  EXPECT_EQ(std::string(in.data(), 4), "abcd");
  EXPECT_GE(engine->stats().short_transfers, 1u);
}

// Errors are kept until someone waits: a failure nobody waited for comes back from
// wait_all(), and waiting for its ticket returns it too.
TEST_P(IoEngineKindTest, BackgroundErrorsAreKeptForTheNextWait) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/readonly";
  { File create(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path); }
  File file(::open(path.c_str(), O_RDONLY | O_CLOEXEC), path);
  ASSERT_GE(file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  std::vector<char> out(4096, 'x');
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket failing,
                              engine->submit({IoOp::kWrite, io_file, out.data(), out.size(), 0, nullptr}));
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket second,
                              engine->submit({IoOp::kWrite, io_file, out.data(), out.size(), 4096, nullptr}));
  const Status first_status = engine->wait(failing);
  ASSERT_FALSE(first_status.ok());
  EXPECT_EQ(first_status.error_number(), EBADF) << first_status.to_string();
  EXPECT_NE(first_status.message().find("write of 4096 bytes at offset 0 to " + path), std::string::npos)
      << first_status.to_string();
  // `second` was never waited for: wait_all hands its error over (and not the claimed one).
  const Status all = engine->wait_all();
  ASSERT_FALSE(all.ok());
  EXPECT_NE(all.message().find("at offset 4096"), std::string::npos) << all.to_string();
  // Handed over once: nothing is left for the next wait_all.
  STRATA_EXPECT_OK(engine->wait_all());
  EXPECT_EQ(engine->stats().failed_requests, 2u);
  (void)second;
  EXPECT_EQ(engine->wait(IoTicket{999}).code(), StatusCode::kInvalidArgument);
}

// A completion hook's Status becomes the request's.
TEST_P(IoEngineKindTest, CompletionHookDecidesTheStatus) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/hook";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path);
  ASSERT_GE(file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  std::vector<char> out(8192, 'y');
  std::atomic<int> calls{0};
  STRATA_ASSERT_OK_AND_ASSIGN(
      IoTicket ticket, engine->submit({IoOp::kWrite, io_file, out.data(), out.size(), 0, [&](const Status& transfer) {
                                         ++calls;
                                         return transfer.ok() ? DataLossError("hook says no") : transfer;
                                       }}));
  const Status status = engine->wait(ticket);
  EXPECT_EQ(calls.load(), 1);
  EXPECT_EQ(status.message(), "hook says no");
}

// Honest short transfers and -EAGAIN: a non-blocking pipe that holds 16 KiB when a
// 64 KiB read is asked for gives a short read; for the pool the next read of the empty
// pipe gives -EAGAIN (io_uring may instead wait for the pipe itself). The rest arrives
// later and the read completes with every byte in order.
TEST_P(IoEngineKindTest, ShortTransfersAndEagainAreResubmitted) {
  int fds[2];
  ASSERT_EQ(::pipe2(fds, O_NONBLOCK | O_CLOEXEC), 0);
  File read_end(fds[0], "test pipe (read end)");
  File write_end(fds[1], "test pipe (write end)");
  MAKE_ENGINE_OR_SKIP(engine, GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(read_end.fd(), "test pipe"));
  std::vector<unsigned char> expected(64 * 1024);
  fill_pattern(expected.data(), expected.size(), 5);
  ASSERT_EQ(::write(write_end.fd(), expected.data(), 16 * 1024), 16 * 1024);
  std::vector<unsigned char> got(expected.size());
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket,
                              engine->submit({IoOp::kRead, io_file, got.data(), got.size(), kIoStreamOffset, nullptr}));
  while (engine->stats().short_transfers == 0) std::this_thread::yield();
  if (GetParam() == IoEngineKind::kPsync) {
    while (engine->stats().again_retries == 0) std::this_thread::yield();
  }
  EXPECT_FALSE(engine->done(ticket));
  size_t sent = 16 * 1024;
  while (sent < expected.size()) {
    const ssize_t n = ::write(write_end.fd(), expected.data() + sent, std::min<size_t>(8192, expected.size() - sent));
    if (n > 0) sent += static_cast<size_t>(n);
  }
  STRATA_ASSERT_OK(engine->wait(ticket));
  EXPECT_EQ(got, expected);
}

// Many requests submitted from one thread and waited for from three others; data
// checked afterwards. Under ThreadSanitizer this is the engine's race check.
TEST_P(IoEngineKindTest, SubmitFromOneThreadWaitFromOthers) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/concurrent";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644), path);
  ASSERT_GE(file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, GetParam(), 4);
  constexpr int kRequests = 64;
  constexpr size_t kBlock = 16 * 1024;
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 2 * kRequests * kBlock}));
  STRATA_ASSERT_OK(engine->register_buffers(*arena));
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  char* out = static_cast<char*>(arena->data());
  char* in = out + kRequests * kBlock;
  fill_pattern(out, kRequests * kBlock, 9);

  std::mutex mutex;
  std::condition_variable ready;
  std::deque<IoTicket> tickets;
  bool finished = false;
  std::atomic<int> failures{0};
  std::vector<std::thread> waiters;
  for (int w = 0; w < 3; ++w) {
    waiters.emplace_back([&] {
      for (;;) {
        IoTicket ticket;
        {
          std::unique_lock<std::mutex> lock(mutex);
          ready.wait(lock, [&] { return finished || !tickets.empty(); });
          if (tickets.empty()) return;
          ticket = tickets.front();
          tickets.pop_front();
        }
        if (!engine->wait(ticket).ok()) ++failures;
      }
    });
  }
  auto submit_all = [&](IoOp op, char* base) {
    for (int i = 0; i < kRequests; ++i) {
      auto ticket = engine->submit({op, io_file, base + i * kBlock, kBlock, static_cast<uint64_t>(i) * kBlock, nullptr});
      ASSERT_TRUE(ticket.ok()) << ticket.status().to_string();
      {
        std::lock_guard<std::mutex> lock(mutex);
        tickets.push_back(*ticket);
      }
      ready.notify_one();
    }
  };
  submit_all(IoOp::kWrite, out);
  STRATA_ASSERT_OK(engine->wait_all());
  submit_all(IoOp::kRead, in);
  {
    std::lock_guard<std::mutex> lock(mutex);
    finished = true;
  }
  ready.notify_all();
  for (auto& waiter : waiters) waiter.join();
  STRATA_ASSERT_OK(engine->wait_all());
  EXPECT_EQ(failures.load(), 0);
  EXPECT_EQ(first_pattern_mismatch(in, kRequests * kBlock, 9), -1);
}

// Callers that wait complete requests on their own thread; a request nobody waits for
// must still complete (its hook runs) through the background reaper, and done() polled
// in a loop must see it finish.
TEST_P(IoEngineKindTest, RequestsNobodyWaitsForStillCompleteAndDonePollsThem) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/unwaited";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path);
  ASSERT_GE(file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, GetParam(), 4);
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  std::vector<char> data(64 * 1024);
  fill_pattern(data.data(), data.size(), 5);
  constexpr int kRequests = 8;
  std::atomic<int> hooks_run{0};
  std::vector<IoTicket> tickets;
  for (int i = 0; i < kRequests; ++i) {
    IoRequest request{IoOp::kWrite, io_file, data.data(), data.size(), static_cast<uint64_t>(i) * data.size(), nullptr};
    request.on_complete = [&hooks_run](const Status& status) {
      ++hooks_run;
      return status;
    };
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket, engine->submit(std::move(request)));
    tickets.push_back(ticket);
  }
  // Nobody waits: the hooks run anyway (a generous deadline, not a timing assertion).
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (hooks_run.load() < kRequests && std::chrono::steady_clock::now() < deadline) {
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
  EXPECT_EQ(hooks_run.load(), kRequests);
  // done() in a polling loop sees a fresh request through.
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket read, engine->submit({IoOp::kRead, io_file, data.data(), data.size(), 0, nullptr}));
  while (!engine->done(read) && std::chrono::steady_clock::now() < deadline) std::this_thread::yield();
  EXPECT_TRUE(engine->done(read));
  for (IoTicket ticket : tickets) STRATA_EXPECT_OK(engine->wait(ticket));
  STRATA_EXPECT_OK(engine->wait(read));
  EXPECT_EQ(first_pattern_mismatch(data.data(), data.size(), 5), -1);
}

using testing::Gate;

// A scratch file in a temporary directory, open for reading and writing.
struct ScratchFile {
  testing::TempDir dir;
  std::string path = dir.str() + "/verify";
  File file{::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path};
};

IoEngineOptions verify_options(IoEngineKind kind, unsigned verify_threads) {
  IoEngineOptions options;
  options.kind = kind;
  options.queue_depth = 4;
  options.verify_threads = verify_threads;
  return options;
}

// Waits (a generous deadline, not a timing assertion) until `flag` is set.
bool eventually(const std::atomic<bool>& flag) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(60);
  while (!flag.load() && std::chrono::steady_clock::now() < deadline) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  return flag.load();
}

// A request's verify hook runs on a verifier thread, beside the I/O: while it is held,
// other requests go through the engine and finish, the held one is not done, and its
// ticket returns what the hook decides once it lets go.
TEST_P(IoEngineKindTest, VerifyHookRunsBesideTheIoAndItsTicketWaitsForIt) {
  ScratchFile scratch;
  ASSERT_GE(scratch.file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, verify_options(GetParam(), 2));
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(scratch.file.fd(), scratch.path));
  std::vector<char> out(8192, 'v');
  Gate gate;
  std::atomic<bool> verifying{false};
  std::atomic<bool> on_complete_first{false};
  std::thread::id verify_thread;
  IoRequest held{IoOp::kWrite, io_file, out.data(), out.size(), 0, [&](const Status& transfer) {
                   on_complete_first = true;
                   return transfer;
                 }};
  held.verify = [&](const Status& transfer) {
    verify_thread = std::this_thread::get_id();
    if (!on_complete_first.load()) return InternalError("verify ran before on_complete");
    verifying = true;
    gate.wait();
    return transfer.ok() ? DataLossError("verify says no") : transfer;
  };
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket held_ticket, engine->submit(std::move(held)));
  ASSERT_TRUE(eventually(verifying));
  for (int i = 1; i <= 8; ++i) {
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket other, engine->submit({IoOp::kWrite, io_file, out.data(), out.size(),
                                                                static_cast<uint64_t>(i) * out.size(), nullptr}));
    STRATA_EXPECT_OK(engine->wait(other));
  }
  EXPECT_FALSE(engine->done(held_ticket));
  EXPECT_NE(verify_thread, std::this_thread::get_id());
  gate.open();
  EXPECT_EQ(engine->wait(held_ticket).message(), "verify says no");
  const IoEngineStats stats = engine->stats();
  EXPECT_EQ(stats.verified_requests, 1u);
  EXPECT_EQ(stats.verified_by_waiters, 0u);
  EXPECT_EQ(stats.failed_requests, 1u);
}

// With its only verifier thread held by another request, a thread waiting for a request
// runs that request's verification itself instead of waiting behind the held one.
TEST_P(IoEngineKindTest, WaiterVerifiesItsOwnRequestWhenNoVerifierIsFree) {
  ScratchFile scratch;
  ASSERT_GE(scratch.file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, verify_options(GetParam(), 1));
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(scratch.file.fd(), scratch.path));
  std::vector<char> out(4096, 'w');
  Gate gate;
  std::atomic<bool> verifying{false};
  IoRequest held{IoOp::kWrite, io_file, out.data(), out.size(), 0, nullptr};
  held.verify = [&](const Status& transfer) {
    verifying = true;
    gate.wait();
    return transfer;
  };
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket held_ticket, engine->submit(std::move(held)));
  ASSERT_TRUE(eventually(verifying));
  std::thread::id verify_thread;
  IoRequest mine{IoOp::kWrite, io_file, out.data(), out.size(), 4096, nullptr};
  mine.verify = [&](const Status& transfer) {
    verify_thread = std::this_thread::get_id();
    return transfer;
  };
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket my_ticket, engine->submit(std::move(mine)));
  STRATA_EXPECT_OK(engine->wait(my_ticket));
  EXPECT_EQ(verify_thread, std::this_thread::get_id());
  EXPECT_FALSE(engine->done(held_ticket));
  gate.open();
  STRATA_EXPECT_OK(engine->wait(held_ticket));
  EXPECT_EQ(engine->stats().verified_requests, 2u);
  EXPECT_EQ(engine->stats().verified_by_waiters, 1u);
}

// Without verifier threads the verify hook runs where the request completes, after
// on_complete and with its Status; errors reach wait_all() as any other.
TEST_P(IoEngineKindTest, VerifyHookWithoutVerifierThreadsRunsWhereTheRequestCompletes) {
  ScratchFile scratch;
  ASSERT_GE(scratch.file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, verify_options(GetParam(), 0));
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(scratch.file.fd(), scratch.path));
  std::vector<char> out(4096, 'z');
  std::atomic<int> verified{0};
  for (int i = 0; i < 4; ++i) {
    IoRequest request{IoOp::kWrite, io_file, out.data(), out.size(), static_cast<uint64_t>(i) * 4096,
                      [](const Status&) { return DataLossError("from on_complete"); }};
    request.verify = [&](const Status& from_on_complete) {
      ++verified;
      return from_on_complete;
    };
    STRATA_ASSERT_OK(engine->submit(std::move(request)).status());
  }
  const Status all = engine->wait_all();
  EXPECT_EQ(verified.load(), 4);
  EXPECT_TRUE(testing::contains(all.to_string(), "from on_complete")) << all.to_string();
  EXPECT_TRUE(testing::contains(all.to_string(), "3 more failed")) << all.to_string();
  EXPECT_EQ(engine->stats().verified_requests, 4u);
  EXPECT_EQ(engine->stats().verified_by_waiters, 0u);
}

// A verifier thread the system refuses is an error, as every thread the library cannot
// start is: the request's hook still runs (the store's bookkeeping with it), and its
// status names the refusal; the next request starts the thread and goes through.
TEST_P(IoEngineKindTest, VerifierThreadThatCannotStartFailsTheRequestAfterItsHookRan) {
  ScratchFile scratch;
  ASSERT_GE(scratch.file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, verify_options(GetParam(), 1));
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(scratch.file.fd(), scratch.path));
  std::vector<char> out(4096, 'r');
  std::atomic<int> hooks{0};
  auto request = [&] {
    IoRequest write{IoOp::kWrite, io_file, out.data(), out.size(), 0, nullptr};
    write.verify = [&](const Status& transfer) {
      ++hooks;
      return transfer;
    };
    return write;
  };
  Status refused;
  {
    ThreadSpawnFailureForTest refuse(1);
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket, engine->submit(request()));
    refused = engine->wait(ticket);
  }
  EXPECT_EQ(hooks.load(), 1);
  EXPECT_FALSE(refused.ok());
  EXPECT_TRUE(testing::contains(refused.to_string(), "starting the threads that verify checksums beside the I/O"))
      << refused.to_string();
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket again, engine->submit(request()));
  STRATA_EXPECT_OK(engine->wait(again));
  EXPECT_EQ(hooks.load(), 2);
}

INSTANTIATE_TEST_SUITE_P(Engines, IoEngineKindTest, ::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kPsync),
                         [](const ::testing::TestParamInfo<IoEngineKind>& info) { return engine_label(info.param); });

TEST(IoEngineTest, AutoPicksIoUringWhereAvailableAndPsyncWhenForced) {
  STRATA_ASSERT_OK_AND_ASSIGN(auto forced, make_engine(IoEngineKind::kPsync));
  EXPECT_EQ(forced->kind(), IoEngineKind::kPsync);
  EXPECT_EQ(forced->name(), "psync");
  STRATA_ASSERT_OK_AND_ASSIGN(auto automatic, make_engine(IoEngineKind::kAuto));
  auto uring = make_engine(IoEngineKind::kIoUring);
  EXPECT_EQ(automatic->kind(), uring.ok() ? IoEngineKind::kIoUring : IoEngineKind::kPsync);
}

// Where the kernel refuses io_uring (here: a seccomp filter in a child makes
// io_uring_setup fail with ENOSYS, as on kernels without it), kAuto falls back to the
// pool and says so once per process; kIoUring is an error naming the reason.
TEST(IoEngineTest, FallsBackToThePoolWhereIoUringIsRefused) {
  testing::TempDir dir;
  std::string child_stderr;
  const std::string result = testing::run_in_child(
      [&]() -> std::string {
        set_log_level(LogLevel::kInfo);
        sock_filter filter[] = {
            BPF_STMT(BPF_LD | BPF_W | BPF_ABS, offsetof(seccomp_data, nr)),
            BPF_JUMP(BPF_JMP | BPF_JEQ | BPF_K, __NR_io_uring_setup, 0, 1),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ERRNO | (ENOSYS & SECCOMP_RET_DATA)),
            BPF_STMT(BPF_RET | BPF_K, SECCOMP_RET_ALLOW),
        };
        sock_fprog program{static_cast<unsigned short>(sizeof(filter) / sizeof(filter[0])), filter};
        if (::prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0 ||
            ::syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, 0, &program) != 0) {
          return std::string("skip: seccomp: ") + std::strerror(errno);
        }
        auto forced = make_engine(IoEngineKind::kIoUring);
        std::string report = forced.ok() ? "io_uring created" : forced.status().to_string();
        for (int i = 0; i < 2; ++i) {
          auto automatic = make_engine(IoEngineKind::kAuto);
          if (!automatic.ok()) return "auto failed: " + automatic.status().to_string();
          report += "\nauto is " + std::string((*automatic)->name());
          const std::string path = dir.str() + "/fallback" + std::to_string(i);
          const int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
          auto file = (*automatic)->register_file(fd, path);
          char out[100] = "fallback data";
          char in[100] = {};
          auto write = (*automatic)->submit({IoOp::kWrite, *file, out, sizeof(out), 0, nullptr});
          Status written = write.ok() ? (*automatic)->wait(*write) : write.status();
          auto read = (*automatic)->submit({IoOp::kRead, *file, in, sizeof(in), 0, nullptr});
          Status got = read.ok() ? (*automatic)->wait(*read) : read.status();
          report += written.ok() && got.ok() && std::string(in) == "fallback data" ? " round trip ok" : " round trip failed";
          ::close(fd);
        }
        return report;
      },
      &child_stderr);
  if (result.rfind("skip: ", 0) == 0) GTEST_SKIP() << result;
  EXPECT_TRUE(testing::contains(result, "UNAVAILABLE: io_uring_queue_init(8) failed: Function not implemented")) << result;
  EXPECT_TRUE(testing::contains(result, "\nauto is psync round trip ok\nauto is psync round trip ok")) << result;
  size_t notes = 0;
  for (size_t at = child_stderr.find("io_uring unavailable"); at != std::string::npos;
       at = child_stderr.find("io_uring unavailable", at + 1)) {
    ++notes;
  }
  EXPECT_EQ(notes, 1u) << child_stderr;
}

// SQPOLL: a kernel thread consumes the submission queue; the round trip is unchanged.
TEST(IoEngineTest, SqpollRoundTrip) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/sqpoll";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644), path);
  ASSERT_GE(file.fd(), 0);
  IoEngineOptions options;
  options.kind = IoEngineKind::kIoUring;
  options.queue_depth = 4;
  options.sqpoll = true;
  options.sqpoll_idle_ms = 10;
  auto created = IoEngine::create(options);
  if (!created.ok() && created.status().code() == StatusCode::kUnavailable) {
    GTEST_SKIP() << "io_uring with SQPOLL unavailable: " << created.status().message();
  }
  STRATA_ASSERT_OK(created);
  std::unique_ptr<IoEngine> engine = std::move(created).value();
  STRATA_ASSERT_OK_AND_ASSIGN(auto arena, PinnedArena::create({.bytes = 2 * kMiB}));
  STRATA_ASSERT_OK(engine->register_buffers(*arena));
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  char* out = static_cast<char*>(arena->data());
  char* in = out + kMiB;
  fill_pattern(out, kMiB, 21);
  std::vector<IoTicket> tickets;
  for (size_t i = 0; i < 16; ++i) {  // more requests than the queue is deep
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket t, engine->submit({IoOp::kWrite, io_file, out + i * 65536, 65536, i * 65536, nullptr}));
    tickets.push_back(t);
  }
  for (IoTicket t : tickets) STRATA_ASSERT_OK(engine->wait(t));
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket read, engine->submit({IoOp::kRead, io_file, in, kMiB, 0, nullptr}));
  STRATA_ASSERT_OK(engine->wait(read));
  EXPECT_EQ(first_pattern_mismatch(in, kMiB, 21), -1);
}

TEST(IoEngineTest, RejectsBadOptionsAndRequests) {
  EXPECT_EQ(make_engine(IoEngineKind::kPsync, 0).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(make_engine(IoEngineKind::kPsync, 4, 1000).status().code(), StatusCode::kInvalidArgument);
  STRATA_ASSERT_OK_AND_ASSIGN(auto engine, make_engine(IoEngineKind::kPsync));
  char byte = 0;
  EXPECT_EQ(engine->submit({IoOp::kRead, IoFile{3}, &byte, 1, 0, nullptr}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(engine->submit({IoOp::kRead, IoFile{}, &byte, 0, 0, nullptr}).status().code(), StatusCode::kInvalidArgument);
  EXPECT_TRUE(parse_io_engine_kind("io_uring").ok());
  EXPECT_FALSE(parse_io_engine_kind("libaio").ok());
}


// ---------------------------------------------------------------------------------------
// Fault injection: each kind of fault on each backend, on an O_DIRECT file where the file
// system takes it. Faults the engine must absorb (short transfers, a few -EAGAIN, a
// delay) leave the bytes exact; the others fail the request with an error that names the
// operation, the file and the errno, and nothing hangs.
// ---------------------------------------------------------------------------------------

struct FaultCase {
  std::string name;
  IoFaultRule rule;
  StatusCode expected = StatusCode::kOk;  // kOk: the engine absorbs the fault
  std::string expected_text;              // in the error, after the operation and the file
};

void PrintTo(const FaultCase& fault, std::ostream* os) { *os << fault.name; }

IoFaultRule fault_rule(IoOp op, IoFaultAction action, int error_number = EIO) {
  IoFaultRule rule;
  rule.match.op = op;
  rule.match.file_contains = "faulty";
  rule.action = action;
  rule.error_number = error_number;
  return rule;
}

std::vector<FaultCase> fault_cases() {
  std::vector<FaultCase> cases;
  for (IoOp op : {IoOp::kRead, IoOp::kWrite}) {
    const std::string prefix = op == IoOp::kRead ? "Read" : "Write";
    cases.push_back({prefix + "Eio", fault_rule(op, IoFaultAction::kFail, EIO), StatusCode::kIoError, "Input/output error (errno 5)"});
    cases.push_back({prefix + "Enospc", fault_rule(op, IoFaultAction::kFail, ENOSPC), StatusCode::kResourceExhausted,
                     "No space left on device (errno 28)"});
    FaultCase again{prefix + "EagainThreeTimes", fault_rule(op, IoFaultAction::kFail, EAGAIN)};
    again.rule.match.count = 3;
    cases.push_back(again);
    FaultCase stuck{prefix + "EagainForever", fault_rule(op, IoFaultAction::kFail, EAGAIN), StatusCode::kUnavailable,
                    "the file returned EAGAIN " + std::to_string(kIoMaxAgainRetries + 1) + " times in a row"};
    stuck.rule.match.count = 0;
    cases.push_back(stuck);
    FaultCase short_io{prefix + "ShortEveryTime", fault_rule(op, IoFaultAction::kShort)};
    short_io.rule.match.count = 0;  // every transfer moves 4 KiB: 16 transfers for 64 KiB
    cases.push_back(short_io);
    FaultCase late{prefix + "Delayed", fault_rule(op, IoFaultAction::kDelay)};
    late.rule.delay = std::chrono::milliseconds(30);
    cases.push_back(late);
    FaultCase late_error{prefix + "DelayedEio", fault_rule(op, IoFaultAction::kFail, EIO), StatusCode::kIoError,
                         "Input/output error"};
    late_error.rule.delay = std::chrono::milliseconds(30);
    cases.push_back(late_error);
  }
  return cases;
}

using FaultParam = std::tuple<IoEngineKind, FaultCase>;
class IoEngineFaultTest : public ::testing::TestWithParam<FaultParam> {};

TEST_P(IoEngineFaultTest, InjectedFaultIsAbsorbedOrNamesTheOperationAndTheFile) {
  const auto& [kind, fault] = GetParam();
  testing::TempDir dir;
  const std::string path = dir.str() + "/faulty-data";
  int fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC | O_DIRECT, 0644);
  if (fd < 0 && errno == EINVAL) fd = ::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644);
  File file(fd, path);
  ASSERT_GE(file.fd(), 0) << std::strerror(errno);
  auto injector = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{fault.rule});
  IoEngineOptions options;
  options.kind = kind;
  options.queue_depth = 4;
  options.faults = injector;
  auto created = IoEngine::create(options);
  if (!created.ok() && created.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << created.status().message();
  STRATA_ASSERT_OK(created);
  std::unique_ptr<IoEngine> engine = std::move(created).value();
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));

  constexpr size_t kBytes = 64 * 1024;
  testing::AlignedMemory out = aligned_memory(kBytes);
  testing::AlignedMemory in = aligned_memory(kBytes);
  fill_pattern(out.get(), kBytes, 11);
  std::memset(in.get(), 0xEE, kBytes);
  const auto started = std::chrono::steady_clock::now();
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket write, engine->submit({IoOp::kWrite, io_file, out.get(), kBytes, 0, nullptr}));
  const Status written = engine->wait(write);
  Status read;
  if (written.ok()) {
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket, engine->submit({IoOp::kRead, io_file, in.get(), kBytes, 0, nullptr}));
    read = engine->wait(ticket);
  }
  const Status& faulted = *fault.rule.match.op == IoOp::kRead ? read : written;
  // Bounded: the slowest case (-EAGAIN for ever) gives up after about a second.
  EXPECT_LT(std::chrono::steady_clock::now() - started, std::chrono::seconds(10));
  EXPECT_GE(engine->stats().injected_faults, 1u);
  ASSERT_FALSE(injector->injected().empty());
  EXPECT_EQ(injector->injected().front().file, path);

  if (fault.expected == StatusCode::kOk) {
    STRATA_ASSERT_OK(written);
    STRATA_ASSERT_OK(read);
    EXPECT_EQ(first_pattern_mismatch(in.get(), kBytes, 11), -1);
    if (fault.rule.action == IoFaultAction::kShort) {
      EXPECT_EQ(engine->stats().short_transfers, kBytes / 4096 - 1);
    }
    if (fault.rule.action == IoFaultAction::kFail && fault.rule.error_number == EAGAIN) {
      EXPECT_EQ(engine->stats().again_retries, 3u);
    }
    if (fault.rule.action == IoFaultAction::kDelay) {
      EXPECT_GE(std::chrono::steady_clock::now() - started, fault.rule.delay);
    }
  } else {
    ASSERT_FALSE(faulted.ok()) << fault.name;
    EXPECT_EQ(faulted.code(), fault.expected) << faulted.to_string();
    const std::string operation = *fault.rule.match.op == IoOp::kRead ? "read of 65536 bytes at offset 0 from "
                                                                       : "write of 65536 bytes at offset 0 to ";
    EXPECT_TRUE(testing::contains(faulted.message(), operation + path + ": " + fault.expected_text)) << faulted.to_string();
    EXPECT_EQ(engine->stats().failed_requests, 1u);
  }
  STRATA_ASSERT_OK(engine->wait_all());
  STRATA_ASSERT_OK(engine->unregister_file(io_file));
}

INSTANTIATE_TEST_SUITE_P(Faults, IoEngineFaultTest,
                         ::testing::Combine(::testing::Values(IoEngineKind::kIoUring, IoEngineKind::kPsync),
                                            ::testing::ValuesIn(fault_cases())),
                         [](const ::testing::TestParamInfo<FaultParam>& info) {
                           return engine_label(std::get<0>(info.param)) + "_" + std::get<1>(info.param).name;
                         });

// Ordinals: the third write of five (and only it) fails; the rule counts all five, the
// record names the third one's offset, and the others' bytes land.
TEST_P(IoEngineKindTest, FaultHitsOnlyTheChosenOrdinal) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/faulty-ordinal";
  const std::string other_path = dir.str() + "/healthy";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path);
  File other(::open(other_path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), other_path);
  ASSERT_GE(file.fd(), 0);
  ASSERT_GE(other.fd(), 0);
  IoFaultRule rule = fault_rule(IoOp::kWrite, IoFaultAction::kFail, ENOSPC);
  rule.match.first = 3;
  auto injector = std::make_shared<IoFaultInjector>(std::vector<IoFaultRule>{rule});
  IoEngineOptions options;
  options.kind = GetParam();
  options.faults = injector;
  auto created = IoEngine::create(options);
  if (!created.ok() && created.status().code() == StatusCode::kUnavailable) GTEST_SKIP() << created.status().message();
  STRATA_ASSERT_OK(created);
  std::unique_ptr<IoEngine> engine = std::move(created).value();
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile other_file, engine->register_file(other.fd(), other_path));
  std::vector<char> block(4096, 'q');
  std::vector<Status> results;
  for (int i = 0; i < 5; ++i) {
    // The healthy file's writes do not match the rule and do not count.
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket spare, engine->submit({IoOp::kWrite, other_file, block.data(), block.size(), 4096u * i, nullptr}));
    STRATA_ASSERT_OK(engine->wait(spare));
    STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket, engine->submit({IoOp::kWrite, io_file, block.data(), block.size(), 4096u * i, nullptr}));
    results.push_back(engine->wait(ticket));
  }
  for (int i = 0; i < 5; ++i) EXPECT_EQ(results[static_cast<size_t>(i)].ok(), i != 2) << i << ": " << results[static_cast<size_t>(i)].to_string();
  EXPECT_TRUE(testing::contains(results[2].message(), "write of 4096 bytes at offset 8192 to " + path)) << results[2].to_string();
  EXPECT_EQ(injector->matched(0), 5u);
  ASSERT_EQ(injector->injected().size(), 1u);
  EXPECT_EQ(injector->injected()[0].ordinal, 3u);
  EXPECT_EQ(injector->injected()[0].offset, 8192u);
  STRATA_ASSERT_OK(engine->unregister_file(io_file));
  STRATA_ASSERT_OK(engine->unregister_file(other_file));
}

// Without a plan nothing is injected (the default engine's path).
TEST_P(IoEngineKindTest, NoPlanInjectsNothing) {
  testing::TempDir dir;
  const std::string path = dir.str() + "/faulty-name-but-no-plan";
  File file(::open(path.c_str(), O_RDWR | O_CREAT | O_CLOEXEC, 0644), path);
  ASSERT_GE(file.fd(), 0);
  MAKE_ENGINE_OR_SKIP(engine, GetParam());
  STRATA_ASSERT_OK_AND_ASSIGN(IoFile io_file, engine->register_file(file.fd(), path));
  std::vector<char> block(8192, 'n');
  STRATA_ASSERT_OK_AND_ASSIGN(IoTicket ticket, engine->submit({IoOp::kWrite, io_file, block.data(), block.size(), 0, nullptr}));
  STRATA_ASSERT_OK(engine->wait(ticket));
  EXPECT_EQ(engine->stats().injected_faults, 0u);
  EXPECT_EQ(engine->stats().short_transfers, 0u);
  STRATA_ASSERT_OK(engine->unregister_file(io_file));
}

}  // namespace
}  // namespace strata
