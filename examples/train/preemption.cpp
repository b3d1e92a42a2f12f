#include "examples/train/preemption.h"

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <string>

namespace strata::train {
namespace {

static_assert(std::atomic<int>::is_always_lock_free, "the signal handler needs a lock-free atomic");

// Process-wide by nature: a signal handler has no other place to leave its news. Written
// by the handler, read by preemption_requested().
std::atomic<int> g_requested{0};

// The lines the handler writes, composed at install time (the handler may not allocate).
struct Notice {
  char text[256] = {};
  size_t size = 0;
};
Notice g_term_notice, g_int_notice;

void compose(Notice& notice, std::string_view program, const char* signal_name) {
  const std::string text = std::string(program) + ": " + signal_name +
                           " received: finishing the current step, then saving a checkpoint and exiting (send it again to exit at once)\n";
  notice.size = std::min(text.size(), sizeof(notice.text));
  std::memcpy(notice.text, text.data(), notice.size);
}

void restore_default_actions() {
  struct sigaction action {};
  action.sa_handler = SIG_DFL;
  sigemptyset(&action.sa_mask);
  ::sigaction(SIGTERM, &action, nullptr);
  ::sigaction(SIGINT, &action, nullptr);
}

void on_signal(int signal_number) {
  const int saved_errno = errno;
  int expected = 0;
  if (!g_requested.compare_exchange_strong(expected, signal_number)) {
    // A second signal raced the first handler's restore: end the process now.
    restore_default_actions();
    ::raise(signal_number);
    return;
  }
  restore_default_actions();  // the next SIGTERM or SIGINT ends the process at once
  const Notice& notice = signal_number == SIGINT ? g_int_notice : g_term_notice;
  [[maybe_unused]] const ssize_t written = ::write(STDERR_FILENO, notice.text, notice.size);
  errno = saved_errno;
}

}  // namespace

Status install_preemption_handlers(std::string_view program) {
  compose(g_term_notice, program, "SIGTERM");
  compose(g_int_notice, program, "SIGINT");
  struct sigaction action {};
  action.sa_handler = on_signal;
  sigemptyset(&action.sa_mask);
  sigaddset(&action.sa_mask, SIGTERM);  // one handler at a time
  sigaddset(&action.sa_mask, SIGINT);
  action.sa_flags = SA_RESTART;
  for (int signal_number : {SIGTERM, SIGINT}) {
    if (::sigaction(signal_number, &action, nullptr) != 0)
      return Status::FromErrno(errno, "sigaction(" + std::string(signal_number == SIGTERM ? "SIGTERM" : "SIGINT") + ")");
  }
  return Status::Ok();
}

int preemption_requested() { return g_requested.load(); }

}  // namespace strata::train
