// The command-line flags of train_gpt and strata-bench (examples/flags/flags.h).
#include "examples/flags/flags.h"
#include "examples/train/train_args.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <cstdint>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "tests/support/test_support.h"

namespace strata {
namespace {

using flags::OutputKind;
using train::TrainArgs;

StatusOr<TrainArgs> parse(std::vector<std::string> args) { return train::parse_train_args(args); }

std::string error_of(std::vector<std::string> args) {
  StatusOr<TrainArgs> parsed = parse(std::move(args));
  EXPECT_FALSE(parsed.ok());
  return parsed.ok() ? std::string() : parsed.status().message();
}

std::string apply_error(std::vector<std::string> args) {
  StatusOr<TrainArgs> parsed = parse(std::move(args));
  EXPECT_TRUE(parsed.ok()) << parsed.status().to_string();
  if (!parsed.ok()) return {};
  RunConfig config;
  const Status status = train::apply_train_overrides(config, *parsed);
  EXPECT_FALSE(status.ok());
  return status.message();
}

TEST(FlagsTest, BothSpellingsOfAValueAreRead) {
  StatusOr<TrainArgs> args = parse({"--steps", "8", "--save-dir=out", "--set", "gradient_clipping=0.5", "--data", "synthetic"});
  ASSERT_TRUE(args.ok()) << args.status().to_string();
  EXPECT_EQ(args->trainer.at("save-dir"), "out");
  EXPECT_EQ(args->data_spec, "synthetic");
  ASSERT_EQ(args->overrides.size(), 2u);
  EXPECT_EQ(args->overrides[0].key, "strata.steps");
  EXPECT_EQ(args->overrides[0].flag, "--steps");
  EXPECT_EQ(args->overrides[1].key, "gradient_clipping");
  EXPECT_EQ(args->overrides[1].value, "0.5");
  EXPECT_TRUE(parse({"--help"})->help);
}

// `--save-dir --steps=8` used to make a directory named "--steps=8".
TEST(FlagsTest, AValueThatIsTheNextFlagIsRefusedAsAMissingValue) {
  EXPECT_EQ(error_of({"--save-dir", "--steps=8"}),
            "--save-dir needs a value, but the next argument is the flag \"--steps=8\" (write --save-dir=--steps=8 if that is the value)");
  EXPECT_EQ(error_of({"--steps", "--lr", "1e-3"}).substr(0, 23), "--steps needs a value, ");
  EXPECT_EQ(error_of({"--steps"}), "--steps needs a value");
  // Written with '=', a value may start with "--"; a negative number is a value.
  StatusOr<TrainArgs> args = parse({"--save-dir=--odd", "--set", "gradient_clipping=-1"});
  ASSERT_TRUE(args.ok());
  EXPECT_EQ(args->trainer.at("save-dir"), "--odd");
}

// `--grad-accum 4294967297` used to run with 1 (static_cast<int> in the trainer).
TEST(FlagsTest, IntegersOutsideTheirTypeAreRefusedNamingFlagValueAndRange) {
  EXPECT_EQ(apply_error({"--grad-accum", "4294967297"}),
            "--grad-accum 4294967297: gradient_accumulation_steps: expected an integer in [1, 2147483647], got 4294967297 on the command "
            "line");
  EXPECT_EQ(apply_error({"--set", "fp16.hysteresis=2147483648"}).substr(0, 45), "--set fp16.hysteresis=2147483648: fp16.hyster");
  EXPECT_EQ(error_of({"--keep-checkpoints", "4294967297"}),
            "--keep-checkpoints is out of range: got \"4294967297\", expected an integer in [0, 2147483647]");
  EXPECT_EQ(error_of({"--save-every", "99999999999999999999"}),
            "--save-every is out of range: got \"99999999999999999999\", expected an integer in [0, 9223372036854775807]");
  EXPECT_EQ(error_of({"--eval-every", "-1"}),
            "--eval-every is out of range: got \"-1\", expected an integer in [0, 9223372036854775807]");
  EXPECT_EQ(error_of({"--synthetic-order", "3"}), "--synthetic-order is out of range: got \"3\", expected an integer in [1, 2]");
  EXPECT_EQ(error_of({"--data-seed", "-5"}),
            "--data-seed is out of range: got \"-5\", expected an integer in [0, 18446744073709551615]");
  EXPECT_EQ(error_of({"--head-chunk-rows", "12abc"}),
            "--head-chunk-rows is not an integer: got \"12abc\", expected an integer in [0, 9223372036854775807]");
  EXPECT_EQ(error_of({"--eval-sequences", ""}),
            "--eval-sequences is not an integer: got \"\", expected an integer in [0, 9223372036854775807]");
  StatusOr<TrainArgs> args = parse({"--data-seed", "18446744073709551615", "--keep-checkpoints", "+3"});
  ASSERT_TRUE(args.ok()) << args.status().to_string();
  EXPECT_EQ(*train::trainer_integer<uint64_t>(*args, "data-seed", 0), UINT64_MAX);
  EXPECT_EQ(*train::trainer_integer<int>(*args, "keep-checkpoints", 0), 3);
  EXPECT_EQ(*train::trainer_integer<int>(*args, "save-every", 7), 7);
}

TEST(FlagsTest, IntegerParsingChecksTheRangeOfItsOwnType) {
  EXPECT_EQ(*flags::parse_flag_integer<uint16_t>("n", "65535"), 65535);
  EXPECT_FALSE(flags::parse_flag_integer<uint16_t>("n", "65536").ok());
  EXPECT_FALSE(flags::parse_flag_integer<int32_t>("n", "-2147483649").ok());
  EXPECT_EQ(*flags::parse_flag_integer<int32_t>("n", "-2147483648"), INT32_MIN);
  EXPECT_FALSE(flags::parse_flag_integer<uint32_t>("n", "-1").ok());
  EXPECT_FALSE(flags::parse_flag_integer<int64_t>("n", "0x10").ok());
  EXPECT_FALSE(flags::parse_flag_integer<int64_t>("n", "+").ok());
  EXPECT_FALSE(flags::parse_flag_number("lr", "nan").ok());
  EXPECT_FALSE(flags::parse_flag_number("lr", "1e999").ok());
  EXPECT_DOUBLE_EQ(*flags::parse_flag_number("lr", "-1.5e-3"), -1.5e-3);
}

TEST(FlagsTest, ASwitchTakesNoValueButMaySayFalse) {
  StatusOr<TrainArgs> args = parse({"--eval-only", "--steps", "3"});
  ASSERT_TRUE(args.ok()) << args.status().to_string();
  EXPECT_EQ(args->trainer.at("eval-only"), "true");
  ASSERT_EQ(args->overrides.size(), 1u);  // "--steps 3" was not eaten as the switch's value
  EXPECT_EQ(parse({"--eval-only=false"})->trainer.at("eval-only"), "false");
  EXPECT_EQ(error_of({"--eval-only=maybe"}), "--eval-only is a switch: write --eval-only or --eval-only=false, got \"maybe\"");
}

TEST(FlagsTest, ExportShardSizeIsAPositiveNumberOfMebibytes) {
  EXPECT_EQ(parse({"--export-shard-mib", "4768", "--model", "dir", "--export-dtype", "bf16"})->trainer.at("export-shard-mib"), "4768");
  EXPECT_EQ(error_of({"--export-shard-mib", "0"}).substr(0, 40), "--export-shard-mib is out of range: got ");
}

TEST(FlagsTest, UnknownFlagsAndBareWordsAreErrors) {
  EXPECT_EQ(error_of({"--no-such-flag", "1"}), "unknown flag --no-such-flag (see --help; --set KEY=VALUE sets any config key)");
  EXPECT_EQ(error_of({"steps"}), "unexpected argument \"steps\" (flags start with --; see --help)");
  EXPECT_EQ(error_of({"--"}), "unexpected argument \"--\" (flags start with --; see --help)");
  EXPECT_EQ(error_of({"--set", "novalue"}), "--set needs KEY=VALUE, got \"novalue\"");
}

class OutputPathTest : public ::testing::Test {
 protected:
  strata::testing::TempDir dir_;
};

TEST_F(OutputPathTest, AMissingFileGetsItsDirectoriesAndAnExistingOneMustBeAFile) {
  const std::string nested = dir_.str() + "/a/b/trace.json";
  ASSERT_TRUE(flags::prepare_output_path("--trace", nested, OutputKind::kFile).ok());
  EXPECT_TRUE(std::filesystem::is_directory(dir_.str() + "/a/b"));
  const Status status = flags::prepare_output_path("--trace", dir_.str(), OutputKind::kFile);
  EXPECT_EQ(status.message(), "--trace " + dir_.str() + ": is a directory, not a file (checked before training starts)");
}

TEST_F(OutputPathTest, APathUnderAFileIsRefusedNamingTheFlagAndThePath) {
  const std::string file = dir_.str() + "/plain";
  std::ofstream(file) << "x";
  const Status metrics = flags::prepare_output_path("--metrics", file + "/m.jsonl", OutputKind::kFile);
  EXPECT_FALSE(metrics.ok());
  EXPECT_EQ(metrics.message().rfind("--metrics " + file + "/m.jsonl: cannot create its directory " + file + ": ", 0), 0u)
      << metrics.message();
  const Status exported = flags::prepare_output_path("--export", file + "/x/y", OutputKind::kDirectory);
  EXPECT_EQ(exported.message(), "--export " + file + "/x/y: cannot be created: " + file + " is not a directory (checked before training starts)");
  EXPECT_EQ(flags::prepare_output_path("--export", file, OutputKind::kDirectory).message(),
            "--export " + file + ": exists and is not a directory (checked before training starts)");
  EXPECT_FALSE(std::filesystem::exists(file + "/x"));
}

TEST_F(OutputPathTest, AReadOnlyDirectoryIsRefused) {
  if (::geteuid() == 0) GTEST_SKIP() << "root writes into read-only directories; the check cannot fail";
  const std::string locked = dir_.str() + "/locked";
  std::filesystem::create_directory(locked);
  std::filesystem::permissions(locked, std::filesystem::perms::owner_read | std::filesystem::perms::owner_exec);
  const Status status = flags::prepare_output_path("--trace", locked + "/t.json", OutputKind::kFile);
  std::filesystem::permissions(locked, std::filesystem::perms::owner_all);
  EXPECT_FALSE(status.ok());
  EXPECT_NE(status.message().find("is not writable"), std::string::npos) << status.message();
}

}  // namespace
}  // namespace strata
