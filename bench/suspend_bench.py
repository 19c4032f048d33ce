#!/usr/bin/python3
"""Suspend and resume of idle kernels, each round on a fresh cluster (a gateway with
--idle-suspend-minutes 0.05 and 3 daemons started one by one), for a kernel with small state and
one holding --big-mb of torch tensors:

  cell       baseline: a cell on the running kernel (execute_request -> reply)
  suspend    the gateway's suspension: checkpoint to the blob store, replicas stopped
  resume     a cell on the suspended kernel: execute_request -> reply, three replicas started
             from the checkpoint on the way (the gateway's own figure beside it)
  cull       what a peer that culls idle kernels costs instead: a new kernel started and the
             state rebuilt by running its cell again (the state is lost, not restored)

    /usr/bin/python3 bench/suspend_bench.py [--nbos build/bin/nbos] [--rounds N] [--big-mb M]
"""

import argparse
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "gateway"))

from healing_bench import wait  # noqa: E402

CHECK = "print(len(names), flush=True)"


def state_cell(big_mb):
    if big_mb == 0:
        return "names = {f'v{i}': list(range(i)) for i in range(100)}"
    return (f"import torch\nnames = {{f't{{i}}': torch.ones({big_mb} << 16) * i "
            f"for i in range(4)}}")  # 4 tensors of big_mb/4 MB each


def timed_cell(ks, code):
    started = time.time()
    reply, _ = ks.execute(code)
    assert reply["content"]["status"] == "ok", reply["content"]
    return (time.time() - started) * 1000


def one_round(SplitCluster, KernelSocket, rest_call, big_mb):
    c = SplitCluster(hosts=3, gateway_args=("--idle-suspend-minutes", "0.05"))
    view = lambda: rest_call(c.url, c.token, "GET", "/api/nbos/cluster")[1]  # noqa: E731
    try:
        kid = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})[1]["id"]
        ks = KernelSocket(c.url, kid, c.token)
        cull_rebuild_ms = timed_cell(ks, state_cell(big_mb))
        cell_ms = timed_cell(ks, CHECK)
        wait(lambda: view()["suspensions"]["suspended"] == 1, "the suspension")
        suspend_ms = view()["suspensions"]["suspend_ms"][0]
        resume_ms = timed_cell(ks, CHECK)
        gateway_resume_ms = view()["suspensions"]["resume_ms"][0]
        ks.close()
        # A peer's culled kernel: a new kernel, and the state computed again.
        started = time.time()
        fresh = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})[1]["id"]
        ks = KernelSocket(c.url, fresh, c.token)
        start_ms = (time.time() - started) * 1000
        cull_ms = start_ms + timed_cell(ks, state_cell(big_mb))
        ks.close()
        return cell_ms, suspend_ms, resume_ms, gateway_resume_ms, cull_ms
    finally:
        c.ps.stop()


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nbos", default="build/bin/nbos")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--big-mb", type=int, default=256)
    args = parser.parse_args()
    os.environ["NBOS_BIN"] = os.path.abspath(args.nbos)
    from cluster import KernelSocket, SplitCluster, rest_call

    for big_mb, label in ((0, "small state (100 lists)"), (args.big_mb, f"{args.big_mb} MB of "
                                                                           "torch tensors")):
        rows = [one_round(SplitCluster, KernelSocket, rest_call, big_mb)
                for _ in range(args.rounds)]
        print(f"{label}, {args.rounds} rounds (p50 / max, ms):")
        names = ("cell", "suspend", "resume", "  gateway's", "cull+rerun")
        for i, name in enumerate(names):
            values = [r[i] for r in rows]
            print(f"  {name:12} {statistics.median(values):8.0f} / {max(values):8.0f}")
        ratio = statistics.median(r[2] for r in rows) / statistics.median(r[0] for r in rows)
        print(f"  resume is {ratio:.0f}x a cell on the running kernel")


if __name__ == "__main__":
    main()
