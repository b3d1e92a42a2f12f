// The one file layer: an fd owner, exact positioned reads and writes, fsync helpers,
// O_DIRECT opens with the alignment probe, and aligned host buffers.
//
// Every call retries EINTR and loops over short transfers (liburing's discipline: a
// transfer either moves every byte or fails). Errors are Status values that name the
// operation, the file, the offset and the errno, e.g.
//   "pread of 4096 bytes at offset 8192 from /d/x.bin: Input/output error (errno 5)"
//   "/d/x.bin is truncated: pread of 4096 bytes at offset 8192 hit the end of the file after 100 bytes"
//
// Floor 1: includes the system and engine/core/status.h only.
#pragma once

#include <fcntl.h>
#include <sys/types.h>

#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <utility>

#include "engine/core/status.h"

namespace strata {

// The alignment every O_DIRECT transfer gets at least: a page, which every Linux file
// system that takes O_DIRECT accepts for offsets, lengths and memory.
inline constexpr size_t kDirectIoMinAlignment = 4096;

// Reads exactly `bytes` at `offset`; EINTR is retried, short reads continue. The end of
// the file before `bytes` is kDataLoss naming the file; other failures carry the errno.
// `path` only names the file in errors.
Status pread_exact(int fd, std::string_view path, void* buffer, size_t bytes, uint64_t offset);
// Writes exactly `bytes` at `offset`, as pread_exact.
Status pwrite_exact(int fd, std::string_view path, const void* data, size_t bytes, uint64_t offset);
// Writes all of `bytes` at the file position (pipes, files opened for sequential writes).
Status write_all(int fd, std::string_view path, const void* data, size_t bytes);

// Flushes `path`'s entry in its directory (after a create or a rename) to the disk.
Status fsync_directory(const std::string& path);

enum class FileDirectIo : uint8_t {
  kOff,        // buffered (the page cache)
  kPreferred,  // O_DIRECT where the file system takes it, else buffered: File::direct_io() says which
};

struct FileOpenOptions {
  int flags = O_RDONLY;                      // open(2) flags; O_CLOEXEC is always added
  mode_t mode = 0644;                        // for O_CREAT
  FileDirectIo direct_io = FileDirectIo::kOff;
  size_t max_direct_alignment = 0;           // kPreferred: a file that asks for more is reopened buffered (0: any)
};

// A move-only owner of a file descriptor and of the path that names it in errors. Also
// owns descriptors that are not files (sockets, pipes, directories): only fd() and the
// closing matter for those.
class File {
 public:
  File() = default;
  // Adopts `fd` (closed by the destructor).
  File(int fd, std::string path) noexcept : fd_(fd), path_(std::move(path)) {}
  ~File() { reset(); }
  File(const File&) = delete;
  File& operator=(const File&) = delete;
  File(File&& other) noexcept;
  File& operator=(File&& other) noexcept;

  // Opens `path`; EINTR is retried. The error is "open(<path>): <strerror> (errno N)"
  // (error_number() tells ENOENT from the rest).
  static StatusOr<File> open(const std::string& path, const FileOpenOptions& options = {});

  int fd() const { return fd_; }
  bool is_open() const { return fd_ >= 0; }
  const std::string& path() const { return path_; }
  // True when opened with O_DIRECT; then transfers need direct_io_alignment() for their
  // offsets, lengths and memory.
  bool direct_io() const { return direct_alignment_ != 0; }
  // What the file asked for (statx STATX_DIOALIGN), never below kDirectIoMinAlignment;
  // 0 for buffered files.
  size_t direct_io_alignment() const { return direct_alignment_; }

  // Gives the descriptor up without closing it.
  int release() noexcept;
  // Closes, ignoring the result: on Linux the descriptor is gone even when close() fails,
  // so close() is never retried (EINTR included).
  void reset() noexcept;
  // Closes and reports close()'s error (a delayed write error, on NFS say).
  Status close();

  Status read_exact(void* buffer, size_t bytes, uint64_t offset) const { return pread_exact(fd_, path_, buffer, bytes, offset); }
  Status write_exact(const void* data, size_t bytes, uint64_t offset) const {
    return pwrite_exact(fd_, path_, data, bytes, offset);
  }
  Status write_all(const void* data, size_t bytes) const { return strata::write_all(fd_, path_, data, bytes); }
  // Reads from the file position to the end (small files: configs, manifests).
  StatusOr<std::string> read_to_end() const;

  Status sync() const;       // fsync
  Status sync_data() const;  // fdatasync
  StatusOr<uint64_t> size() const;
  // fallocate(mode 0): reserves [offset, offset + bytes). EOPNOTSUPP comes back as its errno.
  Status allocate(uint64_t offset, uint64_t bytes) const;
  Status truncate(uint64_t bytes) const;
  // flock(LOCK_EX | LOCK_NB); error_number() is EWOULDBLOCK while another open file holds
  // the lock. The lock goes with the descriptor.
  Status try_lock_exclusive() const;

 private:
  int fd_ = -1;
  std::string path_;
  size_t direct_alignment_ = 0;
};

// A move-only heap buffer aligned for O_DIRECT: its capacity is the size rounded up to the
// alignment, so a transfer of the padded length stays inside it.
class AlignedBuffer {
 public:
  AlignedBuffer() = default;
  // kOutOfMemory when the heap refuses, naming `purpose` when given; `alignment` is a power
  // of two >= sizeof(void*).
  static StatusOr<AlignedBuffer> allocate(size_t bytes, size_t alignment = kDirectIoMinAlignment, std::string_view purpose = {});
  ~AlignedBuffer();
  AlignedBuffer(const AlignedBuffer&) = delete;
  AlignedBuffer& operator=(const AlignedBuffer&) = delete;
  AlignedBuffer(AlignedBuffer&& other) noexcept;
  AlignedBuffer& operator=(AlignedBuffer&& other) noexcept;

  std::byte* data() const { return data_; }
  template <class T>
  T* as() const { return reinterpret_cast<T*>(data_); }
  size_t size() const { return bytes_; }          // as asked
  size_t capacity() const { return capacity_; }  // size rounded up to the alignment (at least one unit)

 private:
  std::byte* data_ = nullptr;
  size_t bytes_ = 0;
  size_t capacity_ = 0;
};

}  // namespace strata
