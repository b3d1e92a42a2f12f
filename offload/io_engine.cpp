#include "offload/io_engine.h"

#include <liburing.h>
#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <thread>
#include <unordered_map>
#include <vector>

#include "engine/core/check.h"
#include "engine/core/log.h"
#include "engine/core/thread.h"
#include "offload/offload_util.h"

namespace strata {

using offload_internal::format_bytes;

namespace internal {

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

template <class Done, class IoHelps>
void IoEngineState::drive_until(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, Done done,
                                IoHelps io_helps) {
  ++waiting_callers;
  bool polled = false;  // took what the ring held since this thread last woke
  while (!done()) {
    // Only with transfers in flight: a completion is then sure to come and end the reap.
    const bool can_reap = backend->reaps_in_callers() && !reaper_busy && in_flight > 0;
    if (can_reap && io_helps()) {
      reap_with_token(lock, ReapMode::kWait);
    } else if (can_reap && !polled) {
      // What this thread waits for comes from elsewhere (a verifier thread), but other
      // requests' completions go on to theirs now rather than when this thread is back.
      reap_with_token(lock, ReapMode::kPoll);
      polled = true;
    } else {
      cv.wait(lock);
      polled = false;
    }
  }
  --waiting_callers;
  last_caller_reap = std::chrono::steady_clock::now();
}

void IoEngineState::reap_with_token(std::unique_lock<std::mutex>& lock, ReapMode mode) {
  reaper_busy = true;
  lock.unlock();
  backend->reap_batch(mode);
  lock.lock();
  reaper_busy = false;
  // Another waiter may take the token now; every waiter rechecks its condition.
  request_finished.notify_all();
  space_available.notify_all();
}

void IoEngineState::run_background_reaper() {
  // While transfers are in flight the thread looks every kPollPeriod and takes the token
  // only when no caller has reaped for kCallerGrace: a caller that submits and then
  // waits comes back sooner and reaps for itself. No per-request wake-ups.
  constexpr auto kPollPeriod = std::chrono::microseconds(500);
  constexpr auto kCallerGrace = std::chrono::microseconds(200);
  std::unique_lock<std::mutex> lock(mutex);
  for (;;) {
    reaper_wanted.wait(lock, [&] { return stopping || in_flight > 0; });
    if (stopping) return;
    if (!reaper_busy && waiting_callers == 0 && in_flight > 0 &&
        std::chrono::steady_clock::now() - last_caller_reap >= kCallerGrace) {
      reap_with_token(lock, ReapMode::kWait);
      continue;
    }
    reaper_wanted.wait_for(lock, kPollPeriod, [&] { return stopping; });
  }
}

std::string IoEngineState::describe(const IoTransfer& transfer) const {
  std::string text = transfer.op == IoOp::kRead ? "read of " : "write of ";
  text += std::to_string(transfer.remaining) + " bytes";
  if (transfer.offset != kIoStreamOffset) text += " at offset " + std::to_string(transfer.offset);
  const std::string& name = files.at(static_cast<size_t>(transfer.slot)).name;
  text += (transfer.op == IoOp::kRead ? " from " : " to ") + name;
  return text;
}

void IoEngineState::issue(IoTransfer* transfer) {
  transfer->fault = IoTransfer::Fault{};
  if (options.faults != nullptr) {
    std::string file;
    {
      std::lock_guard<std::mutex> lock(mutex);
      file = files.at(static_cast<size_t>(transfer->slot)).name;
    }
    const std::optional<IoFaultInjector::Decision> decision =
        options.faults->decide(transfer->op, file, transfer->offset, transfer->remaining);
    if (decision) {
      if (decision->action == IoFaultAction::kFail) transfer->fault.result = -static_cast<int64_t>(decision->error_number);
      if (decision->action == IoFaultAction::kShort) transfer->fault.length = decision->length;
      transfer->fault.delay = decision->delay;
      std::lock_guard<std::mutex> lock(mutex);
      ++stats.injected_faults;
    }
  }
  backend->issue(transfer);
}

void IoEngineState::complete_transfer(IoTransfer* transfer, int64_t result) {
  if ((result == -EAGAIN || result == -EINTR) && transfer->again_in_a_row < kIoMaxAgainRetries) {
    const unsigned attempt = ++transfer->again_in_a_row;
    {
      std::lock_guard<std::mutex> lock(mutex);
      ++stats.again_retries;
      ++stats.transfers;
    }
    // The file had nothing to give right now (a non-blocking file, a busy device): try
    // again after letting others run, then backing off to 10 ms, so a file that never
    // becomes ready fails in about a second instead of spinning for ever.
    if (attempt <= 8) {
      sched_yield();
    } else {
      std::this_thread::sleep_for(std::chrono::milliseconds(std::min(attempt - 8, 10u)));
    }
    issue(transfer);
    return;
  }
  if (result > 0) transfer->again_in_a_row = 0;
  if (result > 0 && static_cast<uint64_t>(result) < transfer->remaining) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      ++stats.short_transfers;
      ++stats.transfers;
      (transfer->op == IoOp::kRead ? stats.bytes_read : stats.bytes_written) += static_cast<uint64_t>(result);
    }
    transfer->buffer += result;
    transfer->remaining -= static_cast<size_t>(result);
    if (transfer->offset != kIoStreamOffset) transfer->offset += static_cast<uint64_t>(result);
    issue(transfer);
    return;
  }
  std::unique_lock<std::mutex> lock(mutex);
  IoRequestRecord& record = requests.at(transfer->ticket);
  if (result == -EAGAIN || result == -EINTR) {
    if (record.status.ok()) {
      record.status = UnavailableError(describe(*transfer) + ": the file returned " +
                                       (result == -EAGAIN ? "EAGAIN" : "EINTR") + " " +
                                       std::to_string(transfer->again_in_a_row + 1) +
                                       " times in a row without moving a byte (is it a non-blocking file that never becomes ready?)");
    }
  } else if (result < 0) {
    if (record.status.ok()) record.status = Status::FromErrno(static_cast<int>(-result), describe(*transfer));
  } else if (result == 0) {
    if (record.status.ok()) {
      record.status = transfer->op == IoOp::kRead
                          ? DataLossError(describe(*transfer) + ": end of file (the file is shorter than expected)")
                          : IoError(describe(*transfer) + ": the kernel wrote 0 bytes");
    }
  } else {
    (transfer->op == IoOp::kRead ? stats.bytes_read : stats.bytes_written) += static_cast<uint64_t>(result);
    transfer->remaining = 0;
  }
  --in_flight;
  space_available.notify_one();
  if (--record.pending == 0) finish_request(transfer->ticket, lock);
}

void IoEngineState::finish_request(uint64_t ticket, std::unique_lock<std::mutex>& lock) {
  Status status = std::move(requests.at(ticket).status);
  IoCompletionHook hook = std::move(requests.at(ticket).on_complete);
  if (hook) {
    lock.unlock();
    status = hook(status);
    lock.lock();
  }
  // The record may have moved while the lock was released: look it up again.
  IoRequestRecord& record = requests.at(ticket);
  if (record.verify) {
    record.status = std::move(status);
    record.stage = IoRequestStage::kVerifyQueued;
    Status started = verifiers_stopping ? Status::Ok() : start_verifiers();
    if (!started.ok() || verifiers.empty() || verifiers_stopping) {
      // No verifier thread (none configured, or refused): the hook runs here, and a refusal
      // is the request's error, as every thread the library cannot start is.
      run_verify(ticket, lock, IoVerifiedBy::kCompleter, std::move(started));
      return;
    }
    verify_queue.push_back(ticket);
    verify_wanted.notify_one();
    // A thread waiting for this request runs it at once rather than wait for a verifier.
    request_finished.notify_all();
    return;
  }
  record_finished(ticket, std::move(status));
}

void IoEngineState::record_finished(uint64_t ticket, Status status) {
  requests.erase(ticket);
  if (!status.ok()) {
    ++stats.failed_requests;
    errors.emplace(ticket, IoErrorRecord{std::move(status), false});
  }
  request_finished.notify_all();
}

std::optional<IoRequestStage> IoEngineState::stage_of(uint64_t ticket) const {
  auto it = requests.find(ticket);
  if (it == requests.end()) return std::nullopt;
  return it->second.stage;
}

Status IoEngineState::start_verifiers() {
  while (verifiers.size() < options.verify_threads) {
    StatusOr<std::thread> verifier = spawn_thread("strata:verify", [this] { run_verifier(); });
    if (!verifier.ok()) {
      return std::move(verifier).status().with_context("I/O engine: starting the threads that verify checksums beside the I/O");
    }
    verifiers.push_back(std::move(verifier).value());
  }
  return Status::Ok();
}

void IoEngineState::run_verify(uint64_t ticket, std::unique_lock<std::mutex>& lock, IoVerifiedBy by, Status refusal) {
  IoRequestRecord& record = requests.at(ticket);
  record.stage = IoRequestStage::kVerifying;
  IoCompletionHook hook = std::move(record.verify);
  Status status = std::move(record.status);
  lock.unlock();
  status = hook(status);
  if (status.ok() && !refusal.ok()) status = std::move(refusal);
  lock.lock();
  ++stats.verified_requests;
  if (by == IoVerifiedBy::kWaiter) ++stats.verified_by_waiters;
  record_finished(ticket, std::move(status));
}

void IoEngineState::run_verifier() {
  std::unique_lock<std::mutex> lock(mutex);
  for (;;) {
    verify_wanted.wait(lock, [&] { return verifiers_stopping || !verify_queue.empty(); });
    if (verify_queue.empty()) return;
    const uint64_t ticket = verify_queue.front();
    verify_queue.pop_front();
    // A thread waiting for the request runs it itself (it is awake, and would otherwise
    // sleep until this thread, which the scheduler may have set aside, is done).
    auto it = requests.find(ticket);
    if (it == requests.end() || it->second.stage != IoRequestStage::kVerifyQueued || it->second.waiters > 0) continue;
    run_verify(ticket, lock, IoVerifiedBy::kVerifierThread);
  }
}

void IoEngineState::stop_verifiers() {
  {
    std::lock_guard<std::mutex> lock(mutex);
    verifiers_stopping = true;
  }
  verify_wanted.notify_all();
  for (std::thread& verifier : verifiers) verifier.join();
}

namespace {

// ---------------------------------------------------------------------------------------
// psync: a pool of threads doing one pread/pwrite (read/write for stream offsets) each.
// ---------------------------------------------------------------------------------------
class PsyncBackend final : public IoBackend {
 public:
  explicit PsyncBackend(IoEngineState* state) : state_(state) {}
  // Starts the pool; on an error the threads already started are stopped by stop().
  Status start(unsigned threads) {
    workers_.reserve(threads);
    for (unsigned i = 0; i < threads; ++i) {
      STRATA_ASSIGN_OR_RETURN(std::thread worker, spawn_thread("strata:psync", [this] { run(); }));
      workers_.push_back(std::move(worker));
    }
    return {};
  }
  ~PsyncBackend() override { stop(); }

  IoEngineKind kind() const override { return IoEngineKind::kPsync; }
  Status register_buffers(std::span<const PinnedRegion>) override { return Status::Ok(); }
  Status register_file(int, int) override { return Status::Ok(); }
  void unregister_file(int) override {}

  void issue(IoTransfer* transfer) override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      queue_.push_back(transfer);
    }
    work_available_.notify_one();
  }

  void stop() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_available_.notify_all();
    for (auto& worker : workers_) {
      if (worker.joinable()) worker.join();
    }
  }

 private:
  void run() {
    for (;;) {
      IoTransfer* transfer = nullptr;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        work_available_.wait(lock, [&] { return stopping_ || !queue_.empty(); });
        if (queue_.empty()) return;
        transfer = queue_.front();
        queue_.pop_front();
      }
      if (transfer->fault.delay.count() > 0) std::this_thread::sleep_for(transfer->fault.delay);
      if (transfer->fault.result) {
        state_->complete_transfer(transfer, *transfer->fault.result);
        continue;
      }
      ssize_t moved;
      const bool stream = transfer->offset == kIoStreamOffset;
      const size_t length = transfer->issue_bytes();
      if (transfer->op == IoOp::kRead) {
        moved = stream ? ::read(transfer->fd, transfer->buffer, length)
                       : ::pread(transfer->fd, transfer->buffer, length, static_cast<off_t>(transfer->offset));
      } else {
        moved = stream ? ::write(transfer->fd, transfer->buffer, length)
                       : ::pwrite(transfer->fd, transfer->buffer, length, static_cast<off_t>(transfer->offset));
      }
      state_->complete_transfer(transfer, moved < 0 ? -static_cast<int64_t>(errno) : static_cast<int64_t>(moved));
    }
  }

  IoEngineState* state_;
  std::mutex mutex_;
  std::condition_variable work_available_;
  std::deque<IoTransfer*> queue_;
  bool stopping_ = false;
  std::vector<std::thread> workers_;
};

// ---------------------------------------------------------------------------------------
// io_uring: any thread submits under sq_mutex_; one completion thread reaps CQEs and
// resubmits short transfers. The ring has queue_depth SQ entries and (by default) twice
// as many CQ entries, and at most queue_depth transfers are in flight, so neither queue
// can overflow.
// ---------------------------------------------------------------------------------------
class IoUringBackend final : public IoBackend {
 public:
  static StatusOr<std::unique_ptr<IoUringBackend>> create(IoEngineState* state, const IoEngineOptions& options) {
    auto backend = std::make_unique<IoUringBackend>(state);
    io_uring_params params{};
    if (options.sqpoll) {
      params.flags |= IORING_SETUP_SQPOLL;
      params.sq_thread_idle = options.sqpoll_idle_ms;
    }
    // An injected delay takes two SQEs (a timeout linked before the transfer).
    const unsigned entries = options.faults != nullptr ? std::max(options.queue_depth, 2u) : options.queue_depth;
    const int ret = io_uring_queue_init_params(entries, &backend->ring_, &params);
    if (ret < 0) {
      return UnavailableError(std::string("io_uring_queue_init(") + std::to_string(options.queue_depth) +
                              (options.sqpoll ? ", SQPOLL" : "") + ") failed: " + std::strerror(-ret) + " (errno " +
                              std::to_string(-ret) + ")");
    }
    backend->ring_ready_ = true;
    backend->sqpoll_ = options.sqpoll;
    const int files_ret = io_uring_register_files_sparse(&backend->ring_, options.max_files);
    if (files_ret < 0) {
      STRATA_LOG(kDebug) << "io_uring: no sparse file table (" << std::strerror(-files_ret) << "); using plain fds";
    } else {
      backend->fixed_files_ = true;
    }
    STRATA_ASSIGN_OR_RETURN(backend->reaper_, spawn_thread("strata:reaper", [state] { state->run_background_reaper(); }));
    return backend;
  }

  explicit IoUringBackend(IoEngineState* state) : state_(state) {}
  ~IoUringBackend() override { stop(); }

  IoEngineKind kind() const override { return IoEngineKind::kIoUring; }

  Status register_buffers(std::span<const PinnedRegion> regions) override {
    std::lock_guard<std::mutex> lock(sq_mutex_);
    if (buffers_registered_) {
      io_uring_unregister_buffers(&ring_);
      buffers_registered_ = false;
    }
    if (regions.empty()) return Status::Ok();
    std::vector<iovec> iovecs;
    iovecs.reserve(regions.size());
    for (const PinnedRegion& region : regions) iovecs.push_back(iovec{region.data, region.bytes});
    const int ret = io_uring_register_buffers(&ring_, iovecs.data(), static_cast<unsigned>(iovecs.size()));
    if (ret < 0) return Status::FromErrno(-ret, "io_uring_register_buffers");
    buffers_registered_ = true;
    return Status::Ok();
  }

  Status register_file(int slot, int fd) override {
    if (!fixed_files_) return UnavailableError("no fixed-file table");
    std::lock_guard<std::mutex> lock(sq_mutex_);
    const int ret = io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &fd, 1);
    if (ret < 0) return Status::FromErrno(-ret, "io_uring_register_files_update");
    return Status::Ok();
  }

  void unregister_file(int slot) override {
    if (!fixed_files_) return;
    std::lock_guard<std::mutex> lock(sq_mutex_);
    int none = -1;
    io_uring_register_files_update(&ring_, static_cast<unsigned>(slot), &none, 1);
  }

  void issue(IoTransfer* transfer) override {
    std::lock_guard<std::mutex> lock(sq_mutex_);
    IoTransfer::Fault& fault = transfer->fault;
    if (fault.delay.count() > 0) {
      // An injected delay: a timeout hard-linked before the transfer, so the transfer
      // starts when it fires. Both SQEs must go to the kernel in one submission.
      wait_for_sq_space(2);
      const auto nanoseconds = std::chrono::duration_cast<std::chrono::nanoseconds>(fault.delay).count();
      fault.timeout.tv_sec = nanoseconds / 1'000'000'000;
      fault.timeout.tv_nsec = nanoseconds % 1'000'000'000;
      io_uring_sqe* timer = next_sqe();
      io_uring_prep_timeout(timer, &fault.timeout, 0, 0);
      timer->flags |= IOSQE_IO_HARDLINK;
      io_uring_sqe_set_data(timer, nullptr);  // its completion carries no transfer
    }
    io_uring_sqe* sqe = next_sqe();
    if (fault.result) {
      // An injected result: a NOP whose completion reap_batch() reads as this result.
      io_uring_prep_nop(sqe);
      io_uring_sqe_set_data(sqe, transfer);
      submit_queued();
      return;
    }
    const int fd = transfer->fixed_file ? transfer->slot : transfer->fd;
    const auto length = static_cast<unsigned>(transfer->issue_bytes());
    if (transfer->op == IoOp::kRead) {
      if (transfer->region >= 0) {
        io_uring_prep_read_fixed(sqe, fd, transfer->buffer, length, transfer->offset, transfer->region);
      } else {
        io_uring_prep_read(sqe, fd, transfer->buffer, length, transfer->offset);
      }
    } else {
      if (transfer->region >= 0) {
        io_uring_prep_write_fixed(sqe, fd, transfer->buffer, length, transfer->offset, transfer->region);
      } else {
        io_uring_prep_write(sqe, fd, transfer->buffer, length, transfer->offset);
      }
    }
    if (transfer->fixed_file) sqe->flags |= IOSQE_FIXED_FILE;
    io_uring_sqe_set_data(sqe, transfer);
    submit_queued();
  }

  void stop() override {
    if (!ring_ready_) return;
    if (reaper_.joinable()) {
      {
        std::lock_guard<std::mutex> lock(state_->mutex);
        state_->stopping = true;
      }
      state_->reaper_wanted.notify_all();
      reaper_.join();
    }
    io_uring_queue_exit(&ring_);
    ring_ready_ = false;
  }

  bool reaps_in_callers() const override { return true; }

  void reap_batch(ReapMode mode) override {
    constexpr unsigned kBatch = 64;
    io_uring_cqe* cqes[kBatch];
    std::pair<IoTransfer*, int> results[kBatch];
    if (mode == ReapMode::kWait) {
      io_uring_cqe* first = nullptr;
      const int ret = io_uring_wait_cqe(&ring_, &first);
      if (ret == -EINTR || ret == -EAGAIN || ret == -ETIME) return;
      if (ret < 0) {
        STRATA_LOG(kError) << "io_uring_wait_cqe failed: " << std::strerror(-ret) << " (errno " << -ret << ")";
        sched_yield();
        return;
      }
    }
    const unsigned count = io_uring_peek_batch_cqe(&ring_, cqes, kBatch);
    for (unsigned i = 0; i < count; ++i) {
      results[i] = {static_cast<IoTransfer*>(io_uring_cqe_get_data(cqes[i])), cqes[i]->res};
    }
    // Free the CQ slots before resubmitting, so resubmissions always find room.
    io_uring_cq_advance(&ring_, count);
    // The kernel ordered each submission before its completion, but a race detector
    // cannot see through the ring: taking the lock every submission was made under
    // makes that order visible to it (one uncontended lock per batch).
    { std::lock_guard<std::mutex> visible(sq_mutex_); }
    for (unsigned i = 0; i < count; ++i) {
      IoTransfer* transfer = results[i].first;
      if (transfer == nullptr) continue;  // an injected delay's timeout fired
      // An injected result rode a NOP: the transfer carries it.
      const int64_t result = transfer->fault.result ? *transfer->fault.result : results[i].second;
      state_->complete_transfer(transfer, result);
    }
  }

  bool fixed_files() const { return fixed_files_; }

 private:
  // sq_mutex_ held. The SQ has room for every transfer in flight; a slot can only be
  // missing while an SQPOLL thread has not consumed earlier entries yet.
  io_uring_sqe* next_sqe() {
    for (;;) {
      io_uring_sqe* sqe = io_uring_get_sqe(&ring_);
      if (sqe != nullptr) return sqe;
      submit_queued();
      if (sqpoll_) {
        io_uring_sqring_wait(&ring_);
      } else {
        sched_yield();
      }
    }
  }

  // sq_mutex_ held. Returns once the SQ has `entries` free slots.
  void wait_for_sq_space(unsigned entries) {
    while (io_uring_sq_space_left(&ring_) < entries) {
      submit_queued();
      if (sqpoll_) {
        io_uring_sqring_wait(&ring_);
      } else {
        sched_yield();
      }
    }
  }

  // sq_mutex_ held. Hands queued SQEs to the kernel, retrying transient refusals. An SQE
  // the kernel did not take stays queued and goes with the next submit.
  void submit_queued() {
    for (int attempt = 0;; ++attempt) {
      const int ret = io_uring_submit(&ring_);
      if (ret >= 0) return;
      if ((ret == -EINTR || ret == -EAGAIN || ret == -EBUSY) && attempt < 1000) {
        sched_yield();
        continue;
      }
      STRATA_LOG(kError) << "io_uring_submit failed: " << std::strerror(-ret) << " (errno " << -ret
                         << "); the request stays queued for the next submission";
      return;
    }
  }

  IoEngineState* state_;
  io_uring ring_{};
  bool ring_ready_ = false;
  bool sqpoll_ = false;
  bool fixed_files_ = false;
  bool buffers_registered_ = false;  // guarded by sq_mutex_
  std::mutex sq_mutex_;
  std::thread reaper_;
};

}  // namespace
}  // namespace internal

using internal::IoEngineState;
using internal::IoTransfer;

std::optional<IoFaultInjector::Decision> IoFaultInjector::decide(IoOp op, std::string_view file, uint64_t offset,
                                                                 size_t bytes) {
  std::lock_guard<std::mutex> lock(mutex_);
  std::optional<Decision> decision;
  for (size_t i = 0; i < rules_.size(); ++i) {
    const IoFaultRule& rule = rules_[i];
    const IoFaultMatch& match = rule.match;
    if (match.op && *match.op != op) continue;
    if (!match.file_contains.empty() && file.find(match.file_contains) == std::string_view::npos) continue;
    const uint64_t ordinal = ++matched_[i];
    const uint64_t since_first = ordinal - match.first;  // meaningful once ordinal >= first
    const bool due = ordinal >= match.first && (match.count == 0 || since_first < match.count) &&
                     since_first % std::max<uint64_t>(match.every, 1) == 0;
    // A short transfer needs something left to move after it.
    const bool applicable = rule.action != IoFaultAction::kShort || (rule.short_bytes > 0 && bytes > rule.short_bytes);
    if (decision || !due || !applicable) continue;
    decision = Decision{rule.action, rule.error_number, rule.short_bytes, rule.delay};
    injected_.push_back(IoFaultRecord{i, op, std::string(file), offset, bytes, ordinal});
  }
  return decision;
}

uint64_t IoFaultInjector::matched(size_t rule) const {
  std::lock_guard<std::mutex> lock(mutex_);
  return rule < matched_.size() ? matched_[rule] : 0;
}

std::vector<IoFaultRecord> IoFaultInjector::injected() const {
  std::lock_guard<std::mutex> lock(mutex_);
  return injected_;
}

IoEngine::IoEngine(ConstructionKey, std::unique_ptr<IoEngineState> state) : state_(std::move(state)) {}

StatusOr<std::unique_ptr<IoEngine>> IoEngine::create(const IoEngineOptions& options) {
  if (options.queue_depth == 0 || options.queue_depth > 4096) {
    return InvalidArgumentError("I/O engine: queue depth " + std::to_string(options.queue_depth) +
                                " is out of range (1..4096)");
  }
  if (options.max_request_bytes < 4096 || options.max_request_bytes % 4096 != 0 ||
      options.max_request_bytes > (size_t{1} << 30)) {
    return InvalidArgumentError("I/O engine: max_request_bytes " + std::to_string(options.max_request_bytes) +
                                " must be a multiple of 4096 between 4 KiB and 1 GiB");
  }
  if (options.max_files == 0) return InvalidArgumentError("I/O engine: max_files must be at least 1");
  auto state = std::make_unique<IoEngineState>();
  state->options = options;
  state->files.resize(options.max_files);
  if (options.kind != IoEngineKind::kPsync) {
    StatusOr<std::unique_ptr<internal::IoUringBackend>> uring = internal::IoUringBackend::create(state.get(), options);
    if (uring.ok()) {
      state->backend = std::move(uring).value();
    } else if (options.kind == IoEngineKind::kIoUring) {
      return std::move(uring).status();
    } else {
      STRATA_LOG_ONCE(kWarn) << "io_uring unavailable (" << uring.status().message()
                             << "): using the pread/pwrite thread pool (psync) instead";
    }
  } else {
    STRATA_LOG_ONCE(kInfo) << "I/O engine: the pread/pwrite thread pool (psync), as the options ask";
  }
  if (state->backend == nullptr) {
    const unsigned threads = options.psync_threads != 0 ? options.psync_threads : std::min(options.queue_depth, 64u);
    auto psync = std::make_unique<internal::PsyncBackend>(state.get());
    STRATA_RETURN_IF_ERROR(psync->start(threads));
    state->backend = std::move(psync);
  }
  return std::make_unique<IoEngine>(ConstructionKey(), std::move(state));
}

IoEngine::~IoEngine() {
  Status unclaimed = wait_all();
  if (!unclaimed.ok()) {
    STRATA_LOG(kError) << "I/O engine destroyed with a request error nobody waited for: " << unclaimed.to_string();
  }
  state_->stop_verifiers();
  state_->backend->stop();
}

IoEngineKind IoEngine::kind() const { return state_->backend->kind(); }
unsigned IoEngine::queue_depth() const { return state_->options.queue_depth; }

StatusOr<bool> IoEngine::register_buffers(std::span<const PinnedRegion> regions) {
  for (const PinnedRegion& region : regions) {
    if (region.data == nullptr || region.bytes == 0 || region.bytes > PinnedArena::kMaxRegionBytes) {
      return InvalidArgumentError("I/O engine: a registered buffer must hold 1 byte to 1 GiB, got " +
                                  format_bytes(region.bytes));
    }
  }
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (state_->in_flight != 0) {
      return FailedPreconditionError("I/O engine: cannot register buffers while " + std::to_string(state_->in_flight) +
                                     " transfers are in flight");
    }
    state_->regions.clear();
  }
  if (kind() == IoEngineKind::kPsync) return false;  // pread/pwrite have nothing to register with
  Status status = state_->backend->register_buffers(regions);
  if (!status.ok()) {
    STRATA_LOG_ONCE(kWarn) << "io_uring refused to register " << regions.size()
                           << " buffer region(s): " << status.message()
                           << "; transfers use plain (unregistered) buffers, which costs a page walk per request";
    return false;
  }
  std::lock_guard<std::mutex> lock(state_->mutex);
  // Fixed-buffer indexes follow the order the caller gave; keep them with the regions.
  state_->regions.assign(regions.begin(), regions.end());
  return true;
}

bool IoEngine::buffers_registered() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return !state_->regions.empty();
}

int IoEngine::registered_region(const void* data, size_t bytes) const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  const auto* p = static_cast<const char*>(data);
  for (size_t i = 0; i < state_->regions.size(); ++i) {
    const auto* begin = static_cast<const char*>(state_->regions[i].data);
    if (p >= begin && p < begin + state_->regions[i].bytes && bytes <= static_cast<size_t>(begin + state_->regions[i].bytes - p)) {
      return static_cast<int>(i);
    }
  }
  return -1;
}

StatusOr<IoFile> IoEngine::register_file(int fd, std::string name) {
  if (fd < 0) return InvalidArgumentError("I/O engine: cannot register fd " + std::to_string(fd) + " (" + name + ")");
  int slot = -1;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    for (size_t i = 0; i < state_->files.size(); ++i) {
      if (state_->files[i].fd < 0) {
        slot = static_cast<int>(i);
        state_->files[i] = internal::IoFileEntry{fd, false, std::move(name)};
        break;
      }
    }
  }
  if (slot < 0) {
    return ResourceExhaustedError("I/O engine: all " + std::to_string(state_->options.max_files) +
                                  " file slots are in use (raise IoEngineOptions::max_files)");
  }
  const Status fixed = state_->backend->register_file(slot, fd);
  if (fixed.ok() && kind() == IoEngineKind::kIoUring) {
    std::lock_guard<std::mutex> lock(state_->mutex);
    state_->files[static_cast<size_t>(slot)].fixed = true;
  } else if (!fixed.ok()) {
    STRATA_LOG(kDebug) << "io_uring: file slot " << slot << " not registered (" << fixed.message() << "); using the fd";
  }
  return IoFile{slot};
}

Status IoEngine::unregister_file(IoFile file) {
  bool fixed = false;
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    if (!file.valid() || static_cast<size_t>(file.slot) >= state_->files.size() ||
        state_->files[static_cast<size_t>(file.slot)].fd < 0) {
      return InvalidArgumentError("I/O engine: file slot " + std::to_string(file.slot) + " is not registered");
    }
    fixed = state_->files[static_cast<size_t>(file.slot)].fixed;
  }
  if (fixed) state_->backend->unregister_file(file.slot);
  std::lock_guard<std::mutex> lock(state_->mutex);
  state_->files[static_cast<size_t>(file.slot)] = internal::IoFileEntry{};
  return Status::Ok();
}

StatusOr<IoTicket> IoEngine::submit(IoRequest request) {
  IoEngineState& s = *state_;
  if (request.bytes == 0 || request.buffer == nullptr) {
    return InvalidArgumentError("I/O engine: a request needs a buffer and at least one byte (got " +
                                std::to_string(request.bytes) + " bytes)");
  }
  std::unique_lock<std::mutex> lock(s.mutex);
  if (!request.file.valid() || static_cast<size_t>(request.file.slot) >= s.files.size() ||
      s.files[static_cast<size_t>(request.file.slot)].fd < 0) {
    return InvalidArgumentError("I/O engine: file slot " + std::to_string(request.file.slot) + " is not registered");
  }
  const int file_fd = s.files[static_cast<size_t>(request.file.slot)].fd;
  const bool file_fixed = s.files[static_cast<size_t>(request.file.slot)].fixed;
  const uint64_t ticket = s.next_ticket++;
  internal::IoRequestRecord& record = s.requests[ticket];
  record.pending = 1;  // held by this call until every transfer is issued
  record.on_complete = std::move(request.on_complete);
  record.verify = std::move(request.verify);
  ++s.stats.requests;

  auto* cursor = static_cast<char*>(request.buffer);
  size_t remaining = request.bytes;
  uint64_t offset = request.offset;
  while (remaining > 0 && s.requests.at(ticket).status.ok()) {
    // Cut at max_request_bytes and at region boundaries: a fixed transfer must lie
    // inside its registered buffer.
    size_t piece = std::min(remaining, s.options.max_request_bytes);
    int region = -1;
    for (size_t i = 0; i < s.regions.size(); ++i) {
      char* begin = static_cast<char*>(s.regions[i].data);
      char* end = begin + s.regions[i].bytes;
      if (cursor >= begin && cursor < end) {
        region = static_cast<int>(i);
        piece = std::min(piece, static_cast<size_t>(end - cursor));
      } else if (begin > cursor && static_cast<size_t>(begin - cursor) < piece) {
        piece = static_cast<size_t>(begin - cursor);
      }
    }
    s.drive_until(lock, s.space_available, [&] { return s.in_flight < s.options.queue_depth; });
    auto transfer = std::make_unique<IoTransfer>();
    transfer->ticket = ticket;
    transfer->op = request.op;
    transfer->fd = file_fd;
    transfer->slot = request.file.slot;
    transfer->fixed_file = file_fixed;
    transfer->buffer = cursor;
    transfer->remaining = piece;
    transfer->offset = offset;
    transfer->region = region;
    IoTransfer* raw = transfer.get();
    // The record may have moved (rehash) while the lock was released: look it up again.
    internal::IoRequestRecord& current = s.requests.at(ticket);
    current.transfers.push_back(std::move(transfer));
    ++current.pending;
    if (s.in_flight++ == 0) s.reaper_wanted.notify_one();
    ++s.stats.transfers;
    if (region >= 0) ++s.stats.fixed_transfers;
    lock.unlock();
    s.issue(raw);
    lock.lock();
    cursor += piece;
    remaining -= piece;
    if (offset != kIoStreamOffset) offset += piece;
  }
  if (--s.requests.at(ticket).pending == 0) s.finish_request(ticket, lock);
  return IoTicket{ticket};
}

Status IoEngine::wait(IoTicket ticket) {
  IoEngineState& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  if (!ticket.valid() || ticket.id >= s.next_ticket) {
    return InvalidArgumentError("I/O engine: ticket " + std::to_string(ticket.id) + " was never issued");
  }
  auto waiting = s.requests.find(ticket.id);
  if (waiting != s.requests.end()) ++waiting->second.waiters;
  for (;;) {
    // Reaping helps only while the request's own transfers are in flight; once it is
    // being verified, its end comes from that thread, not from the ring.
    s.drive_until(
        lock, s.request_finished,
        [&] { return s.stage_of(ticket.id) != internal::IoRequestStage::kTransfers &&
                     s.stage_of(ticket.id) != internal::IoRequestStage::kVerifying; },
        [&] { return s.stage_of(ticket.id) == internal::IoRequestStage::kTransfers; });
    if (s.stage_of(ticket.id) != internal::IoRequestStage::kVerifyQueued) break;
    // No verifier thread has started it: verify here rather than wait for one.
    s.run_verify(ticket.id, lock, internal::IoVerifiedBy::kWaiter);
  }
  auto it = s.errors.find(ticket.id);
  if (it == s.errors.end()) return Status::Ok();
  it->second.claimed = true;
  return it->second.status;
}

bool IoEngine::done(IoTicket ticket) const {
  IoEngineState& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  // A poller (done() in a loop) gets what has completed by now without waiting for the
  // background reaper.
  if (s.requests.count(ticket.id) != 0 && s.backend->reaps_in_callers() && !s.reaper_busy && s.in_flight > 0) {
    s.reap_with_token(lock, internal::ReapMode::kPoll);
  }
  return s.requests.count(ticket.id) == 0;
}

Status IoEngine::wait_all() {
  IoEngineState& s = *state_;
  std::unique_lock<std::mutex> lock(s.mutex);
  s.drive_until(lock, s.request_finished, [&] { return s.requests.empty(); });
  Status first;
  size_t others = 0;
  for (auto& [ticket, error] : s.errors) {
    if (error.claimed) continue;
    if (first.ok()) {
      first = std::move(error.status);
    } else {
      ++others;
    }
  }
  s.errors.clear();
  if (!first.ok() && others > 0) {
    first.with_context("(and " + std::to_string(others) + " more failed I/O request(s) nobody waited for)");
  }
  return first;
}

IoEngineStats IoEngine::stats() const {
  std::lock_guard<std::mutex> lock(state_->mutex);
  return state_->stats;
}

}  // namespace strata
