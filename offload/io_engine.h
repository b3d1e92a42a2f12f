// IoEngine: asynchronous file reads and writes with completion tickets.
//
// Two implementations behind one interface:
//   - io_uring (liburing): an explicit queue depth, fixed (registered) buffers for memory
//     inside registered regions (the pinned arena's pieces) and plain READ/WRITE SQEs
//     for any other memory, registered files, optional SQPOLL. A thread that waits
//     (wait, wait_all, a submit on a full queue, done) reaps completions itself, one
//     thread at a time, as fio's single thread does: no hand-off to another thread sits
//     between a completion and the caller's next submission. A background thread reaps
//     only while no caller waits, so hooks of requests nobody waits for still run.
//   - psync: a pool of threads doing pread/pwrite, used where io_uring is unavailable
//     (io_uring_queue_init fails: old kernel, seccomp, io_uring_disabled) or where the
//     options ask for it. The log says so once per process.
//
// Both follow the io_uring discipline: a result is a byte count or a negative errno;
// short transfers and -EAGAIN are resubmitted for the remainder; a request larger than
// max_request_bytes, or one that crosses from one registered region into the next, is
// split into several transfers, all under the same ticket.
//
// Verification beside the I/O: a request may carry a `verify` hook (the NVMe store's
// checksum check of a read, its checksum computation for a write). It runs after the
// request's transfers and on_complete, on one of the engine's verifier threads (started
// on first use), so the thread that reaps completions goes straight back to the ring and
// the queue stays full while finished requests are checked elsewhere. The request is not
// finished (wait() does not return, done() is false) until its verify hook has returned;
// what it returns is the request's Status. A request a thread is waiting for is verified
// by that thread unless a verifier thread has started it already (the waiter is awake;
// on a busy machine a verifier thread may be waiting for a core). With
// IoEngineOptions::verify_threads 0 the hook runs where on_complete does; so it does when
// the system refuses a verifier thread, and the refusal becomes the request's error.
//
// Tickets: submit() returns a ticket per request; wait(ticket) blocks until that request
// has finished and returns its Status (the first error of its transfers, or the error of
// its completion hook). An error nobody has waited for yet is kept: wait_all() returns it
// (the first one, naming how many others failed), and the destructor logs any that are
// still unclaimed. Nothing is ever dropped silently.
//
// Fault injection (tests only): IoEngineOptions::faults, when set, makes chosen transfers
// fail with an errno (EIO, ENOSPC, EAGAIN, ...), move fewer bytes than asked, or complete
// late. Injected results travel the backend's own completion path (an io_uring NOP or
// timeout, a psync worker), so the engine handles them exactly as it would the kernel's:
// short transfers are resubmitted for the remainder, -EAGAIN is retried (at most
// kIoMaxAgainRetries times in a row), anything else fails the request naming the
// operation and the file. Without a plan the engine checks one null pointer per transfer.
//
// Thread-safety: every method may be called from any thread; submit() may block while
// queue_depth transfers are in flight; any number of threads may wait() at once.
// register_buffers() and register_file()/unregister_file() must not race with transfers
// that use the same memory or file. The engine does not own the file descriptors.
#pragma once

#include <cerrno>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "engine/core/io_engine_kind.h"
#include "engine/core/status.h"
#include "offload/pinned_arena.h"

namespace strata {

// IoEngineKind (auto | io_uring | psync), its name and its parser live in
// engine/core/io_engine_kind.h, where the config's strata.io_engine reads them too.

enum class IoOp : uint8_t { kRead, kWrite };

class IoFaultInjector;

struct IoEngineOptions {
  IoEngineKind kind = IoEngineKind::kAuto;
  unsigned queue_depth = 32;                   // transfers in flight at most (io_uring SQ entries, psync threads)
  bool sqpoll = false;                         // io_uring: a kernel thread polls the submission queue
  unsigned sqpoll_idle_ms = 1000;              // io_uring SQPOLL: idle time before the kernel thread sleeps
  unsigned psync_threads = 0;                  // psync: worker threads; 0 = queue_depth (at most 64)
  size_t max_request_bytes = size_t{1} << 30;  // larger requests are split into transfers of at most this
  unsigned max_files = 64;                     // files that can be registered at once
  unsigned verify_threads = 2;                 // threads running requests' verify hooks beside the I/O (started on first use); 0 = where on_complete runs
  std::shared_ptr<IoFaultInjector> faults;     // tests only: faults to inject (null = none)
};

// A transfer that gets -EAGAIN (or -EINTR) this many times in a row, without moving a
// byte in between, fails with kUnavailable instead of spinning for ever.
inline constexpr unsigned kIoMaxAgainRetries = 100;  // with backoff: about a second

// ---------------------------------------------------------------------------------------
// Fault injection (tests only).
// ---------------------------------------------------------------------------------------

enum class IoFaultAction : uint8_t {
  kFail,   // the transfer completes with -error_number and moves nothing
  kShort,  // the transfer moves short_bytes, as a real short read/write would
  kDelay,  // the transfer is issued `delay` late and then runs normally
};

// Which transfers a rule hits. Every transfer the engine issues counts, resubmissions of
// the remainder of a short transfer and retries after -EAGAIN included: they are
// operations the kernel sees.
struct IoFaultMatch {
  std::optional<IoOp> op;       // kRead or kWrite; nullopt = both
  std::string file_contains;    // a substring of the registered file's name; empty = any file
  uint64_t first = 1;           // the first matching transfer hit (1 = the first one)
  uint64_t count = 1;           // how many matching transfers from `first` on are hit (0 = all of them)
  uint64_t every = 1;           // of those, every `every`-th one (first, first + every, ...)
};

struct IoFaultRule {
  IoFaultMatch match;
  IoFaultAction action = IoFaultAction::kFail;
  int error_number = EIO;                 // kFail: EIO, ENOSPC, EAGAIN, ...
  size_t short_bytes = 4096;              // kShort: bytes moved (keep it a multiple of 4 KiB for O_DIRECT files); a transfer of no more than this is left alone
  std::chrono::milliseconds delay{0};     // kDelay; with kFail or kShort, the injected result arrives this late
};

// What an injector did to one transfer, for tests to check against.
struct IoFaultRecord {
  size_t rule = 0;       // index in the plan
  IoOp op = IoOp::kRead;
  std::string file;      // the registered file's name
  uint64_t offset = 0;   // the transfer's file offset
  size_t bytes = 0;      // the transfer's length as asked
  uint64_t ordinal = 0;  // which matching transfer of its rule it was (1-based)
};

// A set of rules shared by the engines it is given to (thread-safe). The first rule that
// matches a transfer and is due decides its fault; every rule counts the transfers it
// matches, due or not.
class IoFaultInjector {
 public:
  explicit IoFaultInjector(std::vector<IoFaultRule> rules) : rules_(std::move(rules)), matched_(rules_.size(), 0) {}

  // The fault for a transfer about to be issued, or nullopt.
  struct Decision {
    IoFaultAction action = IoFaultAction::kFail;
    int error_number = 0;
    size_t length = 0;  // kShort: bytes to move
    std::chrono::milliseconds delay{0};
  };
  std::optional<Decision> decide(IoOp op, std::string_view file, uint64_t offset, size_t bytes);

  // Transfers rule `rule` matched so far (hit or not); all injected faults so far.
  uint64_t matched(size_t rule) const;
  std::vector<IoFaultRecord> injected() const;

 private:
  mutable std::mutex mutex_;
  std::vector<IoFaultRule> rules_;
  std::vector<uint64_t> matched_;
  std::vector<IoFaultRecord> injected_;
};

// A file registered with an engine (a slot in its file table).
struct IoFile {
  int slot = -1;
  bool valid() const { return slot >= 0; }
};

// One request's handle: pass it to wait().
struct IoTicket {
  uint64_t id = 0;  // 0 = no request
  bool valid() const { return id != 0; }
};

// Runs once a request's bytes have all moved (or one transfer failed), on an engine
// thread, a thread inside wait()/wait_all()/submit()/done() of this engine, or the
// submitting thread; `transfer_status` is the request's status so far.
// What it returns becomes the request's status. It must not call wait() on its engine.
using IoCompletionHook = std::function<Status(const Status& transfer_status)>;

// Offset meaning "the file's current position" (pipes, sockets): read/write, not pread/pwrite.
inline constexpr uint64_t kIoStreamOffset = ~uint64_t{0};

struct IoRequest {
  IoOp op = IoOp::kRead;
  IoFile file;
  void* buffer = nullptr;   // for O_DIRECT files: aligned to the file's DIO alignment
  size_t bytes = 0;         // > 0
  uint64_t offset = 0;      // byte offset in the file, or kIoStreamOffset
  IoCompletionHook on_complete;  // optional; keep it short (it runs where completions are reaped)
  // Optional: CPU work on the request's bytes (checksums), run after on_complete on a
  // verifier thread, beside the I/O of other requests (see "Verification beside the
  // I/O"). Gets on_complete's Status; what it returns becomes the request's. Same rules
  // as on_complete: it must not call wait() on its engine.
  IoCompletionHook verify;
};

struct IoEngineStats {
  uint64_t requests = 0;           // requests submitted
  uint64_t transfers = 0;          // transfers issued (SQEs or pool jobs), resubmissions included
  uint64_t fixed_transfers = 0;    // of which used a registered buffer (READ_FIXED/WRITE_FIXED)
  uint64_t short_transfers = 0;    // transfers that moved fewer bytes than asked and were resubmitted
  uint64_t again_retries = 0;      // transfers resubmitted after -EAGAIN
  uint64_t failed_requests = 0;    // requests that finished with an error
  uint64_t injected_faults = 0;    // transfers IoEngineOptions::faults changed
  uint64_t verified_requests = 0;  // requests whose verify hook ran
  uint64_t verified_by_waiters = 0;  // of which ran on the thread waiting for them (no verifier thread had started it)
  uint64_t bytes_read = 0;
  uint64_t bytes_written = 0;
};

namespace internal {
class IoBackend;
struct IoEngineState;
}  // namespace internal

class IoEngine {
 public:
  // Fails with kUnavailable (naming the reason) when kIoUring is asked for and the kernel
  // refuses io_uring.
  static StatusOr<std::unique_ptr<IoEngine>> create(const IoEngineOptions& options);
  ~IoEngine();
  IoEngine(const IoEngine&) = delete;
  IoEngine& operator=(const IoEngine&) = delete;

  // The implementation in use: kIoUring or kPsync (never kAuto).
  IoEngineKind kind() const;
  std::string_view name() const { return io_engine_kind_name(kind()); }
  unsigned queue_depth() const;

  // Registers memory regions (each at most 1 GiB) as fixed buffers; region i is buffer i.
  // Transfers whose memory lies inside a region then use READ_FIXED/WRITE_FIXED. Replaces
  // an earlier registration; no transfers may be in flight. Where the kernel refuses
  // (locked-memory limit), logs one warning and carries on with plain transfers; the
  // return value says whether the regions are registered (always false for psync, which
  // has nothing to register them with).
  StatusOr<bool> register_buffers(std::span<const PinnedRegion> regions);
  StatusOr<bool> register_buffers(const PinnedArena& arena) { return register_buffers(arena.regions()); }
  bool buffers_registered() const;
  // The registered region holding [data, data + bytes), or -1.
  int registered_region(const void* data, size_t bytes) const;

  // Registers an open file; `name` (its path) names it in errors. The caller keeps the fd
  // open until unregister_file().
  StatusOr<IoFile> register_file(int fd, std::string name);
  Status unregister_file(IoFile file);

  // Queues one request; blocks while queue_depth transfers are in flight.
  StatusOr<IoTicket> submit(IoRequest request);
  // Blocks until the request has finished; returns its Status. Every thread waiting for
  // the ticket gets the same Status, until a wait_all() hands the errors over and forgets
  // them (a later wait for that ticket returns OK). A ticket never issued is
  // kInvalidArgument.
  Status wait(IoTicket ticket);
  // True once the request has finished (its Status is still kept for wait()).
  bool done(IoTicket ticket) const;
  // Blocks until every request submitted so far has finished; returns the first error
  // no wait(ticket) has returned yet (naming how many more there are), and forgets all
  // errors kept so far.
  Status wait_all();

  IoEngineStats stats() const;

  // Only create() can make the key, so only create() constructs engines.
  class ConstructionKey {
    friend class IoEngine;
    ConstructionKey() = default;
  };
  IoEngine(ConstructionKey, std::unique_ptr<internal::IoEngineState> state);

 private:
  std::unique_ptr<internal::IoEngineState> state_;
};

}  // namespace strata
