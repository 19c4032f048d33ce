#include "store/blob_refs.h"

#include <gtest/gtest.h>

#include <nlohmann/json.hpp>

#include "store/blob_store.h"

namespace nbos::store {
namespace {

// A container as nbos_state_wire.pack writes it.
std::string Container(char kind, const nlohmann::json& header, std::string_view payload = "") {
  const std::string text = header.dump();
  std::string out = "NBSD";
  out += '\x01';
  out += kind;
  for (int i = 0; i < 4; ++i) out += static_cast<char>((text.size() >> (8 * i)) & 0xff);
  return out + text + std::string(payload);
}

TEST(BlobRefsTest, FindsEveryKeyOfEveryContainerWhereverItLies) {
  const std::string a = BlobKey("a"), b = BlobKey("b"), c = BlobKey("c"), d = BlobKey("d");
  const std::string delta = Container(
      'D', {{"set", {"x"}}, {"blobs", {{"t1", a}, {nullptr, b}}}, {"oob", {c}}}, "pickles");
  const std::string snapshot = Container('S', {{"payload", d}, {"blobs", nlohmann::json::array()}});
  // Framing around them: a checkpoint's side effects, a snapshot's length prefixes.
  const std::string state =
      "NBCK\x05\x01\x02\x03{...}" + snapshot + "\x10\x20junk" + delta + "tail";
  std::set<std::string> keys;
  AddBlobKeysIn(state, &keys);
  EXPECT_EQ(keys, (std::set<std::string>{a, b, c, d}));
}

TEST(BlobRefsTest, IgnoresWhatIsNotAContainerOrNotAKey) {
  const std::string a = BlobKey("a");
  std::set<std::string> keys;
  AddBlobKeysIn("", &keys);
  AddBlobKeysIn("NBSD", &keys);
  AddBlobKeysIn("NBSD\x02D\x02\0\0\0{}", &keys);                         // another version
  AddBlobKeysIn(Container('X', {{"payload", a}}), &keys);                // another kind
  AddBlobKeysIn(Container('D', {{"payload", a}}).substr(0, 20), &keys);  // truncated
  AddBlobKeysIn(Container('D', {{"payload", "../etc"}, {"oob", {"ABC", 7}}}), &keys);
  AddBlobKeysIn(Container('D', nlohmann::json::array({a})), &keys);  // not an object
  EXPECT_TRUE(keys.empty());
  // A container inside another's bytes (the magic in a pickle) is read too: keys only add up.
  AddBlobKeysIn(Container('D', {{"set", {"x"}}}, Container('S', {{"oob", {a}}})), &keys);
  EXPECT_EQ(keys, std::set<std::string>{a});
}

}  // namespace
}  // namespace nbos::store
