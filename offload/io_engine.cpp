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
#include "offload/io_engine_state.h"
#include "offload/offload_util.h"

namespace strata {

using offload_internal::format_bytes;

namespace internal {

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
    // A thread waiting for this request runs it at once rather than wait for a verifier
    // (which would skip it): no verifier is woken for it.
    if (record.waiters == 0) {
      verify_queue.push_back(ticket);
      verify_wanted.notify_one();
    }
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
    StatusOr<std::unique_ptr<internal::IoBackend>> uring = internal::make_io_uring_backend(state.get(), options);
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
    std::unique_ptr<internal::IoBackend> psync = internal::make_psync_backend(state.get());
    STRATA_RETURN_IF_ERROR(internal::start_psync_backend(*psync, threads));
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
