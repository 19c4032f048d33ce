#include "relay/notebook_runner.h"

#include <spdlog/spdlog.h>

#include <cstring>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <optional>
#include <sstream>

#include "common/ids.h"
#include "jupyter/message.h"
#include "relay/inbox.h"
#include "relay/output_collector.h"
#include "relay/stop_signals.h"

namespace nbos::relay {

namespace {

using jupyter::Json;
using jupyter::Message;
using jupyter::WsMessage;
using Clock = std::chrono::steady_clock;
using namespace std::chrono_literals;

constexpr auto kDeleteTimeout = 30s;

std::string Source(const Json& cell) {
  const Json& src = cell.contains("source") ? cell["source"] : Json("");
  if (src.is_string()) return src.get<std::string>();
  std::string out;
  if (src.is_array()) {
    for (const auto& line : src) {
      if (line.is_string()) out += line.get<std::string>();
    }
  }
  return out;
}

bool HasTag(const Json& cell, std::string_view tag) {
  auto md = cell.find("metadata");
  if (md == cell.end() || !md->is_object()) return false;
  auto tags = md->find("tags");
  if (tags == md->end() || !tags->is_array()) return false;
  for (const auto& t : *tags) {
    if (t.is_string() && t.get<std::string>() == tag) return true;
  }
  return false;
}

bool IsBlank(const std::string& s) { return s.find_first_not_of(" \t\r\n") == std::string::npos; }

Result<Json> ReadNotebook(const std::string& path) {
  std::ifstream in(path);
  if (!in) return NotFound("cannot read " + path);
  std::stringstream text;
  text << in.rdbuf();
  Json nb = Json::parse(text.str(), nullptr, false);
  if (!nb.is_object() || !nb.contains("cells") || !nb["cells"].is_array()) {
    return InvalidArgument(path + " is not a notebook (JSON with a cells list)");
  }
  if (nb.value("nbformat", 0) != 4) {
    return InvalidArgument(path + " is not nbformat 4 (convert it with jupyter nbconvert first)");
  }
  return nb;
}

Status WriteNotebook(const std::string& path, const Json& nb) {
  std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << nb.dump(1, ' ', false, Json::error_handler_t::replace) << "\n";
    if (!out) return Unavailable("cannot write " + tmp);
  }
  std::error_code ec;
  std::filesystem::rename(tmp, path, ec);
  if (ec) return Unavailable("cannot write " + path + ": " + ec.message());
  return Status::Ok();
}

class Runner {
 public:
  explicit Runner(const RunOptions& options) : options_(options), factory_(NewUuid(), "nbos-run") {}

  int Run();
  // Ends the run as if the kernel were lost (from any thread).
  void Stop(const Status& why) { inbox_.Gone(why); }

 private:
  // Sends `msg_type` on shell and waits for its reply until `deadline`.
  std::optional<Message> Request(std::string_view msg_type, Json content,
                                 Clock::time_point deadline);
  enum class CellResult { kOk, kError, kTimeout, kGone };
  CellResult Execute(size_t index, Json* reply_content);
  int Finish(int code);
  bool AwaitKernel();
  int RunCells();

  const RunOptions& options_;
  jupyter::MessageFactory factory_;
  Inbox inbox_;
  std::unique_ptr<GatewayLink> link_;
  Json nb_;
  // Notebook-wide: update_display_data reaches outputs of earlier cells.
  std::optional<OutputCollector> collector_;
  std::string output_;
};

std::optional<Message> Runner::Request(std::string_view msg_type, Json content,
                                       Clock::time_point deadline) {
  Message m = factory_.Make(msg_type, std::move(content), Json::object());
  const std::string id = m.msg_id();
  link_->Send({jupyter::Channel::kShell, m});
  while (auto in = inbox_.Pop(deadline)) {
    if (in->channel == jupyter::Channel::kShell && in->message.parent_msg_id() == id) {
      return std::move(in->message);
    }
  }
  return std::nullopt;
}

Runner::CellResult Runner::Execute(size_t index, Json* reply_content) {
  Json& cell = nb_["cells"][index];
  OutputCollector& collector = *collector_;
  collector.BeginCell(index);
  Json metadata = Json::object();
  if (cell.contains("id") && cell["id"].is_string()) metadata["cellId"] = cell["id"];
  Message m = factory_.Make("execute_request",
                            Json{{"code", Source(cell)},
                                 {"silent", false},
                                 {"store_history", true},
                                 {"user_expressions", Json::object()},
                                 {"allow_stdin", false},
                                 {"stop_on_error", !options_.allow_errors}},
                            Json::object());
  m.metadata = std::move(metadata);
  const std::string id = m.msg_id();
  link_->Send({jupyter::Channel::kShell, m});

  const auto deadline = options_.cell_timeout.count() > 0 ? Clock::now() + options_.cell_timeout
                                                          : Clock::time_point::max();
  std::optional<Json> reply;
  bool idle = false;
  while (!reply || !idle) {
    auto in = inbox_.Pop(deadline);
    if (!in) return inbox_.gone() ? CellResult::kGone : CellResult::kTimeout;
    const Message& msg = in->message;
    if (msg.parent_msg_id() != id) continue;
    if (in->channel == jupyter::Channel::kShell) {
      reply = msg.content;
    } else if (in->channel == jupyter::Channel::kIopub) {
      const std::string type = msg.msg_type();
      if (type == "status") {
        if (msg.content.value("execution_state", "") == "idle") idle = true;
        continue;
      }
      collector.Add(type, msg.content);
    }
  }
  if (reply->contains("execution_count")) collector.SetExecutionCount((*reply)["execution_count"]);
  *reply_content = std::move(*reply);
  return reply_content->value("status", "") == "error" ? CellResult::kError : CellResult::kOk;
}

int Runner::Finish(int code) {
  if (link_) {
    link_->Stop();
    if (Status s = link_->Delete(kDeleteTimeout); !s.ok()) {
      std::cerr << "nbos run: " << s.message() << "\n";
    }
  }
  return code;
}

int Runner::Run() {
  auto nb = ReadNotebook(options_.notebook);
  if (!nb.ok()) {
    std::cerr << "nbos run: " << nb.status().message() << "\n";
    return 2;
  }
  nb_ = std::move(*nb);
  collector_.emplace(&nb_["cells"]);
  output_ = options_.output.empty() ? DefaultOutputPath(options_.notebook) : options_.output;

  auto link = GatewayLink::Start(
      options_.gateway, [this](WsMessage m) { inbox_.Push(std::move(m)); },
      [this](const Status& why) { inbox_.Gone(why); });
  if (!link.ok()) {
    std::cerr << "nbos run: " << link.status().message() << "\n";
    return 2;
  }
  link_ = std::move(*link);

  if (!AwaitKernel()) return Finish(2);
  const int code = RunCells();
  // Fill in what a notebook that never ran might lack, so the output is valid nbformat.
  for (Json& cell : nb_["cells"]) {
    if (cell.value("cell_type", "") != "code") continue;
    if (!cell.contains("outputs")) cell["outputs"] = Json::array();
    if (!cell.contains("execution_count")) cell["execution_count"] = nullptr;
  }
  if (Status s = WriteNotebook(output_, nb_); !s.ok()) {
    std::cerr << "nbos run: " << s.message() << "\n";
    return Finish(code == 0 ? 2 : code);
  }
  std::cout << output_ << std::endl;
  return Finish(code);
}

// Until the kernel answers kernel_info: a just-started kernel may miss the first request
// (jupyter-protocol.md §2.3 (b)). False (and said why) if it does not within the startup timeout.
bool Runner::AwaitKernel() {
  const auto ready_by = Clock::now() + options_.startup_timeout;
  bool ready = false;
  while (!ready && Clock::now() < ready_by && !inbox_.gone()) {
    ready = Request("kernel_info_request", Json::object(), std::min(ready_by, Clock::now() + 1s))
                .has_value();
  }
  if (!ready) {
    auto gone = inbox_.gone();
    std::cerr << "nbos run: kernel " << link_->kernel_id() << " "
              << (gone ? gone->message()
                       : "did not answer kernel_info_request within " +
                             std::to_string(options_.startup_timeout.count()) + " s")
              << "\n";
  }
  return ready;
}

// Runs the code cells in order until one fails (unless errors are allowed); the exit code.
int Runner::RunCells() {
  int code = 0;
  Json& cells = nb_["cells"];
  for (size_t i = 0; i < cells.size(); ++i) {
    Json& cell = cells[i];
    if (cell.value("cell_type", "") != "code") continue;
    if (!cell.contains("outputs")) cell["outputs"] = Json::array();
    if (!cell.contains("execution_count")) cell["execution_count"] = nullptr;
    if (IsBlank(Source(cell)) || HasTag(cell, "skip-execution")) continue;
    Json reply;
    CellResult result = Execute(i, &reply);
    if (result == CellResult::kOk) continue;
    if (result == CellResult::kError) {
      const bool allowed = options_.allow_errors || HasTag(cell, "raises-exception");
      std::cerr << "nbos run: cell " << i << " raised " << reply.value("ename", "an error") << ": "
                << reply.value("evalue", "") << (allowed ? " (allowed)" : "") << "\n";
      if (allowed) continue;
    } else if (result == CellResult::kTimeout) {
      std::cerr << "nbos run: cell " << i << " timed out after " << options_.cell_timeout.count()
                << " s; interrupting the kernel\n";
      if (Status s = link_->Interrupt(); !s.ok()) {
        std::cerr << "nbos run: " << s.message() << "\n";
      }
    } else {
      std::cerr << "nbos run: cell " << i << ": " << inbox_.gone()->message() << "\n";
    }
    code = 1;
    break;
  }
  return code;
}

}  // namespace

std::string DefaultOutputPath(const std::string& notebook) {
  std::filesystem::path p(notebook);
  std::string stem = p.extension() == ".ipynb" ? p.stem().string() : p.filename().string();
  return (p.parent_path() / (stem + ".nbos.ipynb")).string();
}

int RunNotebook(const RunOptions& options) {
  // Ctrl-C or SIGTERM end the run like a lost kernel, so the notebook is still written and the
  // gateway kernel deleted.
  Runner runner(options);
  int code = 0;
  int signalled = 0;
  {
    StopSignals signals([&runner](int sig) {
      runner.Stop(Unavailable(std::string("stopped by signal ") + strsignal(sig)));
    });
    code = runner.Run();
    signalled = signals.signalled();
  }
  return signalled != 0 ? 128 + signalled : code;
}

}  // namespace nbos::relay
