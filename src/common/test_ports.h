// Loopback ports for tests that pick a port first and start a server on it later.
//
// A port probed free with bind(0) lies in the kernel's ephemeral range (32768-60999 by default),
// where any outgoing connection (Raft, Redis, ZeroMQ) may take it before the server binds it.
// These come from 10000-19999 instead: below that range and below the ports `nbos up`'s daemons
// hand out to replicas (20000-32767, daemon/ports.h). tests/conftest.py picks from the same
// range for the end-to-end suites.
#pragma once

namespace nbos::testing {

// A port that binds on 127.0.0.1 now, with the `consecutive` - 1 ports after it binding too.
// No port is handed out twice in one process, and processes start their search at different
// places. Returns 0 when the range has no such run of ports. Thread-safe.
int FreeTestPort(int consecutive = 1);

}  // namespace nbos::testing
