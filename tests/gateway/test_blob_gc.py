"""The blob store returns to what live kernels hold (blob_gc.h): on `nbos up` with a short
collection interval and grace, three kernels each keep an array of a few MB in the store; one is
deleted, one restarted (its namespace starts empty and gets a new array), and the third is
suspended while idle (its state lives on in a checkpoint blob). The deleted and restarted
kernels' arrays leave the store, the live ones stay, the metrics say what was freed and that
everything stored is needed, and the suspended kernel resumes on new replicas that read its array
back from the store."""

import glob
import os
import re
import signal
import time
import urllib.request

from cluster import Cluster, KernelSocket

GRACE_S = "3"
CELL = "import numpy as np\nv = np.random.default_rng({seed}).random(300_000)\nprint(float(v.sum()))"


def metric_values(cluster, name):
    req = urllib.request.Request(cluster.url + "/metrics",
                                 headers={"Authorization": f"token {cluster.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    return {m.group(1) or "": float(m.group(2))
            for m in re.finditer(rf"^{name}(\{{[^}}]*\}})? (\S+)$", text, re.M)}


def stored(blobs_dir):
    """Blob key -> size of every blob in the directory store."""
    out = {}
    for fan in os.listdir(blobs_dir):
        if len(fan) != 2 or not os.path.isdir(os.path.join(blobs_dir, fan)):
            continue
        for name in os.listdir(os.path.join(blobs_dir, fan)):
            if re.fullmatch(r"[0-9a-f]{64}", name):
                out[name] = os.path.getsize(os.path.join(blobs_dir, fan, name))
    return out


def run(ks, code):
    reply, iopub = ks.execute(code)
    assert reply["content"]["status"] == "ok", reply["content"]
    return "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")


def array_blob(cluster, blobs_dir, ks, seed):
    """Runs the cell that makes the array; returns (printed sum, key of its blob)."""
    before = stored(blobs_dir)
    text = run(ks, CELL.format(seed=seed))
    new = {k: size for k, size in stored(blobs_dir).items() if k not in before}
    assert new, "the array did not go to the store"
    # The array's buffer is by far the largest blob the cell wrote.
    return text, max(new, key=new.get)


def test_the_store_returns_to_what_live_kernels_hold():
    c = Cluster(hosts=3, gpus_per_host=1,
                extra=("--blob-gc-interval-s", "1", "--blob-gc-grace-s", GRACE_S,
                       "--idle-suspend-minutes", "0.1"))
    blobs_dir = c.state_dir + "/blobs"
    sockets = []
    try:
        kernels, sums, keys = {}, {}, {}
        for name, seed in (("deleted", 1), ("restarted", 2), ("suspended", 3)):
            kernels[name] = c.start_kernel()
            sockets.append(KernelSocket(c.url, kernels[name], c.token))
            sums[name], keys[name] = array_blob(c, blobs_dir, sockets[-1], seed)
        held_while_live = stored(blobs_dir)

        status, _ = c.request("DELETE", f"/api/kernels/{kernels['deleted']}")
        assert status == 204
        status, body = c.request("POST", f"/api/kernels/{kernels['restarted']}/restart")
        assert status == 200, (status, body)
        restarted = KernelSocket(c.url, kernels["restarted"], c.token)
        sockets.append(restarted)
        assert "NameError" in restarted.execute("v")[0]["content"].get("ename", "")
        sums["after restart"], keys["after restart"] = array_blob(c, blobs_dir, restarted, 4)

        # The third kernel is suspended once idle 6 s: its state is then only its checkpoint and
        # the blobs that names.
        deadline = time.time() + 60
        while not [k for k in c.get("/api/nbos/cluster")["kernels"]
                   if k["id"] == kernels["suspended"] and k["suspended"]]:
            assert time.time() < deadline, "the idle kernel was not suspended"
            time.sleep(0.5)

        # Every blob still stored is needed by a kernel, and the dropped arrays are gone.
        deadline = time.time() + 120
        while True:
            held = stored(blobs_dir)
            bytes_ = metric_values(c, "nbos_blob_store_bytes")
            rounds = metric_values(c, "nbos_blob_gc_rounds_total")
            settled = (keys["deleted"] not in held and keys["restarted"] not in held and
                       bytes_.get('{kind="stored"}') == bytes_.get('{kind="referenced"}') and
                       bytes_.get('{kind="stored"}') == sum(held.values()))
            if settled:
                break
            assert time.time() < deadline, (bytes_, rounds, sorted(held), keys)
            time.sleep(0.5)
        assert keys["suspended"] in held and keys["after restart"] in held, (keys, sorted(held))
        freed = metric_values(c, "nbos_blob_gc_freed_bytes_total")[""]
        assert freed >= held_while_live[keys["deleted"]] + held_while_live[keys["restarted"]]
        assert metric_values(c, "nbos_blob_gc_deleted_total")[""] >= 2
        assert rounds['{outcome="complete"}'] >= 1 and rounds['{outcome="failed"}'] == 0, rounds

        # The suspended kernel's next cell resumes it on new replicas, from the store.
        assert run(sockets[2], "print(float(v.sum()))") == sums["suspended"]
        assert run(restarted, "print(float(v.sum()))") == sums["after restart"]
    finally:
        for ks in sockets:
            ks.close()
        c.stop()


def replica_pid(kernel_id, replica_id):
    """The host pid of a kernel's replica: the process writing its replica log."""
    suffix = f"/{kernel_id}-{replica_id}/replica.log"
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            if argv[1:2] != [b"replica"]:
                continue
            if any(os.readlink(f"/proc/{p}/fd/{fd}").endswith(suffix)
                   for fd in os.listdir(f"/proc/{p}/fd")):
                return int(p)
        except OSError:
            continue
    raise AssertionError(f"no process for replica {replica_id} of {kernel_id}")


def test_a_blob_only_an_old_log_entry_names_stays_for_a_lagging_replica():
    """Replica 3 is frozen while replica 1 replaces an array twice and runs enough cells for a
    checkpoint to drop those deltas from the journal: the first replacement's blob is then named
    only by log entries replica 3 has yet to apply. It stays through several collection rounds,
    and replica 3, thawed, applies every entry and holds the last array."""
    c = Cluster(hosts=3, gpus_per_host=1,
                extra=("--blob-gc-interval-s", "1", "--blob-gc-grace-s", "2"))
    blobs_dir = c.state_dir + "/blobs"
    ks, frozen = None, None
    on_1 = {"nbos": {"target_replica": 1}}
    try:
        kid = c.start_kernel()
        ks = KernelSocket(c.url, kid, c.token)
        for code in (CELL.format(seed=10), "print(1)"):
            assert ks.execute(code, metadata=on_1)[0]["content"]["status"] == "ok"
        frozen = replica_pid(kid, 3)
        os.kill(frozen, signal.SIGSTOP)
        before = stored(blobs_dir)
        assert ks.execute(CELL.format(seed=11), metadata=on_1)[0]["content"]["status"] == "ok"
        first = {k: s for k, s in stored(blobs_dir).items() if k not in before}
        first_key = max(first, key=first.get)
        reply, iopub = ks.execute(CELL.format(seed=12), metadata=on_1)
        assert reply["content"]["status"] == "ok"
        last_sum = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
        for i in range(70):  # past checkpoint_every (64) journal records
            assert ks.execute(f"n = {i}", metadata=on_1)[0]["content"]["status"] == "ok"
        rounds = lambda: metric_values(c, "nbos_blob_gc_rounds_total").get(
            '{outcome="complete"}', 0)
        start, deadline = rounds(), time.time() + 120
        while rounds() < start + 3:
            assert time.time() < deadline, metric_values(c, "nbos_blob_gc_rounds_total")
            time.sleep(0.5)
        assert first_key in stored(blobs_dir), "a blob a lagging replica needs was deleted"

        os.kill(frozen, signal.SIGCONT)
        frozen = None
        # Once the gateway hears from it again, a cell targeted at it runs there.
        on_3, deadline = {"nbos": {"target_replica": 3}}, time.time() + 60
        while True:
            reply, iopub = ks.execute("print(float(v.sum()))", metadata=on_3)
            assert reply["content"]["status"] == "ok", reply["content"]
            if reply["metadata"]["nbos"]["executor"] == 3:
                break
            assert time.time() < deadline, "replica 3 did not come back"
            time.sleep(1)
        assert "".join(m["content"]["text"] for m in iopub
                       if m["msg_type"] == "stream") == last_sum
        log = open(glob.glob(f"{c.state_dir}/host-*/replicas/{kid}-3/replica.log")[0]).read()
        assert "could not rebuild" not in log, log[-3000:]
    finally:
        if frozen:
            os.kill(frozen, signal.SIGCONT)
        if ks:
            ks.close()
        c.stop()
