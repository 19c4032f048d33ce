"""GPUs are scarce: 4 servers x 2 GPUs, 6 kernels that each want 2 GPUs per cell. Cells wait for
GPUs and run on whichever replica's server can grant them; no GPU is ever held by two cells at
once, and every grant is released."""

import threading
import time

from cluster import KernelSocket

KERNELS = 6
CELLS = 4


def test_cells_share_scarce_gpus_without_double_grants(cluster):
    kernel_ids = [cluster.start_kernel({"KERNEL_GPUS": "2"}) for _ in range(KERNELS)]
    results = {k: [] for k in kernel_ids}
    errors = []

    def run(kernel_id):
        try:
            ks = KernelSocket(cluster.url, kernel_id, cluster.token)
            for i in range(CELLS):
                reply, iopub = ks.execute(
                    f"import os, time\ntime.sleep(0.7)\nprint(os.environ['NBOS_GPU_IDS'])\nn{i} = {i}")
                printed = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
                results[kernel_id].append((reply, printed))
            ks.close()
        except Exception as e:  # reported below
            errors.append(f"{kernel_id}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=run, args=(k,)) for k in kernel_ids]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    assert not errors, errors

    holds = {}  # (server, gpu) -> [(from, to, kernel)]
    moved = 0
    for kernel_id, cells in results.items():
        assert len(cells) == CELLS
        executors = []
        for reply, printed in cells:
            assert reply["content"]["status"] == "ok", reply["content"]
            nbos = reply["metadata"]["nbos"]
            assert len(nbos["gpu_ids"]) == 2
            assert printed == ",".join(str(g) for g in nbos["gpu_ids"]) + "\n"
            hops = nbos["gateway_us"]
            for gpu in nbos["gpu_ids"]:
                holds.setdefault((nbos["server"], gpu), []).append(
                    (hops["planned"], hops["releasing"], kernel_id))
            executors.append(nbos["executor"])
        moved += sum(1 for a, b in zip(executors, executors[1:]) if a != b)
    for device, spans in holds.items():
        spans.sort()
        for (a_from, a_to, a_kernel), (b_from, b_to, b_kernel) in zip(spans, spans[1:]):
            assert b_from >= a_to, f"GPU {device} held by {a_kernel} and {b_kernel} at once"
    assert moved > 0, "no cell ran on another replica although GPUs were scarce"

    # Every grant released: the gateway's view and the daemons' own ledgers.
    deadline = time.time() + 15
    while True:
        servers = cluster.get("/api/nbos/cluster")["servers"]
        if all(s["gpus_committed"] == 0 and s["daemon_gpus_committed"] == 0 for s in servers):
            break
        assert time.time() < deadline, servers
        time.sleep(0.2)
    for kernel_id in kernel_ids:
        assert cluster.request("DELETE", f"/api/kernels/{kernel_id}")[0] == 204
