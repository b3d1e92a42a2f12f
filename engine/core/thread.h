// Starting threads without std::terminate. A std::thread constructor throws
// std::system_error when the process or user is at its thread limit (RLIMIT_NPROC) or no
// memory is left for the new stack; uncaught, that ends the program. Every thread the
// library starts goes through spawn_thread, which turns the failure into a Status naming
// the thread, the errno and the limits in force.
#pragma once

#include <exception>
#include <new>
#include <string>
#include <string_view>
#include <system_error>
#include <thread>
#include <utility>

#include "engine/core/status.h"

namespace strata {

namespace internal {
// The error for a thread that could not be started (`error` is an errno value).
Status thread_spawn_error(std::string_view name, int error);
// Test-only fault injection (see ThreadSpawnFailureForTest): the failure to report
// instead of starting `name`, when one is armed for this spawn.
Status injected_thread_spawn_failure(std::string_view name);
// Names the calling thread; Linux keeps 15 characters, longer names are cut.
void set_current_thread_name(const std::string& name);
}  // namespace internal

// Sets the calling thread's nice value (Linux: per thread). Only ever used to lower a
// thread's priority, which needs no privilege; raising it back would (CAP_SYS_NICE).
Status set_current_thread_nice(int nice);
// The same, best effort and only downwards: a thread already at `nice` or lower keeps its
// priority; one that cannot lower it works on at the process's, and the first such failure
// in the process is logged as a warning.
void lower_current_thread_priority(int nice);

// Starts `body` on a new thread named `name` (as `top` and debuggers show it). Fails with
// ResourceExhausted naming the thread, the errno meaning and RLIMIT_NPROC's value when the
// system refuses a thread; never throws.
template <class F>
StatusOr<std::thread> spawn_thread(std::string_view name, F&& body) {
  STRATA_RETURN_IF_ERROR(internal::injected_thread_spawn_failure(name));
  try {
    // The thread names itself before the body runs, so the body always sees its name.
    return std::thread([thread_name = std::string(name), body = std::forward<F>(body)]() mutable {
      internal::set_current_thread_name(thread_name);
      body();
    });
  } catch (const std::system_error& e) {
    return internal::thread_spawn_error(name, e.code().value());
  } catch (const std::bad_alloc&) {
    return internal::thread_spawn_error(name, ENOMEM);
  }
}

// Test-only: while an object of this class lives, the `nth` spawn_thread call (1-based,
// counted from its construction, in any thread) fails with EAGAIN as if the thread limit
// were reached; the calls before and after it start their threads. One at a time.
class ThreadSpawnFailureForTest {
 public:
  explicit ThreadSpawnFailureForTest(int nth);
  ~ThreadSpawnFailureForTest();
  ThreadSpawnFailureForTest(const ThreadSpawnFailureForTest&) = delete;
  ThreadSpawnFailureForTest& operator=(const ThreadSpawnFailureForTest&) = delete;
  // Spawns attempted since construction (including the failed one).
  int attempts() const;
};

}  // namespace strata
