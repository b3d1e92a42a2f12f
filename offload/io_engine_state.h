// The I/O engine's shared state and its backends' interface, for io_engine.cpp (the engine
// and its API) and io_backends.cpp (the psync pool and io_uring). Internal to offload/.
#pragma once

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "offload/io_engine.h"

namespace strata::internal {

// One transfer in flight: a piece of a request, resubmitted in place for its remainder.
struct IoTransfer {
  uint64_t ticket = 0;
  IoOp op = IoOp::kRead;
  int fd = -1;             // the file descriptor (pool, or io_uring without a fixed file)
  int slot = -1;           // the engine's file slot (names the file in errors)
  bool fixed_file = false; // io_uring: use `slot` as a registered file instead of fd
  char* buffer = nullptr;  // where the remaining bytes go / come from
  size_t remaining = 0;    // bytes still to move
  uint64_t offset = 0;     // where they go in the file, or kIoStreamOffset
  int region = -1;         // the fixed buffer holding `buffer`, or -1
  unsigned again_in_a_row = 0;  // -EAGAIN/-EINTR results since the last byte moved
  // An injected fault for the issue in progress (IoEngineOptions::faults); reset at every issue.
  struct Fault {
    std::optional<int64_t> result;        // complete with this instead of doing the I/O
    size_t length = 0;                    // > 0: move at most this many bytes
    std::chrono::milliseconds delay{0};   // issue (or deliver `result`) this late
    __kernel_timespec timeout{};          // io_uring: the linked timeout's time, alive until it fires
  } fault;
  // Bytes this issue asks the kernel to move.
  size_t issue_bytes() const { return fault.length > 0 ? std::min(fault.length, remaining) : remaining; }
};

enum class ReapMode : uint8_t {
  kWait,  // block until a completion arrives
  kPoll,  // take what is there now
};

class IoBackend {
 public:
  virtual ~IoBackend() = default;
  virtual IoEngineKind kind() const = 0;
  // Registers regions as fixed buffers (an empty span unregisters); an error leaves none.
  virtual Status register_buffers(std::span<const PinnedRegion> regions) = 0;
  // Puts `fd` in fixed-file slot `slot`; an error means "use the plain fd".
  virtual Status register_file(int slot, int fd) = 0;
  virtual void unregister_file(int slot) = 0;
  // Starts a transfer. Its result (bytes moved or -errno) arrives later through
  // IoEngineState::complete_transfer, on a backend thread or in reap_batch().
  virtual void issue(IoTransfer* transfer) = 0;
  // True when completions are consumed by whoever holds the engine's reaper token
  // (reap_batch); false when the backend's own threads complete transfers (psync).
  virtual bool reaps_in_callers() const { return false; }
  // Completes every completion that has arrived; with kWait, first blocks until there is
  // at least one. Called by the reaper token's holder only, without the engine mutex.
  virtual void reap_batch(ReapMode) {}
  // Stops the backend's threads; no transfers are in flight.
  virtual void stop() = 0;
};

struct IoFileEntry {
  int fd = -1;
  bool fixed = false;  // registered with the backend as a fixed file
  std::string name;
};

// Where a request is on its way to finished (a finished request has no record).
enum class IoRequestStage : uint8_t {
  kTransfers,      // transfers in flight (or submit() still issuing them), or on_complete running
  kVerifyQueued,   // waiting for a verifier thread, or for the thread that waits for it
  kVerifying,      // its verify hook is running
};

struct IoRequestRecord {
  uint64_t pending = 0;  // transfers in flight, plus one while submit() is still issuing
  Status status;         // the first transfer error; from kVerifyQueued on, on_complete's result
  IoCompletionHook on_complete;
  IoCompletionHook verify;
  IoRequestStage stage = IoRequestStage::kTransfers;
  unsigned waiters = 0;  // threads inside wait() for it: one of them verifies it, not a verifier thread
  std::vector<std::unique_ptr<IoTransfer>> transfers;
};

// Who ran a request's verify hook (for the stats).
enum class IoVerifiedBy : uint8_t {
  kVerifierThread,
  kWaiter,     // the thread waiting for the request, before any verifier thread took it
  kCompleter,  // the thread that completed it: no verifier threads (verify_threads 0)
};

struct IoErrorRecord {
  Status status;
  bool claimed = false;  // returned by a wait(ticket) already
};

struct IoEngineState {
  IoEngineOptions options;
  std::unique_ptr<IoBackend> backend;

  mutable std::mutex mutex;
  std::condition_variable space_available;  // in_flight dropped below the queue depth
  std::condition_variable request_finished;
  uint64_t next_ticket = 1;
  unsigned in_flight = 0;  // transfers issued and not yet finished
  std::unordered_map<uint64_t, IoRequestRecord> requests;
  std::map<uint64_t, IoErrorRecord> errors;
  IoEngineStats stats;
  std::vector<PinnedRegion> regions;  // registered fixed buffers: regions[i] is fixed buffer i
  std::vector<IoFileEntry> files;     // by slot; fd -1 = free

  // Completions (io_uring): one thread at a time holds the reaper token and consumes the
  // completion queue. A caller that waits (wait, wait_all, a submit on a full queue) takes
  // the token and completes requests itself, as fio's single thread does, so no hand-off
  // to another thread sits between a completion and the next submission. The background
  // reaper takes the token only while no caller waits, so hooks of requests nobody waits
  // for still run.
  bool reaper_busy = false;        // a thread holds the token (may be blocked in the ring)
  unsigned waiting_callers = 0;    // callers inside drive_until
  bool stopping = false;           // the background reaper must exit
  std::condition_variable reaper_wanted;  // the background reaper's: work in flight, or stop
  std::chrono::steady_clock::time_point last_caller_reap;  // when a caller last left drive_until

  // Verification beside the I/O (IoRequest::verify): requests whose transfers are done
  // queue here for the verifier threads, started on the first such request.
  std::deque<uint64_t> verify_queue;      // tickets in kVerifyQueued, oldest first
  std::vector<std::thread> verifiers;
  bool verifiers_stopping = false;
  std::condition_variable verify_wanted;  // the verifiers': a request queued, or stop

  // Hands a transfer (a new one or a resubmission) to the backend, with any fault the
  // injector picks for it. Called without the mutex.
  void issue(IoTransfer* transfer);
  // Called by a backend with a transfer's result: bytes moved, or -errno.
  void complete_transfer(IoTransfer* transfer, int64_t result);
  // Runs on_complete, then hands the request to the verify stage or records its final status.
  void finish_request(uint64_t ticket, std::unique_lock<std::mutex>& lock);
  // Records a request's final status and forgets the request (mutex held).
  void record_finished(uint64_t ticket, Status status);
  // Starts the verifier threads not running yet (mutex held); the first refusal is the
  // error (the threads that did start keep serving).
  Status start_verifiers();
  // Runs a kVerifyQueued request's verify hook without the mutex and finishes it; a
  // `refusal` (a verifier thread that could not start) becomes its status if the hook's is OK.
  void run_verify(uint64_t ticket, std::unique_lock<std::mutex>& lock, IoVerifiedBy by, Status refusal = Status::Ok());
  // A verifier thread's loop; stop_verifiers() ends it once no request is queued.
  void run_verifier();
  void stop_verifiers();
  // kTransfers, kVerifyQueued or kVerifying; nullopt once finished (mutex held).
  std::optional<IoRequestStage> stage_of(uint64_t ticket) const;
  std::string describe(const IoTransfer& transfer) const;  // mutex held
  // mutex held (through `lock`). Returns once `done()` holds, reaping completions on this
  // thread while the token is free, transfers are in flight and `io_helps()` says a
  // completion can bring `done()` closer; else sleeping on `cv`.
  template <class Done, class IoHelps>
  void drive_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Done done, IoHelps io_helps);
  template <class Done>
  void drive_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Done done) {
    drive_until(lock, cv, done, [] { return true; });
  }
  // mutex held. Takes the token, reaps one batch without the mutex, gives the token back.
  void reap_with_token(std::unique_lock<std::mutex>& lock, ReapMode mode);
  // The background reaper thread's loop (io_uring).
  void run_background_reaper();
};

// The backends (io_backends.cpp). The pool's threads start with start(); io_uring's
// create() fails, naming why, where the kernel or the limits refuse a ring.
std::unique_ptr<IoBackend> make_psync_backend(IoEngineState* state);
Status start_psync_backend(IoBackend& backend, unsigned threads);
StatusOr<std::unique_ptr<IoBackend>> make_io_uring_backend(IoEngineState* state, const IoEngineOptions& options);

}  // namespace strata::internal
