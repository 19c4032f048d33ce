#!/usr/bin/python3
"""Live migration on `nbos up` (4 servers x 1 GPU): a kernel whose three servers' GPUs are all
held by other kernels' cells runs its next cell on a replica migrated to the free server. Each
round starts a fresh cluster, builds that situation, and measures

  migration   the gateway's own figure: new replica launched, added to the Raft group, caught
              up (snapshot + log + blobs of the kernel's state), answering, old one removed
              (/api/nbos/cluster migrations.durations_ms)
  cell        the waiting cell's round trip (execute_request -> reply), migration included
  baseline    the same cell on the same kernel right after, no migration (same run)

in two situations, --rounds each:
  warm ready  the cell is sent once every server's warm pool is full again (the steady state:
              the new replica is a promoted, preloaded process)
  refilling   the cell is sent at once, while the warm processes that the kernel starts just
              took are still being replaced (the promoted process may still be preloading)

Design target (DESIGN.md §9): migration incl. catch-up (small state) <= 1 s. Run from the
repository root:

    /usr/bin/python3 bench/migration_bench.py [--nbos build/bin/nbos] [--rounds N] [--state-mb M]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "gateway"))

LONG_CELL = "import time\nfor _ in range(1200): time.sleep(0.1)"


def warm_pools_full(c):
    pools = [s["warm_pool"] for s in c.get("/api/nbos/cluster")["servers"]]
    return all(w["ready"] == w["target"] for w in pools)


def one_round(Cluster, KernelSocket, state_mb, wait_warm):
    c = Cluster(hosts=4, gpus_per_host=1)
    sockets = []
    try:
        a = c.start_kernel({"KERNEL_GPUS": "1"})
        ks = KernelSocket(c.url, a, c.token)
        sockets.append(ks)
        reply, _ = ks.execute(f"x = 1\nstate = bytearray({state_mb} << 20)")
        assert reply["content"]["status"] == "ok", reply["content"]
        view = c.get("/api/nbos/cluster")
        mine = next(k for k in view["kernels"] if k["id"] == a)
        to_fill = {r["server_id"] for r in mine["replicas"]}
        while to_fill:
            other = c.start_kernel({"KERNEL_GPUS": "1"})
            kernel = next(k for k in c.get("/api/nbos/cluster")["kernels"] if k["id"] == other)
            for r in kernel["replicas"]:
                if r["server_id"] in to_fill:
                    sock = KernelSocket(c.url, other, c.token)
                    sockets.append(sock)
                    sock.send("execute_request", {
                        "code": LONG_CELL, "silent": False, "store_history": True,
                        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
                        metadata={"nbos": {"target_replica": r["replica_id"]}})
                    to_fill.discard(r["server_id"])
                    break
        servers = set(r["server_id"] for r in mine["replicas"])
        while not all(s["gpus_committed"] == 1 for s in c.get("/api/nbos/cluster")["servers"]
                      if s["server_id"] in servers):
            time.sleep(0.05)
        deadline = time.time() + 120
        while wait_warm and not warm_pools_full(c):
            if time.time() > deadline:
                raise SystemExit("warm pools did not fill within 120 s")
            time.sleep(0.05)
        started = time.perf_counter()
        reply, _ = ks.execute("x + 1")
        cell_ms = (time.perf_counter() - started) * 1000
        assert reply["content"]["status"] == "ok", reply["content"]
        started = time.perf_counter()
        reply, _ = ks.execute("x + 1")
        baseline_ms = (time.perf_counter() - started) * 1000
        durations = c.get("/api/nbos/cluster")["migrations"]["durations_ms"]
        if len(durations) != 1:
            raise SystemExit(f"expected one migration, got {durations}")
        return durations[0], cell_ms, baseline_ms
    finally:
        for s in sockets:
            s.close()
        c.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nbos", default="build/bin/nbos")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state-mb", type=int, default=1, help="size of the kernel's state")
    args = parser.parse_args()
    os.environ["NBOS_BIN"] = os.path.abspath(args.nbos)
    from cluster import Cluster, KernelSocket

    series = {"warm ready": [], "refilling": []}
    for _ in range(args.rounds):  # interleaved, so both see the same machine
        for name in series:
            series[name].append(
                one_round(Cluster, KernelSocket, args.state_mb, name == "warm ready"))
    print(f"live migration, {args.rounds} rounds per situation, kernel state ~{args.state_mb} MB")
    for situation, rows in series.items():
        print(f"{situation}:")
        for name, i in (("migration", 0), ("cell incl. migration", 1), ("baseline cell", 2)):
            values = [r[i] for r in rows]
            print(f"  {name:22} p50 {statistics.median(values):7.0f} ms   "
                  f"max {max(values):7.0f} ms")
    print("target: migration incl. catch-up <= 1000 ms (warm ready is the steady state)")


if __name__ == "__main__":
    main()
