#include "engine/core/status.h"

#include <fcntl.h>
#include <gtest/gtest.h>

#include "engine/core/check.h"
#include "engine/core/log.h"
#include "tests/support/test_support.h"

namespace strata {
namespace {

Status fails_inner() { return NotFoundError("tensor 'h.0.attn' is missing"); }
Status fails_outer() {
  STRATA_RETURN_IF_ERROR_CTX(fails_inner(), "while loading checkpoint step 4");
  return {};
}
Status fails_outermost() {
  STRATA_RETURN_IF_ERROR(fails_outer());
  return {};
}

StatusOr<int> maybe_value(bool give) {
  if (give) return 42;
  return InvalidArgumentError("no value");
}

Status uses_assign(bool give, int* out) {
  STRATA_ASSIGN_OR_RETURN(*out, maybe_value(give));
  return {};
}

Status open_missing(const std::string& path) {
  int fd = -1;
  STRATA_SYSCALL(fd, ::open(path.c_str(), O_RDONLY));
  return {};
}

TEST(StatusTest, OkByDefault) {
  Status status;
  EXPECT_TRUE(status.ok());
  EXPECT_EQ(status.to_string(), "OK");
  status.with_context("ignored on OK");
  EXPECT_TRUE(status.trail().empty());
}

TEST(StatusTest, TrailGrowsOutward) {
  const Status status = fails_outermost();
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  ASSERT_EQ(status.trail().size(), 2u);
  EXPECT_EQ(status.trail()[0], "while loading checkpoint step 4");
  EXPECT_NE(status.trail()[1].find("tests/engine/core/status_test.cpp"), std::string::npos) << status.trail()[1];
  const std::string text = status.to_string();
  EXPECT_NE(text.find("NOT_FOUND: tensor 'h.0.attn' is missing\n  -> while loading checkpoint step 4\n  -> at "), std::string::npos) << text;
}

TEST(StatusTest, StatusOrCarriesValueOrError) {
  int out = 0;
  STRATA_EXPECT_OK(uses_assign(true, &out));
  EXPECT_EQ(out, 42);
  const Status status = uses_assign(false, &out);
  EXPECT_EQ(status.code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(status.message(), "no value");
  StatusOr<int> from_ok_status{Status()};
  EXPECT_FALSE(from_ok_status.ok());
  EXPECT_EQ(from_ok_status.status().code(), StatusCode::kInternal);
}

TEST(StatusTest, SyscallErrorsNameTheCallAndErrno) {
  testing::TempDir dir;
  const Status status = open_missing((dir.path() / "missing").string());
  ASSERT_FALSE(status.ok());
  EXPECT_EQ(status.code(), StatusCode::kNotFound);
  EXPECT_EQ(status.error_number(), ENOENT);
  EXPECT_NE(status.message().find("::open(path.c_str(), O_RDONLY): No such file or directory (errno 2)"), std::string::npos)
      << status.message();
}

TEST(StatusTest, ErrnoCodesMapToCategories) {
  EXPECT_EQ(Status::FromErrno(ENOSPC, "write").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(Status::FromErrno(EEXIST, "mkdir").code(), StatusCode::kAlreadyExists);
  EXPECT_EQ(Status::FromErrno(EIO, "read").code(), StatusCode::kIoError);
}

TEST(StatusDeathTest, CheckOkAbortsWithTheStatus) {
  EXPECT_DEATH(STRATA_CHECK_OK(InvalidArgumentError("budget too small")), "budget too small");
  EXPECT_DEATH(STRATA_CHECK(1 + 1 == 3), "1 \\+ 1 == 3");
}

TEST(LogTest, ParsesLevels) {
  LogLevel level = LogLevel::kInfo;
  EXPECT_TRUE(parse_log_level("DEBUG", &level));
  EXPECT_EQ(level, LogLevel::kDebug);
  EXPECT_TRUE(parse_log_level("warning", &level));
  EXPECT_EQ(level, LogLevel::kWarn);
  EXPECT_FALSE(parse_log_level("loud", &level));
}

TEST(LogTest, LevelFiltersLines) {
  const LogLevel saved = log_level();
  set_log_level(LogLevel::kWarn);
  EXPECT_FALSE(log_enabled(LogLevel::kInfo));
  EXPECT_TRUE(log_enabled(LogLevel::kError));
  ::testing::internal::CaptureStderr();
  STRATA_LOG(kInfo) << "hidden line";
  STRATA_LOG(kWarn) << "shown line";
  for (int i = 0; i < 3; ++i) STRATA_LOG_ONCE(kWarn) << "once line";
  const std::string err = ::testing::internal::GetCapturedStderr();
  set_log_level(saved);
  EXPECT_EQ(err.find("hidden line"), std::string::npos);
  EXPECT_NE(err.find("shown line"), std::string::npos);
  EXPECT_EQ(err.find("once line"), err.rfind("once line"));
  EXPECT_NE(err.find("once line"), std::string::npos);
}

}  // namespace
}  // namespace strata
