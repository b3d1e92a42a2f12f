// Parallel executors for CPU compute.
//
// CPU-device kernels and the CPU optimizer fan work out through an Executor. The
// default is a oneTBB task_arena of a fixed size (optionally pinned to cores). Under
// ThreadSanitizer, oneTBB's own synchronization is invisible to the tool and shows up
// as false races, so sanitizer builds use the plain-thread executor instead: same
// interface, std::thread workers and a mutex/condition-variable handoff TSan can see.
#pragma once

#include <cstddef>
#include <functional>
#include <memory>
#include <string_view>
#include <vector>

#include "engine/core/status.h"

namespace strata {

enum class ExecutorKind {
  kDefault,  // oneTBB, or plain threads in a ThreadSanitizer build
  kTbb,      // a oneTBB task_arena
  kThreads,  // plain std::thread workers
};

struct ExecutorOptions {
  int threads = 0;                // worker count; 0 = the cores this process may run on
  ExecutorKind kind = ExecutorKind::kDefault;
  std::vector<int> cpu_affinity;  // cores to pin workers to (TBB: via an observer); empty = no pinning
  // Nice value for the workers (0 = the process's own; only ever lowers one). Plain threads:
  // each worker. oneTBB: each worker thread as it enters the arena; oneTBB's workers serve
  // every arena of the process, so they keep it there too (the CPU device sets it; CPU Adam and the
  // gradient path run on plain threads of their own for that reason). The thread that
  // calls parallel_for keeps its own.
  int worker_nice = 0;
};

class Executor {
 public:
  virtual ~Executor() = default;
  // Number of workers that run a parallel_for (including the caller where it helps).
  virtual int concurrency() const = 0;
  // Which implementation this is ("tbb" or "threads").
  virtual std::string_view name() const = 0;
  // Splits [begin, end) into chunks of at least `grain` elements and runs `body(lo, hi)`
  // on each, returning once all have finished. Chunk boundaries are multiples of
  // `grain` from `begin` (so a caller can keep chunks cache- or page-aligned).
  virtual void parallel_for(size_t begin, size_t end, size_t grain,
                            const std::function<void(size_t, size_t)>& body) = 0;
  // Runs `fn` inside the executor's context (for TBB, inside the arena, so that any
  // nested TBB algorithm uses the arena's threads).
  virtual void execute(const std::function<void()>& fn) = 0;
};

StatusOr<std::unique_ptr<Executor>> make_executor(const ExecutorOptions& options);

// The number of CPUs this process may run on (sched_getaffinity), at least 1.
int available_cpu_count();

// True in a ThreadSanitizer build (then ExecutorKind::kDefault means kThreads).
bool built_with_thread_sanitizer();

}  // namespace strata
