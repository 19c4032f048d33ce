#include "relay/output_collector.h"

#include <string>

#include "common/check.h"

namespace nbos::relay {

using jupyter::Json;

namespace {

// nbformat's output_from_msg; null for message types that are not outputs.
Json OutputFromMessage(std::string_view msg_type, const Json& content) {
  auto field = [&](const char* key, Json fallback) {
    auto it = content.find(key);
    return it != content.end() ? *it : fallback;
  };
  if (msg_type == "stream") {
    return Json{
        {"output_type", "stream"}, {"name", field("name", "stdout")}, {"text", field("text", "")}};
  }
  if (msg_type == "display_data" || msg_type == "execute_result") {
    Json out{{"output_type", msg_type},
             {"data", field("data", Json::object())},
             {"metadata", field("metadata", Json::object())}};
    if (msg_type == "execute_result") out["execution_count"] = field("execution_count", nullptr);
    return out;
  }
  if (msg_type == "error") {
    return Json{{"output_type", "error"},
                {"ename", field("ename", "")},
                {"evalue", field("evalue", "")},
                {"traceback", field("traceback", Json::array())}};
  }
  return nullptr;
}

std::string DisplayId(const Json& content) {
  auto transient = content.find("transient");
  if (transient == content.end() || !transient->is_object()) return {};
  auto id = transient->find("display_id");
  return id != transient->end() && id->is_string() ? id->get<std::string>() : std::string();
}

}  // namespace

OutputCollector::OutputCollector(Json* cells) : cells_(cells) {
  NBOS_CHECK(cells_->is_array(), "a notebook's cells are an array");
}

Json& OutputCollector::Outputs() { return (*cells_)[current_]["outputs"]; }

void OutputCollector::BeginCell(size_t index) {
  // operator[] past the end would grow the notebook with null cells.
  NBOS_CHECK(index < cells_->size(), "BeginCell of a cell the notebook has");
  current_ = index;
  started_ = true;
  clear_pending_ = false;
  ForgetDisplays(index);
  (*cells_)[index]["outputs"] = Json::array();
  (*cells_)[index]["execution_count"] = nullptr;
}

void OutputCollector::ForgetDisplays(size_t cell) {
  for (auto it = displays_.begin(); it != displays_.end();) {
    it->second.erase(cell);
    it = it->second.empty() ? displays_.erase(it) : std::next(it);
  }
}

void OutputCollector::UpdateDisplay(const std::string& display_id, const Json& content) {
  auto shown = displays_.find(display_id);
  if (shown == displays_.end()) return;
  Json data = content.contains("data") ? content["data"] : Json::object();
  Json metadata = content.contains("metadata") ? content["metadata"] : Json::object();
  for (const auto& [cell, indices] : shown->second) {
    Json& outputs = (*cells_)[cell]["outputs"];
    for (size_t i : indices) {
      if (i >= outputs.size()) continue;
      outputs[i]["data"] = data;
      outputs[i]["metadata"] = metadata;
    }
  }
}

void OutputCollector::SetExecutionCount(const Json& count) {
  NBOS_CHECK(started_, "outputs before BeginCell would land in cell 0");
  (*cells_)[current_]["execution_count"] = count;
}

void OutputCollector::Add(std::string_view msg_type, const Json& content) {
  NBOS_CHECK(started_, "outputs before BeginCell would land in cell 0");
  if (!content.is_object()) return;
  const std::string display_id = DisplayId(content);
  if (!display_id.empty() && (msg_type == "display_data" || msg_type == "execute_result" ||
                              msg_type == "update_display_data")) {
    UpdateDisplay(display_id, content);
  }
  if (auto count = content.find("execution_count"); count != content.end()) {
    SetExecutionCount(*count);
  }
  if (msg_type == "clear_output") {
    if (content.value("wait", false)) {
      clear_pending_ = true;
    } else {
      Outputs() = Json::array();
      ForgetDisplays(current_);
    }
    return;
  }
  Json out = OutputFromMessage(msg_type, content);
  if (out.is_null()) return;  // update_display_data, status, execute_input, comm_*, ...
  if (clear_pending_) {
    Outputs() = Json::array();
    ForgetDisplays(current_);
    clear_pending_ = false;
  }
  Json& outputs = Outputs();
  if (msg_type == "stream" && !outputs.empty()) {
    Json& last = outputs.back();
    if (last["output_type"] == "stream" && last["name"] == out["name"] &&
        last["text"].is_string() && out["text"].is_string()) {
      last["text"] = last["text"].get<std::string>() + out["text"].get<std::string>();
      return;
    }
  }
  if (!display_id.empty()) displays_[display_id][current_].push_back(outputs.size());
  outputs.push_back(std::move(out));
}

}  // namespace nbos::relay
