"""Idle kernels cost nothing and keep their state (DESIGN.md §5): with --idle-suspend-minutes a
kernel idle that long is checkpointed to the blob store and its replicas stopped (their
resources released); a client still connected keeps its WebSocket, kernel_info does not wake the
kernel, and the next cell resumes it on three new replicas with the namespace intact (per-name
digests on every replica), also after a gateway restart, even one that cut a suspension off."""

import contextlib
import os
import pathlib
import shutil
import signal
import threading
import time
import urllib.request

import pytest

from cluster import KernelSocket, freeze, rest_call, split_cluster
from test_self_healing import (DIGEST, STATE, digests_by_replica, expected_digest,
                               kernel_with_state)

IDLE_MINUTES = "0.05"  # 3 s


@pytest.fixture
def cluster():
    c = split_cluster(hosts=3, gateway_args=("--idle-suspend-minutes", IDLE_MINUTES))
    yield c
    c.close()


def view(c):
    status, body = rest_call(c.url, c.token, "GET", "/api/nbos/cluster")
    assert status == 200, body
    return body


def kernel_of(c, kernel_id):
    return next(k for k in view(c)["kernels"] if k["id"] == kernel_id)


def wait_suspended(c, kernel_id, timeout=60):
    deadline = time.time() + timeout
    while not kernel_of(c, kernel_id)["suspended"]:
        assert time.time() < deadline, f"the idle kernel was not suspended: {view(c)}"
        time.sleep(0.2)
    body = view(c)
    assert kernel_of(c, kernel_id)["replicas"] == []
    for server in body["servers"]:
        assert server["subscribed"]["millicpus"] == 0, server
    deadline = time.time() + 30
    while c.replicas():
        assert time.time() < deadline, f"replica processes still run: {c.replicas()}"
        time.sleep(0.2)


def assert_kept_state(reply, iopub):
    """`print(kept)` ran and printed what kernel_with_state(c, "kept = 'state'") left."""
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream") == "state\n"


def delete_kernel(c, kernel_id, ks):
    ks.close()
    assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kernel_id}")[0] == 204
    c.wait_no_replicas()


def test_an_idle_kernel_is_suspended_and_resumes_with_its_namespace(cluster):
    c = cluster
    kid, ks, _ = kernel_with_state(c, STATE + "import os\nos.environ['NBOS_KEPT'] = 'yes'\n")

    wait_suspended(c, kid)
    # A client connecting to a suspended kernel is answered without waking it.
    KernelSocket(c.url, kid, c.token).close()
    assert kernel_of(c, kid)["suspended"]

    # A cell on the socket opened before the suspension wakes the kernel.
    started = time.time()
    reply, iopub = ks.execute(DIGEST)
    resumed_s = time.time() - started
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    assert text == expected_digest()
    kernel = kernel_of(c, kid)
    assert not kernel["suspended"]
    replicas = {r["replica_id"] for r in kernel["replicas"]}
    assert len(replicas) == 3 and all(r["state"] == "live" for r in kernel["replicas"])
    assert set(digests_by_replica(ks, replicas).values()) == {expected_digest()}
    reply, iopub = ks.execute("import os\nprint(os.environ['NBOS_KEPT'])")
    assert "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream") == "yes\n"
    suspensions = view(c)["suspensions"]
    assert suspensions["suspended"] == 1 and suspensions["resumed"] == 1, suspensions
    print(f"resume (cell sent -> its reply): {resumed_s:.2f} s; "
          f"gateway's resume time: {suspensions['resume_ms']} ms")
    req = urllib.request.Request(c.url + "/metrics", headers={"Authorization": f"token {c.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert 'nbos_kernel_suspensions_total{event="resumed"} 1' in resp.read().decode()

    # Suspended again, across a gateway restart: the kernel comes back suspended and resumes.
    wait_suspended(c, kid)
    ks.close()
    c.kill_gateway()
    c.gateway = c.start_gateway()
    c.wait_servers()
    assert kernel_of(c, kid)["suspended"]
    ks = KernelSocket(c.url, kid, c.token)
    reply, iopub = ks.execute(DIGEST)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream") == \
        expected_digest()
    delete_kernel(c, kid, ks)


def test_a_suspended_kernel_that_cannot_resume_says_so_and_resumes_later(cluster):
    c = cluster
    kid, ks, _ = kernel_with_state(c, "kept = 'state'")
    wait_suspended(c, kid)
    # Every server goes away: the kernel cannot resume, and the cell is answered saying so.
    for i in range(1, c.hosts + 1):
        c.kill_host(i)
    deadline = time.time() + 30
    while any(s["alive"] for s in view(c)["servers"]):
        assert time.time() < deadline, view(c)["servers"]
        time.sleep(0.2)
    reply, _ = ks.execute("print(kept)")
    assert reply["content"]["status"] == "error", reply["content"]
    assert reply["content"]["ename"] == "ReplicasUnavailable", reply["content"]
    assert "suspended" in reply["content"]["evalue"], reply["content"]
    # The servers are back: the next cell resumes the kernel with its state.
    for i in range(1, c.hosts + 1):
        c.start_daemon(i)
    deadline = time.time() + 30
    while not all(s["alive"] for s in view(c)["servers"]):
        assert time.time() < deadline, view(c)["servers"]
        time.sleep(0.2)
    reply, iopub = ks.execute("print(kept)")
    assert_kept_state(reply, iopub)
    delete_kernel(c, kid, ks)


@contextlib.contextmanager
def checkpoints_away(c):
    """The blob store's files are moved away for the block: a replica cannot read a checkpoint,
    exits, and after its restarts is given up."""
    blobs = c.stores[1].removeprefix("dir://")
    away = blobs + ".away"
    os.rename(blobs, away)
    try:
        yield
    finally:
        # A replica that opened the store made the directory again, empty.
        shutil.copytree(away, blobs, dirs_exist_ok=True)
        shutil.rmtree(away)


def wait_for_failed_resume(c, cell):
    """Until the gateway's log says a resume attempt failed and another follows."""
    gateway_log = pathlib.Path(c.ps.root, "gateway.log")
    deadline = time.time() + 45
    while "resuming failed, trying again" not in gateway_log.read_text(errors="replace"):
        assert time.time() < deadline, "no failed attempt to resume in the gateway's log"
        assert cell.is_alive(), "the cell was answered before a retry"
        time.sleep(0.2)


def execute_ignoring_errors(ks, code):
    with contextlib.suppress(Exception):
        ks.execute(code)


def test_a_resume_that_cannot_start_its_replicas_is_tried_again_while_the_cell_waits(cluster):
    """A resume can fail for a moment with servers to place on (a daemon just back that does not
    answer yet, a replica that cannot start). Here the new replicas cannot read the checkpoint
    and exit for good. The cell waits while the gateway undoes the attempt and tries again, and
    runs once the checkpoint can be read."""
    c = cluster
    kid, ks, _ = kernel_with_state(c, "kept = 'state'")
    wait_suspended(c, kid)
    answer = {}
    cell = threading.Thread(target=lambda: answer.update(done=ks.execute("print(kept)")))
    with checkpoints_away(c):
        cell.start()
        wait_for_failed_resume(c, cell)
    cell.join(timeout=120)
    assert not cell.is_alive(), "the cell was not answered"
    reply, iopub = answer["done"]
    assert_kept_state(reply, iopub)
    kernel = kernel_of(c, kid)
    assert not kernel["suspended"] and len(kernel["replicas"]) == 3, kernel
    delete_kernel(c, kid, ks)


def restart_gateway_then_resume(c, kid, avoiding=frozenset()):
    """Starts the gateway again: it must have the kernel suspended, without replicas, and a cell
    must resume it with the state kernel_with_state(c, "kept = 'state'") left, on replicas with
    none of the ids in `avoiding`."""
    c.gateway = c.start_gateway()
    c.wait_servers()
    kernel = kernel_of(c, kid)
    assert kernel["suspended"] and kernel["replicas"] == [], kernel
    ks = KernelSocket(c.url, kid, c.token)
    reply, iopub = ks.execute("print(kept)")
    assert_kept_state(reply, iopub)
    resumed = {r["replica_id"] for r in kernel_of(c, kid)["replicas"]}
    assert resumed and not resumed & avoiding, (resumed, avoiding)
    delete_kernel(c, kid, ks)


def kill_gateway_mid_suspension(c):
    """A kernel with state, and the gateway killed while the kernel's idle suspension stops its
    replicas: (the kernel's id, the ids of the replicas the suspension was stopping)."""
    gateway_log = pathlib.Path(c.ps.root, "gateway.log")
    for _ in range(3):
        # The socket stays open (a suspension keeps its clients): closing it can take longer
        # than the kernel takes to become idle.
        kid, ks, kernel = kernel_with_state(c, "kept = 'state'")
        deadline = time.time() + 60
        while f"kernel {kid}: suspending" not in gateway_log.read_text(errors="replace"):
            assert time.time() < deadline, "the idle kernel was not suspended"
            time.sleep(0.005)
        # Frozen daemons hold the suspension in its calls to stop the replicas (their deadline
        # is seconds away), so the gateway dies in the middle of it.
        freeze([d.pid for d in c.daemons.values()])
        try:
            c.kill_gateway()
        finally:
            for d in c.daemons.values():
                d.send_signal(signal.SIGCONT)
        with contextlib.suppress(Exception):
            ks.close()
        if f"kernel {kid} suspended" not in gateway_log.read_text(errors="replace"):
            return kid, {r["replica_id"] for r in kernel["replicas"]}
        # The suspension finished before the kill (a loaded machine): again, with a new kernel.
        c.gateway = c.start_gateway()
        c.wait_servers()
        assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")[0] == 204
    raise AssertionError("every suspension finished before the gateway was killed")


def test_a_gateway_killed_while_a_suspension_stops_the_replicas_finds_the_kernel_suspended(
        cluster):
    """The gateway goes down while an idle kernel's suspension stops its replicas. Restarted, it
    must have the kernel suspended on the checkpoint the suspension took (not on the replicas it
    was stopping), and the next cell resumes it with its state on replicas with new ids (the old
    ones may still run until they are stopped as orphans)."""
    kid, stopping = kill_gateway_mid_suspension(cluster)
    restart_gateway_then_resume(cluster, kid, avoiding=stopping)


def test_a_gateway_restarted_between_resume_attempts_finds_the_kernel_suspended(cluster):
    """A failed attempt leaves the database as it found it: a gateway that goes down before the
    next attempt restores the kernel suspended on its checkpoint, not on the attempt's replicas
    (gone), and the next cell resumes it with its state."""
    c = cluster
    kid, ks, _ = kernel_with_state(c, "kept = 'state'")
    wait_suspended(c, kid)
    # The cell's socket closes with the gateway; what it gets does not matter here.
    cell = threading.Thread(target=lambda: execute_ignoring_errors(ks, "print(kept)"))
    with checkpoints_away(c):
        cell.start()
        wait_for_failed_resume(c, cell)
        c.kill_gateway()
    cell.join(timeout=60)
    restart_gateway_then_resume(c, kid)


def test_a_gateway_killed_while_a_resume_waits_for_its_replicas_finds_the_kernel_suspended(cluster):
    """The gateway goes down after a resume attempt has recorded its replicas and before they
    answer (here they cannot: the checkpoint is unreadable, and they exit). Restarted, it must
    restore the kernel suspended on its checkpoint, not on the attempt's replicas, and the next
    cell resumes it with its state, on replicas whose ids the cut-off attempt did not use."""
    c = cluster
    kid, ks, _ = kernel_with_state(c, "kept = 'state'")
    wait_suspended(c, kid)
    # Restored suspended, the kernel has no replicas to number the next ones after.
    ks.close()
    c.kill_gateway()
    c.gateway = c.start_gateway()
    c.wait_servers()
    gateway_log = pathlib.Path(c.ps.root, "gateway.log")
    waits = lambda: gateway_log.read_text(errors="replace").count("waiting for its resumed replicas")  # noqa
    waited = waits()
    with checkpoints_away(c):
        ks = KernelSocket(c.url, kid, c.token, ready=False)
        cell = threading.Thread(target=lambda: execute_ignoring_errors(ks, "print(kept)"))
        cell.start()
        deadline = time.time() + 45
        while waits() == waited:
            assert time.time() < deadline, "no resume attempt waited for its replicas"
            time.sleep(0.05)
        cut_off = {r["replica_id"] for r in kernel_of(c, kid)["replicas"]}
        assert len(cut_off) == 3, cut_off
        c.kill_gateway()
        # The attempt's replicas fail on the missing checkpoint until their daemons give up.
        logs = [pathlib.Path(c.ps.root, f"host-{i}.log") for i in range(1, c.hosts + 1)]
        deadline = time.time() + 90
        while sum(log.read_text(errors="replace").count("restart budget spent")
                  for log in logs) < 3:
            assert time.time() < deadline, "the attempt's replicas were not given up"
            time.sleep(0.2)
        c.wait_no_replicas()
    cell.join(timeout=60)
    restart_gateway_then_resume(c, kid, avoiding=cut_off)
