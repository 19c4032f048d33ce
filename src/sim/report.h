// SVG plots and the markdown report of `nbos sim report`. Pure string builders.
#pragma once

#include <string>
#include <vector>

#include "sim/simulator.h"

namespace nbos::sim {

// A CDF plot (x: seconds on a log10 axis from 0.001 s, y: 0..100 %) of each result's
// `delay_cdf_s` (tct = false) or `tct_cdf_s` (tct = true), one line per result.
std::string CdfSvg(const std::vector<SimResult>& results, bool tct);
// Servers over time (x: hours, y: servers), one line per result.
std::string ServersSvg(const std::vector<SimResult>& results);
// The markdown report: the comparison table, savings versus reservation and the plot links.
std::string MarkdownReport(const std::vector<SimResult>& results, const std::string& trace,
                           const std::string& command);

}  // namespace nbos::sim
