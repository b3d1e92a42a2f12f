// The preemption handlers, in a child process each: the first SIGTERM or SIGINT is
// recorded (and announced on stderr) without ending the process; a second one ends it at
// once, by the signal's default action.
#include "examples/train/preemption.h"

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

namespace strata::train {
namespace {

class PreemptionTest : public ::testing::TestWithParam<int> {};

TEST_P(PreemptionTest, TheFirstSignalIsRecordedAndTheSecondEndsTheProcessAtOnce) {
  const int signal_number = GetParam();
  int report[2];
  ASSERT_EQ(::pipe(report), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(report[0]);
    if (!install_preemption_handlers("preemption_test").ok()) ::_exit(2);
    char state = preemption_requested() == 0 ? 'a' : 'x';  // nothing yet
    ::raise(signal_number);
    state = (state == 'a' && preemption_requested() == signal_number) ? 'b' : 'x';  // recorded, still alive
    (void)!::write(report[1], &state, 1);
    ::raise(signal_number);  // the second: the default action ends the process here
    ::_exit(3);
  }
  ::close(report[1]);
  char state = 0;
  EXPECT_EQ(::read(report[0], &state, 1), 1);
  ::close(report[0]);
  EXPECT_EQ(state, 'b') << "the first signal was not recorded, or ended the process";
  int status = 0;
  ASSERT_EQ(::waitpid(child, &status, 0), child);
  ASSERT_TRUE(WIFSIGNALED(status)) << "the child exited with " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1);
  EXPECT_EQ(WTERMSIG(status), signal_number);
}

INSTANTIATE_TEST_SUITE_P(Signals, PreemptionTest, ::testing::Values(SIGTERM, SIGINT),
                         [](const auto& info) { return std::string(info.param == SIGTERM ? "SIGTERM" : "SIGINT"); });

}  // namespace
}  // namespace strata::train
