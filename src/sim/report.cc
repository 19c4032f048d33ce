#include "sim/report.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>

namespace nbos::sim {

namespace {

constexpr const char* kColors[] = {"#1f77b4", "#d62728", "#2ca02c", "#9467bd",
                                   "#ff7f0e", "#8c564b", "#e377c2", "#7f7f7f"};
constexpr double kW = 720, kH = 420, kLeft = 60, kRight = 180, kTop = 30, kBottom = 50;

std::string Label(const SimResult& r) {
  return r.policy + (r.idle_reclaim_min ? " idle " + std::to_string(r.idle_reclaim_min) : "");
}

std::string Frame(const std::string& title, const std::string& x_label,
                  const std::string& y_label) {
  return fmt::format(
      "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{0}\" height=\"{1}\" "
      "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"{0}\" height=\"{1}\" "
      "fill=\"white\"/>\n<text x=\"{2}\" y=\"18\" font-size=\"14\">{3}</text>\n"
      "<rect x=\"{2}\" y=\"{4}\" width=\"{5}\" height=\"{6}\" fill=\"none\" stroke=\"black\"/>\n"
      "<text x=\"{7}\" y=\"{8}\" text-anchor=\"middle\">{9}</text>\n"
      "<text x=\"14\" y=\"{10}\" transform=\"rotate(-90 14 {10})\" "
      "text-anchor=\"middle\">{11}</text>\n",
      kW, kH, kLeft, title, kTop, kW - kLeft - kRight, kH - kTop - kBottom,
      kLeft + (kW - kLeft - kRight) / 2, kH - 10, x_label, kTop + (kH - kTop - kBottom) / 2,
      y_label);
}

std::string Legend(const std::vector<SimResult>& results) {
  std::string out;
  for (size_t i = 0; i < results.size(); ++i) {
    const double y = kTop + 16 + 18 * static_cast<double>(i);
    out += fmt::format(
        "<line x1=\"{0}\" y1=\"{1}\" x2=\"{2}\" y2=\"{1}\" stroke=\"{3}\" stroke-width=\"2\"/>"
        "<text x=\"{4}\" y=\"{5}\">{6}</text>\n",
        kW - kRight + 10, y, kW - kRight + 30, kColors[i % 8], kW - kRight + 35, y + 4,
        Label(results[i]));
  }
  return out;
}

std::string Polyline(const std::vector<std::pair<double, double>>& points, size_t color) {
  std::string pts;
  for (const auto& [x, y] : points) pts += fmt::format("{:.1f},{:.1f} ", x, y);
  return fmt::format("<polyline fill=\"none\" stroke=\"{}\" stroke-width=\"1.5\" points=\"{}\"/>\n",
                     kColors[color % 8], pts);
}

}  // namespace

std::string CdfSvg(const std::vector<SimResult>& results, bool tct) {
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  double max_s = 1;
  for (const SimResult& r : results) {
    const auto& cdf = tct ? r.tct_cdf_s : r.delay_cdf_s;
    if (!cdf.empty()) max_s = std::max(max_s, cdf.back());
  }
  const double lo = -3, hi = std::ceil(std::log10(max_s));
  auto x_of = [&](double s) {
    const double l = std::log10(std::max(s, 1e-3));
    return kLeft + (l - lo) / (hi - lo) * pw;
  };
  std::string svg = Frame(tct ? "Task completion time CDF" : "Interactivity delay CDF",
                          "seconds (log scale)", "% of cells");
  for (double d = lo; d <= hi; d += 1) {
    const double x = kLeft + (d - lo) / (hi - lo) * pw;
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">1e{}</text>\n", x,
                       kTop + ph + 16, static_cast<int>(d));
  }
  for (int p = 0; p <= 100; p += 25) {
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{}</text>\n", kLeft - 4,
                       kTop + ph - p / 100.0 * ph + 4, p);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    const auto& cdf = tct ? results[i].tct_cdf_s : results[i].delay_cdf_s;
    std::vector<std::pair<double, double>> pts;
    for (size_t p = 0; p < cdf.size(); ++p) {
      pts.emplace_back(x_of(cdf[p]), kTop + ph - static_cast<double>(p) / 100.0 * ph);
    }
    svg += Polyline(pts, i);
  }
  return svg + Legend(results) + "</svg>\n";
}

std::string ServersSvg(const std::vector<SimResult>& results) {
  const double pw = kW - kLeft - kRight, ph = kH - kTop - kBottom;
  double max_h = 1, max_n = 1;
  for (const SimResult& r : results) {
    for (const auto& [h, n] : r.servers_over_time) {
      max_h = std::max(max_h, h + 1);
      max_n = std::max(max_n, static_cast<double>(n));
    }
  }
  std::string svg = Frame("Servers over time (hourly max)", "hours", "servers");
  for (int k = 0; k <= 4; ++k) {
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"middle\">{:.0f}</text>\n",
                       kLeft + k / 4.0 * pw, kTop + ph + 16, k / 4.0 * max_h);
    svg += fmt::format("<text x=\"{:.1f}\" y=\"{:.1f}\" text-anchor=\"end\">{:.0f}</text>\n",
                       kLeft - 4, kTop + ph - k / 4.0 * ph + 4, k / 4.0 * max_n);
  }
  for (size_t i = 0; i < results.size(); ++i) {
    std::vector<std::pair<double, double>> pts;
    for (const auto& [h, n] : results[i].servers_over_time) {
      pts.emplace_back(kLeft + h / max_h * pw, kTop + ph - n / max_n * ph);
    }
    svg += Polyline(pts, i);
  }
  return svg + Legend(results) + "</svg>\n";
}

std::string MarkdownReport(const std::vector<SimResult>& results, const std::string& trace,
                           const std::string& command) {
  std::string md = "# nbos sim report\n\nTrace: `" + trace + "`  \nCommand: `" + command +
                   "`\n\n| policy | idle reclaim (min) | GPU-h provisioned | GPU-h committed | "
                   "oracle GPU-h | × oracle | vs reservation | cells immediate % | executor "
                   "reuse % | delay p50/p90/p99 (s) | TCT p50/p90/p99 (s) | migrations | scale "
                   "out/in events | peak/mean servers | cost $ | revenue $ | margin % |\n"
                   "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n";
  double reservation = 0;
  for (const SimResult& r : results) {
    if (r.policy == "reservation" && r.idle_reclaim_min == 0) reservation = r.gpu_hours_provisioned;
  }
  for (const SimResult& r : results) {
    const std::string vs =
        reservation > 0 ? fmt::format("{:+.1f} %",
                                      100.0 * (r.gpu_hours_provisioned - reservation) / reservation)
                        : "–";
    md += fmt::format(
        "| {} | {} | {:.1f} | {:.1f} | {:.1f} | {:.2f} | {} | {:.1f} | {:.1f} | {:.2f} / {:.2f} / "
        "{:.2f} | {:.0f} / {:.0f} / {:.0f} | {} | {} / {} | {} / {:.1f} | {:.0f} | {:.0f} | {:.1f} "
        "|\n",
        r.policy, r.idle_reclaim_min == 0 ? "none" : std::to_string(r.idle_reclaim_min),
        r.gpu_hours_provisioned, r.gpu_hours_committed, r.gpu_hours_oracle,
        r.gpu_hours_oracle > 0 ? r.gpu_hours_provisioned / r.gpu_hours_oracle : 0, vs,
        r.pct_immediate, r.pct_executor_reuse, r.delay_s.p50, r.delay_s.p90, r.delay_s.p99,
        r.tct_s.p50, r.tct_s.p90, r.tct_s.p99, r.migrations, r.scale_out_events, r.scale_in_events,
        r.peak_servers, r.mean_servers, r.provider_cost_usd, r.revenue_usd, r.margin_pct);
  }
  md +=
      "\nWhy cells were not immediate (counts of cells; docs/decisions/0004-simulator.md):\n\n"
      "| policy | idle reclaim (min) | not immediate | migrated at once | waited, migration | "
      "waited, placement | waited, proactive move | other | of them whole-host cells | "
      "migrations (of them proactive) |\n|---|---|---|---|---|---|---|---|---|---|\n";
  for (const SimResult& r : results) {
    md += fmt::format("| {} | {} | {} | {} | {} | {} | {} | {} | {} | {} ({}) |\n", r.policy,
                      r.idle_reclaim_min == 0 ? "none" : std::to_string(r.idle_reclaim_min),
                      r.late_migrated + r.late_migration_wait + r.late_placement_wait +
                          r.late_rebalance_wait + r.late_other,
                      r.late_migrated, r.late_migration_wait, r.late_placement_wait,
                      r.late_rebalance_wait, r.late_other, r.late_whole_host, r.migrations,
                      r.proactive_migrations);
  }
  md +=
      "\n![interactivity delay CDF](delay_cdf.svg)\n\n![task completion time CDF](tct_cdf.svg)"
      "\n\n![servers over time](servers.svg)\n";
  return md;
}

}  // namespace nbos::sim
