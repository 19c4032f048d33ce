#include "web/assets.h"

#include <gtest/gtest.h>

namespace nbos::web {
namespace {

TEST(Assets, PagesAreEmbeddedWithTheirContentTypes) {
  auto index = FindAsset("index.html");
  ASSERT_TRUE(index.has_value());
  EXPECT_EQ(index->content_type, "text/html; charset=utf-8");
  EXPECT_NE(index->body.find("dashboard.js"), std::string_view::npos);
  auto script = FindAsset("dashboard.js");
  ASSERT_TRUE(script.has_value());
  EXPECT_EQ(script->content_type, "text/javascript; charset=utf-8");
  EXPECT_FALSE(FindAsset("../CMakeLists.txt").has_value());
  EXPECT_FALSE(FindAsset("").has_value());
}

}  // namespace
}  // namespace nbos::web
