#include "engine/core/file.h"

#include <gtest/gtest.h>
#include <pthread.h>
#include <signal.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/test_support.h"

namespace strata {
namespace {

using testing::TempDir;

using testing::contains;

std::vector<char> pattern(size_t bytes) {
  std::vector<char> data(bytes);
  for (size_t i = 0; i < bytes; ++i) data[i] = static_cast<char>((i * 131 + 7) & 0xff);
  return data;
}

TEST(FileTest, WriteExactThenReadExactRoundTripsAtAnOffset) {
  TempDir dir;
  const std::string path = dir.str() + "/data.bin";
  STRATA_ASSERT_OK_AND_ASSIGN(File file, File::open(path, {.flags = O_RDWR | O_CREAT}));
  const std::vector<char> data = pattern(10000);
  STRATA_ASSERT_OK(file.write_exact(data.data(), data.size(), 123));
  std::vector<char> back(data.size());
  STRATA_ASSERT_OK(file.read_exact(back.data(), back.size(), 123));
  EXPECT_EQ(back, data);
  STRATA_ASSERT_OK_AND_ASSIGN(const uint64_t size, file.size());
  EXPECT_EQ(size, 10123u);
}

TEST(FileTest, AShortReadAtTheEndOfTheFileIsDataLossNamingTheFileAndOffset) {
  TempDir dir;
  const std::string path = dir.str() + "/short.bin";
  STRATA_ASSERT_OK_AND_ASSIGN(File file, File::open(path, {.flags = O_RDWR | O_CREAT}));
  const std::vector<char> data = pattern(100);
  STRATA_ASSERT_OK(file.write_exact(data.data(), data.size(), 0));
  std::vector<char> back(4096);
  const Status status = file.read_exact(back.data(), back.size(), 50);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kDataLoss);
  EXPECT_TRUE(contains(status.message(), path + " is truncated")) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "pread of 4096 bytes at offset 50")) << status.to_string();
  EXPECT_TRUE(contains(status.message(), "after 50 bytes")) << status.to_string();
}

TEST(FileTest, AFailedReadNamesTheOperationTheFileTheOffsetAndTheErrno) {
  TempDir dir;
  const std::string path = dir.str() + "/write-only.bin";
  STRATA_ASSERT_OK_AND_ASSIGN(File file, File::open(path, {.flags = O_WRONLY | O_CREAT}));
  char byte = 0;
  const Status status = file.read_exact(&byte, 1, 7);
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.error_number(), EBADF);
  EXPECT_TRUE(contains(status.message(), "pread of 1 bytes at offset 7 from " + path)) << status.to_string();
}

TEST(FileTest, OpeningAMissingFileIsNotFoundNamingThePath) {
  TempDir dir;
  const std::string path = dir.str() + "/missing";
  const StatusOr<File> file = File::open(path);
  ASSERT_FALSE(file.ok());
  EXPECT_EQ(file.status().code(), StatusCode::kNotFound);
  EXPECT_EQ(file.status().error_number(), ENOENT);
  EXPECT_TRUE(contains(file.status().message(), "open(" + path + ")")) << file.status().to_string();
}

TEST(FileTest, MovingTransfersOwnershipAndReleaseGivesTheDescriptorUp) {
  TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(File first, File::open(dir.str() + "/a", {.flags = O_RDWR | O_CREAT}));
  const int fd = first.fd();
  File second = std::move(first);
  EXPECT_FALSE(first.is_open());  // NOLINT(bugprone-use-after-move): the moved-from state is the point
  EXPECT_EQ(second.fd(), fd);
  const int released = second.release();
  EXPECT_FALSE(second.is_open());
  EXPECT_EQ(released, fd);
  File adopted(released, dir.str() + "/a");
  STRATA_EXPECT_OK(adopted.close());
  EXPECT_FALSE(adopted.is_open());
  EXPECT_EQ(::fcntl(fd, F_GETFD), -1);  // closed
}

TEST(FileTest, SyncAndSyncDataSucceedOnAFileAndFsyncDirectoryOnItsDirectory) {
  TempDir dir;
  STRATA_ASSERT_OK_AND_ASSIGN(File file, File::open(dir.str() + "/durable", {.flags = O_RDWR | O_CREAT}));
  const std::vector<char> data = pattern(64);
  STRATA_ASSERT_OK(file.write_exact(data.data(), data.size(), 0));
  STRATA_EXPECT_OK(file.sync());
  STRATA_EXPECT_OK(file.sync_data());
  STRATA_EXPECT_OK(fsync_directory(dir.str()));
  const Status missing = fsync_directory(dir.str() + "/no-such-dir");
  EXPECT_EQ(missing.code(), StatusCode::kNotFound);
  EXPECT_TRUE(contains(missing.message(), dir.str() + "/no-such-dir")) << missing.to_string();
}

TEST(FileTest, DirectOpenProbesAnAlignmentOfAtLeastAPageOrFallsBackToBuffered) {
  TempDir dir;
  const std::string path = dir.str() + "/direct.bin";
  STRATA_ASSERT_OK_AND_ASSIGN(
      File file, File::open(path, {.flags = O_RDWR | O_CREAT, .direct_io = FileDirectIo::kPreferred}));
  if (!file.direct_io()) GTEST_SKIP() << "the file system under " << dir.str() << " refuses O_DIRECT";
  const size_t alignment = file.direct_io_alignment();
  EXPECT_GE(alignment, kDirectIoMinAlignment);
  EXPECT_EQ(alignment & (alignment - 1), 0u);
  EXPECT_NE(::fcntl(file.fd(), F_GETFL) & O_DIRECT, 0);
  // An aligned buffer moves through O_DIRECT at an aligned offset.
  STRATA_ASSERT_OK_AND_ASSIGN(AlignedBuffer out, AlignedBuffer::allocate(3 * alignment, alignment));
  STRATA_ASSERT_OK_AND_ASSIGN(AlignedBuffer in, AlignedBuffer::allocate(3 * alignment, alignment));
  const std::vector<char> data = pattern(out.size());
  std::memcpy(out.data(), data.data(), data.size());
  STRATA_ASSERT_OK(file.write_exact(out.data(), out.size(), alignment));
  STRATA_ASSERT_OK(file.read_exact(in.data(), in.size(), alignment));
  EXPECT_EQ(std::memcmp(in.data(), data.data(), data.size()), 0);
}

TEST(FileTest, ADirectFileAskingForMoreThanTheCallerAllowsIsReopenedBufferedWithItsData) {
  TempDir dir;
  const std::string path = dir.str() + "/capped.bin";
  const std::vector<char> data = pattern(100);
  {
    STRATA_ASSERT_OK_AND_ASSIGN(File file, File::open(path, {.flags = O_RDWR | O_CREAT}));
    STRATA_ASSERT_OK(file.write_exact(data.data(), data.size(), 0));
  }
  // No file system asks for less than a page, so a cap of 512 always reopens buffered.
  STRATA_ASSERT_OK_AND_ASSIGN(
      File file,
      File::open(path, {.flags = O_RDWR | O_TRUNC, .direct_io = FileDirectIo::kPreferred, .max_direct_alignment = 512}));
  EXPECT_FALSE(file.direct_io());
  EXPECT_EQ(file.direct_io_alignment(), 0u);
  EXPECT_EQ(::fcntl(file.fd(), F_GETFL) & O_DIRECT, 0);
  char byte = 0;
  STRATA_EXPECT_OK(file.write_exact(&byte, 1, 0));  // unaligned: buffered I/O takes it
}

TEST(FileTest, AlignedBufferRoundsItsCapacityUpAndRejectsABadAlignment) {
  STRATA_ASSERT_OK_AND_ASSIGN(AlignedBuffer buffer, AlignedBuffer::allocate(5000, 4096));
  EXPECT_EQ(buffer.size(), 5000u);
  EXPECT_EQ(buffer.capacity(), 8192u);
  EXPECT_EQ(reinterpret_cast<uintptr_t>(buffer.data()) % 4096, 0u);
  AlignedBuffer moved = std::move(buffer);
  EXPECT_EQ(buffer.data(), nullptr);  // NOLINT(bugprone-use-after-move)
  EXPECT_EQ(moved.capacity(), 8192u);
  const StatusOr<AlignedBuffer> bad = AlignedBuffer::allocate(100, 3000);
  EXPECT_EQ(bad.status().code(), StatusCode::kInvalidArgument);
}

// Signals without SA_RESTART make blocked reads and writes return EINTR (or a short
// count): the layer must carry on with the rest.
std::atomic<int> g_signals_caught{0};
void count_signal(int) { g_signals_caught.fetch_add(1, std::memory_order_relaxed); }

class InterruptingSignal {
 public:
  InterruptingSignal() {
    struct sigaction action {};
    action.sa_handler = count_signal;
    sigemptyset(&action.sa_mask);
    action.sa_flags = 0;  // no SA_RESTART: interrupted syscalls fail with EINTR
    ::sigaction(SIGUSR1, &action, &previous_);
  }
  ~InterruptingSignal() { ::sigaction(SIGUSR1, &previous_, nullptr); }

 private:
  struct sigaction previous_ {};
};

// Sends SIGUSR1 to `target` until `done`, a signal per millisecond.
void pester(pthread_t target, const std::atomic<bool>& done) {
  while (!done.load()) {
    ::pthread_kill(target, SIGUSR1);
    std::this_thread::sleep_for(std::chrono::milliseconds(1));
  }
}

TEST(FileTest, WriteAllRetriesWritesInterruptedBySignals) {
  InterruptingSignal handler;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  File read_end(fds[0], "pipe (read end)");
  File write_end(fds[1], "pipe (write end)");
  const std::vector<char> data = pattern(size_t{1} << 20);  // 16x a pipe's buffer: the writer blocks
  g_signals_caught = 0;
  std::atomic<bool> written{false};
  Status write_status;
  std::thread writer([&] {
    write_status = write_all(write_end.fd(), write_end.path(), data.data(), data.size());
    written = true;
    write_end.reset();  // the reader sees the end of the stream, also after a failed write
  });
  std::thread signaller(pester, writer.native_handle(), std::cref(written));
  // Let the writer block on the full pipe and take signals there before draining it.
  while (g_signals_caught.load() < 20 && !written.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  std::vector<char> back;
  char chunk[4096];
  while (back.size() < data.size()) {
    const ssize_t got = ::read(read_end.fd(), chunk, sizeof(chunk));
    if (got < 0 && errno == EINTR) continue;
    if (got <= 0) break;  // the writer gave up
    back.insert(back.end(), chunk, chunk + got);
  }
  signaller.join();  // first: it signals the writer until the writer is done
  writer.join();
  STRATA_EXPECT_OK(write_status);
  EXPECT_GE(g_signals_caught.load(), 20);
  EXPECT_EQ(back, data);
}

TEST(FileTest, ReadToEndRetriesReadsInterruptedBySignals) {
  InterruptingSignal handler;
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  File read_end(fds[0], "pipe (read end)");
  File write_end(fds[1], "pipe (write end)");
  g_signals_caught = 0;
  std::atomic<bool> finished{false};
  StatusOr<std::string> text = std::string();
  std::thread reader([&] {
    text = read_end.read_to_end();
    finished = true;
  });
  std::thread signaller(pester, reader.native_handle(), std::cref(finished));
  // The reader blocks on the empty pipe and is interrupted there before any byte comes.
  while (g_signals_caught.load() < 20 && !finished.load()) std::this_thread::sleep_for(std::chrono::milliseconds(1));
  const std::string message = "after the signals";
  STRATA_ASSERT_OK(write_end.write_all(message.data(), message.size()));
  STRATA_ASSERT_OK(write_end.close());
  signaller.join();  // first: it signals the reader until the reader is done
  reader.join();
  ASSERT_TRUE(text.ok()) << text.status().to_string();
  EXPECT_EQ(*text, message);
}

}  // namespace
}  // namespace strata
