"""Auto-scaling on `nbos up --max-hosts` (DESIGN.md §5): cells that need more GPUs than the
initial servers have make the cluster grow (the gateway's local host provider starts `nbos
daemon` processes), every cell runs, and idleness shrinks the cluster back to --hosts by moving
standby replicas off idle servers first. No server holding committed GPUs is ever removed, and
the decision journal of the run replays through `nbos sim replay`."""

import json
import subprocess
import tempfile
import threading
import time

from cluster import Cluster, KernelSocket, nbos_bin

HOSTS, MAX_HOSTS = 3, 5


def servers(c):
    return {s["server_id"]: s for s in c.get("/api/nbos/cluster")["servers"]}


def committed_at_removal(journal_text):
    """For each server_left in the journal: the GPUs committed on that server then (from the
    journaled grants and releases)."""
    committed, out = {}, []
    for line in journal_text.splitlines()[1:]:
        record = json.loads(line)
        if record["outcome"]["status"]["code"] != "ok":
            continue
        event, data = record["event"], record["input"]
        if event in ("grant_committed", "grant_released"):
            sign = 1 if event == "grant_committed" else -1
            server = data["server_id"]
            committed[server] = committed.get(server, 0) + sign * data["resources"]["gpus"]
        elif event == "server_left":
            out.append((data["server_id"], committed.get(data["server_id"], 0)))
    return out


def test_the_cluster_grows_for_cells_and_shrinks_back_when_idle():
    journal = tempfile.mktemp(prefix="nbos-journal-", suffix=".jsonl")
    c = Cluster(hosts=HOSTS, gpus_per_host=1,
                extra=("--max-hosts", str(MAX_HOSTS), "--scaling-interval-ms", "1000",
                       "--decision-journal", journal))
    kernels, sockets = [], []
    try:
        assert len(servers(c)) == HOSTS
        for _ in range(HOSTS + 1):
            kernels.append(c.start_kernel({"KERNEL_GPUS": "1"}))
            sockets.append(KernelSocket(c.url, kernels[-1], c.token))
        # One more cell needing a GPU than the cluster has GPUs, all at once.
        results, errors = {}, []

        def run(i):
            try:
                results[i] = sockets[i].execute(
                    "import time, os\ntime.sleep(6)\nprint(os.environ['NBOS_GPU_IDS'], end='')")
            except Exception as e:  # noqa: BLE001 - reported below
                errors.append(repr(e))

        threads = [threading.Thread(target=run, args=(i,)) for i in range(len(sockets))]
        for t in threads:
            t.start()
        most, pending_seen = HOSTS, False
        while any(t.is_alive() for t in threads):
            view = c.get("/api/nbos/cluster")
            most = max(most, len(view["servers"]))
            pending_seen |= bool(view["pending_servers"])
            time.sleep(0.1)
        assert not errors, errors
        for i, (reply, _) in results.items():
            assert reply["content"]["status"] == "ok", (i, reply["content"])
        assert most > HOSTS, "the cluster did not grow"
        view = c.get("/api/nbos/cluster")
        assert view["scaling"]["scale_outs"] >= 1, view["scaling"]
        print(f"grew to {most} servers (pending seen: {pending_seen}); "
              f"events: {view['scaling']['events']}")

        # Idle: the cluster shrinks back to --hosts.
        deadline = time.time() + 120
        while len(servers(c)) > HOSTS or c.get("/api/nbos/cluster")["pending_servers"]:
            assert time.time() < deadline, c.get("/api/nbos/cluster")
            time.sleep(0.5)
        view = c.get("/api/nbos/cluster")
        assert view["scaling"]["scale_ins"] >= 1, view["scaling"]
        for k in view["kernels"]:
            assert len(k["replicas"]) == 3, k
            assert all(r["state"] == "live" for r in k["replicas"]), k
            assert {r["server_id"] for r in k["replicas"]} <= set(servers(c)), k
        # Every kernel still runs cells, with its state.
        for ks in sockets:
            reply, _ = ks.execute("x = 1")
            assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        for ks in sockets:
            ks.close()
        for k in kernels:
            c.request("DELETE", f"/api/kernels/{k}")
        assert c.stop() == 0
    assert not c.nbos_processes(), c.nbos_processes()
    done = subprocess.run([nbos_bin(), "sim", "replay", "--journal", journal],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(journal) as f:
        removals = committed_at_removal(f.read())
    assert removals, "no server_left in the journal"
    assert all(gpus == 0 for _, gpus in removals), removals
