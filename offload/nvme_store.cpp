#include "offload/nvme_store.h"

#include <fcntl.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <utility>
#include <vector>

#include "engine/core/check.h"
#include "engine/core/log.h"
#include "offload/checksum.h"
#include "offload/offload_util.h"
#include "offload/range_allocator.h"

namespace strata {

using offload_internal::format_bytes;
using offload_internal::is_aligned;
using offload_internal::round_up;

struct NvmeStore::Extent {
  std::string key;
  uint64_t file_offset = 0;
  size_t bytes = 0;
  size_t disk_bytes = 0;
  std::vector<uint64_t> checksums;   // per block: XXH64 of the block's bytes (checksums on)
  std::vector<uint8_t> block_valid;  // per block: the last write of it succeeded
  unsigned inflight = 0;             // transfers in flight on this extent
};

struct NvmeStore::Shared {
  std::mutex mutex;
  std::condition_variable idle;  // inflight dropped to zero
  std::unordered_map<uint64_t, Extent> extents;
  std::unordered_map<std::string, uint64_t> keys;
  uint64_t next_id = 1;
  std::unique_ptr<internal::RangeAllocator> allocator;
  uint64_t file_bytes = 0;
  unsigned inflight = 0;
  NvmeStoreStats stats;

  // Ends one transfer on extent `id` (mutex held); the last one in flight wakes the waiters.
  void end_transfer(uint64_t id) {
    --extents.at(id).inflight;
    if (--inflight == 0) idle.notify_all();
  }
};

namespace {

std::string hex64(uint64_t value) {
  char text[24];
  std::snprintf(text, sizeof(text), "0x%016llx", static_cast<unsigned long long>(value));
  return text;
}

// Bytes the file system can still give us, for error messages.
std::string free_space_text(const std::string& path) {
  struct statvfs info {};
  if (::statvfs(path.c_str(), &info) != 0) return "unknown free space";
  return format_bytes(static_cast<uint64_t>(info.f_bavail) * info.f_frsize) + " free";
}

bool is_not_writable_errno(int error) { return error == EROFS || error == EACCES || error == EPERM; }

// XXH64 of each `block_bytes` block of data[0, bytes) (the last one may be short).
std::vector<uint64_t> block_checksums(const char* data, size_t bytes, size_t block_bytes) {
  std::vector<uint64_t> sums((bytes + block_bytes - 1) / block_bytes);
  for (size_t i = 0; i < sums.size(); ++i) {
    sums[i] = xxhash64(data + i * block_bytes, std::min(block_bytes, bytes - i * block_bytes));
  }
  return sums;
}

// Gives a transfer its store-side completion: `finish` checks or records checksums, copies
// out of a bounce buffer and does the bookkeeping. Work on the bytes (`heavy`) runs as the
// engine's verify hook, beside the I/O; bookkeeping alone runs where the completion is
// reaped. `completed_at` is stamped when the transfer itself finishes, before any checks.
void set_completion_hooks(IoRequest& request, IoCompletionHook finish, bool heavy,
                          std::chrono::steady_clock::time_point* completed_at) {
  if (!heavy) {
    request.on_complete = [finish = std::move(finish), completed_at](const Status& transfer) {
      if (completed_at != nullptr) *completed_at = std::chrono::steady_clock::now();
      return finish(transfer);
    };
    return;
  }
  if (completed_at != nullptr) {
    request.on_complete = [completed_at](const Status& transfer) {
      *completed_at = std::chrono::steady_clock::now();
      return transfer;
    };
  }
  request.verify = std::move(finish);
}

}  // namespace

// A write's block checksums, computed once by whichever thread comes first: the writer
// right after submitting (the disk writes meanwhile), or the request's verify hook when
// the write finished before the writer got to them.
class NvmeStore::WriteChecksums {
 public:
  void compute_unless_started(const char* data, size_t bytes, size_t block_bytes) {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      if (state_ != State::kNotStarted) return;
      state_ = State::kComputing;
    }
    std::vector<uint64_t> sums = block_checksums(data, bytes, block_bytes);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      sums_ = std::move(sums);
      state_ = State::kDone;
    }
    computed_.notify_all();
  }
  // The checksums, computing them here if nobody has started.
  std::vector<uint64_t> get(const char* data, size_t bytes, size_t block_bytes) {
    compute_unless_started(data, bytes, block_bytes);
    std::unique_lock<std::mutex> lock(mutex_);
    computed_.wait(lock, [&] { return state_ == State::kDone; });
    return sums_;
  }

 private:
  enum class State : uint8_t { kNotStarted, kComputing, kDone };
  std::mutex mutex_;
  std::condition_variable computed_;
  State state_ = State::kNotStarted;
  std::vector<uint64_t> sums_;
};

// "pid N" from the pid file the lock holder wrote, "pid unknown" when it is gone.
std::string NvmeStore::lock_holder() const {
  char text[32] = {};
  const int fd = ::open(lock_path_.c_str(), O_RDONLY | O_CLOEXEC);
  const ssize_t got = fd >= 0 ? ::pread(fd, text, sizeof(text) - 1, 0) : -1;  // best effort: only names the holder
  if (fd >= 0) ::close(fd);
  const long holder = got > 0 ? std::strtol(text, nullptr, 10) : 0;
  std::string who = holder > 0 ? "pid " + std::to_string(holder) : "pid unknown";
  if (holder == static_cast<long>(::getpid())) who += ", this process: another NvmeStore of rank " + std::to_string(options_.rank) + " is open";
  return who;
}

NvmeStore::NvmeStore(ConstructionKey) : shared_(std::make_shared<Shared>()) {}

namespace {
// A rank's files under nvme_path share this stem: <stem>.swap (data), <stem>.lock (holder).
std::string rank_stem(const std::string& nvme_path, int rank) { return nvme_path + "/strata-rank" + std::to_string(rank); }
}  // namespace

std::string NvmeStore::file_path_for(const std::string& nvme_path, int rank) { return rank_stem(nvme_path, rank) + ".swap"; }

StatusOr<size_t> NvmeStore::room_bytes(const std::string& nvme_path, int rank) {
  std::error_code ignored;
  std::filesystem::path at = std::filesystem::absolute(nvme_path, ignored);
  while (!at.empty() && !std::filesystem::exists(at, ignored)) {
    if (at == at.parent_path()) break;
    at = at.parent_path();
  }
  struct statvfs fs {};
  if (at.empty() || statvfs(at.c_str(), &fs) != 0) {
    return Status::FromErrno(at.empty() ? ENOENT : errno, "nvme_path " + nvme_path + ": cannot ask its file system for free space (statvfs)");
  }
  size_t room = static_cast<size_t>(fs.f_bavail) * static_cast<size_t>(fs.f_frsize);
  // Blocks the file holds, not its length: a sparse file grows into free space.
  struct stat left {};
  if (::stat(file_path_for(nvme_path, rank).c_str(), &left) == 0) room += static_cast<size_t>(left.st_blocks) * 512;
  return room;
}

StatusOr<std::unique_ptr<NvmeStore>> NvmeStore::open(const NvmeStoreOptions& options, IoEngine* engine) {
  if (options.nvme_path.empty()) return InvalidArgumentError("nvme store: nvme_path is empty");
  if (options.rank < 0) return InvalidArgumentError("nvme store: rank " + std::to_string(options.rank) + " is negative");
  if (options.checksum_block_bytes == 0 || options.checksum_block_bytes % 4096 != 0) {
    return InvalidArgumentError("nvme store: checksum_block_bytes " + std::to_string(options.checksum_block_bytes) +
                                " must be a positive multiple of 4096");
  }
  auto store = std::make_unique<NvmeStore>(ConstructionKey());
  store->options_ = options;
  store->directory_ = options.nvme_path;
  store->file_path_ = file_path_for(store->directory_, options.rank);
  store->lock_path_ = rank_stem(store->directory_, options.rank) + ".lock";
  STRATA_RETURN_IF_ERROR(store->open_files());
  if (engine == nullptr) {
    STRATA_ASSIGN_OR_RETURN(store->owned_engine_, IoEngine::create(options.io));
    engine = store->owned_engine_.get();
  }
  store->engine_ = engine;
  STRATA_ASSIGN_OR_RETURN(store->io_file_, engine->register_file(store->data_file_.fd(), store->file_path_));
  STRATA_LOG(kDebug) << "nvme store: " << store->file_path_ << " (" << format_bytes(store->shared_->file_bytes) << ", "
                     << (store->direct_io_ ? "O_DIRECT" : "buffered") << ", alignment " << store->alignment_ << ", "
                     << engine->name() << " queue depth " << engine->queue_depth() << ")";
  return store;
}

Status NvmeStore::open_files() {
  namespace fs = std::filesystem;
  std::error_code error;
  const fs::path directory(directory_);
  if (fs::exists(directory, error) && !fs::is_directory(directory, error)) {
    return InvalidArgumentError("nvme store: nvme_path '" + directory_ + "' exists but is not a directory");
  }
  fs::create_directories(directory, error);
  if (error) {
    return Status(error.value() == EROFS || error.value() == EACCES ? StatusCode::kFailedPrecondition
                                                                    : StatusCode::kInvalidArgument,
                  "nvme store: cannot create nvme_path '" + directory_ + "': " + error.message());
  }

  // The data file: O_DIRECT where the file system takes it, at the alignment it asks for.
  // It is its own lock (flock), taken before anything reads or writes it: a side file
  // could be deleted, after which a second process would write into this one's data.
  StatusOr<File> data_file =
      File::open(file_path_, {.flags = O_RDWR | O_CREAT,
                              .direct_io = options_.direct_io ? FileDirectIo::kPreferred : FileDirectIo::kOff});
  if (!data_file.ok()) {
    Status status = std::move(data_file).status();
    if (is_not_writable_errno(status.error_number())) {
      return FailedPreconditionError("nvme store: nvme_path '" + directory_ + "' is not writable: " + status.message());
    }
    return std::move(status).with_context("nvme store: cannot open the data file");
  }
  Status locked = data_file->try_lock_exclusive();
  if (!locked.ok()) {
    if (locked.error_number() != EWOULDBLOCK) return locked;
    return AlreadyExistsError("nvme store: nvme_path '" + directory_ + "' is in use by another live process (" + lock_holder() +
                              ", holding a lock on " + file_path_ + "); give each run its own nvme_path or rank");
  }
  data_file_ = std::move(data_file).value();
  // The owner's pid, only to name it in a refusal.
  StatusOr<File> pid_file = File::open(lock_path_, {.flags = O_RDWR | O_CREAT | O_TRUNC});
  Status written = pid_file.ok() ? Status::Ok() : pid_file.status();
  const std::string pid_text = std::to_string(::getpid()) + "\n";
  if (written.ok()) written = pid_file->write_exact(pid_text.data(), pid_text.size(), 0);
  if (!written.ok()) {
    return FailedPreconditionError("nvme store: nvme_path '" + directory_ + "' is not writable: " + written.message());
  }
  direct_io_ = data_file_.direct_io();
  if (options_.direct_io && !direct_io_) {
    STRATA_LOG(kWarn) << "nvme store: the file system under '" << directory_
                      << "' refuses O_DIRECT; using buffered I/O (the page cache) for " << file_path_;
  }
  // Never below 4 KiB (page-sized buffers), also when buffered.
  alignment_ = direct_io_ ? data_file_.direct_io_alignment() : kDirectIoMinAlignment;
  if (options_.checksum_block_bytes % alignment_ != 0) {
    return InvalidArgumentError("nvme store: checksum_block_bytes " + std::to_string(options_.checksum_block_bytes) +
                                " is not a multiple of " + file_path_ + "'s O_DIRECT alignment " + std::to_string(alignment_));
  }

  STRATA_ASSIGN_OR_RETURN(const uint64_t file_size, data_file_.size());
  // A file a finished run left is reused: all of it is free space now.
  const uint64_t reused = file_size / alignment_ * alignment_;
  shared_->file_bytes = reused;
  shared_->allocator = std::make_unique<internal::RangeAllocator>(reused, alignment_);
  if (reused > 0) STRATA_LOG(kDebug) << "nvme store: reusing " << file_path_ << " (" << format_bytes(reused) << ")";
  if (options_.initial_bytes > reused) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    STRATA_RETURN_IF_ERROR(grow_file(round_up(options_.initial_bytes, alignment_), "(initial preallocation)",
                                     options_.initial_bytes, 0));
  }
  return Status::Ok();
}

NvmeStore::~NvmeStore() {
  if (shared_ != nullptr) {
    std::unique_lock<std::mutex> lock(shared_->mutex);
    shared_->idle.wait(lock, [&] { return shared_->inflight == 0; });
  }
  if (engine_ != nullptr && io_file_.valid()) {
    Status status = engine_->unregister_file(io_file_);
    if (!status.ok()) STRATA_LOG(kWarn) << "nvme store: " << status.to_string();
  }
  owned_engine_.reset();
  if (options_.remove_files_on_close && data_file_.is_open()) {
    // Unlinked while the flock is still held: no other store can have opened them meanwhile.
    for (const std::string& path : {file_path_, lock_path_}) {
      if (::unlink(path.c_str()) != 0 && errno != ENOENT)
        STRATA_LOG(kWarn) << "nvme store: cannot remove " << path << ": " << std::strerror(errno);
    }
  }
  data_file_.reset();  // releases the flock
}

// mutex held. Makes the allocator's free tail at least `needed_bytes` long, growing the
// file by at least `growth_step` (fewer growths, fewer fallocate calls).
Status NvmeStore::grow_file(size_t needed_bytes, std::string_view key, size_t extent_bytes, size_t growth_step) {
  Shared& s = *shared_;
  const uint64_t old_size = s.file_bytes;
  const size_t tail = s.allocator->free_tail_bytes();
  const size_t need = needed_bytes > tail ? needed_bytes - tail : 0;
  if (need == 0) return Status::Ok();
  size_t grow_by = round_up(std::max(need, growth_step), alignment_);
  Status grown;
  for (;;) {
    grown = data_file_.allocate(old_size, grow_by);
    if (grown.ok()) break;
    if (grown.error_number() == EOPNOTSUPP) {
      // The file system cannot reserve blocks: extend the size only. A full disk then shows
      // up as a failed write, which marks that extent unreadable and nothing else.
      STRATA_LOG_ONCE(kWarn) << "nvme store: fallocate is not supported under '" << directory_
                             << "'; growing " << file_path_ << " without reserving blocks";
      grown = data_file_.truncate(old_size + grow_by);
      if (grown.ok()) break;
    }
    // Out of room for the growth step: try the bare need before giving up.
    const int grow_errno = grown.error_number();
    if ((grow_errno == ENOSPC || grow_errno == EDQUOT || grow_errno == EFBIG) && grow_by > need) {
      grow_by = need;
      continue;
    }
    break;
  }
  if (!grown.ok()) {
    const int grow_errno = grown.error_number();
    return Status(grow_errno == ENOSPC || grow_errno == EDQUOT || grow_errno == EFBIG ? StatusCode::kResourceExhausted
                                                                                       : grown.code(),
                  "nvme store: the disk under '" + directory_ + "' cannot hold " + format_bytes(need) +
                      " more for extent '" + std::string(key) + "' (" + format_bytes(extent_bytes) + "): " +
                      grown.message() + "; the file system has " + free_space_text(directory_) + ", " + file_path_ +
                      " holds " + format_bytes(old_size));
  }
  s.file_bytes = old_size + grow_by;
  s.allocator->grow(s.file_bytes);
  s.stats.file_bytes = s.file_bytes;
  return Status::Ok();
}

StatusOr<NvmeExtent> NvmeStore::allocate(std::string_view key, size_t bytes) {
  if (bytes == 0) return InvalidArgumentError("nvme store: extent '" + std::string(key) + "' needs at least one byte");
  Shared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  if (s.keys.count(std::string(key)) != 0) {
    return AlreadyExistsError("nvme store: an extent named '" + std::string(key) + "' already exists in " + file_path_);
  }
  const size_t disk_bytes = round_up(bytes, alignment_);
  std::optional<size_t> offset = s.allocator->allocate(disk_bytes);
  if (!offset) {
    STRATA_RETURN_IF_ERROR(grow_file(disk_bytes, key, bytes, options_.growth_bytes));
    offset = s.allocator->allocate(disk_bytes);
    if (!offset) return InternalError("nvme store: no room for extent '" + std::string(key) + "' after growing the file");
  }
  const uint64_t id = s.next_id++;
  Extent extent;
  extent.key = std::string(key);
  extent.file_offset = *offset;
  extent.bytes = bytes;
  extent.disk_bytes = disk_bytes;
  const size_t blocks = (bytes + transfer_granularity() - 1) / transfer_granularity();
  extent.block_valid.assign(blocks, 0);
  if (options_.checksums) extent.checksums.assign(blocks, 0);
  s.keys.emplace(extent.key, id);
  s.extents.emplace(id, std::move(extent));
  s.stats.allocated_bytes += disk_bytes;
  ++s.stats.extents;
  return NvmeExtent{id};
}

StatusOr<NvmeExtent> NvmeStore::find(std::string_view key) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  auto it = shared_->keys.find(std::string(key));
  if (it == shared_->keys.end()) return NotFoundError("nvme store: no extent named '" + std::string(key) + "' in " + file_path_);
  return NvmeExtent{it->second};
}

StatusOr<NvmeExtentInfo> NvmeStore::info(NvmeExtent handle) const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  auto it = shared_->extents.find(handle.id);
  if (it == shared_->extents.end()) return NotFoundError("nvme store: extent id " + std::to_string(handle.id) + " does not exist");
  const Extent& extent = it->second;
  NvmeExtentInfo info;
  info.key = extent.key;
  info.file_offset = extent.file_offset;
  info.bytes = extent.bytes;
  info.disk_bytes = extent.disk_bytes;
  info.readable = std::all_of(extent.block_valid.begin(), extent.block_valid.end(), [](uint8_t v) { return v != 0; });
  return info;
}

Status NvmeStore::free(NvmeExtent handle) {
  Shared& s = *shared_;
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.extents.find(handle.id);
  if (it == s.extents.end()) return NotFoundError("nvme store: extent id " + std::to_string(handle.id) + " does not exist");
  if (it->second.inflight != 0) {
    return FailedPreconditionError("nvme store: cannot free extent '" + it->second.key + "' while " +
                                   std::to_string(it->second.inflight) + " transfer(s) on it are in flight");
  }
  s.allocator->free(it->second.file_offset, it->second.disk_bytes);
  s.stats.allocated_bytes -= it->second.disk_bytes;
  --s.stats.extents;
  s.keys.erase(it->second.key);
  s.extents.erase(it);
  return Status::Ok();
}

Status NvmeStore::check_range(const Extent& extent, size_t bytes, size_t extent_offset, const char* what) const {
  auto describe = [&] {
    return std::string("nvme store: ") + what + " of extent '" + extent.key + "' (" + std::to_string(extent.bytes) +
           " bytes): bytes [" + std::to_string(extent_offset) + ", " + std::to_string(extent_offset + bytes) + ")";
  };
  if (bytes == 0) return InvalidArgumentError(describe() + " is empty");
  if (extent_offset > extent.bytes || bytes > extent.bytes - extent_offset) {
    return InvalidArgumentError(describe() + " run past the extent's end");
  }
  const bool reaches_end = extent_offset + bytes == extent.bytes;
  const size_t granule = transfer_granularity();
  // A checksum block is a multiple of 4 KiB, not always a power of two: modulo, not a mask.
  if (extent_offset % granule != 0 || (!reaches_end && bytes % granule != 0)) {
    return InvalidArgumentError(describe() + " must start on a multiple of " + std::to_string(granule) +
                                " bytes and end on one or at the extent's end (" +
                                (options_.checksums ? "the checksum block" : "the O_DIRECT alignment") + ")");
  }
  return Status::Ok();
}

// One ranged write or read of an extent, as its steps and its completion see it.
struct NvmeStore::Transfer {
  Transfer(uint64_t id, size_t bytes, size_t extent_offset, size_t block_bytes, std::string file_path)
      : id(id), bytes(bytes), extent_offset(extent_offset), block_bytes(block_bytes), file_path(std::move(file_path)) {}

  uint64_t id = 0;           // the extent's handle
  std::string key;           // the extent's name
  size_t bytes = 0;          // the caller's bytes
  size_t extent_offset = 0;  // where they start in the extent
  uint64_t file_offset = 0;  // where they start in the file
  size_t io_bytes = 0;       // `bytes` rounded up to the alignment
  size_t block_bytes = 0;    // the transfer granularity (the checksum block with checksums on)
  size_t first_block = 0;    // the first block the transfer touches
  size_t blocks = 0;         // blocks the transfer covers
  std::string file_path;
  std::shared_ptr<AlignedBuffer> bounce;  // the staging buffer; null when the caller's buffer is used

  // "extent 'k' bytes [a, b) at file offset f of path", for messages.
  std::string describe() const {
    return "extent '" + key + "' bytes [" + std::to_string(extent_offset) + ", " +
           std::to_string(extent_offset + bytes) + ") at file offset " + std::to_string(file_offset) + " of " +
           file_path;
  }
};

StatusOr<IoTicket> NvmeStore::write_async(NvmeExtent handle, const void* src, size_t bytes, size_t extent_offset,
                                          size_t src_capacity, std::chrono::steady_clock::time_point* completed_at) {
  if (src == nullptr) return InvalidArgumentError("nvme store: write from a null buffer");
  Shared& s = *shared_;
  StatusOr<Transfer> planned = plan_write(handle, bytes, extent_offset);
  if (!planned.ok()) return planned.status();
  Transfer transfer = std::move(planned).value();
  const size_t capacity = src_capacity == 0 ? bytes : src_capacity;
  const bool direct = is_aligned(reinterpret_cast<uintptr_t>(src), alignment_) && capacity >= transfer.io_bytes;
  const char* data = static_cast<const char*>(src);
  if (!direct) {
    STRATA_LOG_ONCE(kDebug) << "nvme store: a write from an unaligned or short buffer goes through a bounce buffer";
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::allocate(transfer.io_bytes, alignment_));
    transfer.bounce = std::make_shared<AlignedBuffer>(std::move(buffer));
    std::memcpy(transfer.bounce->data(), src, bytes);
    std::memset(transfer.bounce->data() + bytes, 0, transfer.io_bytes - bytes);
    data = transfer.bounce->as<const char>();
  }
  {
    std::lock_guard<std::mutex> lock(s.mutex);
    auto it = s.extents.find(handle.id);
    if (it == s.extents.end()) return NotFoundError("nvme store: extent '" + transfer.key + "' was freed");
    // Until this write lands, the blocks it covers hold nothing trustworthy.
    for (size_t i = 0; i < transfer.blocks; ++i) it->second.block_valid[transfer.first_block + i] = 0;
    ++it->second.inflight;
    ++s.inflight;
    if (transfer.bounce) ++s.stats.bounce_transfers;
  }
  IoRequest request;
  request.op = IoOp::kWrite;
  request.file = io_file_;
  request.buffer = const_cast<char*>(data);  // the engine only reads it for a write
  request.bytes = transfer.io_bytes;
  request.offset = transfer.file_offset;
  // The checksums are computed while the write is in flight: by this thread once the
  // request is submitted, or by whichever thread finishes the request first (the verify
  // hook), so a fast completion never waits for a thread that has not started. The
  // blocks become readable with them.
  const bool checksums = options_.checksums;
  auto pending_sums = checksums ? std::make_shared<WriteChecksums>() : nullptr;
  const size_t block_bytes = transfer.block_bytes;
  // This thread may still be hashing the bounce buffer when a failed write's completion
  // has run and dropped the transfer: it keeps the buffer until it is done.
  const std::shared_ptr<AlignedBuffer> hashing = transfer.bounce;
  set_completion_hooks(request, write_completion(shared_, std::move(transfer), data, pending_sums), checksums,
                       completed_at);
  StatusOr<IoTicket> ticket = submit_transfer(std::move(request), handle.id);
  if (ticket.ok() && pending_sums != nullptr) pending_sums->compute_unless_started(data, bytes, block_bytes);
  return ticket;
}

// The first step of a write (mutex taken): the extent looked up, the range checked, the
// blocks it covers.
StatusOr<NvmeStore::Transfer> NvmeStore::plan_write(NvmeExtent handle, size_t bytes, size_t extent_offset) const {
  Transfer transfer(handle.id, bytes, extent_offset, transfer_granularity(), file_path_);
  {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    auto it = shared_->extents.find(handle.id);
    if (it == shared_->extents.end())
      return NotFoundError("nvme store: extent id " + std::to_string(handle.id) + " does not exist");
    const Extent& extent = it->second;
    STRATA_RETURN_IF_ERROR(check_range(extent, bytes, extent_offset, "write"));
    transfer.key = extent.key;
    transfer.file_offset = extent.file_offset + extent_offset;
    transfer.io_bytes = round_up(bytes, alignment_);  // the padding up to the alignment belongs to the extent
    transfer.first_block = extent_offset / transfer.block_bytes;
  }
  // The blocks this write touches (with checksums on, it starts on a block boundary).
  transfer.blocks = (extent_offset + bytes - 1) / transfer.block_bytes - transfer.first_block + 1;
  return transfer;
}

// A write's completion: with checksums, the blocks' sums recorded; the blocks readable
// again once the write landed.
IoCompletionHook NvmeStore::write_completion(std::shared_ptr<Shared> shared, Transfer transfer, const char* data,
                                             std::shared_ptr<WriteChecksums> pending_sums) {
  return [shared = std::move(shared), transfer = std::move(transfer), data,
          pending_sums = std::move(pending_sums)](const Status& result) -> Status {
    std::vector<uint64_t> sums;
    if (result.ok() && pending_sums != nullptr) sums = pending_sums->get(data, transfer.bytes, transfer.block_bytes);
    std::lock_guard<std::mutex> lock(shared->mutex);
    Extent& extent = shared->extents.at(transfer.id);
    if (result.ok()) {
      for (size_t i = 0; i < transfer.blocks; ++i) {
        extent.block_valid[transfer.first_block + i] = 1;
        if (!sums.empty()) extent.checksums[transfer.first_block + i] = sums[i];
      }
      shared->stats.bytes_written += transfer.bytes;
    }
    shared->end_transfer(transfer.id);
    if (result.ok()) return Status::Ok();
    Status failed = result;
    return std::move(failed).with_context("nvme store: write of " + transfer.describe() +
                                          " failed; those bytes of the extent are not readable");
  };
}

StatusOr<IoTicket> NvmeStore::read_async(NvmeExtent handle, void* dst, size_t bytes, size_t extent_offset,
                                         size_t dst_capacity, std::chrono::steady_clock::time_point* completed_at) {
  if (dst == nullptr) return InvalidArgumentError("nvme store: read into a null buffer");
  std::vector<uint64_t> expected;
  StatusOr<Transfer> started = start_read(handle, dst, bytes, extent_offset, dst_capacity, &expected);
  if (!started.ok()) return started.status();
  Transfer transfer = std::move(started).value();
  IoRequest request;
  request.op = IoOp::kRead;
  request.file = io_file_;
  request.buffer = transfer.bounce ? transfer.bounce->data() : dst;
  request.bytes = transfer.io_bytes;
  request.offset = transfer.file_offset;
  // Verified on a verifier thread beside the I/O of the requests behind this one
  // (IoRequest::verify); the ticket completes, and dst is handed over, only after.
  const bool heavy = !expected.empty() || transfer.bounce != nullptr;
  set_completion_hooks(request, read_completion(shared_, std::move(transfer), std::move(expected), dst), heavy,
                       completed_at);
  return submit_transfer(std::move(request), handle.id);
}

// The first step of a read (mutex taken): the extent looked up, the range checked and
// found valid, the checksums to expect copied out, a bounce buffer when `dst` cannot take
// the transfer, and the read counted in flight.
StatusOr<NvmeStore::Transfer> NvmeStore::start_read(NvmeExtent handle, const void* dst, size_t bytes,
                                                    size_t extent_offset, size_t dst_capacity,
                                                    std::vector<uint64_t>* expected) {
  Shared& s = *shared_;
  Transfer transfer(handle.id, bytes, extent_offset, transfer_granularity(), file_path_);
  const size_t block_bytes = transfer.block_bytes;
  const size_t first_block = extent_offset / block_bytes;
  const size_t blocks = (bytes + block_bytes - 1) / block_bytes;
  const size_t capacity = dst_capacity == 0 ? bytes : dst_capacity;
  std::lock_guard<std::mutex> lock(s.mutex);
  auto it = s.extents.find(handle.id);
  if (it == s.extents.end()) return NotFoundError("nvme store: extent id " + std::to_string(handle.id) + " does not exist");
  Extent& extent = it->second;
  STRATA_RETURN_IF_ERROR(check_range(extent, bytes, extent_offset, "read"));
  transfer.key = extent.key;
  // Blocks touched by the range (with checksums off a range may end inside a block).
  const size_t last_block = (extent_offset + bytes - 1) / block_bytes;
  for (size_t b = first_block; b <= last_block; ++b) {
    if (extent.block_valid[b] == 0) {
      return FailedPreconditionError("nvme store: extent '" + transfer.key + "' bytes [" +
                                     std::to_string(b * block_bytes) + ", " +
                                     std::to_string(std::min(extent.bytes, (b + 1) * block_bytes)) +
                                     ") hold no valid data: never written, or their last write failed (" +
                                     file_path_ + ")");
    }
  }
  if (options_.checksums) expected->assign(extent.checksums.begin() + first_block, extent.checksums.begin() + first_block + blocks);
  transfer.file_offset = extent.file_offset + extent_offset;
  transfer.io_bytes = round_up(bytes, alignment_);
  const bool direct = is_aligned(reinterpret_cast<uintptr_t>(dst), alignment_) && capacity >= transfer.io_bytes;
  if (!direct) {
    STRATA_LOG_ONCE(kDebug) << "nvme store: a read into an unaligned or short buffer goes through a bounce buffer";
    STRATA_ASSIGN_OR_RETURN(AlignedBuffer buffer, AlignedBuffer::allocate(transfer.io_bytes, alignment_));
    transfer.bounce = std::make_shared<AlignedBuffer>(std::move(buffer));
    ++s.stats.bounce_transfers;
  }
  ++extent.inflight;
  ++s.inflight;
  return transfer;
}

// A read's completion: every block checked against its stored checksum (the first
// mismatch reported, the others counted), then the bytes copied out of the bounce buffer.
IoCompletionHook NvmeStore::read_completion(std::shared_ptr<Shared> shared, Transfer transfer,
                                            std::vector<uint64_t> expected, void* dst) {
  return [shared = std::move(shared), transfer = std::move(transfer), expected = std::move(expected),
          dst](const Status& result) -> Status {
    Status status = result;
    const size_t bytes = transfer.bytes;
    const char* data = transfer.bounce ? transfer.bounce->as<const char>() : static_cast<const char*>(dst);
    size_t mismatches = 0;
    if (status.ok()) {
      // Verify every block; report the first mismatch.
      for (size_t i = 0; i < expected.size(); ++i) {
        const size_t begin = i * transfer.block_bytes;
        const size_t length = std::min(transfer.block_bytes, bytes - begin);
        const uint64_t got = xxhash64(data + begin, length);
        if (got == expected[i]) continue;
        if (mismatches++ == 0) {
          status = DataLossError("nvme store: checksum mismatch in extent '" + transfer.key + "' of " +
                                 transfer.file_path + " at file offset " + std::to_string(transfer.file_offset + begin) +
                                 " (extent bytes [" + std::to_string(transfer.extent_offset + begin) + ", " +
                                 std::to_string(transfer.extent_offset + begin + length) + ")): stored " +
                                 hex64(expected[i]) + ", read " + hex64(got));
        }
      }
      if (mismatches > 1) status.with_context(std::to_string(mismatches) + " blocks of the read failed their checksum");
      if (status.ok() && transfer.bounce) std::memcpy(dst, transfer.bounce->data(), bytes);
    } else {
      status.with_context("nvme store: read of " + transfer.describe() + " failed");
    }
    std::lock_guard<std::mutex> lock(shared->mutex);
    if (status.ok()) shared->stats.bytes_read += bytes;
    shared->stats.checksum_failures += mismatches;
    shared->end_transfer(transfer.id);
    return status;
  };
}

// Submits a transfer already counted in flight; uncounts it when the engine refuses it.
StatusOr<IoTicket> NvmeStore::submit_transfer(IoRequest request, uint64_t id) {
  StatusOr<IoTicket> ticket = engine_->submit(std::move(request));
  if (!ticket.ok()) {
    std::lock_guard<std::mutex> lock(shared_->mutex);
    shared_->end_transfer(id);
  }
  return ticket;
}

Status NvmeStore::write(NvmeExtent extent, const void* src, size_t bytes, size_t extent_offset, size_t src_capacity) {
  STRATA_ASSIGN_OR_RETURN(IoTicket ticket, write_async(extent, src, bytes, extent_offset, src_capacity));
  return wait(ticket);
}

Status NvmeStore::read(NvmeExtent extent, void* dst, size_t bytes, size_t extent_offset, size_t dst_capacity) {
  STRATA_ASSIGN_OR_RETURN(IoTicket ticket, read_async(extent, dst, bytes, extent_offset, dst_capacity));
  return wait(ticket);
}

NvmeStoreStats NvmeStore::stats() const {
  std::lock_guard<std::mutex> lock(shared_->mutex);
  NvmeStoreStats stats = shared_->stats;
  stats.file_bytes = shared_->file_bytes;
  return stats;
}

}  // namespace strata
