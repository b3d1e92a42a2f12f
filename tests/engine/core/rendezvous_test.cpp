#include "engine/core/rendezvous.h"

#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdlib>
#include <cstring>
#include <future>
#include <map>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "tests/support/test_support.h"

namespace strata {
namespace {

using std::chrono::milliseconds;

// ---------------------------------------------------------------------------
// Options from the environment
// ---------------------------------------------------------------------------

EnvLookup map_lookup(std::map<std::string, std::string> values) {
  return [values = std::move(values)](const char* name) -> std::optional<std::string> {
    const auto found = values.find(name);
    if (found == values.end()) return std::nullopt;
    return found->second;
  };
}

TEST(RendezvousEnvTest, NothingSetIsAWorldOfOne) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env(map_lookup({})));
  EXPECT_EQ(options.world_size, 1);
  EXPECT_EQ(options.rank, 0);
  EXPECT_EQ(options.local_rank, 0);
}

TEST(RendezvousEnvTest, ReadsTheLauncherVariables) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options,
                              rendezvous_options_from_env(map_lookup({{"RANK", "5"},
                                                                      {"WORLD_SIZE", "8"},
                                                                      {"LOCAL_RANK", "1"},
                                                                      {"MASTER_ADDR", "node-a"},
                                                                      {"MASTER_PORT", "29500"},
                                                                      {"STRATA_RENDEZVOUS_TIMEOUT_S", "2.5"}})));
  EXPECT_EQ(options.rank, 5);
  EXPECT_EQ(options.world_size, 8);
  EXPECT_EQ(options.local_rank, 1);
  EXPECT_EQ(options.master_addr, "node-a");
  EXPECT_EQ(options.master_port, 29500);
  EXPECT_EQ(options.timeout, milliseconds(2500));
}

TEST(RendezvousEnvTest, LocalRankDefaultsToRank) {
  STRATA_ASSERT_OK_AND_ASSIGN(
      const RendezvousOptions options,
      rendezvous_options_from_env(map_lookup(
          {{"RANK", "3"}, {"WORLD_SIZE", "4"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}})));
  EXPECT_EQ(options.local_rank, 3);
}

struct BadEnvCase {
  std::map<std::string, std::string> env;
  std::string variable;  // the error must name it
};

class RendezvousBadEnvTest : public ::testing::TestWithParam<BadEnvCase> {};

TEST_P(RendezvousBadEnvTest, ErrorNamesTheVariable) {
  const StatusOr<RendezvousOptions> options = rendezvous_options_from_env(map_lookup(GetParam().env));
  ASSERT_FALSE(options.ok());
  EXPECT_EQ(options.status().code(), StatusCode::kInvalidArgument);
  EXPECT_NE(options.status().message().find(GetParam().variable), std::string::npos) << options.status().to_string();
}

const std::map<std::string, std::string> kGoodEnv = {
    {"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_ADDR", "127.0.0.1"}, {"MASTER_PORT", "1234"}};

std::map<std::string, std::string> good_env_with(const std::string& name, const std::string& value) {
  std::map<std::string, std::string> env = kGoodEnv;
  env[name] = value;
  return env;
}
std::map<std::string, std::string> good_env_without(const std::string& name) {
  std::map<std::string, std::string> env = kGoodEnv;
  env.erase(name);
  return env;
}

INSTANTIATE_TEST_SUITE_P(
    Cases, RendezvousBadEnvTest,
    ::testing::Values(BadEnvCase{good_env_with("WORLD_SIZE", "abc"), "WORLD_SIZE"},
                      BadEnvCase{good_env_with("WORLD_SIZE", "0"), "WORLD_SIZE"},
                      BadEnvCase{good_env_with("WORLD_SIZE", "2x"), "WORLD_SIZE"},
                      BadEnvCase{good_env_with("RANK", "2"), "RANK"},
                      BadEnvCase{good_env_with("RANK", "-1"), "RANK"},
                      BadEnvCase{good_env_with("RANK", ""), "RANK"},
                      BadEnvCase{good_env_without("RANK"), "RANK"},
                      BadEnvCase{{{"RANK", "0"}}, "WORLD_SIZE"},
                      BadEnvCase{good_env_with("LOCAL_RANK", "one"), "LOCAL_RANK"},
                      BadEnvCase{good_env_without("MASTER_ADDR"), "MASTER_ADDR"},
                      BadEnvCase{good_env_with("MASTER_ADDR", ""), "MASTER_ADDR"},
                      BadEnvCase{good_env_without("MASTER_PORT"), "MASTER_PORT"},
                      BadEnvCase{good_env_with("MASTER_PORT", "70000"), "MASTER_PORT"},
                      BadEnvCase{good_env_with("MASTER_PORT", "http"), "MASTER_PORT"},
                      BadEnvCase{good_env_with("STRATA_RENDEZVOUS_TIMEOUT_S", "-3"), "STRATA_RENDEZVOUS_TIMEOUT_S"},
                      BadEnvCase{good_env_with("STRATA_MASTER_PORT", "65536"), "STRATA_MASTER_PORT"},
                      BadEnvCase{{{"RANK", "0"},
                                  {"WORLD_SIZE", "2"},
                                  {"MASTER_ADDR", "h"},
                                  {"MASTER_PORT", "65535"},
                                  {"TORCHELASTIC_USE_AGENT_STORE", "True"}},
                                 "STRATA_MASTER_PORT"},
                      BadEnvCase{good_env_with("STRATA_COLLECTIVE_TIMEOUT_S", "0"), "STRATA_COLLECTIVE_TIMEOUT_S"},
                      BadEnvCase{good_env_with("STRATA_COLLECTIVE_TIMEOUT_S", "1m"), "STRATA_COLLECTIVE_TIMEOUT_S"},
                      BadEnvCase{good_env_with("LOCAL_WORLD_SIZE", "3"), "LOCAL_WORLD_SIZE"},
                      BadEnvCase{good_env_with("LOCAL_WORLD_SIZE", "0"), "LOCAL_WORLD_SIZE"},
                      BadEnvCase{good_env_with("GROUP_RANK", "-1"), "GROUP_RANK"},
                      BadEnvCase{{{"OMPI_COMM_WORLD_RANK", "1"}}, "OMPI_COMM_WORLD_SIZE"},
                      BadEnvCase{{{"OMPI_COMM_WORLD_RANK", "4"}, {"OMPI_COMM_WORLD_SIZE", "4"}}, "OMPI_COMM_WORLD_RANK"},
                      BadEnvCase{{{"OMPI_COMM_WORLD_RANK", "0"},
                                  {"OMPI_COMM_WORLD_SIZE", "4"},
                                  {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"}},
                                 "MASTER_ADDR"},
                      BadEnvCase{{{"OMPI_COMM_WORLD_RANK", "0"},
                                  {"OMPI_COMM_WORLD_SIZE", "2"},
                                  {"OMPI_COMM_WORLD_LOCAL_RANK", "2"}},
                                 "OMPI_COMM_WORLD_LOCAL_RANK"},
                      BadEnvCase{{{"SLURM_PROCID", "0"}}, "SLURM_NTASKS"},
                      BadEnvCase{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}}, "SLURM_JOB_NODELIST"},
                      BadEnvCase{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_NODELIST", "n[1-"}},
                                 "SLURM_JOB_NODELIST"},
                      BadEnvCase{{{"SLURM_PROCID", "0"},
                                  {"SLURM_NTASKS", "4"},
                                  {"SLURM_NODEID", "2"},
                                  {"SLURM_TASKS_PER_NODE", "1(x2)"},
                                  {"MASTER_ADDR", "h"}},
                                 "SLURM_TASKS_PER_NODE"},
                      BadEnvCase{{{"SLURM_PROCID", "0"},
                                  {"SLURM_NTASKS", "2"},
                                  {"SLURM_TASKS_PER_NODE", "two"},
                                  {"MASTER_ADDR", "h"}},
                                 "SLURM_TASKS_PER_NODE"},
                      BadEnvCase{{{"SLURM_PROCID", "0"},
                                  {"SLURM_NTASKS", "2"},
                                  {"SLURM_TASKS_PER_NODE", "4"},
                                  {"MASTER_ADDR", "h"}},
                                 "SLURM_TASKS_PER_NODE"},
                      BadEnvCase{{{"SLURM_PROCID", "0"}, {"SLURM_NTASKS", "2"}, {"SLURM_JOB_ID", "x"}, {"MASTER_ADDR", "h"}},
                                 "SLURM_JOB_ID"}));

TEST(RendezvousEnvTest, ReadsTorchrunsNodeVariables) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options,
                              rendezvous_options_from_env(map_lookup({{"RANK", "5"},
                                                                      {"WORLD_SIZE", "8"},
                                                                      {"LOCAL_RANK", "1"},
                                                                      {"LOCAL_WORLD_SIZE", "4"},
                                                                      {"GROUP_RANK", "1"},
                                                                      {"MASTER_ADDR", "node-a"},
                                                                      {"MASTER_PORT", "29501"},
                                                                      {"STRATA_COLLECTIVE_TIMEOUT_S", "7.5"}})));
  EXPECT_EQ(options.launched_by, LaunchEnvironment::kTorchrun);
  EXPECT_EQ(options.local_world_size, 4);
  EXPECT_EQ(options.node_rank, 1);
  EXPECT_EQ(options.local_rank, 1);
  EXPECT_EQ(options.collective_timeout, milliseconds(7500));
  EXPECT_EQ(options.timeout, std::chrono::minutes(5)) << "the rendezvous deadline keeps its own default";
}

TEST(RendezvousEnvTest, DefaultsPutEveryRankOnOneNodeWithASixtySecondCollectiveTimeout) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env(map_lookup(kGoodEnv)));
  EXPECT_EQ(options.local_world_size, 2);
  EXPECT_EQ(options.node_rank, 0);
  EXPECT_EQ(options.collective_timeout, std::chrono::seconds(60));
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions alone, rendezvous_options_from_env(map_lookup({})));
  EXPECT_EQ(alone.launched_by, LaunchEnvironment::kNone);
  EXPECT_EQ(alone.local_world_size, 1);
}

TEST(RendezvousEnvTest, NodeRankDefaultsToRankOverLocalWorldSize) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options,
                              rendezvous_options_from_env(map_lookup({{"RANK", "5"},
                                                                      {"WORLD_SIZE", "6"},
                                                                      {"LOCAL_WORLD_SIZE", "2"},
                                                                      {"MASTER_ADDR", "h"},
                                                                      {"MASTER_PORT", "1"}})));
  EXPECT_EQ(options.node_rank, 2);
  EXPECT_EQ(options.local_rank, 1);
}

const std::map<std::string, std::string> kOpenMpiEnv = {{"OMPI_COMM_WORLD_RANK", "3"},
                                                         {"OMPI_COMM_WORLD_SIZE", "4"},
                                                         {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                         {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                         {"MASTER_ADDR", "mpi-head"}};

TEST(RendezvousEnvTest, ReadsOpenMpisVariables) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env(map_lookup(kOpenMpiEnv)));
  EXPECT_EQ(options.launched_by, LaunchEnvironment::kOpenMpi);
  EXPECT_EQ(options.rank, 3);
  EXPECT_EQ(options.world_size, 4);
  EXPECT_EQ(options.local_rank, 1);
  EXPECT_EQ(options.local_world_size, 2);
  EXPECT_EQ(options.node_rank, 1) << "rank / local size, mpirun's by-slot mapping";
  EXPECT_EQ(options.master_addr, "mpi-head");
  EXPECT_EQ(options.master_port, kDefaultMasterPort);
}

TEST(RendezvousEnvTest, OpenMpiOnOneNodeNeedsNoMasterAddress) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options,
                              rendezvous_options_from_env(map_lookup({{"OMPI_COMM_WORLD_RANK", "1"},
                                                                      {"OMPI_COMM_WORLD_SIZE", "2"},
                                                                      {"OMPI_COMM_WORLD_LOCAL_RANK", "1"},
                                                                      {"OMPI_COMM_WORLD_LOCAL_SIZE", "2"},
                                                                      {"MASTER_PORT", "4242"}})));
  EXPECT_EQ(options.master_addr, "127.0.0.1");
  EXPECT_EQ(options.master_port, 4242);
}

const std::map<std::string, std::string> kSlurmEnv = {{"SLURM_PROCID", "6"},
                                                      {"SLURM_NTASKS", "7"},
                                                      {"SLURM_LOCALID", "0"},
                                                      {"SLURM_NODEID", "3"},
                                                      {"SLURM_TASKS_PER_NODE", "2(x3),1"},
                                                      {"SLURM_JOB_NODELIST", "node[01-04],gpu7"},
                                                      {"SLURM_JOB_ID", "123456"}};

TEST(RendezvousEnvTest, ReadsSlurmsVariables) {
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env(map_lookup(kSlurmEnv)));
  EXPECT_EQ(options.launched_by, LaunchEnvironment::kSlurm);
  EXPECT_EQ(options.rank, 6);
  EXPECT_EQ(options.world_size, 7);
  EXPECT_EQ(options.local_rank, 0);
  EXPECT_EQ(options.node_rank, 3);
  EXPECT_EQ(options.local_world_size, 1) << "the fourth node's entry of 2(x3),1";
  EXPECT_EQ(options.master_addr, "node01");
  EXPECT_EQ(options.master_port, kDefaultMasterPort + 456) << "offset by the job id";
}

TEST(RendezvousEnvTest, SlurmPrefersTheStepsNodeListAndExplicitMasterVariables) {
  std::map<std::string, std::string> env = kSlurmEnv;
  env["SLURM_STEP_NODELIST"] = "step[7-8]";
  env["SLURM_NTASKS_PER_NODE"] = "2";
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions from_step, rendezvous_options_from_env(map_lookup(env)));
  EXPECT_EQ(from_step.master_addr, "step7");
  EXPECT_EQ(from_step.local_world_size, 2) << "SLURM_NTASKS_PER_NODE before SLURM_TASKS_PER_NODE";
  env["MASTER_ADDR"] = "10.0.0.9";
  env["MASTER_PORT"] = "31000";
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions explicit_master, rendezvous_options_from_env(map_lookup(env)));
  EXPECT_EQ(explicit_master.master_addr, "10.0.0.9");
  EXPECT_EQ(explicit_master.master_port, 31000);
}

TEST(RendezvousEnvTest, DisagreeingLaunchersResolveByPrecedence) {
  // torchrun started inside an srun step (or under mpirun): its variables win as a whole.
  std::map<std::string, std::string> env = kSlurmEnv;
  env.insert(kOpenMpiEnv.begin(), kOpenMpiEnv.end());
  env.insert({{"RANK", "1"}, {"WORLD_SIZE", "2"}, {"MASTER_PORT", "1234"}});
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions torchrun, rendezvous_options_from_env(map_lookup(env)));
  EXPECT_EQ(torchrun.launched_by, LaunchEnvironment::kTorchrun);
  EXPECT_EQ(torchrun.rank, 1);
  EXPECT_EQ(torchrun.world_size, 2);
  EXPECT_EQ(torchrun.local_rank, 1) << "LOCAL_RANK unset: not taken from OMPI_COMM_WORLD_LOCAL_RANK or SLURM_LOCALID";
  EXPECT_EQ(torchrun.local_world_size, 2);
  // Without torchrun's, Open MPI's beat Slurm's.
  env.erase("RANK");
  env.erase("WORLD_SIZE");
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions mpi, rendezvous_options_from_env(map_lookup(env)));
  EXPECT_EQ(mpi.launched_by, LaunchEnvironment::kOpenMpi);
  EXPECT_EQ(mpi.rank, 3);
  EXPECT_EQ(mpi.world_size, 4);
}

TEST(RendezvousEnvTest, TorchrunsAgentStoreMovesTheRendezvousToTheNextPort) {
  std::map<std::string, std::string> env = kGoodEnv;
  env["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env(map_lookup(env)));
  EXPECT_EQ(options.master_port, 1235) << "MASTER_PORT=1234 is torchrun's own store";
  env["TORCHELASTIC_USE_AGENT_STORE"] = "False";
  STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions workers_store, rendezvous_options_from_env(map_lookup(env)));
  EXPECT_EQ(workers_store.master_port, 1234);
}

TEST(RendezvousEnvTest, StrataMasterPortOverridesEveryLauncher) {
  std::map<std::string, std::string> torchrun = kGoodEnv;
  torchrun["TORCHELASTIC_USE_AGENT_STORE"] = "True";
  for (const auto& env : {torchrun, kSlurmEnv, kOpenMpiEnv}) {
    std::map<std::string, std::string> with_port = env;
    with_port["STRATA_MASTER_PORT"] = "40000";
    STRATA_ASSERT_OK_AND_ASSIGN(const RendezvousOptions options, rendezvous_options_from_env(map_lookup(with_port)));
    EXPECT_EQ(options.master_port, 40000);
  }
}

TEST(RendezvousEnvTest, LaunchEnvironmentsHaveNames) {
  EXPECT_EQ(launch_environment_name(LaunchEnvironment::kNone), "none");
  EXPECT_EQ(launch_environment_name(LaunchEnvironment::kTorchrun), "torchrun");
  EXPECT_EQ(launch_environment_name(LaunchEnvironment::kOpenMpi), "openmpi");
  EXPECT_EQ(launch_environment_name(LaunchEnvironment::kSlurm), "slurm");
}

struct NodelistCase {
  std::string nodelist;
  std::vector<std::string> hosts;
};

class SlurmNodelistTest : public ::testing::TestWithParam<NodelistCase> {};

TEST_P(SlurmNodelistTest, ExpandsInSlurmsOrder) {
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<std::string> hosts, expand_slurm_nodelist(GetParam().nodelist));
  EXPECT_EQ(hosts, GetParam().hosts);
}

INSTANTIATE_TEST_SUITE_P(
    Forms, SlurmNodelistTest,
    ::testing::Values(NodelistCase{"gpu7", {"gpu7"}}, NodelistCase{"a,b.example.org", {"a", "b.example.org"}},
                      NodelistCase{"node[01-04],gpu7", {"node01", "node02", "node03", "node04", "gpu7"}},
                      NodelistCase{"n[8-10]", {"n8", "n9", "n10"}}, NodelistCase{"n[08-10]", {"n08", "n09", "n10"}},
                      NodelistCase{"n[1,3,5-6]x", {"n1x", "n3x", "n5x", "n6x"}},
                      NodelistCase{"r[1-2]n[1-2]", {"r1n1", "r1n2", "r2n1", "r2n2"}},
                      NodelistCase{"c[1-2],d[3]", {"c1", "c2", "d3"}}));

TEST(SlurmNodelistTest, MalformedListsAreErrorsNamingTheText) {
  for (const std::string bad : {"", "a,,b", "n[1-", "n1]", "n[2-1]", "n[a-b]", "n[]", "n[0-99999999]"}) {
    const StatusOr<std::vector<std::string>> hosts = expand_slurm_nodelist(bad);
    ASSERT_FALSE(hosts.ok()) << bad;
    EXPECT_NE(hosts.status().message().find("'" + bad + "'"), std::string::npos) << hosts.status().to_string();
  }
}

TEST(SlurmTasksPerNodeTest, ExpandsRepeats) {
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<int> counts, expand_slurm_tasks_per_node("2(x3),1"));
  EXPECT_EQ(counts, (std::vector<int>{2, 2, 2, 1}));
  STRATA_ASSERT_OK_AND_ASSIGN(const std::vector<int> one, expand_slurm_tasks_per_node("8"));
  EXPECT_EQ(one, (std::vector<int>{8}));
  for (const std::string bad : {"", "0", "2(x0)", "2(x3", "x", "2,,1"})
    EXPECT_FALSE(expand_slurm_tasks_per_node(bad).ok()) << bad;
}

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
