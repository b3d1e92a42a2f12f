#include "engine/core/launch_env.h"

#include <map>
#include <string>
#include <utility>

#include "tests/support/test_support.h"

namespace strata {
namespace {

using std::chrono::milliseconds;

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

}  // namespace
}  // namespace strata
