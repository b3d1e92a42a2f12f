// Replays every seed input (tests/fuzz/corpus/<target>/) and every input a fuzzer once
// broke a parser with (tests/fuzz/regressions/<target>/) through the harnesses of
// fuzz_targets.h, so the ordinary and ASan builds check them without libFuzzer. A harness
// aborts on a broken invariant and the sanitizers on memory errors: either fails the test.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <ostream>
#include <string>
#include <vector>

#include "tests/fuzz/fuzz_targets.h"
#include "tests/support/test_support.h"

namespace strata::fuzz {

// gtest prints a parameter with this (the harness's name, not its bytes).
void PrintTo(const FuzzTarget& target, std::ostream* out) { *out << target.name; }

namespace {

namespace fs = std::filesystem;

fs::path fuzz_dir() { return strata::testing::source_dir() / "tests" / "fuzz"; }

std::vector<fs::path> inputs_under(const fs::path& dir) {
  std::vector<fs::path> files;
  if (!fs::is_directory(dir)) return files;
  for (const auto& entry : fs::directory_iterator(dir)) {
    if (entry.is_regular_file() && entry.path().filename() != "README.md") files.push_back(entry.path());
  }
  std::sort(files.begin(), files.end());
  return files;
}

std::string read_bytes(const fs::path& path) {
  std::ifstream in(path, std::ios::binary);
  return std::string(std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>());
}

class FuzzReplayTest : public ::testing::TestWithParam<FuzzTarget> {
 protected:
  void SetUp() override { fuzz_quiet_logs(); }
};

void replay(const FuzzTarget& target, const std::vector<fs::path>& files) {
  for (const fs::path& file : files) {
    SCOPED_TRACE(file.string());
    const std::string bytes = read_bytes(file);
    EXPECT_EQ(target.run(reinterpret_cast<const uint8_t*>(bytes.data()), bytes.size()), 0);
  }
}

TEST_P(FuzzReplayTest, EverySeedInputRunsThroughTheParserCleanly) {
  const std::vector<fs::path> seeds = inputs_under(fuzz_dir() / "corpus" / std::string(GetParam().name));
  ASSERT_FALSE(seeds.empty()) << "no seed corpus for " << GetParam().name;
  replay(GetParam(), seeds);
}

TEST_P(FuzzReplayTest, EveryInputThatOnceBrokeTheParserNowGivesAnErrorOrAValidResult) {
  replay(GetParam(), inputs_under(fuzz_dir() / "regressions" / std::string(GetParam().name)));
}

INSTANTIATE_TEST_SUITE_P(AllParsers, FuzzReplayTest, ::testing::ValuesIn(kFuzzTargets),
                         [](const ::testing::TestParamInfo<FuzzTarget>& info) { return std::string(info.param.name); });

}  // namespace
}  // namespace strata::fuzz
