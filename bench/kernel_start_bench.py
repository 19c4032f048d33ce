#!/usr/bin/python3
"""Kernel start latency at the gateway (POST /api/kernels until the kernel's three replicas all
answer kernel_info) on `nbos up`, cold versus from the daemons' warm pools, each with and without
the replica sandbox, in the same run.

  cold   nbos up --warm-pool 0: every replica is a fresh `nbos replica` process
  warm   nbos up --warm-pool 1: replicas are promoted pre-started processes (the pools are
         given time to refill between starts, so each start finds one per server)
  sandbox on: bubblewrap, a user id per kernel and a cgroup per replica (as root);
  sandbox off: replicas run as the daemon runs (the baseline)
  burst  two kernels started at once (sandbox off) with a pool of 1 and of 2 per server: a pool
         of 1 has one warm process for two starts, so one of them starts cold (the
         time of each start is one sample)

Each start is followed by a DELETE; both clusters are stopped at the end and checked for
leftover processes. Run from the repository root:

    /usr/bin/python3 bench/kernel_start_bench.py [--nbos build/bin/nbos] [--starts N]

Exit status 0 on success; 1 when a start fails or processes are left behind.
"""

import argparse
import concurrent.futures
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "gateway"))


def percentile(values, p):
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(p / 100 * (len(ordered) - 1))))]


def timed_start(c):
    started = time.perf_counter()
    kernel_id = c.start_kernel()
    return kernel_id, (time.perf_counter() - started) * 1000


def measure(Cluster, warm_pool, starts, sandbox, burst=1):
    c = Cluster(hosts=3, gpus_per_host=1,
                extra=("--warm-pool", str(warm_pool), "--sandbox", sandbox))
    times_ms = []
    try:
        for _ in range(starts):
            if warm_pool:
                deadline = time.time() + 60
                while not all(s["warm_pool"]["ready"] >= warm_pool
                              for s in c.get("/api/nbos/cluster")["servers"]):
                    if time.time() > deadline:
                        raise SystemExit("warm pools did not refill")
                    time.sleep(0.05)
            with concurrent.futures.ThreadPoolExecutor(burst) as pool:
                started = list(pool.map(lambda _: timed_start(c), range(burst)))
            for kernel_id, ms in started:
                times_ms.append(ms)
                status, _ = c.request("DELETE", f"/api/kernels/{kernel_id}")
                if status != 204:
                    raise SystemExit(f"DELETE answered {status}")
        servers = c.get("/api/nbos/cluster")["servers"]
        launches = {k: sum(s["warm_pool"][k] for s in servers) for k in ("promoted", "cold")}
    finally:
        rc = c.stop()
        left = c.nbos_processes()
    if rc != 0 or left:
        raise SystemExit(f"nbos up exited {rc}; left behind: {left}")
    return times_ms, launches


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nbos", default="build/bin/nbos")
    parser.add_argument("--starts", type=int, default=10)
    args = parser.parse_args()
    os.environ["NBOS_BIN"] = os.path.abspath(args.nbos)
    from cluster import Cluster

    # "on" needs root and bubblewrap; elsewhere "auto" measures what this machine can do.
    sandbox = "on" if os.geteuid() == 0 else "auto"
    results = {}
    for name, pool in (("cold", 0), ("warm", 1)):
        for box in ("off", sandbox):
            results[f"{name}, sandbox {box}"] = measure(Cluster, pool, args.starts, box)
    for pool in (1, 2):
        results[f"burst of 2, pool {pool}"] = measure(Cluster, pool, args.starts, "off", burst=2)
    print(f"kernel start (POST /api/kernels until 3 replicas answer), {args.starts} starts each")
    print(f"{'':22} {'p50 ms':>8} {'p90 ms':>8} {'mean ms':>8}  launches")
    for name, (times, launches) in results.items():
        print(f"{name:22} {statistics.median(times):8.0f} {percentile(times, 90):8.0f} "
              f"{statistics.mean(times):8.0f}  warm {launches['promoted']}, cold {launches['cold']}")
    p50 = {name: statistics.median(times) for name, (times, _) in results.items()}
    print(f"warm / cold at p50 (sandbox off): "
          f"{p50['warm, sandbox off'] / p50['cold, sandbox off']:.2f}x")
    for name in ("cold", "warm"):
        print(f"{name}: sandbox {sandbox} / off at p50: "
              f"{p50[f'{name}, sandbox {sandbox}'] / p50[f'{name}, sandbox off']:.2f}x")


if __name__ == "__main__":
    main()
