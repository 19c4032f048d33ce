// Assembling executed-notebook outputs from iopub messages the way nbclient 0.7 does (pure):
// stream, display_data, execute_result and error become nbformat 4 outputs; clear_output clears
// at once or, with wait=true, just before the next output; update_display_data (and a
// display_data or execute_result with a display_id already shown) replaces the data and
// metadata of every output shown with that display_id, in any cell of the notebook. Like
// nbconvert's coalesce_streams, consecutive stream outputs of one name become one.
#pragma once

#include <cstddef>
#include <map>
#include <string_view>
#include <vector>

#include "jupyter/message.h"

namespace nbos::relay {

class OutputCollector {
 public:
  // `cells` is a notebook's "cells" array; it must outlive the collector, which modifies the
  // outputs and execution_count of the cells it is given.
  explicit OutputCollector(jupyter::Json* cells);

  // Starts a code cell: its outputs are emptied and its execution_count set to null. A
  // clear_output(wait=true) still pending from the previous cell is dropped.
  void BeginCell(size_t index);

  // One iopub message whose parent is the current cell's execute_request. Messages that are not
  // outputs (status, execute_input, comm_*) only update execution_count when they carry one.
  void Add(std::string_view msg_type, const jupyter::Json& content);

  // Sets the current cell's execution_count (from the execute_reply).
  void SetExecutionCount(const jupyter::Json& count);

 private:
  jupyter::Json& Outputs();
  void UpdateDisplay(const std::string& display_id, const jupyter::Json& content);
  void ForgetDisplays(size_t cell);

  jupyter::Json* cells_;
  size_t current_ = 0;
  bool started_ = false;
  bool clear_pending_ = false;
  // display_id -> cell index -> output indices showing it.
  std::map<std::string, std::map<size_t, std::vector<size_t>>> displays_;
};

}  // namespace nbos::relay
