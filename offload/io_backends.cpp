// The I/O engine's backends: a pread/pwrite thread pool and io_uring (io_engine_state.h).
#include <liburing.h>
#include <sched.h>
#include <sys/uio.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>

#include "engine/core/check.h"
#include "engine/core/log.h"
#include "engine/core/thread.h"
#include "offload/io_engine_state.h"
#include "offload/offload_util.h"

namespace strata::internal {

using offload_internal::format_bytes;

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

std::unique_ptr<IoBackend> make_psync_backend(IoEngineState* state) { return std::make_unique<PsyncBackend>(state); }

Status start_psync_backend(IoBackend& backend, unsigned threads) { return static_cast<PsyncBackend&>(backend).start(threads); }

StatusOr<std::unique_ptr<IoBackend>> make_io_uring_backend(IoEngineState* state, const IoEngineOptions& options) {
  STRATA_ASSIGN_OR_RETURN(std::unique_ptr<IoUringBackend> backend, IoUringBackend::create(state, options));
  return std::unique_ptr<IoBackend>(std::move(backend));
}

}  // namespace strata::internal
