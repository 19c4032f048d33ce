// `nbos run NB.ipynb`: executes a notebook on a gateway kernel and writes the executed notebook,
// like `jupyter nbconvert --execute` (nbclient 0.7 semantics).
//
// A kernel is started on the gateway; kernel_info_request is sent on shell once a second until
// one is answered (a just-started kernel may miss the first). Then each code cell runs in order
// (execute_request with store_history, stop_on_error unless errors are allowed, allow_stdin
// false) until its execute_reply and its iopub idle have both arrived; outputs are assembled
// by OutputCollector and execution_count is set. Cells whose source is blank, or tagged
// "skip-execution", are not run. A cell that fails stops the run unless --allow-errors or the
// cell is tagged "raises-exception" (as in nbclient). The executed notebook is written even
// after a failure, and the gateway kernel is deleted at the end in every case.
#pragma once

#include <chrono>
#include <string>

#include "relay/gateway_link.h"

namespace nbos::relay {

struct RunOptions {
  std::string notebook;  // input .ipynb (nbformat 4)
  std::string output;    // empty: <dir>/<stem>.nbos.ipynb next to the input
  GatewayOptions gateway;
  std::chrono::seconds cell_timeout{0};  // per cell; 0 waits forever
  std::chrono::seconds startup_timeout{120};
  bool allow_errors = false;
};

// The default output path for `notebook`: "dir/NB.ipynb" -> "dir/NB.nbos.ipynb".
std::string DefaultOutputPath(const std::string& notebook);

// Runs the notebook. Returns the exit code: 0 every cell ran (errors allowed or tagged), 1 a cell
// failed or timed out (it is interrupted) or the kernel was lost, 2 the run could not start
// (unreadable notebook, gateway unreachable or refusing the token, kernel never ready); the
// reason goes to stderr as one line prefixed "nbos run: ". The output path is printed on stdout
// once written. SIGINT, SIGTERM or SIGHUP stop the run the same way (notebook written, kernel
// deleted) with exit code 128 + the signal number.
int RunNotebook(const RunOptions& options);

}  // namespace nbos::relay
