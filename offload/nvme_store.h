// NvmeStore: a rank's scratch file under nvme_path, carved into extents, read and
// written asynchronously through the I/O engine with O_DIRECT.
//
// nvme_path (strata.nvme_path, docs/config.md): the directory is created if missing and
// creatable; an error names the path when it cannot be created or written. The store holds
//   <nvme_path>/strata-rank<R>.swap  the data file, flock'ed for the store's life (the file
//                                    itself, so deleting any other file cannot unlock it):
//                                    a second live process (or a second store in this
//                                    process) on the same nvme_path and rank is refused
//                                    with an error naming the path and the holder's pid.
//                                    Ranks lock separately, so one process per GPU can
//                                    share a node's nvme_path. Preallocated with fallocate
//                                    and grown as extents need room. A file a finished run
//                                    left is reused (its contents are scratch; nothing of
//                                    it is trusted).
//   <nvme_path>/strata-rank<R>.lock  the holder's pid, only to name it in that refusal.
//
// Extents are named by a key, 4 KiB (the file's O_DIRECT alignment) aligned and freed for
// reuse. Every checksum block (1 MiB by default) of an extent carries an XXH64 checksum
// computed on write and verified on read; a mismatch is kDataLoss naming the extent, the
// file, the offset and both checksums. Both run beside the I/O, on the engine's verifier
// threads (IoRequest::verify): the thread reaping completions goes back to the ring at
// once, so the disk's queue stays full while finished transfers are checked. A read's
// ticket completes, and its bytes are the caller's, only once every block has verified. A block whose write failed (disk full, I/O error) is marked
// invalid, and reading it is an error; other blocks and extents keep their data and
// checksums.
//
// Buffers: a transfer moves bytes between the extent and a host buffer. The fast path
// (no copy) is a buffer aligned to alignment() whose capacity covers the transfer rounded
// up to the alignment (a PinnedBuffer always qualifies). Other buffers go through a
// bounce buffer of the transfer's size, with a debug-level note.
//
// Ranged transfers: `extent_offset` must be a multiple of the alignment, and, with
// checksums on, of the checksum block; the range must end on a checksum block boundary or
// at the extent's end.
//
// Thread-safety: all methods may be called from any thread. Transfers that overlap the
// same bytes of an extent must be ordered by the caller; an extent cannot be freed while
// transfers on it are in flight.
#pragma once

#include <cstddef>
#include <cstdint>
#include <chrono>
#include <memory>
#include <mutex>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "engine/core/file.h"
#include "engine/core/status.h"
#include "offload/io_engine.h"

namespace strata {

struct NvmeStoreOptions {
  std::string nvme_path;                       // the directory (created if missing)
  int rank = 0;                                // names this rank's files
  bool direct_io = true;                       // O_DIRECT; buffered (with a logged note) where the file system refuses it
  bool checksums = true;                       // XXH64 per checksum block, verified on read
  size_t checksum_block_bytes = size_t{1} << 20;  // checksum granularity, a multiple of 4 KiB
  size_t initial_bytes = 0;                    // file size to preallocate at open (rounded to the alignment)
  size_t growth_bytes = size_t{256} << 20;     // the least the file grows by when extents need room
  IoEngineOptions io;                          // for the engine the store creates when none is given
  bool remove_files_on_close = false;          // the data and lock files go when the store closes (benchmarks); else a later run reuses them
};

// A handle to an extent; names it in the store's calls.
struct NvmeExtent {
  uint64_t id = 0;
  bool valid() const { return id != 0; }
};

struct NvmeExtentInfo {
  std::string key;
  uint64_t file_offset = 0;  // where the extent starts in the file
  size_t bytes = 0;          // the extent's size
  size_t disk_bytes = 0;     // bytes reserved in the file (bytes rounded up to the alignment)
  bool readable = false;     // every block holds data from a successful write
};

struct NvmeStoreStats {
  uint64_t file_bytes = 0;        // the data file's size
  uint64_t allocated_bytes = 0;   // bytes reserved by live extents
  uint64_t extents = 0;           // live extents
  uint64_t bytes_written = 0;     // by successful writes
  uint64_t bytes_read = 0;        // by successful reads
  uint64_t checksum_failures = 0; // blocks whose checksum did not match on read
  uint64_t bounce_transfers = 0;  // transfers that went through a bounce buffer
};

class NvmeStore {
 public:
  // Opens (creating where needed) nvme_path and this rank's files. With `engine` null the
  // store creates its own from options.io; otherwise `engine` must outlive the store.
  static StatusOr<std::unique_ptr<NvmeStore>> open(const NvmeStoreOptions& options, IoEngine* engine = nullptr);
  // The data file of `rank`'s store under nvme_path.
  static std::string file_path_for(const std::string& nvme_path, int rank);
  // The bytes a store for `rank` can take under nvme_path: the file system's free space
  // (under the nearest folder that exists; nothing is created) plus the size of the file
  // a finished run left there, which the store reuses. An error names the path when the
  // file system cannot be asked.
  static StatusOr<size_t> room_bytes(const std::string& nvme_path, int rank);
  ~NvmeStore();
  NvmeStore(const NvmeStore&) = delete;
  NvmeStore& operator=(const NvmeStore&) = delete;

  const std::string& directory() const { return directory_; }
  const std::string& file_path() const { return file_path_; }
  const std::string& lock_path() const { return lock_path_; }
  size_t alignment() const { return alignment_; }
  bool direct_io() const { return direct_io_; }
  bool checksums() const { return options_.checksums; }
  size_t checksum_block_bytes() const { return options_.checksum_block_bytes; }
  // The unit a transfer's offset (and, but at an extent's end, its size) must be a
  // multiple of, and the unit whose validity the store tracks: the checksum block, or the
  // O_DIRECT alignment without checksums. Concurrent transfers of different units of one
  // extent never interfere.
  size_t transfer_granularity() const { return options_.checksums ? options_.checksum_block_bytes : alignment_; }
  IoEngine& io_engine() { return *engine_; }

  // Reserves `bytes` (> 0) for a new extent named `key` (unique among live extents),
  // growing the file where needed. Fails with kResourceExhausted naming the bytes and the
  // file system's free space when the disk cannot hold them.
  StatusOr<NvmeExtent> allocate(std::string_view key, size_t bytes);
  StatusOr<NvmeExtent> find(std::string_view key) const;
  StatusOr<NvmeExtentInfo> info(NvmeExtent extent) const;
  // Gives the extent's space back for reuse.
  Status free(NvmeExtent extent);

  // Writes `bytes` from `src` to the extent at `extent_offset`; `src_capacity` (0 = bytes)
  // says how many bytes at src may be read (see "Buffers"). The checksums are computed
  // from the bytes written, beside the I/O, before the ticket completes: `src` must keep
  // its bytes until then. The blocks become readable when the ticket completes. When
  // `completed_at` is given, the time the transfer finished is stored there before the
  // ticket's wait returns (for traces that show the disk's work, not the waiting).
  StatusOr<IoTicket> write_async(NvmeExtent extent, const void* src, size_t bytes, size_t extent_offset = 0,
                                 size_t src_capacity = 0, std::chrono::steady_clock::time_point* completed_at = nullptr);
  // Reads `bytes` of the extent at `extent_offset` into `dst` (`dst_capacity` bytes may be
  // written; 0 = bytes). The checksums are verified before the ticket completes; a ticket
  // that fails its checksums leaves dst's contents unspecified.
  StatusOr<IoTicket> read_async(NvmeExtent extent, void* dst, size_t bytes, size_t extent_offset = 0,
                                size_t dst_capacity = 0, std::chrono::steady_clock::time_point* completed_at = nullptr);
  // The engine's wait: the request's Status, with the store's context.
  Status wait(IoTicket ticket) { return engine_->wait(ticket); }
  Status wait_all() { return engine_->wait_all(); }

  // Synchronous forms.
  Status write(NvmeExtent extent, const void* src, size_t bytes, size_t extent_offset = 0, size_t src_capacity = 0);
  Status read(NvmeExtent extent, void* dst, size_t bytes, size_t extent_offset = 0, size_t dst_capacity = 0);

  NvmeStoreStats stats() const;

  // Only open() can make the key, so only open() constructs stores.
  class ConstructionKey {
    friend class NvmeStore;
    ConstructionKey() = default;
  };
  explicit NvmeStore(ConstructionKey);

 private:
  struct Extent;
  struct Shared;
  struct Transfer;       // one ranged write or read, as its steps and completion see it
  class WriteChecksums;  // a write's block checksums, computed once

  Status open_files();
  std::string lock_holder() const;  // "pid N" of the store holding file_path_'s lock
  Status grow_file(size_t needed_bytes, std::string_view key, size_t extent_bytes, size_t growth_step);
  // Checks a ranged transfer against the extent and the alignment rules (mutex held).
  Status check_range(const Extent& extent, size_t bytes, size_t extent_offset, const char* what) const;
  // The steps of write_async and read_async (see there).
  StatusOr<Transfer> plan_write(NvmeExtent handle, size_t bytes, size_t extent_offset) const;
  StatusOr<Transfer> start_read(NvmeExtent handle, const void* dst, size_t bytes, size_t extent_offset,
                                size_t dst_capacity, std::vector<uint64_t>* expected);
  static IoCompletionHook write_completion(std::shared_ptr<Shared> shared, Transfer transfer, const char* data,
                                           std::shared_ptr<WriteChecksums> pending_sums);
  static IoCompletionHook read_completion(std::shared_ptr<Shared> shared, Transfer transfer,
                                          std::vector<uint64_t> expected, void* dst);
  StatusOr<IoTicket> submit_transfer(IoRequest request, uint64_t id);

  NvmeStoreOptions options_;
  std::string directory_;
  std::string file_path_;
  std::string lock_path_;
  size_t alignment_ = 4096;
  bool direct_io_ = true;
  File data_file_;
  IoFile io_file_;
  std::unique_ptr<IoEngine> owned_engine_;
  IoEngine* engine_ = nullptr;
  // State the completion hooks reach; kept alive by them until the last one has run.
  std::shared_ptr<Shared> shared_;
};

}  // namespace strata
