#include "engine/core/slurm_nodelist.h"

#include <string>
#include <vector>

#include "tests/support/test_support.h"

namespace strata {
namespace {

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

}  // namespace
}  // namespace strata
