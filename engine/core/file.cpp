#include "engine/core/file.h"

#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstdlib>
#include <cstring>

namespace strata {

namespace {

// "pread of 4096 bytes at offset 8192 from /d/x.bin".
std::string describe_transfer(std::string_view op, size_t bytes, uint64_t offset, std::string_view path) {
  std::string text(op);
  text += " of " + std::to_string(bytes) + " bytes at offset " + std::to_string(offset);
  text += op == "pread" ? " from " : " to ";
  text += path;
  return text;
}

// open(2) with EINTR retried; -1 and errno on failure.
int open_retrying(const std::string& path, int flags, mode_t mode) {
  int fd;
  do {
    fd = ::open(path.c_str(), flags | O_CLOEXEC, mode);
  } while (fd < 0 && errno == EINTR);
  return fd;
}

// The O_DIRECT alignment the open file asks for (statx STATX_DIOALIGN), at least a page;
// 0 when it asks for something that is not a power of two (no buffer can satisfy it).
size_t probe_direct_alignment(int fd) {
  size_t alignment = kDirectIoMinAlignment;
#ifdef STATX_DIOALIGN
  struct statx dio {};
  if (::statx(fd, "", AT_EMPTY_PATH, STATX_DIOALIGN, &dio) == 0 && (dio.stx_mask & STATX_DIOALIGN) != 0) {
    const size_t asked = std::max<size_t>(dio.stx_dio_offset_align, dio.stx_dio_mem_align);
    if (asked > alignment) alignment = (asked & (asked - 1)) == 0 ? asked : 0;
  }
#endif
  return alignment;
}

}  // namespace

Status pread_exact(int fd, std::string_view path, void* buffer, size_t bytes, uint64_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t got = ::pread(fd, static_cast<char*>(buffer) + done, bytes - done, static_cast<off_t>(offset + done));
    if (got < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, describe_transfer("pread", bytes - done, offset + done, path));
    }
    if (got == 0) {
      return DataLossError(std::string(path) + " is truncated: " + describe_transfer("pread", bytes, offset, path) +
                           " hit the end of the file after " + std::to_string(done) + " bytes");
    }
    done += static_cast<size_t>(got);
  }
  return Status::Ok();
}

Status pwrite_exact(int fd, std::string_view path, const void* data, size_t bytes, uint64_t offset) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t wrote = ::pwrite(fd, static_cast<const char*>(data) + done, bytes - done, static_cast<off_t>(offset + done));
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, describe_transfer("pwrite", bytes - done, offset + done, path));
    }
    if (wrote == 0) return IoError(describe_transfer("pwrite", bytes - done, offset + done, path) + ": the kernel wrote 0 bytes");
    done += static_cast<size_t>(wrote);
  }
  return Status::Ok();
}

Status write_all(int fd, std::string_view path, const void* data, size_t bytes) {
  size_t done = 0;
  while (done < bytes) {
    const ssize_t wrote = ::write(fd, static_cast<const char*>(data) + done, bytes - done);
    if (wrote < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "write of " + std::to_string(bytes - done) + " bytes to " + std::string(path));
    }
    if (wrote == 0) return IoError("write of " + std::to_string(bytes - done) + " bytes to " + std::string(path) + ": the kernel wrote 0 bytes");
    done += static_cast<size_t>(wrote);
  }
  return Status::Ok();
}

Status fsync_directory(const std::string& path) {
  STRATA_ASSIGN_OR_RETURN(File directory, File::open(path, {.flags = O_RDONLY | O_DIRECTORY}));
  return directory.sync();
}

// ---------------------------------------------------------------------------------------
// File

File::File(File&& other) noexcept
    : fd_(std::exchange(other.fd_, -1)),
      path_(std::move(other.path_)),
      direct_alignment_(std::exchange(other.direct_alignment_, 0)) {}

File& File::operator=(File&& other) noexcept {
  if (this != &other) {
    reset();
    fd_ = std::exchange(other.fd_, -1);
    path_ = std::move(other.path_);
    direct_alignment_ = std::exchange(other.direct_alignment_, 0);
  }
  return *this;
}

StatusOr<File> File::open(const std::string& path, const FileOpenOptions& options) {
  const int flags = options.flags & ~O_DIRECT;
  if (options.direct_io == FileDirectIo::kPreferred) {
    const int fd = open_retrying(path, flags | O_DIRECT, options.mode);
    if (fd >= 0) {
      File direct(fd, path);
      direct.direct_alignment_ = probe_direct_alignment(fd);
      const bool fits = direct.direct_alignment_ != 0 &&
                        (options.max_direct_alignment == 0 || direct.direct_alignment_ <= options.max_direct_alignment);
      if (fits) return direct;
      // Asks for more than the caller's buffers give: reopen the file (it exists now) buffered.
      direct.reset();
      const int plain = open_retrying(path, flags & ~(O_TRUNC | O_EXCL), options.mode);
      if (plain < 0) return Status::FromErrno(errno, "open(" + path + ")");
      return File(plain, path);
    }
    // EINVAL: the file system refuses O_DIRECT; fall through to a buffered open.
    if (errno != EINVAL) return Status::FromErrno(errno, "open(" + path + ")");
  }
  const int fd = open_retrying(path, flags, options.mode);
  if (fd < 0) return Status::FromErrno(errno, "open(" + path + ")");
  return File(fd, path);
}

int File::release() noexcept {
  direct_alignment_ = 0;
  return std::exchange(fd_, -1);
}

void File::reset() noexcept {
  if (fd_ >= 0) ::close(fd_);
  fd_ = -1;
  direct_alignment_ = 0;
}

Status File::close() {
  if (fd_ < 0) return Status::Ok();
  const int fd = release();
  if (::close(fd) != 0 && errno != EINTR) return Status::FromErrno(errno, "close(" + path_ + ")");
  return Status::Ok();
}

StatusOr<std::string> File::read_to_end() const {
  std::string text;
  char buffer[1 << 14];
  for (;;) {
    const ssize_t got = ::read(fd_, buffer, sizeof(buffer));
    if (got < 0) {
      if (errno == EINTR) continue;
      return Status::FromErrno(errno, "read(" + path_ + ")");
    }
    if (got == 0) return text;
    text.append(buffer, static_cast<size_t>(got));
  }
}

Status File::sync() const {
  int ret;
  do {
    ret = ::fsync(fd_);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) return Status::FromErrno(errno, "fsync(" + path_ + ")");
  return Status::Ok();
}

Status File::sync_data() const {
  int ret;
  do {
    ret = ::fdatasync(fd_);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) return Status::FromErrno(errno, "fdatasync(" + path_ + ")");
  return Status::Ok();
}

StatusOr<uint64_t> File::size() const {
  struct stat info {};
  if (::fstat(fd_, &info) != 0) return Status::FromErrno(errno, "fstat(" + path_ + ")");
  return static_cast<uint64_t>(info.st_size);
}

Status File::allocate(uint64_t offset, uint64_t bytes) const {
  int ret;
  do {
    ret = ::fallocate(fd_, 0, static_cast<off_t>(offset), static_cast<off_t>(bytes));
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) {
    return Status::FromErrno(errno, "fallocate(" + path_ + ", " + std::to_string(bytes) + " bytes at offset " +
                                        std::to_string(offset) + ")");
  }
  return Status::Ok();
}

Status File::truncate(uint64_t bytes) const {
  int ret;
  do {
    ret = ::ftruncate(fd_, static_cast<off_t>(bytes));
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) return Status::FromErrno(errno, "ftruncate(" + path_ + ", " + std::to_string(bytes) + " bytes)");
  return Status::Ok();
}

Status File::try_lock_exclusive() const {
  int ret;
  do {
    ret = ::flock(fd_, LOCK_EX | LOCK_NB);
  } while (ret != 0 && errno == EINTR);
  if (ret != 0) return Status::FromErrno(errno, "flock(" + path_ + ")");
  return Status::Ok();
}

// ---------------------------------------------------------------------------------------
// AlignedBuffer

StatusOr<AlignedBuffer> AlignedBuffer::allocate(size_t bytes, size_t alignment, std::string_view purpose) {
  if (alignment < sizeof(void*) || (alignment & (alignment - 1)) != 0) {
    return InvalidArgumentError("aligned buffer: alignment " + std::to_string(alignment) + " is not a power of two >= " +
                                std::to_string(sizeof(void*)));
  }
  const size_t capacity = bytes == 0 ? alignment : (bytes + alignment - 1) / alignment * alignment;
  void* data = std::aligned_alloc(alignment, capacity);
  if (data == nullptr) {
    const std::string what = purpose.empty() ? std::string() : " for '" + std::string(purpose) + "'";
    return OutOfMemoryError("aligned buffer: the heap refused " + std::to_string(capacity) + " bytes" + what + " aligned to " +
                            std::to_string(alignment));
  }
  AlignedBuffer buffer;
  buffer.data_ = static_cast<std::byte*>(data);
  buffer.bytes_ = bytes;
  buffer.capacity_ = capacity;
  return buffer;
}

AlignedBuffer::~AlignedBuffer() { std::free(data_); }

AlignedBuffer::AlignedBuffer(AlignedBuffer&& other) noexcept
    : data_(std::exchange(other.data_, nullptr)),
      bytes_(std::exchange(other.bytes_, 0)),
      capacity_(std::exchange(other.capacity_, 0)) {}

AlignedBuffer& AlignedBuffer::operator=(AlignedBuffer&& other) noexcept {
  if (this != &other) {
    std::free(data_);
    data_ = std::exchange(other.data_, nullptr);
    bytes_ = std::exchange(other.bytes_, 0);
    capacity_ = std::exchange(other.capacity_, 0);
  }
  return *this;
}

}  // namespace strata
