#include "replica/stream_buffer.h"

#include <gtest/gtest.h>

namespace nbos::replica {
namespace {

TEST(StreamBufferTest, CoalescesConsecutiveWritesKeepingOrder) {
  StreamBuffer b;
  b.Append("stdout", "a");
  b.Append("stdout", "b\n");
  b.Append("stderr", "warn\n");
  b.Append("stdout", "c");
  b.Append("stdout", "");
  EXPECT_EQ(b.buffered_bytes(), 9u);
  auto segs = b.Take();
  ASSERT_EQ(segs.size(), 3u);
  EXPECT_EQ(segs[0].name, "stdout");
  EXPECT_EQ(segs[0].text, "ab\n");
  EXPECT_EQ(segs[1].name, "stderr");
  EXPECT_EQ(segs[2].text, "c");
  EXPECT_TRUE(b.Take().empty());
  EXPECT_EQ(b.buffered_bytes(), 0u);
}

TEST(StreamBufferTest, Utf8PrefixNeverSplitsACharacter) {
  std::string euro = "\xE2\x82\xAC";  // €
  EXPECT_EQ(CompleteUtf8Prefix("abc"), 3u);
  EXPECT_EQ(CompleteUtf8Prefix("a" + euro), 4u);
  EXPECT_EQ(CompleteUtf8Prefix("a" + euro.substr(0, 2)), 1u);
  EXPECT_EQ(CompleteUtf8Prefix("a" + euro.substr(0, 1)), 1u);
  EXPECT_EQ(CompleteUtf8Prefix("\xF0\x9F\x98"), 0u);
  EXPECT_EQ(CompleteUtf8Prefix("\xF0\x9F\x98\x80"), 4u);
  EXPECT_EQ(CompleteUtf8Prefix(""), 0u);
  EXPECT_EQ(CompleteUtf8Prefix("\x80\x80"), 2u);
}

}  // namespace
}  // namespace nbos::replica
