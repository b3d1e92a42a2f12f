// The C++ loader reads what scripts/prepare-data writes: tests/scripts/prepare_data_test.py
// --fixture (with the reference venv; skipped without it) writes a packed file of every
// kind of example with a tiny tokenizer, and each row's inputs, targets and position ids
// by the rules of docs/data.md; the loader must give exactly those, checked against the
// tokenizer's (small) vocabulary.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdlib>
#include <fstream>

#include <nlohmann/json.hpp>

#include "examples/data/token_data.h"
#include "tests/support/test_support.h"

namespace strata::data {
namespace {

constexpr int kSkipped = 77;  // the script's exit status when it has no interpreter to run with

TEST(PrepareDataReaderTest, TheLoaderGivesTheRowsTargetsAndPositionsPrepareDataMeant) {
  if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "/usr/bin/python3 is not installed";
  testing::TempDir dir;
  const std::string log = (dir.path() / "fixture.log").string();
  const std::string command = "/usr/bin/python3 " + (testing::source_dir() / "tests/scripts/prepare_data_test.py").string() +
                              " --fixture " + dir.str() + " > " + log + " 2>&1";
  const int status = std::system(command.c_str());
  std::ifstream log_file(log);
  const std::string output((std::istreambuf_iterator<char>(log_file)), {});
  ASSERT_TRUE(WIFEXITED(status)) << command;
  if (WEXITSTATUS(status) == kSkipped) GTEST_SKIP() << output;
  ASSERT_EQ(WEXITSTATUS(status), 0) << command << "\n" << output;

  std::ifstream expected_file(dir.path() / "expected.json");
  const nlohmann::json expected = nlohmann::json::parse(expected_file);
  const auto seq_len = expected["seq_len"].get<int64_t>();
  const auto& rows = expected["rows"];
  ASSERT_GE(rows.size(), 2u);
  DataConfig config;
  config.kind = DataKind::kTokens;
  config.path = (dir.path() / "data.bin").string();
  STRATA_ASSERT_OK_AND_ASSIGN(auto dataset, TokenDataset::open(config, {.vocab_size = expected["vocab_size"].get<int64_t>()}));
  ASSERT_EQ(dataset->row_length(), static_cast<uint64_t>(seq_len + 1));
  const auto global_batch = static_cast<int64_t>(rows.size());
  STRATA_ASSERT_OK_AND_ASSIGN(DataLoader loader, DataLoader::create(dataset, {.global_batch = global_batch, .seq_len = seq_len}));
  std::vector<int32_t> inputs(loader.batch_elements()), targets(loader.batch_elements()), positions(loader.batch_elements());
  STRATA_ASSERT_OK(loader.batch_at(0, inputs, targets, positions));
  for (size_t r = 0; r < rows.size(); ++r) {
    const auto slice = [&](const std::vector<int32_t>& v) {
      return std::vector<int32_t>(v.begin() + static_cast<ptrdiff_t>(r * seq_len), v.begin() + static_cast<ptrdiff_t>((r + 1) * seq_len));
    };
    EXPECT_EQ(slice(inputs), rows[r]["inputs"].get<std::vector<int32_t>>()) << "row " << r;
    EXPECT_EQ(slice(targets), rows[r]["targets"].get<std::vector<int32_t>>()) << "row " << r;
    EXPECT_EQ(slice(positions), rows[r]["positions"].get<std::vector<int32_t>>()) << "row " << r;
  }
}

}  // namespace
}  // namespace strata::data
