#include "engine/core/executor.h"

#include <pthread.h>
#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <mutex>
#include <string>
#include <thread>

#if !defined(STRATA_SANITIZER_THREAD)
#include <oneapi/tbb/blocked_range.h>
#include <oneapi/tbb/parallel_for.h>
#include <oneapi/tbb/partitioner.h>
#include <oneapi/tbb/task_arena.h>
#include <oneapi/tbb/task_scheduler_observer.h>
#endif

#include "engine/core/log.h"
#include "engine/core/thread.h"

namespace strata {

int available_cpu_count() {
  cpu_set_t set;
  CPU_ZERO(&set);
  if (sched_getaffinity(0, sizeof(set), &set) == 0) return std::max(1, CPU_COUNT(&set));
  return std::max(1u, std::thread::hardware_concurrency());
}

bool built_with_thread_sanitizer() {
#if defined(STRATA_SANITIZER_THREAD)
  return true;
#else
  return false;
#endif
}

namespace {

void pin_current_thread(const std::vector<int>& cpus, size_t slot) {
  if (cpus.empty()) return;
  cpu_set_t set;
  CPU_ZERO(&set);
  CPU_SET(cpus[slot % cpus.size()], &set);
  (void)pthread_setaffinity_np(pthread_self(), sizeof(set), &set);
}

// Plain-thread executor: a fixed pool of workers; parallel_for hands out chunk indices
// through an atomic counter, and the caller works too.
class ThreadExecutor final : public Executor {
 public:
  ThreadExecutor(int threads, std::vector<int> affinity, int worker_nice)
      : threads_(threads), affinity_(std::move(affinity)), worker_nice_(worker_nice) {}
  // Starts the workers (the caller is worker 0); the destructor joins those started.
  Status start() {
    for (int i = 1; i < threads_; ++i) {
      STRATA_ASSIGN_OR_RETURN(std::thread worker, spawn_thread("strata:exec", [this, i] {
                                pin_current_thread(affinity_, static_cast<size_t>(i));
                                lower_current_thread_priority(worker_nice_);
                                worker_loop();
                              }));
      workers_.push_back(std::move(worker));
    }
    return {};
  }
  ~ThreadExecutor() override {
    {
      std::lock_guard<std::mutex> lock(mutex_);
      stopping_ = true;
    }
    work_ready_.notify_all();
    for (auto& worker : workers_) worker.join();
  }

  int concurrency() const override { return threads_; }
  std::string_view name() const override { return "threads"; }

  void parallel_for(size_t begin, size_t end, size_t grain, const std::function<void(size_t, size_t)>& body) override {
    if (end <= begin) return;
    grain = std::max<size_t>(grain, 1);
    const size_t chunks = (end - begin + grain - 1) / grain;
    if (chunks == 1 || threads_ == 1) {
      body(begin, end);
      return;
    }
    // One parallel_for at a time through the pool; concurrent callers queue here.
    std::lock_guard<std::mutex> job_lock(job_mutex_);
    Job job{begin, end, grain, chunks, &body};
    {
      std::lock_guard<std::mutex> lock(mutex_);
      job_ = &job;
      ++generation_;
    }
    work_ready_.notify_all();
    run_chunks(job);
    std::unique_lock<std::mutex> lock(mutex_);
    job_done_.wait(lock, [&] { return job.finished_chunks == job.chunks && active_workers_ == 0; });
    job_ = nullptr;
  }

  void execute(const std::function<void()>& fn) override { fn(); }

 private:
  struct Job {
    size_t begin, end, grain, chunks;
    const std::function<void(size_t, size_t)>* body;
    std::atomic<size_t> next_chunk{0};
    size_t finished_chunks = 0;  // guarded by mutex_
  };

  // Runs chunks of `job` until none are left; returns how many this thread ran.
  void run_chunks(Job& job) {
    size_t done = 0;
    for (;;) {
      const size_t chunk = job.next_chunk.fetch_add(1, std::memory_order_relaxed);
      if (chunk >= job.chunks) break;
      const size_t lo = job.begin + chunk * job.grain;
      const size_t hi = std::min(job.end, lo + job.grain);
      (*job.body)(lo, hi);
      ++done;
    }
    std::lock_guard<std::mutex> lock(mutex_);
    job.finished_chunks += done;
    if (job.finished_chunks == job.chunks) job_done_.notify_all();
  }

  void worker_loop() {
    uint64_t seen_generation = 0;
    std::unique_lock<std::mutex> lock(mutex_);
    for (;;) {
      work_ready_.wait(lock, [&] { return stopping_ || (job_ != nullptr && generation_ != seen_generation); });
      if (stopping_) return;
      seen_generation = generation_;
      Job* job = job_;
      ++active_workers_;
      lock.unlock();
      run_chunks(*job);
      lock.lock();
      --active_workers_;
      if (active_workers_ == 0) job_done_.notify_all();
    }
  }

  const int threads_;
  const std::vector<int> affinity_;
  const int worker_nice_;
  std::vector<std::thread> workers_;
  std::mutex job_mutex_;
  std::mutex mutex_;
  std::condition_variable work_ready_;
  std::condition_variable job_done_;
  Job* job_ = nullptr;
  uint64_t generation_ = 0;
  int active_workers_ = 0;
  bool stopping_ = false;
};

#if !defined(STRATA_SANITIZER_THREAD)
// Pins the arena's threads to the given cores as they enter it.
class AffinityObserver final : public oneapi::tbb::task_scheduler_observer {
 public:
  AffinityObserver(oneapi::tbb::task_arena& arena, std::vector<int> cpus)
      : oneapi::tbb::task_scheduler_observer(arena), cpus_(std::move(cpus)) {
    observe(true);
  }
  ~AffinityObserver() override { observe(false); }
  void on_scheduler_entry(bool /*is_worker*/) override {
    const int slot = oneapi::tbb::this_task_arena::current_thread_index();
    pin_current_thread(cpus_, slot < 0 ? 0 : static_cast<size_t>(slot));
  }

 private:
  std::vector<int> cpus_;
};

// Lowers the priority of oneTBB's worker threads as they enter the arena. The workers are
// the process's, shared by every arena, and cannot raise a priority back without privilege,
// so a worker only ever goes lower: to the highest nice any observer asked of it. Callers
// of parallel_for keep theirs.
class WorkerNiceObserver final : public oneapi::tbb::task_scheduler_observer {
 public:
  WorkerNiceObserver(oneapi::tbb::task_arena& arena, int nice) : oneapi::tbb::task_scheduler_observer(arena), nice_(nice) {
    observe(true);
  }
  ~WorkerNiceObserver() override { observe(false); }
  void on_scheduler_entry(bool is_worker) override {
    thread_local int applied = 0;
    if (!is_worker || nice_ <= applied) return;
    applied = nice_;
    lower_current_thread_priority(nice_);
  }

 private:
  const int nice_;
};

class TbbExecutor final : public Executor {
 public:
  TbbExecutor(int threads, std::vector<int> affinity, int worker_nice) : threads_(threads), arena_(threads) {
    if (!affinity.empty()) observer_ = std::make_unique<AffinityObserver>(arena_, std::move(affinity));
    if (worker_nice != 0) nice_observer_ = std::make_unique<WorkerNiceObserver>(arena_, worker_nice);
  }
  int concurrency() const override { return threads_; }
  std::string_view name() const override { return "tbb"; }

  void parallel_for(size_t begin, size_t end, size_t grain, const std::function<void(size_t, size_t)>& body) override {
    if (end <= begin) return;
    grain = std::max<size_t>(grain, 1);
    const size_t chunks = (end - begin + grain - 1) / grain;
    if (chunks == 1 || threads_ == 1) {
      body(begin, end);
      return;
    }
    // Iterate over chunk indices so boundaries stay multiples of `grain`. One task per
    // chunk, taken by whichever thread is free (simple_partitioner), not one pre-assigned
    // half per thread (static_partitioner): the engine's stages share the cores, and with a
    // static split a call waited for its slower half while the caller's own thread sat
    // idle. The engine's CPU Adam beside the CPU device's copies went from 0.60-0.69 to
    // 0.81-0.82 of its standalone rate (docs/benchmarks.md, 2026-12-02 AVX-512 section).
    arena_.execute([&] {
      oneapi::tbb::parallel_for(
          oneapi::tbb::blocked_range<size_t>(0, chunks, 1),
          [&](const oneapi::tbb::blocked_range<size_t>& r) {
            const size_t lo = begin + r.begin() * grain;
            const size_t hi = std::min(end, begin + r.end() * grain);
            body(lo, hi);
          },
          oneapi::tbb::simple_partitioner());
    });
  }

  void execute(const std::function<void()>& fn) override { arena_.execute(fn); }

 private:
  const int threads_;
  oneapi::tbb::task_arena arena_;
  std::unique_ptr<AffinityObserver> observer_;
  std::unique_ptr<WorkerNiceObserver> nice_observer_;
};
#endif

}  // namespace

StatusOr<std::unique_ptr<Executor>> make_executor(const ExecutorOptions& options) {
  if (options.threads < 0) return InvalidArgumentError("executor threads must be >= 0, got " + std::to_string(options.threads));
  const int threads = options.threads == 0 ? available_cpu_count() : options.threads;
  ExecutorKind kind = options.kind;
  if (kind == ExecutorKind::kDefault) kind = built_with_thread_sanitizer() ? ExecutorKind::kThreads : ExecutorKind::kTbb;
  if (kind == ExecutorKind::kThreads) {
    auto executor = std::make_unique<ThreadExecutor>(threads, options.cpu_affinity, options.worker_nice);
    STRATA_RETURN_IF_ERROR(executor->start().with_context("while starting a " + std::to_string(threads) + "-thread executor"));
    return std::unique_ptr<Executor>(std::move(executor));
  }
#if defined(STRATA_SANITIZER_THREAD)
  return UnavailableError("the oneTBB executor is not built into ThreadSanitizer builds (its synchronization is invisible to TSan)");
#else
  return std::unique_ptr<Executor>(std::make_unique<TbbExecutor>(threads, options.cpu_affinity, options.worker_nice));
#endif
}

}  // namespace strata
