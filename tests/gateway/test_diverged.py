"""A replica that cannot follow its kernel's log (a value of a cell could not be rebuilt on it)
never leaves a cell without an answer: a cell routed to it is answered within 2 s with what
failed, for which name; it is left out of executor choice, shown in the cluster view and replaced
through the self-healing path, and the kernel goes on with three live replicas that hold the
value."""

import os
import shutil
import tempfile
import time

import pytest

from cluster import Cluster, KernelSocket

# A value whose rebuild fails on the replicas FLAG lists (the function is the notebook's, so it
# travels by value with the delta).
PICKY = """
import os
FLAG = {flag!r}

def rebuild_picky(origin):
    here = os.environ["NBOS_REPLICA_ID"]
    if os.path.exists(FLAG) and here in open(FLAG).read().split():
        raise RuntimeError("picky refuses replica " + here)
    return Picky()

class Picky:
    def __reduce__(self):
        return (rebuild_picky, (os.environ["NBOS_REPLICA_ID"],))
    def __repr__(self):
        return "picky"

x = Picky()
"""


@pytest.fixture(scope="module")
def share():
    # Readable by every replica's sandbox (bound in), whatever its user id.
    path = tempfile.mkdtemp(prefix="nbos-diverged-", dir="/var/tmp")
    os.chmod(path, 0o755)
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="module")
def cluster(share):
    c = Cluster(hosts=4, gpus_per_host=1, extra=("--sandbox-share", share))
    yield c
    c.stop()


def kernel_view(c, kernel_id):
    return next(k for k in c.get("/api/nbos/cluster")["kernels"] if k["id"] == kernel_id)


def wait_for(what, predicate, timeout=90):
    deadline = time.time() + timeout
    while True:
        value = predicate()
        if value:
            return value
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def diverged_replicas(c, kernel_id):
    return [r["replica_id"] for r in kernel_view(c, kernel_id)["replicas"]
            if "diverged" in r and r["state"] == "live"]


def test_a_replica_that_cannot_rebuild_a_value_answers_at_once_and_is_replaced(cluster, share):
    flag = os.path.join(share, "refuse")
    with open(flag, "w") as f:
        f.write("2 3")
    kernel_id = cluster.start_kernel()
    ks = KernelSocket(cluster.url, kernel_id, cluster.token)
    try:
        reply, _ = ks.execute(PICKY.format(flag=flag), metadata={"nbos": {"target_replica": 1}})
        assert reply["content"]["status"] == "ok", reply["content"]

        # A cell routed to one of them is answered at once, saying what failed for which name.
        # (Self-healing replaces them meanwhile: a cell for one already gone runs elsewhere.)
        for _ in range(10):
            target = wait_for("a replica shown diverged",
                              lambda: diverged_replicas(cluster, kernel_id))[0]
            started = time.monotonic()
            reply, iopub = ks.execute("print('ran')", metadata={"nbos": {"target_replica": target}})
            took = time.monotonic() - started
            if reply["metadata"]["nbos"].get("executor") == target:
                break
        content = reply["content"]
        assert content["status"] == "error" and content["ename"] == "ReplicaOutOfSync", content
        assert "'x'" in content["evalue"] and f"picky refuses replica {target}" in content["evalue"]
        assert "did not run" in content["evalue"]
        assert not [m for m in iopub if m["msg_type"] == "stream"]
        assert took < 2.0, f"answered after {took:.1f} s"

        # Both are replaced; the new replicas rebuild `x` from the log and run cells.
        def healed():
            k = kernel_view(cluster, kernel_id)
            ids = {r["replica_id"] for r in k["replicas"]}
            ok = (len(ids) == 3 and ids.isdisjoint({2, 3}) and not k["migration"] and
                  all(r["state"] == "live" and r["reachable"] and "diverged" not in r
                      for r in k["replicas"]))
            return ids if ok else None
        ids = wait_for("the diverged replicas to be replaced", healed)
        events = cluster.get("/api/nbos/cluster")["events"]
        assert any(e["kind"] == "replica-diverged" and e["kernel_id"] == kernel_id
                   for e in events), events
        for rid in sorted(ids):
            reply, iopub = ks.execute("print(repr(x))", metadata={"nbos": {"target_replica": rid}})
            text = "".join(m["content"].get("text", "") for m in iopub
                           if m["msg_type"] == "stream")
            assert reply["content"]["status"] == "ok", (rid, reply["content"])
            assert reply["metadata"]["nbos"]["executor"] == rid
            assert text == "picky\n", (rid, text)
    finally:
        ks.close()
