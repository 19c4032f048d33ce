// `nbos status`: the gateway's /api/nbos/cluster document as text for a terminal. Pure: the JSON
// in, lines out, so that tests pin the layout and the command only fetches and prints.
//
// Layout: a summary line (servers alive, kernels, GPUs committed of all, subscription ratio);
// a table of servers (state, GPUs idle/committed/all, GPUs subscribed, warm pool ready/target);
// a table of kernels (id, owner, kernelspec, execution state, replicas as id@server:state with
// the executor starred, a migration under way); the last scaling events and the migration,
// replacement and suspension counts. Fields the document lacks print as "-": an older or newer
// gateway still gets a readable answer.
#pragma once

#include <nlohmann/json.hpp>
#include <string>

namespace nbos::relay {

// `max_events`: how many of the latest scaling events to list.
std::string RenderClusterStatus(const nlohmann::json& cluster, const std::string& gateway_url,
                                size_t max_events = 5);

}  // namespace nbos::relay
