#!/usr/bin/python3
"""Self-healing and scale-out in the live cluster, each round on a fresh cluster:

replacement (a gateway and 4 daemons started one by one, 1 GPU each; a kernel holding
--state-mb of numpy state):
  baseline    an operator's migration of one replica of the kernel to the spare server
              (POST /api/nbos/kernels/{id}/migrate; /api/nbos/cluster durations_ms)
  detected    server killed (daemon and replicas, kept down) -> its replica shown lost
              (the 5 s heartbeat timeout)
  replaced    loss seen by the gateway -> the new replica answers (replacement_ms)
  total       server killed -> three live replicas in the cluster view

no majority (a gateway and 4 daemons; two of a kernel's three servers frozen with SIGSTOP just
before a cell is sent, then thawed):
  baseline    the same cell with every server answering
  standbys    the two servers of the standbys frozen: execute_request -> ReplicasUnavailable
              ("did not run": the live executor confirmed it had not begun the cell)
  executor    the executor's server and one other frozen: -> ReplicasUnavailable ("not known")
  target: every execute_request answered within 2 s

scale-out (`nbos up --hosts 3 --max-hosts 4`, 1 GPU each, every GPU held by a long cell):
  scale-out   a cell that needs a GPU: execute_request -> reply, a server started, registered
              and a replica migrated to it on the way
  baseline    the same cell right after, on the new server (no scale-out)

    /usr/bin/python3 bench/healing_bench.py [--nbos build/bin/nbos] [--rounds N] [--state-mb M]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "gateway"))

LONG_CELL = "import time\nfor _ in range(1200): time.sleep(0.1)"


def kernel_of(view, kernel_id):
    return next(k for k in view["kernels"] if k["id"] == kernel_id)


def wait(predicate, what, timeout=120):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.time() > deadline:
            raise SystemExit(f"timed out waiting for {what}")
        time.sleep(0.05)


def replacement_round(SplitCluster, KernelSocket, rest_call, state_mb):
    c = SplitCluster(hosts=4)
    view = lambda: rest_call(c.url, c.token, "GET", "/api/nbos/cluster")[1]  # noqa: E731
    try:
        kid = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})[1]["id"]
        ks = KernelSocket(c.url, kid, c.token)
        reply, _ = ks.execute(f"import numpy as np\na = np.ones({state_mb} << 17)")
        assert reply["content"]["status"] == "ok", reply["content"]
        status, body = rest_call(c.url, c.token, "POST", f"/api/nbos/kernels/{kid}/migrate", {})
        assert status == 202, body
        wait(lambda: len(view()["migrations"]["durations_ms"]) == 1, "the migration")
        baseline_ms = view()["migrations"]["durations_ms"][0]
        victim = sorted(r["server_id"] for r in kernel_of(view(), kid)["replicas"])[0]
        c.kill_host(int(victim.split("-")[1]))
        killed = time.perf_counter()
        wait(lambda: any(r["state"] == "lost" for r in kernel_of(view(), kid)["replicas"]),
             "the loss to show")
        detected_ms = (time.perf_counter() - killed) * 1000
        wait(lambda: [r for r in kernel_of(view(), kid)["replicas"]
                      if r["state"] == "live" and r["server_id"] != victim][2:], "3 live")
        total_ms = (time.perf_counter() - killed) * 1000
        replaced_ms = view()["migrations"]["replacement_ms"][0]
        ks.close()
        return baseline_ms, detected_ms, replaced_ms, total_ms
    finally:
        c.ps.stop()


def scale_out_round(Cluster, KernelSocket):
    c = Cluster(hosts=3, gpus_per_host=1,
                extra=("--max-hosts", "4", "--scaling-interval-ms", "60000"))
    sockets = []
    try:
        a = c.start_kernel({"KERNEL_GPUS": "1"})
        ks = KernelSocket(c.url, a, c.token)
        sockets.append(ks)
        for server in ("host-1", "host-2", "host-3"):
            other = c.start_kernel({"KERNEL_GPUS": "1"})
            rid = next(r["replica_id"] for r in kernel_of(c.get("/api/nbos/cluster"),
                                                          other)["replicas"]
                       if r["server_id"] == server)
            sock = KernelSocket(c.url, other, c.token)
            sockets.append(sock)
            sock.send("execute_request", {
                "code": LONG_CELL, "silent": False, "store_history": True,
                "user_expressions": {}, "allow_stdin": False, "stop_on_error": True},
                metadata={"nbos": {"target_replica": rid}})
        wait(lambda: all(s["gpus_committed"] == 1 for s in c.get("/api/nbos/cluster")["servers"]),
             "every GPU held")
        started = time.perf_counter()
        reply, _ = ks.execute("1 + 1")
        scale_ms = (time.perf_counter() - started) * 1000
        assert reply["content"]["status"] == "ok", reply["content"]
        assert reply["metadata"]["nbos"]["server"] == "host-4", reply["metadata"]
        started = time.perf_counter()
        reply, _ = ks.execute("1 + 1")
        baseline_ms = (time.perf_counter() - started) * 1000
        return scale_ms, baseline_ms
    finally:
        for s in sockets:
            s.close()
        c.stop()


def no_majority_round(SplitCluster, KernelSocket, rest_call):
    import signal
    c = SplitCluster(hosts=4)
    try:
        kid = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})[1]["id"]
        ks = KernelSocket(c.url, kid, c.token)
        reply, _ = ks.execute("x = 1")
        assert reply["content"]["status"] == "ok", reply["content"]
        started = time.perf_counter()
        reply, _ = ks.execute("x += 1")
        row = [(time.perf_counter() - started) * 1000]
        executor = reply["metadata"]["nbos"]["executor"]
        view = rest_call(c.url, c.token, "GET", "/api/nbos/cluster")[1]
        host = {r["replica_id"]: int(r["server_id"].split("-")[1])
                for r in kernel_of(view, kid)["replicas"]}
        others = sorted(h for rid, h in host.items() if rid != executor)
        for frozen in (others, [host[executor], others[0]]):
            for i in frozen:
                c.signal_host(i, signal.SIGSTOP)
            started = time.perf_counter()
            reply, _ = ks.execute("x += 1")
            row.append((time.perf_counter() - started) * 1000)
            assert reply["content"].get("ename") == "ReplicasUnavailable", reply["content"]
            for i in frozen:
                c.signal_host(i, signal.SIGCONT)
            wait(lambda: ks.execute("x")[0]["content"]["status"] == "ok", "the kernel to resume")
        ks.close()
        return row
    finally:
        for i in range(1, 5):
            c.signal_host(i, signal.SIGCONT)
        c.ps.stop()


def report(title, names, rows):
    print(title)
    for i, name in enumerate(names):
        values = [r[i] for r in rows]
        print(f"  {name:12} p50 {statistics.median(values):7.0f} ms   max {max(values):7.0f} ms")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nbos", default="build/bin/nbos")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--state-mb", type=int, default=8)
    args = parser.parse_args()
    os.environ["NBOS_BIN"] = os.path.abspath(args.nbos)
    from cluster import Cluster, KernelSocket, SplitCluster, rest_call

    replacement, scale_out, no_majority = [], [], []
    for _ in range(args.rounds):
        replacement.append(replacement_round(SplitCluster, KernelSocket, rest_call, args.state_mb))
        scale_out.append(scale_out_round(Cluster, KernelSocket))
        no_majority.append(no_majority_round(SplitCluster, KernelSocket, rest_call))
    report(f"replacement of a lost server's replica, {args.rounds} rounds, "
           f"state ~{args.state_mb} MB:",
           ("baseline", "detected", "replaced", "total"), replacement)
    print("  target: three live replicas within 10 s of the loss being detected (replaced)")
    report(f"scale-out, {args.rounds} rounds:", ("scale-out", "baseline"), scale_out)
    report(f"a cell sent as two of three servers freeze, {args.rounds} rounds:",
           ("baseline", "standbys", "executor"), no_majority)
    print("  target: every execute_request answered within 2 s")


if __name__ == "__main__":
    main()
