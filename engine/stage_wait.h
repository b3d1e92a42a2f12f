// How a pipeline stage waits: on its own condition variable, until the condition holds,
// the stage is aborted (an error anywhere in the engine) or stopped. A wait that lasts
// longer than STRATA_HANG_WARNING_S (default 120 s) logs, once, where every stage stands:
// a hang's diagnosis, not a silent stall.
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "engine/core/log.h"
#include "engine/core/status.h"
#include "engine/core/thread.h"

namespace strata::engine_internal {

// The abort/stop facts of one stage, guarded by the stage's mutex.
struct StageHalt {
  bool stopping = false;
  Status failure;  // not ok: the engine failed; waits return this

  bool halted() const { return stopping || !failure.ok(); }
};

// What every stage with a queue shares: the mutex and condition variable guarding its
// queue and facts, its halt facts, and its worker thread (where it has one).
class StageSync {
 public:
  std::mutex mutex;
  std::condition_variable cv;
  StageHalt halt;  // guarded by mutex

  StageSync() = default;
  StageSync(const StageSync&) = delete;
  StageSync& operator=(const StageSync&) = delete;
  ~StageSync() { stop(); }

  // Starts the worker thread, named `name`; an error (the thread limit) instead of a throw.
  Status start(std::string_view name, std::function<void()> body) {
    STRATA_ASSIGN_OR_RETURN(worker_, spawn_thread(name, std::move(body)));
    return {};
  }
  // Halts the stage (every wait returns, the worker leaves its loop) and joins the worker.
  void stop() {
    {
      std::lock_guard<std::mutex> lock(mutex);
      halt.stopping = true;
    }
    cv.notify_all();
    if (worker_.joinable()) worker_.join();
  }
  // An error elsewhere in the engine: every wait of the stage returns it (the first wins).
  void abort(const Status& status) {
    {
      std::lock_guard<std::mutex> lock(mutex);
      if (halt.failure.ok()) halt.failure = status;
    }
    cv.notify_all();
  }
  // A stage's own description followed by the engine's, for hang warnings.
  static std::string with_engine(std::string own, const std::function<std::string()>& engine) {
    if (engine) {
      own += '\n';
      own += engine();
    }
    return own;
  }

 private:
  std::thread worker_;
};

// How long a wait may last before it is reported: STRATA_HANG_WARNING_S, default 120 s.
inline std::chrono::seconds hang_warning_after() {
  static const std::chrono::seconds seconds = [] {
    const char* text = std::getenv("STRATA_HANG_WARNING_S");
    const long value = text != nullptr ? std::strtol(text, nullptr, 10) : 0;
    return std::chrono::seconds(value > 0 ? value : 120);
  }();
  return seconds;
}

// Waits on `cv` (with `lock` held on the stage's mutex) until `done()`, or the halt.
// `describe` is called without the lock.
template <class Done>
Status stage_wait(std::unique_lock<std::mutex>& lock, std::condition_variable& cv, const StageHalt& halt, Done done,
                  const char* what, const std::function<std::string()>& describe) {
  const auto patience = hang_warning_after();
  if (!cv.wait_for(lock, patience, [&] { return done() || halt.halted(); })) {
    lock.unlock();
    STRATA_LOG(kWarn) << "waited " << patience.count() << " s for " << what << "\n" << (describe ? describe() : std::string());
    lock.lock();
    cv.wait(lock, [&] { return done() || halt.halted(); });
  }
  if (!halt.failure.ok()) return Status(halt.failure).with_context(std::string("while waiting for ") + what);
  if (done()) return {};
  return CancelledError(std::string("engine shut down while waiting for ") + what);
}

}  // namespace strata::engine_internal
