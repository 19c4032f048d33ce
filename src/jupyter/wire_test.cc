#include "jupyter/wire.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <random>

namespace nbos::jupyter {
namespace {

Message Sample() {
  MessageFactory factory("session-1", "alice");
  Message m = factory.Make("execute_request", Json{{"code", "print('héllo')"}, {"silent", false}},
                           Json::object());
  m.identities = {"client-identity"};
  m.metadata = Json{{"cellId", "abc"}};
  m.buffers = {std::string("\x00\x01\x02", 3)};
  return m;
}

TEST(WireTest, RoundTripKeepsEverything) {
  auto signer = Signer::Create("secret-key");
  ASSERT_TRUE(signer.ok());
  Message m = Sample();
  auto frames = EncodeFrames(m, *signer);
  ASSERT_EQ(frames.size(), 1u + 6u + 1u);
  EXPECT_EQ(frames[1], kDelimiter);
  EXPECT_EQ(frames[2].size(), 64u);
  auto decoded = DecodeFrames(frames, *signer);
  ASSERT_TRUE(decoded.ok()) << decoded.status().ToString();
  EXPECT_EQ(decoded->identities, m.identities);
  EXPECT_EQ(decoded->header, m.header);
  EXPECT_EQ(decoded->content, m.content);
  EXPECT_EQ(decoded->metadata, m.metadata);
  EXPECT_EQ(decoded->buffers, m.buffers);
}

TEST(WireTest, WrongKeyIsUnauthenticated) {
  auto frames = EncodeFrames(Sample(), *Signer::Create("one"));
  auto decoded = DecodeFrames(frames, *Signer::Create("other"));
  ASSERT_FALSE(decoded.ok());
  EXPECT_EQ(decoded.status().code(), StatusCode::kUnauthenticated);
}

TEST(WireTest, TamperedContentIsUnauthenticated) {
  auto signer = *Signer::Create("k");
  auto frames = EncodeFrames(Sample(), signer);
  frames[6] = R"j({"code":"import os; os.remove('x')"})j";
  EXPECT_EQ(DecodeFrames(frames, signer).status().code(), StatusCode::kUnauthenticated);
}

TEST(WireTest, UnsignedMessageRejectedWhenKeyed) {
  auto frames = EncodeFrames(Sample(), Signer());
  EXPECT_EQ(frames[2], "");
  EXPECT_EQ(DecodeFrames(frames, *Signer::Create("k")).status().code(),
            StatusCode::kUnauthenticated);
  EXPECT_TRUE(DecodeFrames(frames, Signer()).ok());
}

TEST(WireTest, MalformedInputsAreErrorsNotCrashes) {
  auto signer = Signer();
  EXPECT_EQ(DecodeFrames({}, signer).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeFrames({"id", "x"}, signer).status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeFrames({"<IDS|MSG>", "", "{}", "{}"}, signer).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeFrames({"<IDS|MSG>", "", "not json", "{}", "{}", "{}"}, signer).status().code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(DecodeFrames({"<IDS|MSG>", "", "[1]", "{}", "{}", "{}"}, signer).status().code(),
            StatusCode::kInvalidArgument);
  // A header without msg_type cannot be dispatched.
  EXPECT_EQ(DecodeFrames({"<IDS|MSG>", "", "{}", "{}", "{}", "{}"}, signer).status().code(),
            StatusCode::kInvalidArgument);
}

TEST(WireTest, OversizedMessageIsResourceExhausted) {
  DecodeLimits limits;
  limits.max_message_bytes = 1000;
  Message m = Sample();
  m.buffers = {std::string(2000, 'x')};
  auto frames = EncodeFrames(m, Signer());
  EXPECT_EQ(DecodeFrames(frames, Signer(), limits).status().code(), StatusCode::kResourceExhausted);
}

TEST(WireTest, UnsupportedSchemeRejected) { EXPECT_FALSE(Signer::Create("k", "hmac-md5").ok()); }

TEST(WireTest, ReplyTypes) {
  EXPECT_EQ(ReplyTypeFor("execute_request"), "execute_reply");
  EXPECT_EQ(ReplyTypeFor("_request"), "");
  EXPECT_EQ(ReplyTypeFor("stream"), "");
}

// Signatures must equal jupyter_client's byte for byte: random keys and frames (including
// non-ASCII and binary-looking bytes) are signed by both and compared.
TEST(WireTest, SignaturesMatchJupyterClient) {
  if (!std::filesystem::exists("/usr/bin/python3")) GTEST_SKIP() << "no /usr/bin/python3";
  std::mt19937 rng(7);
  auto random_bytes = [&](size_t n) {
    std::string s(n, '\0');
    for (auto& c : s) c = static_cast<char>(rng() & 0xff);
    return s;
  };
  auto dir = std::filesystem::temp_directory_path() / ("nbos-hmac-" + std::to_string(::getpid()));
  std::filesystem::create_directories(dir);
  constexpr int kCases = 20;
  std::vector<std::string> ours;
  for (int i = 0; i < kCases; ++i) {
    std::string key = random_bytes(1 + rng() % 64);
    std::vector<std::string> parts;
    for (int p = 0; p < 4; ++p) parts.push_back(random_bytes(rng() % 300));
    parts[0] = R"({"msg_id":"ü-)" + std::to_string(i) + "\"}";
    for (int p = 0; p < 4; ++p) {
      std::ofstream(dir / (std::to_string(i) + "." + std::to_string(p)), std::ios::binary)
          << parts[p];
    }
    std::ofstream(dir / (std::to_string(i) + ".key"), std::ios::binary) << key;
    ours.push_back(Signer::Create(key)->Sign({parts[0], parts[1], parts[2], parts[3]}));
  }
  std::string script =
      "import sys,pathlib\n"
      "from jupyter_client.session import Session\n"
      "d=pathlib.Path(sys.argv[1])\n"
      "for i in range(" +
      std::to_string(kCases) +
      "):\n"
      "  k=(d/f'{i}.key').read_bytes()\n"
      "  s=Session(key=k, signature_scheme='hmac-sha256')\n"
      "  print(s.sign([(d/f'{i}.{p}').read_bytes() for p in range(4)]).decode())\n";
  std::ofstream(dir / "sign.py") << script;
  std::string cmd = "/usr/bin/python3 " + (dir / "sign.py").string() + " " + dir.string();
  FILE* pipe = popen(cmd.c_str(), "r");
  ASSERT_NE(pipe, nullptr);
  char line[256];
  int i = 0;
  while (fgets(line, sizeof(line), pipe) != nullptr && i < kCases) {
    std::string theirs(line);
    while (!theirs.empty() && (theirs.back() == '\n' || theirs.back() == '\r')) theirs.pop_back();
    EXPECT_EQ(ours[i], theirs) << "case " << i;
    ++i;
  }
  EXPECT_EQ(pclose(pipe), 0);
  EXPECT_EQ(i, kCases);
  std::filesystem::remove_all(dir);
}

}  // namespace
}  // namespace nbos::jupyter
