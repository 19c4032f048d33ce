#include "jupyter/json_limits.h"

#include <gtest/gtest.h>

#include <string>

namespace nbos::jupyter {
namespace {

TEST(JsonDepthWithin, CountsNestedArraysAndObjects) {
  EXPECT_TRUE(JsonDepthWithin("1", 0));
  EXPECT_FALSE(JsonDepthWithin("[]", 0));
  EXPECT_TRUE(JsonDepthWithin("[]", 1));
  EXPECT_TRUE(JsonDepthWithin(R"({"a": [1, {"b": []}], "c": {}})", 4));
  EXPECT_FALSE(JsonDepthWithin(R"({"a": [1, {"b": []}], "c": {}})", 3));
}

TEST(JsonDepthWithin, IgnoresBracketsInStringsAndEscapedQuotes) {
  EXPECT_TRUE(JsonDepthWithin(R"({"a": "[[[[{{{{"})", 1));
  EXPECT_TRUE(JsonDepthWithin(R"({"a": "\"[[[[", "b": 1})", 1));
  EXPECT_TRUE(JsonDepthWithin(R"(["\\", "[[["])", 1));
  EXPECT_FALSE(JsonDepthWithin(R"(["\\", [[1]]])", 2));
}

TEST(JsonDepthWithin, RefusesDeepNestingWithoutRecursing) {
  const std::string deep = std::string(10'000'000, '[') + std::string(10'000'000, ']');
  EXPECT_FALSE(JsonDepthWithin(deep, 64));
  EXPECT_TRUE(JsonDepthWithin(deep, 10'000'000));
}

}  // namespace
}  // namespace nbos::jupyter
