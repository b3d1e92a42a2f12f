#include "engine/core/json_depth.h"

#include <gtest/gtest.h>

#include <string>

namespace strata {
namespace {

TEST(JsonDepthTest, CountsTheDeepestNestingOfObjectsAndArrays) {
  EXPECT_EQ(json_nesting_depth("1"), 0u);
  EXPECT_EQ(json_nesting_depth("{}"), 1u);
  EXPECT_EQ(json_nesting_depth(R"({"a":[1,{"b":[]}],"c":{}})"), 4u);
  EXPECT_EQ(json_nesting_depth(std::string(100000, '[') + std::string(100000, ']')), 100000u);
}

TEST(JsonDepthTest, BracketsInsideStringsAndEscapedQuotesDoNotCount) {
  EXPECT_EQ(json_nesting_depth(R"({"[[[{{": "]]]\"[[["})"), 1u);
  EXPECT_EQ(json_nesting_depth(R"(["\\", [[]]])"), 3u);
}

TEST(JsonDepthTest, MalformedTextGivesABoundAndNeverUnderflows) {
  EXPECT_EQ(json_nesting_depth("]]]}}}[["), 2u);
  EXPECT_EQ(json_nesting_depth("[[[\"unterminated"), 3u);
}

}  // namespace
}  // namespace strata
