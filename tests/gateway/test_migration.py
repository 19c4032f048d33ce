"""Live migration (DESIGN.md §5): when no server holding one of a kernel's replicas has idle GPUs,
the gateway adds a replica on a server that has them to the kernel's Raft group, lets it catch
up, removes the old one, and the waiting cell runs on the new replica with the kernel's state."""

import contextlib
import os
import subprocess
import tempfile
import time

from cluster import Cluster, KernelSocket, nbos_bin, split_cluster

HOSTS = 4


def replicas_of(c, kernel_id):
    """The kernel's group members by id (a replica a migration is still adding is left out)."""
    kernel = next(k for k in c.get("/api/nbos/cluster")["kernels"] if k["id"] == kernel_id)
    return {r["replica_id"]: r for r in kernel["replicas"] if r["state"] != "joining"}


def occupy(c, servers, kernels, busy):
    """Holds the GPU of each of `servers` with a long cell of another kernel (started here and
    appended to `kernels`); appends (kernel id, socket, msg id) of each cell to `busy`."""
    to_fill = set(servers)
    for _ in range(8):
        if not to_fill:
            break
        other = c.start_kernel({"KERNEL_GPUS": "1"})
        kernels.append(other)
        for rid, r in sorted(replicas_of(c, other).items()):
            if r["server_id"] in to_fill:
                sock = KernelSocket(c.url, other, c.token)
                msg_id = sock.send("execute_request", {
                    "code": "import time\nfor _ in range(1200): time.sleep(0.1)",
                    "silent": False, "store_history": True, "user_expressions": {},
                    "allow_stdin": False, "stop_on_error": True},
                    metadata={"nbos": {"target_replica": rid}})
                busy.append((other, sock, msg_id))
                to_fill.discard(r["server_id"])
                break
    assert not to_fill, f"could not occupy {to_fill}"


@contextlib.contextmanager
def journaled_cluster(*extra):
    """A 4 x 1 GPU `nbos up` with a decision journal. Yields (cluster, kernels, busy): kernels
    started and (kernel id, socket, msg id) of cells still running, both cleaned up at the end;
    then checks that nothing is left running and that the journal replays through `nbos sim`.
    Puts the journal's text into the yielded cluster's `journal_text` after the exit. With
    NBOS_TEST_NETNS=1 the gateway and each daemon run in a network namespace of their own."""
    journal = tempfile.mktemp(prefix="nbos-journal-", suffix=".jsonl")
    if os.environ.get("NBOS_TEST_NETNS") == "1":
        c = split_cluster(HOSTS, gateway_args=("--decision-journal", journal, *extra))
    else:
        c = Cluster(hosts=HOSTS, gpus_per_host=1, extra=("--decision-journal", journal, *extra))
    kernels, busy = [], []
    try:
        yield c, kernels, busy
    finally:
        for (_, sock, _) in busy:
            sock.close()
        for k in kernels:
            c.request("DELETE", f"/api/kernels/{k}")
        assert c.stop() == 0
    assert not c.nbos_processes()
    done = subprocess.run([nbos_bin(), "sim", "replay", "--journal", journal],
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    with open(journal) as f:
        c.journal_text = f.read()


def release(c, busy):
    """Interrupts the long cells in `busy` and waits for their replies."""
    for (other, sock, msg_id) in busy:
        assert c.request("POST", f"/api/kernels/{other}/interrupt", {})[0] == 204
        reply, _ = sock.wait_for(msg_id)
        assert reply["content"]["status"] == "error"
        sock.close()
    busy.clear()


def replica_processes(replica_dir_name):
    """Pids whose working directory is a replica directory of that name."""
    pids = []
    for pid in os.listdir("/proc"):
        if pid.isdigit():
            try:
                if os.readlink(f"/proc/{pid}/cwd").endswith("/" + replica_dir_name):
                    pids.append(int(pid))
            except OSError:
                pass
    return pids


def test_a_cell_without_gpus_on_its_servers_runs_on_a_migrated_replica():
    with journaled_cluster() as (c, kernels, busy):
        a = c.start_kernel({"KERNEL_GPUS": "1", "KERNEL_MARK": "moved"})
        kernels.append(a)
        ks = KernelSocket(c.url, a, c.token)
        reply, _ = ks.execute("x = 42\nimport array\nbig = array.array('d', range(200000))")
        assert reply["content"]["status"] == "ok", reply["content"]
        a_servers = {r["server_id"]: rid for rid, r in replicas_of(c, a).items()}
        free = ({f"host-{i}" for i in range(1, HOSTS + 1)} - set(a_servers)).pop()

        # Hold the GPU of every server of kernel a with long cells of other kernels.
        occupy(c, set(a_servers), kernels, busy)
        deadline = time.time() + 60
        while True:
            servers = {s["server_id"]: s for s in c.get("/api/nbos/cluster")["servers"]}
            if all(servers[s]["gpus_committed"] == 1 for s in a_servers):
                break
            assert time.time() < deadline, servers
            time.sleep(0.1)
        assert servers[free]["gpus_committed"] == 0

        reply, iopub = ks.execute("print(x + 1, len(big))")
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
        assert text == "43 200000\n", text
        nbos = reply["metadata"]["nbos"]
        assert nbos["server"] == free, nbos
        now = replicas_of(c, a)
        assert len(now) == 3
        assert nbos["executor"] in now and now[nbos["executor"]]["server_id"] == free
        assert nbos["executor"] not in a_servers.values(), "the executor is a new replica"
        # The new replica was started with the kernel's start environment.
        reply, iopub = ks.execute("import os\nprint(os.environ.get('KERNEL_MARK'))",
                                  metadata={"nbos": {"target_replica": nbos["executor"]}})
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
        assert text == "moved\n", text
        gone = set(a_servers.values()) - set(now)
        assert len(gone) == 1, (a_servers, now)
        # The old replica's process is stopped; the kernel keeps working on its new group.
        old_dir = f"{a}-{gone.pop()}"
        deadline = time.time() + 30
        while replica_processes(old_dir):
            assert time.time() < deadline, "the migrated replica's process outlived it"
            time.sleep(0.2)
        view = c.get("/api/nbos/cluster")
        assert view["migrations"]["done"] >= 1, view["migrations"]
        release(c, busy)
        # Any replica of the new group can still execute.
        for rid in sorted(now):
            reply, _ = ks.execute("x", metadata={"nbos": {"target_replica": rid}})
            assert reply["content"]["status"] == "ok", (rid, reply["content"])
        ks.close()
    assert ('"event":"replica_added"' in c.journal_text
            and '"event":"replica_removed"' in c.journal_text)


def test_an_idle_kernel_is_moved_to_a_server_with_gpus_before_its_next_cell():
    """With --rebalance-interval-ms, a kernel that is idle while every server of its replicas has
    its GPUs held gets a replica moved to the free server between cells, so its next cell starts
    there without a migration on its path."""
    with journaled_cluster("--rebalance-interval-ms", "300") as (c, kernels, busy):
        a = c.start_kernel({"KERNEL_GPUS": "1"})
        kernels.append(a)
        ks = KernelSocket(c.url, a, c.token)
        reply, _ = ks.execute("x = 42")
        assert reply["content"]["status"] == "ok"
        a_servers = {r["server_id"] for r in replicas_of(c, a).values()}
        free = ({f"host-{i}" for i in range(1, HOSTS + 1)} - a_servers).pop()
        occupy(c, a_servers, kernels, busy)
        # No cell of kernel a is sent: the move happens while it is idle.
        deadline = time.time() + 60
        while free not in {r["server_id"] for r in replicas_of(c, a).values()}:
            assert time.time() < deadline, (free, replicas_of(c, a))
            time.sleep(0.2)
        done = c.get("/api/nbos/cluster")["migrations"]["done"]
        assert done >= 1
        reply, iopub = ks.execute("print(x + 1)")
        assert reply["content"]["status"] == "ok", reply["content"]
        assert reply["metadata"]["nbos"]["server"] == free
        text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
        assert text == "43\n"
        # The cell found its GPU on a replica's server: no further migration for it.
        migrated = c.get("/api/nbos/cluster")["migrations"]
        assert migrated["done"] == done and migrated["failed"] == 0, migrated
        release(c, busy)
        ks.close()
    assert '"rebalance":[{' in c.journal_text
