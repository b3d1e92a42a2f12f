#include "engine/core/rendezvous.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <future>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/test_support.h"

namespace strata {
namespace {

using std::chrono::milliseconds;

TEST(RendezvousTest, StartRejectsBadOptions) {
  RendezvousOptions options;
  options.world_size = 2;
  options.rank = 2;
  StatusOr<Rendezvous> bad_rank = Rendezvous::start(options);
  ASSERT_FALSE(bad_rank.ok());
  EXPECT_NE(bad_rank.status().message().find("RANK"), std::string::npos) << bad_rank.status().to_string();

  options.rank = 1;
  options.master_port = 0;  // only rank 0 may ask for a free port
  StatusOr<Rendezvous> bad_port = Rendezvous::start(options);
  ASSERT_FALSE(bad_port.ok());
  EXPECT_NE(bad_port.status().message().find("MASTER_PORT"), std::string::npos) << bad_port.status().to_string();
}

// ---------------------------------------------------------------------------
// In one process: ranks as threads over loopback.
// ---------------------------------------------------------------------------

RendezvousOptions loopback_options(int rank, int world_size, uint16_t port, milliseconds timeout) {
  RendezvousOptions options;
  options.rank = rank;
  options.world_size = world_size;
  options.local_rank = rank;
  options.master_addr = "127.0.0.1";
  options.master_port = port;
  options.timeout = timeout;
  return options;
}

TEST(RendezvousTest, WorldOfOneNeedsNoSockets) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous rendezvous, Rendezvous::create(loopback_options(0, 1, 0, milliseconds(100))));
  EXPECT_TRUE(rendezvous.joined());
  STRATA_ASSERT_OK_AND_ASSIGN(const std::string shared, rendezvous.broadcast_string("id"));
  EXPECT_EQ(shared, "id");
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<std::string> all, rendezvous.all_gather_strings("mine"));
  EXPECT_EQ(all, std::vector<std::string>{"mine"});
  STRATA_EXPECT_OK(rendezvous.barrier());
}

TEST(RendezvousTest, ThreadsAgreeOnBlobs) {
  constexpr int kWorld = 4;
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(loopback_options(0, kWorld, 0, milliseconds(30000))));
  const uint16_t port = root.port();
  ASSERT_NE(port, 0);

  std::vector<Status> results(kWorld);
  std::vector<std::vector<std::string>> gathered(kWorld);
  std::vector<std::string> from_root(kWorld), from_rank2(kWorld);
  const auto exercise = [&](int rank, Rendezvous& rendezvous) -> Status {
    STRATA_RETURN_IF_ERROR(rendezvous.join());
    STRATA_ASSIGN_OR_RETURN(from_root[rank], rendezvous.broadcast_string(rank == 0 ? "the-root-id" : "ignored", 0));
    // Blobs of different sizes, rank 0's a single character.
    STRATA_ASSIGN_OR_RETURN(gathered[rank], rendezvous.all_gather_strings(std::string(rank, 'x') + std::to_string(rank)));
    STRATA_RETURN_IF_ERROR(rendezvous.barrier());
    STRATA_ASSIGN_OR_RETURN(from_rank2[rank], rendezvous.broadcast_string(rank == 2 ? "from-two" : "", 2));
    return rendezvous.barrier();
  };
  std::vector<std::thread> threads;
  for (int rank = 1; rank < kWorld; ++rank) {
    threads.emplace_back([&, rank] {
      results[rank] = [&]() -> Status {
        STRATA_ASSIGN_OR_RETURN(Rendezvous rendezvous,
                                Rendezvous::start(loopback_options(rank, kWorld, port, milliseconds(30000))));
        return exercise(rank, rendezvous);
      }();
    });
  }
  results[0] = exercise(0, root);
  for (std::thread& thread : threads) thread.join();

  for (int rank = 0; rank < kWorld; ++rank) {
    STRATA_EXPECT_OK(results[rank]);
    EXPECT_EQ(from_root[rank], "the-root-id") << "rank " << rank;
    EXPECT_EQ(from_rank2[rank], "from-two") << "rank " << rank;
    ASSERT_EQ(gathered[rank].size(), static_cast<size_t>(kWorld));
    for (int other = 0; other < kWorld; ++other)
      EXPECT_EQ(gathered[rank][other], std::string(other, 'x') + std::to_string(other));
  }
}

TEST(RendezvousTest, RankThatNeverArrivesTimesOutNamingIt) {
  constexpr int kWorld = 3;
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(loopback_options(0, kWorld, 0, milliseconds(1000))));
  const uint16_t port = root.port();
  Status rank1_status;
  std::thread rank1([&] {
    // A longer deadline than rank 0's: it learns about the failure from rank 0.
    rank1_status = Rendezvous::create(loopback_options(1, kWorld, port, milliseconds(5000))).status();
  });
  const Status root_status = root.join();
  rank1.join();
  ASSERT_EQ(root_status.code(), StatusCode::kDeadlineExceeded) << root_status.to_string();
  // "rank 2 of WORLD_SIZE=3 never arrived" (or "ranks 1, 2 ..." on a machine too busy to
  // start rank 1's thread within the deadline).
  EXPECT_NE(root_status.message().find("2 of WORLD_SIZE=3 never arrived"), std::string::npos) << root_status.to_string();
  ASSERT_FALSE(rank1_status.ok());
  if (rank1_status.code() == StatusCode::kFailedPrecondition) {  // it had arrived: rank 0 told it why
    EXPECT_NE(rank1_status.message().find("2 of WORLD_SIZE=3 never arrived"), std::string::npos)
        << rank1_status.to_string();
  }
  // Broken for good.
  EXPECT_FALSE(root.join().ok());
}

TEST(RendezvousTest, MissingRankZeroTimesOutNamingTheAddress) {
  // A socket bound but not listening holds a port that refuses connections.
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
  ASSERT_GE(fd, 0);
  File holder(fd, "socket");
  sockaddr_in address{};
  address.sin_family = AF_INET;
  address.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  ASSERT_EQ(::bind(fd, reinterpret_cast<sockaddr*>(&address), sizeof(address)), 0) << std::strerror(errno);
  socklen_t length = sizeof(address);
  ASSERT_EQ(::getsockname(fd, reinterpret_cast<sockaddr*>(&address), &length), 0);
  const uint16_t port = ntohs(address.sin_port);

  const StatusOr<Rendezvous> rendezvous = Rendezvous::create(loopback_options(1, 2, port, milliseconds(300)));
  ASSERT_FALSE(rendezvous.ok());
  EXPECT_EQ(rendezvous.status().code(), StatusCode::kDeadlineExceeded);
  EXPECT_NE(rendezvous.status().message().find("127.0.0.1:" + std::to_string(port)), std::string::npos)
      << rendezvous.status().to_string();
  EXPECT_NE(rendezvous.status().message().find("rank 0"), std::string::npos) << rendezvous.status().to_string();
}

// Runs rank 0's join on this thread and `peers` on their own threads; returns every status.
std::vector<Status> join_all(Rendezvous& root, const std::vector<RendezvousOptions>& peers) {
  std::vector<Status> statuses(peers.size() + 1);
  std::vector<std::thread> threads;
  for (size_t i = 0; i < peers.size(); ++i)
    threads.emplace_back([&, i] { statuses[i + 1] = Rendezvous::create(peers[i]).status(); });
  statuses[0] = root.join();
  for (std::thread& thread : threads) thread.join();
  return statuses;
}

TEST(RendezvousTest, WrongWorldSizeIsNamedOnBothSides) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(loopback_options(0, 2, 0, milliseconds(30000))));
  const std::vector<Status> statuses = join_all(root, {loopback_options(1, 3, root.port(), milliseconds(30000))});
  for (const Status& status : statuses) {
    ASSERT_FALSE(status.ok());
    EXPECT_NE(status.message().find("WORLD_SIZE=3"), std::string::npos) << status.to_string();
    EXPECT_NE(status.message().find("WORLD_SIZE=2"), std::string::npos) << status.to_string();
  }
}

TEST(RendezvousTest, DuplicateRankIsNamed) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(loopback_options(0, 3, 0, milliseconds(30000))));
  const std::vector<Status> statuses = join_all(root, {loopback_options(1, 3, root.port(), milliseconds(30000)),
                                                       loopback_options(1, 3, root.port(), milliseconds(30000))});
  ASSERT_FALSE(statuses[0].ok());
  EXPECT_NE(statuses[0].message().find("two processes have RANK=1"), std::string::npos) << statuses[0].to_string();
  EXPECT_FALSE(statuses[1].ok());
  EXPECT_FALSE(statuses[2].ok());
}

TEST(RendezvousTest, MismatchedCollectivesAreAnErrorNotAHang) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(loopback_options(0, 2, 0, milliseconds(30000))));
  const uint16_t port = root.port();
  Status peer_status;
  std::thread peer([&] {
    peer_status = [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(Rendezvous rendezvous, Rendezvous::create(loopback_options(1, 2, port, milliseconds(30000))));
      return rendezvous.all_gather_strings("x").status();
    }();
  });
  STRATA_ASSERT_OK(root.join());
  const Status root_status = root.barrier();
  peer.join();
  ASSERT_EQ(root_status.code(), StatusCode::kFailedPrecondition) << root_status.to_string();
  EXPECT_NE(root_status.message().find("all_gather #0"), std::string::npos) << root_status.to_string();
  EXPECT_NE(root_status.message().find("barrier #0"), std::string::npos) << root_status.to_string();
  ASSERT_FALSE(peer_status.ok());
  EXPECT_NE(peer_status.message().find("rank 0"), std::string::npos) << peer_status.to_string();
}

TEST(RendezvousTest, PeerThatExitsIsReportedNotWaitedFor) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(loopback_options(0, 2, 0, milliseconds(30000))));
  const uint16_t port = root.port();
  Status peer_status;
  std::thread peer([&] {
    // Joins, then goes away without calling the collective.
    peer_status = Rendezvous::create(loopback_options(1, 2, port, milliseconds(30000))).status();
  });
  STRATA_ASSERT_OK(root.join());
  peer.join();
  STRATA_ASSERT_OK(peer_status);
  const Status status = root.barrier();
  ASSERT_EQ(status.code(), StatusCode::kUnavailable) << status.to_string();
  EXPECT_NE(status.message().find("rank 1"), std::string::npos) << status.to_string();
}

// A peer that is alive but stuck (a stopped process, a rank in a long loop) holds a
// collective for the collective timeout, not for the join's minutes.
TEST(RendezvousTest, StuckPeerIsBoundedByTheCollectiveTimeoutNamingIt) {
  RendezvousOptions root_options = loopback_options(0, 2, 0, std::chrono::minutes(5));
  root_options.collective_timeout = milliseconds(300);
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(root_options));
  const uint16_t port = root.port();
  std::promise<void> root_done;
  Status peer_status;
  std::thread peer([&, done = root_done.get_future()] {
    peer_status = [&]() -> Status {
      RendezvousOptions options = loopback_options(1, 2, port, std::chrono::minutes(5));
      options.collective_timeout = milliseconds(300);
      STRATA_ASSIGN_OR_RETURN(Rendezvous rendezvous, Rendezvous::create(options));
      done.wait();  // stuck until rank 0 has given up on it
      return rendezvous.barrier();
    }();
  });
  STRATA_ASSERT_OK(root.join());
  const Status status = root.all_gather_strings("step 1").status();
  root_done.set_value();
  peer.join();
  ASSERT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.to_string();
  EXPECT_NE(status.message().find("rank 1"), std::string::npos) << status.to_string();
  EXPECT_FALSE(peer_status.ok()) << "rank 0 gave up: the late peer must not succeed";
}

// Rank 1 reached the gather before rank 0: its own clock would run out first, naming only
// rank 0. Rank 0 says it is waiting, so rank 1 waits for its verdict and names rank 2.
TEST(RendezvousTest, RanksWaitingOnRankZeroHearWhichRankIsStuck) {
  auto options_for = [](int rank, uint16_t port) {
    RendezvousOptions options = loopback_options(rank, 3, port, std::chrono::minutes(5));
    options.collective_timeout = milliseconds(400);
    return options;
  };
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(options_for(0, 0)));
  const uint16_t port = root.port();
  std::promise<void> first_arrived, all_done;
  Status early_status;
  std::thread early([&] {
    early_status = [&]() -> Status {
      STRATA_ASSIGN_OR_RETURN(Rendezvous rendezvous, Rendezvous::create(options_for(1, port)));
      first_arrived.set_value();
      return rendezvous.all_gather_strings("rank 1").status();
    }();
  });
  std::thread stuck([&, done = all_done.get_future()] {
    StatusOr<Rendezvous> rendezvous = Rendezvous::create(options_for(2, port));
    done.wait();  // joined, then never calls the gather
  });
  STRATA_ASSERT_OK(root.join());
  first_arrived.get_future().wait();
  std::this_thread::sleep_for(milliseconds(250));  // rank 1's clock runs well ahead of rank 0's
  const Status status = root.all_gather_strings("rank 0").status();
  early.join();
  all_done.set_value();
  stuck.join();
  ASSERT_EQ(status.code(), StatusCode::kDeadlineExceeded) << status.to_string();
  EXPECT_NE(status.message().find("rank 2"), std::string::npos) << status.to_string();
  ASSERT_FALSE(early_status.ok());
  EXPECT_NE(early_status.message().find("rank 2"), std::string::npos) << early_status.to_string();
}

// ---------------------------------------------------------------------------
// Two processes: this binary re-executes itself as rank 1.
// ---------------------------------------------------------------------------

constexpr const char* kChildVariable = "STRATA_RENDEZVOUS_TEST_CHILD";

// The child's side of TwoProcessesAgreeOnASharedId; skipped unless run as that child.
TEST(RendezvousChildProcess, JoinAndAgree) {
  if (std::getenv(kChildVariable) == nullptr) GTEST_SKIP() << "runs only as the child of TwoProcessesAgreeOnASharedId";
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env());
  ASSERT_EQ(options.rank, 1);
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous rendezvous, Rendezvous::create(options));
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<std::byte> id, rendezvous.broadcast({}, 0));
  ASSERT_EQ(id.size(), 128u);
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<std::vector<std::byte>> views, rendezvous.all_gather(id));
  ASSERT_EQ(views.size(), 2u);
  EXPECT_EQ(views[0], views[1]);
  STRATA_ASSERT_OK(rendezvous.barrier());
}

TEST(RendezvousTest, TwoProcessesAgreeOnASharedId) {
  STRATA_ASSERT_OK_AND_ASSIGN(Rendezvous root, Rendezvous::start(loopback_options(0, 2, 0, milliseconds(60000))));
  const std::string port = std::to_string(root.port());

  // The environment a launcher would give rank 1.
  std::vector<std::string> environment = {"RANK=1",        "WORLD_SIZE=2",       "LOCAL_RANK=1",
                                          "MASTER_ADDR=127.0.0.1", "MASTER_PORT=" + port,
                                          "STRATA_RENDEZVOUS_TIMEOUT_S=60", std::string(kChildVariable) + "=1"};
  for (char** entry = environ; *entry != nullptr; ++entry) {
    const std::string text = *entry;
    const std::string name = text.substr(0, text.find('='));
    if (name != "RANK" && name != "WORLD_SIZE" && name != "LOCAL_RANK" && name != "MASTER_ADDR" &&
        name != "MASTER_PORT" && name != "STRATA_RENDEZVOUS_TIMEOUT_S" && name != kChildVariable)
      environment.push_back(text);
  }
  std::vector<char*> envp;
  for (std::string& entry : environment) envp.push_back(entry.data());
  envp.push_back(nullptr);
  std::string program = "/proc/self/exe";
  std::string filter = "--gtest_filter=RendezvousChildProcess.JoinAndAgree";
  std::vector<char*> argv = {program.data(), filter.data(), nullptr};

  const pid_t child = ::fork();
  ASSERT_GE(child, 0) << std::strerror(errno);
  if (child == 0) {
    ::execve(program.c_str(), argv.data(), envp.data());
    ::_exit(127);
  }

  const Status joined = root.join();
  std::vector<std::byte> id(128);
  std::mt19937_64 random(std::random_device{}());
  for (std::byte& byte : id) byte = static_cast<std::byte>(random() & 0xff);
  StatusOr<std::vector<std::byte>> shared = joined.ok() ? root.broadcast(id, 0) : StatusOr<std::vector<std::byte>>(joined);
  StatusOr<std::vector<std::vector<std::byte>>> views =
      shared.ok() ? root.all_gather(*shared) : StatusOr<std::vector<std::vector<std::byte>>>(shared.status());
  const Status barrier = views.ok() ? root.barrier() : views.status();

  int wait_status = 0;
  ASSERT_EQ(::waitpid(child, &wait_status, 0), child);
  STRATA_ASSERT_OK(joined);
  STRATA_ASSERT_OK(shared);
  STRATA_ASSERT_OK(views);
  STRATA_ASSERT_OK(barrier);
  EXPECT_EQ(*shared, id);
  ASSERT_EQ(views->size(), 2u);
  EXPECT_EQ((*views)[0], id);
  EXPECT_EQ((*views)[1], id) << "the child saw another id";
  ASSERT_TRUE(WIFEXITED(wait_status)) << "child status " << wait_status;
  EXPECT_EQ(WEXITSTATUS(wait_status), 0) << "the child process's test failed (its output is above)";
}

}  // namespace
}  // namespace strata
