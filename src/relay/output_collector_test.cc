#include "relay/output_collector.h"

#include <gtest/gtest.h>

namespace nbos::relay {
namespace {

using jupyter::Json;

Json Cells(int n) {
  Json cells = Json::array();
  for (int i = 0; i < n; ++i) {
    cells.push_back(Json{{"cell_type", "code"},
                         {"source", ""},
                         {"metadata", Json::object()},
                         {"outputs", Json::array({Json{{"stale", true}}})},
                         {"execution_count", 7}});
  }
  return cells;
}

Json Stream(const std::string& name, const std::string& text) {
  return Json{{"name", name}, {"text", text}};
}

Json Display(const std::string& text, const std::string& display_id = "") {
  Json c{{"data", {{"text/plain", text}}}, {"metadata", Json::object()}};
  if (!display_id.empty()) c["transient"] = {{"display_id", display_id}};
  return c;
}

TEST(OutputCollectorTest, BuildsNbformatOutputsAndMergesStreams) {
  Json cells = Cells(1);
  OutputCollector c(&cells);
  c.BeginCell(0);
  EXPECT_EQ(cells[0]["outputs"], Json::array());
  EXPECT_TRUE(cells[0]["execution_count"].is_null());

  c.Add("status", Json{{"execution_state", "busy"}});
  c.Add("execute_input", Json{{"code", "x"}, {"execution_count", 3}});
  c.Add("stream", Stream("stdout", "a"));
  c.Add("stream", Stream("stdout", "b\n"));
  c.Add("stream", Stream("stderr", "warn\n"));
  c.Add("stream", Stream("stdout", "c"));
  c.Add(
      "execute_result",
      Json{{"data", {{"text/plain", "6"}}}, {"metadata", Json::object()}, {"execution_count", 3}});
  c.Add("error", Json{{"ename", "E"}, {"evalue", "v"}, {"traceback", {"t1", "t2"}}});
  c.Add("comm_open", Json{{"comm_id", "x"}});

  Json want = Json::array({Json{{"output_type", "stream"}, {"name", "stdout"}, {"text", "ab\n"}},
                           Json{{"output_type", "stream"}, {"name", "stderr"}, {"text", "warn\n"}},
                           Json{{"output_type", "stream"}, {"name", "stdout"}, {"text", "c"}},
                           Json{{"output_type", "execute_result"},
                                {"data", {{"text/plain", "6"}}},
                                {"metadata", Json::object()},
                                {"execution_count", 3}},
                           Json{{"output_type", "error"},
                                {"ename", "E"},
                                {"evalue", "v"},
                                {"traceback", {"t1", "t2"}}}});
  EXPECT_EQ(cells[0]["outputs"], want);
  EXPECT_EQ(cells[0]["execution_count"], 3);
}

TEST(OutputCollectorTest, ClearOutputNowAndWithWait) {
  Json cells = Cells(1);
  OutputCollector c(&cells);
  c.BeginCell(0);
  c.Add("stream", Stream("stdout", "1"));
  c.Add("clear_output", Json{{"wait", false}});
  EXPECT_EQ(cells[0]["outputs"], Json::array());

  c.Add("stream", Stream("stdout", "2"));
  c.Add("clear_output", Json{{"wait", true}});
  EXPECT_EQ(cells[0]["outputs"].size(), 1u);  // kept until the next output
  c.Add("stream", Stream("stdout", "3"));
  ASSERT_EQ(cells[0]["outputs"].size(), 1u);
  EXPECT_EQ(cells[0]["outputs"][0]["text"], "3");

  // A wait left pending at the end of a cell does not clear the next cell.
  c.Add("clear_output", Json{{"wait", true}});
  cells.push_back(cells[0]);
  c.BeginCell(1);
  c.Add("stream", Stream("stdout", "4"));
  EXPECT_EQ(cells[0]["outputs"][0]["text"], "3");
  EXPECT_EQ(cells[1]["outputs"][0]["text"], "4");
}

TEST(OutputCollectorTest, DisplayIdsUpdateEveryCellShowingThem) {
  Json cells = Cells(2);
  OutputCollector c(&cells);
  c.BeginCell(0);
  c.Add("display_data", Display("v1", "d"));
  c.Add("display_data", Display("other"));
  c.BeginCell(1);
  c.Add("update_display_data", Display("v2", "d"));
  EXPECT_EQ(cells[0]["outputs"][0]["data"]["text/plain"], "v2");
  EXPECT_EQ(cells[0]["outputs"][1]["data"]["text/plain"], "other");
  EXPECT_EQ(cells[1]["outputs"], Json::array());  // an update adds no output

  // Showing the same display_id again updates the old one and adds a new output.
  c.Add("display_data", Display("v3", "d"));
  EXPECT_EQ(cells[0]["outputs"][0]["data"]["text/plain"], "v3");
  ASSERT_EQ(cells[1]["outputs"].size(), 1u);
  c.Add("update_display_data", Display("v4", "d"));
  EXPECT_EQ(cells[0]["outputs"][0]["data"]["text/plain"], "v4");
  EXPECT_EQ(cells[1]["outputs"][0]["data"]["text/plain"], "v4");
  EXPECT_EQ(cells[1]["outputs"][0]["output_type"], "display_data");

  // Clearing a cell forgets its displays; re-running cell 0 forgets its old ones.
  c.Add("clear_output", Json{{"wait", false}});
  c.BeginCell(0);
  c.Add("update_display_data", Display("v5", "d"));
  EXPECT_EQ(cells[0]["outputs"], Json::array());
  EXPECT_EQ(cells[1]["outputs"], Json::array());
}

TEST(OutputCollectorTest, ExecutionCountFromTheReply) {
  Json cells = Cells(1);
  OutputCollector c(&cells);
  c.BeginCell(0);
  c.SetExecutionCount(12);
  EXPECT_EQ(cells[0]["execution_count"], 12);
}

}  // namespace
}  // namespace nbos::relay
