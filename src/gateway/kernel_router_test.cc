// Data-driven scenario tests of KernelRouter, in the manner of etcd-raft's testdata: each file in
// testdata/router holds blocks of events, a `----` line, and the effects those events must
// produce, one per line; blocks are separated by blank lines. NBOS_REWRITE_TESTDATA=1 rewrites
// the expected effects from what the router does (review the diff before keeping it).
//
// Events (one per line; a trailing JSON object, where allowed, runs to the end of the line):
//   attach C | detach C                       a WebSocket client C comes or goes
//   send C CHANNEL TYPE id=ID [parent=P] [metadata=JSON-without-spaces] [CONTENT-JSON]
//                                             a well-formed client message on CHANNEL
//   frame C RAW | frame-hex C HEX             a raw text / binary WebSocket frame from C
//   replica R CHANNEL TYPE id=ID [parent=P] [metadata=JSON-without-spaces] [CONTENT-JSON]
//   lost R | back R | link R | unlink R       replica liveness and membership
//   plan-done N replica=R [server=S] [grant=G] [devices=0,1] | plan-done N none |
//   plan-done N error=MESSAGE                 the answer to PlanWanted N (none: wait=WHY, to the
//                                             end of the line, says what the cell waits for)
//   timer N | interrupt | hold on|off [why=WHY to the end of the line] | probe R... |
//   call N R TYPE [CONTENT-JSON] | close
// The kernel is "k", its session "sess", its replicas 1, 2 and 3, per-cell GPUs 0; a file may
// start with `options gpus=G replicas=1,2 max-queued=N max-bytes=B` to change that. Time starts at
// 1700000000 s and advances 1 ms per event.
#include "gateway/kernel_router.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "common/overloaded.h"

namespace nbos::gateway {
namespace {

using jupyter::Channel;
using jupyter::Json;
using jupyter::Message;

std::vector<std::string> Split(const std::string& s, char sep) {
  std::vector<std::string> out;
  std::string cur;
  std::istringstream in(s);
  while (std::getline(in, cur, sep))
    if (!cur.empty()) out.push_back(cur);
  return out;
}

Channel ChannelOf(const std::string& name) {
  Channel c = Channel::kShell;
  EXPECT_TRUE(jupyter::ParseChannel(name, &c)) << "unknown channel " << name;
  return c;
}

std::string Dump(const Json& j) { return j.dump(-1, ' ', false, Json::error_handler_t::replace); }

// The words of a line up to a trailing JSON object, and that object's text.
struct Words {
  std::vector<std::string> positional;
  std::map<std::string, std::string> named;
  std::string json;  // the rest of the line from the first '{' word on
};

Words ParseWords(const std::string& line) {
  Words w;
  std::istringstream in(line);
  std::string word;
  while (in >> word) {
    if (word[0] == '{' || word[0] == '[') {
      std::string rest;
      std::getline(in, rest);
      w.json = word + rest;
      break;
    }
    auto eq = word.find('=');
    if (eq != std::string::npos && eq > 0) {
      w.named[word.substr(0, eq)] = word.substr(eq + 1);
    } else {
      w.positional.push_back(word);
    }
  }
  return w;
}

Json ParseJson(const std::string& text) {
  if (text.empty()) return Json::object();
  Json j = Json::parse(text, nullptr, false);
  EXPECT_FALSE(j.is_discarded()) << "bad JSON in test: " << text;
  return j.is_discarded() ? Json::object() : j;
}

Message MakeMessage(const Words& w, size_t type_at) {
  Message m;
  m.header = Json{{"msg_id", w.named.count("id") ? w.named.at("id") : "x"},
                  {"msg_type", w.positional.at(type_at)},
                  {"session", "client-session"},
                  {"username", "test"},
                  {"version", "5.3"},
                  {"date", "2024-01-01T00:00:00.000000Z"}};
  if (w.named.count("parent")) m.parent_header = Json{{"msg_id", w.named.at("parent")}};
  if (w.named.count("metadata")) m.metadata = ParseJson(w.named.at("metadata"));
  m.content = ParseJson(w.json);
  return m;
}

std::string Hex(const std::string& hex) {
  std::string out;
  for (size_t i = 0; i + 1 < hex.size(); i += 2)
    out.push_back(static_cast<char>(std::stoi(hex.substr(i, 2), nullptr, 16)));
  return out;
}

RouterEvent ParseEvent(const std::string& line) {
  const Words w = ParseWords(line);
  const std::string& cmd = w.positional.at(0);
  auto num = [&](size_t i) { return std::stoull(w.positional.at(i)); };
  if (cmd == "attach") return ClientAttached{num(1)};
  if (cmd == "detach") return ClientDetached{num(1)};
  if (cmd == "send") {
    jupyter::WsMessage ws{ChannelOf(w.positional.at(2)), MakeMessage(w, 3)};
    return ClientFrame{num(1), jupyter::EncodeWsText(ws), false};
  }
  if (cmd == "frame" || cmd == "frame-hex") {
    const size_t start = line.find(' ', line.find(' ') + 1) + 1;
    const std::string raw = line.substr(start);
    return ClientFrame{num(1), cmd == "frame" ? raw : Hex(raw), cmd == "frame-hex"};
  }
  if (cmd == "replica") {
    return ReplicaMessage{static_cast<ReplicaId>(num(1)), ChannelOf(w.positional.at(2)),
                          MakeMessage(w, 3)};
  }
  if (cmd == "lost") {
    return ReplicaLost{static_cast<ReplicaId>(num(1)),
                       w.named.count("why") ? w.named.at("why") : ""};
  }
  if (cmd == "back") return ReplicaBack{static_cast<ReplicaId>(num(1))};
  if (cmd == "unreachable") return ReplicaReachable{static_cast<ReplicaId>(num(1)), false};
  if (cmd == "reachable") return ReplicaReachable{static_cast<ReplicaId>(num(1)), true};
  if (cmd == "link") return ReplicaLinked{static_cast<ReplicaId>(num(1))};
  if (cmd == "unlink") return ReplicaUnlinked{static_cast<ReplicaId>(num(1))};
  if (cmd == "plan-done") {
    PlanDone done{num(1)};
    if (w.named.count("error")) {
      done.plan = Unavailable(line.substr(line.find("error=") + 6));
    } else if (w.positional.size() > 2 && w.positional[2] == "none") {
      done.plan = std::optional<ExecutionPlan>();
      if (w.named.count("wait")) done.wait = line.substr(line.find("wait=") + 5);
    } else {
      ExecutionPlan p;
      p.target_replica = static_cast<ReplicaId>(std::stoul(w.named.at("replica")));
      p.server_id = w.named.count("server") ? w.named.at("server") : "";
      p.grant_id = w.named.count("grant") ? w.named.at("grant") : "";
      if (w.named.count("devices"))
        for (const std::string& d : Split(w.named.at("devices"), ','))
          p.device_ids.push_back(std::stoi(d));
      done.plan = std::optional<ExecutionPlan>(p);
    }
    return done;
  }
  if (cmd == "timer") return TimerFired{num(1)};
  if (cmd == "interrupt") return InterruptRequested{};
  if (cmd == "hold") {
    return ExecutionsHeld{w.positional.at(1) == "on",
                          w.named.count("why") ? line.substr(line.find("why=") + 4) : ""};
  }
  if (cmd == "probe") {
    ProbeRequested p;
    for (size_t i = 1; i < w.positional.size(); ++i)
      p.replicas.push_back(static_cast<ReplicaId>(num(i)));
    return p;
  }
  if (cmd == "call") {
    return ControlCallRequested{num(1), static_cast<ReplicaId>(num(2)), w.positional.at(3),
                                ParseJson(w.json)};
  }
  if (cmd == "close") return RouterClosing{};
  if (cmd == "recover") return RecoverExecution{};
  if (cmd == "suspend") return SuspendChanged{w.positional.at(1) == "on"};
  if (cmd == "majority-lost") {
    std::string why;
    for (size_t i = 1; i < w.positional.size(); ++i) why += (i > 1 ? " " : "") + w.positional[i];
    return MajorityLost{why};
  }
  ADD_FAILURE() << "unknown event: " << line;
  return InterruptRequested{};
}

std::string Describe(const Message& m, bool with_id) {
  std::string out = m.msg_type();
  if (with_id) out += " id=" + m.msg_id();
  if (!m.parent_msg_id().empty()) out += " parent=" + m.parent_msg_id();
  if (!m.metadata.empty()) out += " metadata=" + Dump(m.metadata);
  out += " " + Dump(m.content);
  if (!m.buffers.empty()) out += " buffers=" + std::to_string(m.buffers.size());
  return out;
}

std::string Join(const auto& ids) {
  std::string out;
  for (auto id : ids) out += (out.empty() ? "" : ",") + std::to_string(id);
  return out;
}

std::string DescribeEffect(const RouterEffect& effect) {
  return std::visit(
      Overloaded{
          [](const SendToReplicas& e) {
            return "-> replicas " + Join(e.replicas) + " " + jupyter::ChannelName(e.channel) + " " +
                   Describe(e.message, true);
          },
          [](const SendToClient& e) {
            EXPECT_EQ(e.message.message.header.value("session", ""), "sess");
            return "-> client " + std::to_string(e.client) + " " +
                   jupyter::ChannelName(e.message.channel) + " " +
                   Describe(e.message.message, false);
          },
          [](const SendToAllClients& e) {
            EXPECT_EQ(e.message.message.header.value("session", ""), "sess");
            return std::string("-> all ") + jupyter::ChannelName(e.message.channel) + " " +
                   Describe(e.message.message, false);
          },
          [](const CloseClient& e) {
            return "close client " + std::to_string(e.client) + " " + std::to_string(e.code) + " " +
                   e.reason;
          },
          [](const PlanWanted& e) {
            return "plan-wanted " + std::to_string(e.plan_id) + " exec=" + e.exec_id +
                   " gpus=" + std::to_string(e.gpus) +
                   " target=" + std::to_string(e.requested_target) + " live=" + Join(e.live);
          },
          [](const GrantReleaseWanted& e) {
            return "release grant=" + e.plan.grant_id +
                   " replica=" + std::to_string(e.plan.target_replica) +
                   " server=" + e.plan.server_id;
          },
          [](const TimerWanted& e) {
            return "timer-wanted " + std::to_string(e.timer_id) + " " + std::to_string(e.delay_ms) +
                   "ms";
          },
          [](const ShutdownWanted& e) {
            return std::string("shutdown-wanted restart=") + (e.restart ? "true" : "false");
          },
          [](const ProbeAnswered& e) { return "probe-answered " + std::to_string(e.replica); },
          [](const ControlCallAnswered& e) {
            return "call-answered " + std::to_string(e.call_id) + " " +
                   (e.reply.ok() ? "ok " + Dump(*e.reply) : "error " + e.reply.status().ToString());
          },
          [](const InputRejected& e) {
            return std::string("rejected ") + RejectClassName(e.reason) + ": " + e.detail;
          },
          [](const ResumeWanted&) { return std::string("resume-wanted"); },
          [](const ExecutionStarted& e) {
            return "started " + e.exec_id + " delay=" + std::to_string(e.delay_us / 1000) + "ms";
          },
          [](const ReplicaDiverged& e) {
            return "diverged " + std::to_string(e.replica) + (e.why.empty() ? "" : ": " + e.why);
          },
      },
      effect);
}

struct Block {
  std::vector<std::string> events;
  std::vector<std::string> expected;
};

struct Scenario {
  std::vector<std::string> preamble;               // comments and options before the first block
  std::vector<std::vector<std::string>> comments;  // per block, the comment lines before it
  std::vector<Block> blocks;
};

Scenario Load(const std::filesystem::path& path) {
  std::ifstream in(path);
  Scenario s;
  std::vector<std::string> comments;
  std::string line;
  Block current;
  enum { kEvents, kExpected } part = kEvents;
  auto finish = [&] {
    if (current.events.empty()) return;
    s.comments.push_back(std::move(comments));
    comments.clear();
    s.blocks.push_back(std::move(current));
    current = Block{};
    part = kEvents;
  };
  while (std::getline(in, line)) {
    if (line.empty()) {
      finish();
      continue;
    }
    if (part == kEvents && (line[0] == '#' || line.rfind("options", 0) == 0)) {
      (s.blocks.empty() && current.events.empty() && line.rfind("options", 0) == 0 ? s.preamble
                                                                                   : comments)
          .push_back(line);
      continue;
    }
    if (line == "----") {
      part = kExpected;
    } else if (part == kEvents) {
      current.events.push_back(line);
    } else {
      current.expected.push_back(line);
    }
  }
  finish();
  return s;
}

RouterOptions OptionsFor(const Scenario& s) {
  RouterOptions o;
  o.kernel_id = "k";
  o.session_id = "sess";
  o.replicas = {1, 2, 3};
  for (const std::string& line : s.preamble) {
    const Words w = ParseWords(line);
    if (w.named.count("gpus")) o.gpus = std::stoi(w.named.at("gpus"));
    if (w.named.count("max-queued")) o.max_queued_requests = std::stoul(w.named.at("max-queued"));
    if (w.named.count("max-bytes"))
      o.limits.max_message_bytes = std::stoul(w.named.at("max-bytes"));
    if (w.named.count("replicas")) {
      o.replicas.clear();
      for (const std::string& r : Split(w.named.at("replicas"), ','))
        o.replicas.push_back(static_cast<ReplicaId>(std::stoul(r)));
    }
  }
  return o;
}

void Write(const std::filesystem::path& path, const Scenario& s,
           const std::vector<std::vector<std::string>>& actual) {
  std::ofstream out(path);
  for (const std::string& line : s.preamble) out << line << "\n";
  if (!s.preamble.empty()) out << "\n";
  for (size_t i = 0; i < s.blocks.size(); ++i) {
    for (const std::string& line : s.comments[i]) out << line << "\n";
    for (const std::string& line : s.blocks[i].events) out << line << "\n";
    out << "----\n";
    for (const std::string& line : actual[i]) out << line << "\n";
    if (i + 1 < s.blocks.size()) out << "\n";
  }
}

class RouterScenario : public testing::TestWithParam<std::string> {};

TEST_P(RouterScenario, EffectsAreAsWritten) {
  const std::filesystem::path path = GetParam();
  const Scenario s = Load(path);
  ASSERT_FALSE(s.blocks.empty()) << path;
  KernelRouter router(OptionsFor(s));
  int64_t now_us = int64_t{1700000000} * 1000000;
  std::vector<std::vector<std::string>> actual;
  for (const Block& block : s.blocks) {
    std::vector<std::string> got;
    for (const std::string& line : block.events) {
      now_us += 1000;
      for (const RouterEffect& e : router.Apply(now_us, ParseEvent(line))) {
        got.push_back(DescribeEffect(e));
      }
    }
    got.push_back("state " + std::string(router.execution_state()) +
                  " executing=" + std::to_string(router.executing_replica()) +
                  " executor=" + std::to_string(router.current_executor()) +
                  " live=" + Join(router.live_replicas()));
    actual.push_back(got);
  }
  if (std::getenv("NBOS_REWRITE_TESTDATA") != nullptr) {
    Write(path, s, actual);
    return;
  }
  for (size_t i = 0; i < s.blocks.size(); ++i) {
    std::string events;
    for (const std::string& e : s.blocks[i].events) events += "\n  " + e;
    EXPECT_EQ(actual[i], s.blocks[i].expected)
        << path.filename() << ", block " << i + 1 << ":" << events;
  }
}

std::vector<std::string> ScenarioFiles() {
  std::vector<std::string> files;
  for (const auto& entry : std::filesystem::directory_iterator(NBOS_ROUTER_TESTDATA))
    if (entry.path().extension() == ".txt") files.push_back(entry.path().string());
  std::sort(files.begin(), files.end());
  return files;
}

INSTANTIATE_TEST_SUITE_P(Testdata, RouterScenario, testing::ValuesIn(ScenarioFiles()),
                         [](const testing::TestParamInfo<std::string>& scenario) {
                           std::string name = std::filesystem::path(scenario.param).stem().string();
                           for (char& c : name)
                             if (!isalnum(static_cast<unsigned char>(c))) c = '_';
                           return name;
                         });

// Session ids on every client-bound message are checked in DescribeEffect; these properties hold
// whatever the events.
TEST(KernelRouter, IgnoresEverythingAfterClosingButReleasesLateGrants) {
  RouterOptions o;
  o.kernel_id = "k";
  o.session_id = "sess";
  o.replicas = {1};
  KernelRouter router(o);
  (void)router.Apply(1, RouterClosing{});
  EXPECT_TRUE(router.closed());
  EXPECT_TRUE(router.Apply(2, ClientAttached{1}).empty());
  auto effects =
      router.Apply(3, PlanDone{7, std::optional<ExecutionPlan>(ExecutionPlan{1, "s", "g", {0}})});
  ASSERT_EQ(effects.size(), 1u);
  ASSERT_TRUE(std::holds_alternative<GrantReleaseWanted>(effects[0]));
  EXPECT_EQ(std::get<GrantReleaseWanted>(effects[0]).plan.grant_id, "g");
}

}  // namespace
}  // namespace nbos::gateway
