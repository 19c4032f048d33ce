"""A server cut off by the network (DESIGN.md §5): each daemon and its replicas run in their own
network namespace behind a bridge, and nftables drops every packet of one of them. The majority
goes on without it, the cut-off replica never executes a cell (each cell marks a file named after
the replica that ran it), the gateway replaces it on the spare server, and once the cut heals the
stale replica is stopped and every live replica holds the same namespace."""

import os
import shutil
import tempfile
import time

import pytest

from cluster import KernelSocket, NetnsCluster, rest_call

HOSTS = 4


def _can_make_namespaces():
    return os.geteuid() == 0 and shutil.which("ip") and shutil.which("nft")


pytestmark = pytest.mark.skipif(not _can_make_namespaces(),
                                reason="needs root, iproute2 and nftables (scripts/bootstrap)")


@pytest.fixture
def cluster():
    # Cells record which replica ran them in a directory every sandbox may write.
    marks = tempfile.mkdtemp(prefix="nbos-marks-")
    os.chmod(marks, 0o1777)
    c = NetnsCluster(HOSTS, daemon_args=("--sandbox-share", marks))
    c.marks = marks
    try:
        yield c
    finally:
        c.close()
        shutil.rmtree(marks, ignore_errors=True)


def mark(marks, tag):
    """A cell that counts and records which replica ran it."""
    return (f"n = globals().get('n', 0) + 1\n"
            f"import os\n"
            f"with open(os.path.join({marks!r}, os.environ['NBOS_REPLICA_ID']), 'a') as f:\n"
            f"    f.write('{tag},')\n")


def kernel_view(c, kernel_id):
    status, body = rest_call(c.url, c.token, "GET", "/api/nbos/cluster")
    assert status == 200, body
    return next(k for k in body["kernels"] if k["id"] == kernel_id)


def run(ks, code, **kw):
    reply, iopub = ks.execute(code, **kw)
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    return reply["metadata"]["nbos"]["executor"], text


def test_a_cut_off_server_executes_nothing_and_the_kernel_is_whole_after_the_cut(cluster):
    c = cluster
    marks = c.marks
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    kid = model["id"]
    ks = KernelSocket(c.url, kid, c.token)
    executor, _ = run(ks, mark(marks, "c1") + "import numpy as np\na = np.arange(10_000) * 7\n")
    servers = {r["replica_id"]: r["server_id"] for r in kernel_view(c, kid)["replicas"]}
    cut_replica, cut_server = executor, servers[executor]
    cut_host = int(cut_server.split("-")[1])

    # The executor's server is cut off. The next cell was meant for it (the gateway does not know
    # yet): it runs on the majority side, or, once the gateway sees the server lost, is answered
    # with a clear error and did not run; then it runs on the majority side.
    c.net.cut(cut_host)
    reply, _ = ks.execute(mark(marks, "c2"))
    if reply["content"]["status"] != "ok":
        assert reply["content"]["ename"] == "CellCancelled", reply["content"]
        assert "did not run" in reply["content"]["evalue"], reply["content"]
        reply, _ = ks.execute(mark(marks, "c2"))
        assert reply["content"]["status"] == "ok", reply["content"]
    assert reply["metadata"]["nbos"]["executor"] != cut_replica

    # The gateway sees the server lost and replaces its replica on the spare server.
    deadline, seen = time.time() + 90, set()
    while True:
        replicas = {r["replica_id"]: r for r in kernel_view(c, kid)["replicas"]}
        seen.update(r["state"] for r in replicas.values())
        if (cut_replica not in replicas and len(replicas) == 3
                and all(r["state"] == "live" and r["reachable"] for r in replicas.values())):
            break
        assert time.time() < deadline, f"the cut-off replica was not replaced: {replicas}"
        time.sleep(0.2)
    assert "lost" in seen or "leaving" in seen, seen
    assert cut_server not in {r["server_id"] for r in replicas.values()}
    run(ks, mark(marks, "c3"))

    # The cut heals: the stale replica is stopped, not let back in.
    c.net.heal(cut_host)
    deadline = time.time() + 60
    while c.host_replicas(cut_host):
        assert time.time() < deadline, "the stale replica still runs after the cut healed"
        time.sleep(0.2)
    run(ks, mark(marks, "c4"))

    # Each cell ran exactly once, and never on the cut-off replica after the cut.
    ran = {}
    for name in os.listdir(marks):
        with open(os.path.join(marks, name)) as f:
            for tag in filter(None, f.read().split(",")):
                ran.setdefault(tag, []).append(int(name))
    assert sorted(ran) == ["c1", "c2", "c3", "c4"], ran
    assert all(len(r) == 1 for r in ran.values()), f"a cell ran twice: {ran}"
    assert ran["c1"] == [cut_replica]
    assert cut_replica not in ran["c2"] + ran["c3"] + ran["c4"], ran

    # Every live replica holds the same namespace.
    seen_state = {}
    for rid in sorted(replicas):
        executor, text = run(ks, "print(n, int(a.sum()))",
                             metadata={"nbos": {"target_replica": rid}})
        assert executor == rid
        seen_state[rid] = text
    assert set(seen_state.values()) == {f"4 {sum(range(10_000)) * 7}\n"}, seen_state
    ks.close()
    assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")[0] == 204
    c.wait_no_replicas()
