#include "http/router.h"

#include <gtest/gtest.h>

namespace nbos::http {
namespace {

using Params = std::map<std::string, std::string>;

TEST(PercentDecodeTest, DecodesEscapesAndOptionalPlus) {
  EXPECT_EQ(PercentDecode("a%20b%2Fc", false), "a b/c");
  EXPECT_EQ(PercentDecode("a+b", false), "a+b");
  EXPECT_EQ(PercentDecode("a+b", true), "a b");
  EXPECT_EQ(PercentDecode("%e2%9C%93", false), "\xe2\x9c\x93");
  EXPECT_EQ(PercentDecode("%", false), std::nullopt);
  EXPECT_EQ(PercentDecode("%2", false), std::nullopt);
  EXPECT_EQ(PercentDecode("%zz", false), std::nullopt);
}

TEST(ParseQueryTest, SplitsDecodesAndKeepsFirst) {
  auto q = ParseQuery("token=abc%3D&x&&y=1+2&token=second&=v");
  ASSERT_TRUE(q);
  EXPECT_EQ(*q, (Params{{"token", "abc="}, {"x", ""}, {"y", "1 2"}, {"", "v"}}));
  EXPECT_EQ(ParseQuery(""), Params{});
  EXPECT_EQ(ParseQuery("a=%G0"), std::nullopt);
}

TEST(SplitPathTest, SegmentsAndTrailingSlash) {
  using V = std::vector<std::string>;
  EXPECT_EQ(SplitPath("/"), V{});
  EXPECT_EQ(SplitPath("/api/kernels"), (V{"api", "kernels"}));
  EXPECT_EQ(SplitPath("/api/kernels/"), (V{"api", "kernels"}));
  EXPECT_EQ(SplitPath("/a//b"), (V{"a", "", "b"}));
  EXPECT_EQ(SplitPath("/f/my%20nb.ipynb"), (V{"f", "my nb.ipynb"}));
  EXPECT_EQ(SplitPath("api"), std::nullopt);
  EXPECT_EQ(SplitPath(""), std::nullopt);
  EXPECT_EQ(SplitPath("/a%"), std::nullopt);
}

TEST(PathPatternTest, RejectsMalformedPatterns) {
  for (const char* bad : {"", "api", "/api/", "/{", "/{}", "/{a", "/a}", "/{a}/{a}", "/{r*}/x",
                          "/x{a}", "/{a/b}", "/{*}"}) {
    EXPECT_FALSE(PathPattern::Parse(bad)) << bad;
  }
  EXPECT_TRUE(PathPattern::Parse("/"));
  EXPECT_TRUE(PathPattern::Parse("/api/kernels/{kernel_id}/channels"));
  EXPECT_TRUE(PathPattern::Parse("/api/contents/{path*}"));
}

TEST(PathPatternTest, MatchesLiteralsAndCaptures) {
  auto p = PathPattern::Parse("/api/kernels/{kernel_id}/interrupt");
  ASSERT_TRUE(p);
  Params params;
  EXPECT_TRUE(p->Match(*SplitPath("/api/kernels/k%201/interrupt"), &params));
  EXPECT_EQ(params, (Params{{"kernel_id", "k 1"}}));

  Params untouched{{"x", "y"}};
  EXPECT_FALSE(p->Match(*SplitPath("/api/kernels/k1"), &untouched));
  EXPECT_FALSE(p->Match(*SplitPath("/api/kernels/k1/interrupt/x"), &untouched));
  EXPECT_FALSE(p->Match(*SplitPath("/api/kernels//interrupt"), &untouched));
  EXPECT_FALSE(p->Match(*SplitPath("/api/sessions/k1/interrupt"), &untouched));
  EXPECT_EQ(untouched, (Params{{"x", "y"}}));

  auto root = PathPattern::Parse("/");
  EXPECT_TRUE(root->Match(*SplitPath("/"), &params));
  EXPECT_FALSE(root->Match(*SplitPath("/a"), &params));
}

TEST(PathPatternTest, RestCaptureTakesZeroOrMoreSegments) {
  auto p = PathPattern::Parse("/api/contents/{path*}");
  ASSERT_TRUE(p);
  Params params;
  ASSERT_TRUE(p->Match(*SplitPath("/api/contents/a/b%20c.ipynb"), &params));
  EXPECT_EQ(params["path"], "a/b c.ipynb");
  ASSERT_TRUE(p->Match(*SplitPath("/api/contents"), &params));
  EXPECT_EQ(params["path"], "");
  EXPECT_FALSE(p->Match(*SplitPath("/api"), &params));
}

}  // namespace
}  // namespace nbos::http
