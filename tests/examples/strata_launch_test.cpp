// strata-launch: its flags and the variables each process gets (launch_plan), whole
// prefixed lines (line_prefixer), and the binary driving tests/examples/strata_launch_child.sh:
// what each child sees, the prefixes on stdout and stderr kept apart, exit codes passed
// on, the others stopped when one fails, signals forwarded, SIGKILL after the grace period.
#include <fcntl.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "examples/strata_launch/launch_plan.h"
#include "examples/strata_launch/line_prefixer.h"
#include "examples/strata_launch/process_group.h"
#include "tests/support/test_support.h"

namespace strata::launch {
namespace {

using namespace std::chrono_literals;
using strata::testing::TempDir;

// ---------------------------------------------------------------------------
// Flags and environment
// ---------------------------------------------------------------------------

StatusOr<LaunchPlan> parse(std::vector<std::string> args) { return parse_launch_args(args); }

TEST(LaunchPlanTest, ParsesTheFlagsAndTheCommandAfterTheSeparator) {
  STRATA_ASSERT_OK_AND_ASSIGN(const LaunchPlan plan,
                              parse({"--nproc-per-node", "2", "--nnodes=3", "--node-rank", "1", "--master-addr",
                                     "10.77.0.1", "--master-port", "29999", "--grace-period", "0.5", "--", "prog",
                                     "--steps", "8"}));
  EXPECT_EQ(plan.nproc_per_node, 2);
  EXPECT_EQ(plan.nnodes, 3);
  EXPECT_EQ(plan.node_rank, 1);
  EXPECT_EQ(plan.master_addr, "10.77.0.1");
  EXPECT_EQ(plan.master_port, 29999);
  EXPECT_EQ(plan.grace_period, 500ms);
  EXPECT_EQ(plan.command, (std::vector<std::string>{"prog", "--steps", "8"}));
  EXPECT_EQ(plan.world_size(), 6);
  EXPECT_EQ(plan.global_rank(1), 3);
}

TEST(LaunchPlanTest, OneNodeDefaultsLeaveThePortToBePicked) {
  STRATA_ASSERT_OK_AND_ASSIGN(const LaunchPlan plan, parse({"--nproc-per-node", "4", "prog"}));
  EXPECT_EQ(plan.nnodes, 1);
  EXPECT_EQ(plan.master_addr, "127.0.0.1");
  EXPECT_EQ(plan.master_port, 0);
  EXPECT_EQ(plan.grace_period, 10s);
  EXPECT_EQ(plan.command, (std::vector<std::string>{"prog"}));
  STRATA_ASSERT_OK_AND_ASSIGN(const uint16_t port, pick_free_port());
  EXPECT_GT(port, 0);
}

TEST(LaunchPlanTest, SeveralNodesDefaultToTorchrunsPort) {
  STRATA_ASSERT_OK_AND_ASSIGN(const LaunchPlan plan,
                              parse({"--nnodes", "2", "--node-rank", "0", "--master-addr", "a", "--", "prog"}));
  EXPECT_EQ(plan.master_port, 29500);
}

struct BadLaunchArgs {
  std::vector<std::string> args;
  std::string named;  // the error must say this
};

class LaunchPlanBadArgsTest : public ::testing::TestWithParam<BadLaunchArgs> {};

TEST_P(LaunchPlanBadArgsTest, ErrorNamesTheFlag) {
  const StatusOr<LaunchPlan> plan = parse_launch_args(GetParam().args);
  ASSERT_FALSE(plan.ok());
  EXPECT_NE(plan.status().message().find(GetParam().named), std::string::npos) << plan.status().to_string();
}

INSTANTIATE_TEST_SUITE_P(
    Cases, LaunchPlanBadArgsTest,
    ::testing::Values(BadLaunchArgs{{"--nproc-per-node", "0", "p"}, "--nproc-per-node"},
                      BadLaunchArgs{{"--nproc-per-node", "two", "p"}, "--nproc-per-node"},
                      BadLaunchArgs{{"--nproc-per-node", "2"}, "no program"},
                      BadLaunchArgs{{"--nnodes", "2", "--master-addr", "a", "p"}, "--node-rank"},
                      BadLaunchArgs{{"--nnodes", "2", "--node-rank", "1", "p"}, "--master-addr"},
                      BadLaunchArgs{{"--nnodes", "2", "--node-rank", "2", "--master-addr", "a", "p"}, "--node-rank 2"},
                      BadLaunchArgs{{"--master-port", "70000", "p"}, "--master-port"},
                      BadLaunchArgs{{"--master-addr=", "p"}, "--master-addr"},
                      BadLaunchArgs{{"--grace-period", "-1", "p"}, "--grace-period"},
                      BadLaunchArgs{{"--nproc", "2", "p"}, "--nproc"}));

TEST(LaunchPlanTest, ChildEnvironmentReplacesTheLaunchVariablesAndKeepsTheRest) {
  STRATA_ASSERT_OK_AND_ASSIGN(LaunchPlan plan, parse({"--nproc-per-node", "2", "--nnodes", "2", "--node-rank", "1",
                                                      "--master-addr", "10.77.0.1", "--master-port", "1234", "p"}));
  const std::vector<std::string> inherited = {"PATH=/bin", "RANK=9", "MASTER_PORT=1", "RANKING=kept"};
  const std::vector<std::string> environment = child_environment(plan, 1, inherited);
  std::map<std::string, std::string> values;
  for (const std::string& entry : environment) {
    const size_t equals = entry.find('=');
    EXPECT_FALSE(values.contains(entry.substr(0, equals))) << "set twice: " << entry;
    values[entry.substr(0, equals)] = entry.substr(equals + 1);
  }
  EXPECT_EQ(values, (std::map<std::string, std::string>{{"PATH", "/bin"},
                                                        {"RANKING", "kept"},
                                                        {"RANK", "3"},
                                                        {"WORLD_SIZE", "4"},
                                                        {"LOCAL_RANK", "1"},
                                                        {"LOCAL_WORLD_SIZE", "2"},
                                                        {"GROUP_RANK", "1"},
                                                        {"MASTER_ADDR", "10.77.0.1"},
                                                        {"MASTER_PORT", "1234"}}));
}

TEST(LaunchPlanTest, WaitStatusesReadAsAShellWouldReportThem) {
  EXPECT_EQ(describe_wait_status(3 << 8), "exited with code 3");
  EXPECT_EQ(exit_code_of_wait_status(3 << 8), 3);
  EXPECT_EQ(describe_wait_status(SIGKILL), "was killed by signal 9 (SIGKILL)");
  EXPECT_EQ(exit_code_of_wait_status(SIGKILL), 137);
}

// ---------------------------------------------------------------------------
// Line prefixing
// ---------------------------------------------------------------------------

struct CollectedLines {
  std::vector<std::string> lines;
  LineSink sink() {
    return [this](std::string_view line) {
      lines.emplace_back(line);
      return Status::Ok();
    };
  }
};

Status feed_text(LinePrefixer& prefixer, std::string_view text) {
  return prefixer.feed(std::span<const char>(text.data(), text.size()));
}

TEST(LinePrefixerTest, PassesOnWholeLinesOnlyWhateverTheChunks) {
  CollectedLines collected;
  LinePrefixer prefixer("[rank 2] ", collected.sink());
  STRATA_ASSERT_OK(feed_text(prefixer, "hel"));
  EXPECT_TRUE(collected.lines.empty());
  STRATA_ASSERT_OK(feed_text(prefixer, "lo\nwor"));
  STRATA_ASSERT_OK(feed_text(prefixer, "ld\n\nlast"));
  STRATA_ASSERT_OK(prefixer.finish());
  EXPECT_EQ(collected.lines,
            (std::vector<std::string>{"[rank 2] hello\n", "[rank 2] world\n", "[rank 2] \n", "[rank 2] last\n"}));
  STRATA_ASSERT_OK(prefixer.finish());
  EXPECT_EQ(collected.lines.size(), 4u) << "finish() twice adds nothing";
}

TEST(LinePrefixerTest, CutsALineLongerThanTheLimitIntoPrefixedPieces) {
  CollectedLines collected;
  LinePrefixer prefixer("> ", collected.sink());
  const std::string long_line(LinePrefixer::kMaxLineBytes * 2 + 7, 'x');
  STRATA_ASSERT_OK(feed_text(prefixer, long_line + "\n"));
  ASSERT_EQ(collected.lines.size(), 3u);
  EXPECT_EQ(collected.lines[0], "> " + std::string(LinePrefixer::kMaxLineBytes, 'x') + "\n");
  EXPECT_EQ(collected.lines[2], "> " + std::string(7, 'x') + "\n");
}

TEST(LinePrefixerTest, SinkErrorsAreReturned) {
  LinePrefixer prefixer("p ", [](std::string_view) { return IoError("write to stdout: Broken pipe"); });
  const Status status = feed_text(prefixer, "a\n");
  EXPECT_EQ(status.code(), StatusCode::kIoError);
}

// ---------------------------------------------------------------------------
// The binary
// ---------------------------------------------------------------------------

std::string read_text(const std::filesystem::path& path) {
  std::ifstream in(path);
  std::stringstream text;
  text << in.rdbuf();
  return text.str();
}

std::vector<std::string> split_lines(const std::string& text) {
  std::vector<std::string> lines;
  std::stringstream stream(text);
  for (std::string line; std::getline(stream, line);) lines.push_back(line);
  return lines;
}

std::string child_script() { return (strata::testing::source_dir() / "tests/examples/strata_launch_child.sh").string(); }

// strata-launch started in the background, its stdout and stderr in files.
class Launcher {
 public:
  Launcher(const TempDir& dir, std::vector<std::string> args) : out_(dir.path() / "launch.out"), err_(dir.path() / "launch.err") {
    args.insert(args.begin(), (strata::testing::binary_dir() / "bin/strata-launch").string());
    std::vector<char*> argv;
    for (std::string& arg : args) argv.push_back(arg.data());
    argv.push_back(nullptr);
    pid_ = ::fork();
    if (pid_ == 0) {
      const int out = ::open(out_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      const int err = ::open(err_.c_str(), O_WRONLY | O_CREAT | O_TRUNC, 0644);
      ::dup2(out, STDOUT_FILENO);
      ::dup2(err, STDERR_FILENO);
      ::execv(argv[0], argv.data());
      ::_exit(126);
    }
  }
  ~Launcher() {
    if (pid_ > 0 && !reaped_) {
      ::kill(pid_, SIGKILL);
      ::waitpid(pid_, nullptr, 0);
    }
  }
  pid_t pid() const { return pid_; }
  // Waits for the launcher; its exit code (1000 + signal if it was killed).
  int wait() {
    int status = 0;
    ::waitpid(pid_, &status, 0);
    reaped_ = true;
    return WIFEXITED(status) ? WEXITSTATUS(status) : 1000 + WTERMSIG(status);
  }
  std::string out() const { return read_text(out_); }
  std::string err() const { return read_text(err_); }

 private:
  pid_t pid_ = -1;
  bool reaped_ = false;
  std::filesystem::path out_, err_;
};

// Waits (up to 20 s) until `count` files named prefix* exist in `dir`.
bool wait_for_files(const std::filesystem::path& dir, const std::string& prefix, int count) {
  for (int i = 0; i < 2000; ++i) {
    int found = 0;
    for (const auto& entry : std::filesystem::directory_iterator(dir))
      found += entry.path().filename().string().starts_with(prefix) ? 1 : 0;
    if (found >= count) return true;
    std::this_thread::sleep_for(10ms);
  }
  return false;
}

TEST(StrataLaunchTest, EachChildSeesTorchrunsVariablesAndItsLinesArePrefixed) {
  TempDir dir;
  Launcher launcher(dir, {"--nproc-per-node", "3", "--nnodes", "2", "--node-rank", "1", "--master-addr",
                          "10.77.0.1", "--master-port", "29876", "--", child_script(), "env", dir.str()});
  ASSERT_EQ(launcher.wait(), 0) << launcher.err();
  std::vector<std::string> out = split_lines(launcher.out());
  std::sort(out.begin(), out.end());
  std::vector<std::string> expected_out;
  std::vector<std::string> expected_err;
  for (int local = 0; local < 3; ++local) {
    const std::string rank = std::to_string(3 + local);
    expected_out.push_back("[rank " + rank + "] RANK=" + rank + " WORLD_SIZE=6 LOCAL_RANK=" + std::to_string(local) +
                           " LOCAL_WORLD_SIZE=3 GROUP_RANK=1 MASTER_ADDR=10.77.0.1 MASTER_PORT=29876");
    expected_err.push_back("[rank " + rank + "] on stderr from " + rank);
  }
  EXPECT_EQ(out, expected_out);
  std::vector<std::string> err = split_lines(launcher.err());
  std::sort(err.begin(), err.end());
  EXPECT_EQ(err, expected_err) << "stderr holds the children's stderr only, prefixed";
}

TEST(StrataLaunchTest, OneNodeWithoutAPortGetsAFreeOne) {
  TempDir dir;
  Launcher launcher(dir, {"--nproc-per-node", "2", child_script(), "env", dir.str()});
  ASSERT_EQ(launcher.wait(), 0) << launcher.err();
  const std::vector<std::string> out = split_lines(launcher.out());
  ASSERT_EQ(out.size(), 2u);
  std::set<std::string> ports;
  for (const std::string& line : out) ports.insert(line.substr(line.find("MASTER_PORT=")));
  EXPECT_EQ(ports.size(), 1u) << "both ranks get the same port";
  EXPECT_NE(*ports.begin(), "MASTER_PORT=0");
}

TEST(StrataLaunchTest, LongLinesFromSeveralRanksNeverInterleave) {
  TempDir dir;
  Launcher launcher(dir, {"--nproc-per-node", "4", "--", child_script(), "lines", dir.str(), "50"});
  ASSERT_EQ(launcher.wait(), 0) << launcher.err();
  const std::vector<std::string> out = split_lines(launcher.out());
  EXPECT_EQ(out.size(), 200u);
  std::map<char, int> per_rank;
  for (const std::string& line : out) {
    ASSERT_TRUE(line.starts_with("[rank ") && line.size() == 9 + 12000) << line.substr(0, 80) << "... (" << line.size() << ")";
    const char rank = line[6];
    EXPECT_EQ(line.substr(9), std::string(12000, rank)) << "a line mixes ranks";
    ++per_rank[rank];
  }
  EXPECT_EQ(per_rank, (std::map<char, int>{{'0', 50}, {'1', 50}, {'2', 50}, {'3', 50}}));
}

TEST(StrataLaunchTest, AFailingRankStopsTheOthersAndItsCodeIsTheLaunchersCode) {
  TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  Launcher launcher(dir, {"--nproc-per-node", "3", "--", child_script(), "fail", dir.str(), "1", "7"});
  EXPECT_EQ(launcher.wait(), 7) << launcher.err();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s) << "the others sleep 60 s unless stopped";
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "stopped-0")) << launcher.err();
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "stopped-2")) << launcher.err();
  EXPECT_FALSE(std::filesystem::exists(dir.path() / "stopped-1"));
  EXPECT_NE(launcher.err().find("strata-launch: rank 1 failed: it exited with code 7; exiting with code 7"),
            std::string::npos)
      << launcher.err();
}

TEST(StrataLaunchTest, ARankKilledBySignalGivesOneHundredTwentyEightPlusTheSignal) {
  TempDir dir;
  Launcher launcher(dir, {"--nproc-per-node", "2", "--", child_script(), "kill", dir.str(), "0", "KILL"});
  EXPECT_EQ(launcher.wait(), 128 + SIGKILL) << launcher.err();
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "stopped-1")) << launcher.err();
  EXPECT_NE(launcher.err().find("rank 0 failed: it was killed by signal 9 (SIGKILL)"), std::string::npos)
      << launcher.err();
}

class StrataLaunchSignalTest : public ::testing::TestWithParam<int> {};

TEST_P(StrataLaunchSignalTest, ForwardsTheSignalToEveryRank) {
  const int signal_number = GetParam();
  const std::string name = std::string(::sigabbrev_np(signal_number));
  TempDir dir;
  Launcher launcher(dir, {"--nproc-per-node", "2", "--", child_script(), "wait", dir.str()});
  ASSERT_TRUE(wait_for_files(dir.path(), "ready-", 2)) << launcher.err();
  ASSERT_EQ(::kill(launcher.pid(), signal_number), 0);
  EXPECT_EQ(launcher.wait(), 0) << "the ranks handle the signal and exit 0: " << launcher.err();
  EXPECT_TRUE(std::filesystem::exists(dir.path() / ("got-" + name + "-0"))) << launcher.err();
  EXPECT_TRUE(std::filesystem::exists(dir.path() / ("got-" + name + "-1"))) << launcher.err();
}

INSTANTIATE_TEST_SUITE_P(Signals, StrataLaunchSignalTest, ::testing::Values(SIGINT, SIGTERM, SIGHUP),
                         [](const ::testing::TestParamInfo<int>& info) { return std::string(::sigabbrev_np(info.param)); });

TEST(StrataLaunchTest, ARankEndedByAForwardedSignalStopsTheRanksThatIgnoredIt) {
  TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  Launcher launcher(dir, {"--nproc-per-node", "2", "--", child_script(), "split", dir.str()});
  ASSERT_TRUE(wait_for_files(dir.path(), "ready-", 2)) << launcher.err();
  ASSERT_EQ(::kill(launcher.pid(), SIGINT), 0);
  EXPECT_EQ(launcher.wait(), 5) << launcher.err();
  EXPECT_TRUE(std::filesystem::exists(dir.path() / "stopped-1")) << "rank 1 got SIGTERM, not only SIGKILL: " << launcher.err();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 8s) << "within the 10 s grace period";
}

TEST(StrataLaunchTest, ARankIgnoringSigtermIsKilledAfterTheGracePeriod) {
  TempDir dir;
  const auto start = std::chrono::steady_clock::now();
  Launcher launcher(dir, {"--nproc-per-node", "2", "--grace-period", "0.5", "--", child_script(), "stubborn", dir.str()});
  ASSERT_TRUE(wait_for_files(dir.path(), "ready-", 2)) << launcher.err();
  ASSERT_EQ(::kill(launcher.pid(), SIGTERM), 0);
  EXPECT_EQ(launcher.wait(), 128 + SIGKILL) << launcher.err();
  EXPECT_LT(std::chrono::steady_clock::now() - start, 20s) << "the ranks loop for 60 s unless killed";
  EXPECT_NE(launcher.err().find("grace period over: sending SIGKILL"), std::string::npos) << launcher.err();
}

TEST(StrataLaunchTest, AProgramThatCannotRunExitsOneHundredTwentySeven) {
  TempDir dir;
  Launcher launcher(dir, {"--nproc-per-node", "1", "--", (dir.path() / "no-such-program").string()});
  EXPECT_EQ(launcher.wait(), 127);
  EXPECT_NE(launcher.err().find("[rank 0] strata-launch: cannot execute"), std::string::npos) << launcher.err();
}

TEST(StrataLaunchTest, BadFlagsExitTwoNamingTheFlag) {
  TempDir dir;
  Launcher launcher(dir, {"--nproc-per-node", "zero", "--", "true"});
  EXPECT_EQ(launcher.wait(), 2);
  EXPECT_NE(launcher.err().find("--nproc-per-node"), std::string::npos) << launcher.err();
}

}  // namespace
}  // namespace strata::launch
