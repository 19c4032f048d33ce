"""Faults below the gateway, with `nbos gateway` and `nbos daemon` started one by one: a server
whose data store is unreachable makes kernel starts fail at once with a clear error (not after
the start timeout), nothing is left behind, and the gateway keeps serving; replicas of kernels
deleted while their daemons were not registered, lost from the gateway's database, or started
by a gateway killed before they answered, are stopped; a kernel whose restart a gateway kill cut
off is restarted again, and one whose delete it cut off stays deleted."""

import os
import pathlib
import re
import signal
import sqlite3
import threading
import time

import pytest
import websocket

from cluster import KernelSocket, freeze, is_replica_of, rest_call, split_cluster


@pytest.fixture
def faulty_cluster():
    c = split_cluster(dead_store_host=2)
    yield c.url, c.token, c.ps
    c.close()


@pytest.fixture
def healthy_split_cluster():
    c = split_cluster()
    yield c
    c.close()


def test_a_kernel_deleted_right_after_a_gateway_restart_leaves_no_replica(healthy_split_cluster):
    c = healthy_split_cluster
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    assert len(c.replicas()) == 3
    c.kill_gateway()
    c.gateway = c.start_gateway()
    # Before the daemons have registered again: the delete waits for them.
    status, body = rest_call(c.url, c.token, "DELETE", f"/api/kernels/{model['id']}")
    assert status == 204, body
    c.wait_no_replicas()


def kill_gateway_during(c, method, path, body, log_pattern):
    """Sends the request on a thread and kills the gateway as soon as its log matches
    `log_pattern`, before the request was answered. Returns the match."""
    gateway_log = pathlib.Path(c.ps.root, "gateway.log")
    answers = []

    def call():
        try:
            answers.append(rest_call(c.url, c.token, method, path, body))
        except OSError as e:  # the gateway went away mid-request
            answers.append(e)

    client = threading.Thread(target=call)
    client.start()
    deadline = time.time() + 60
    while not (m := re.search(log_pattern, gateway_log.read_text(errors="replace"))):
        assert time.time() < deadline, f"the gateway never logged {log_pattern!r}"
        time.sleep(0.005)
    c.kill_gateway()
    client.join(timeout=60)
    assert answers and not isinstance(answers[0], tuple), f"the request finished first: {answers}"
    return m


def test_a_gateway_killed_while_a_start_waits_for_its_replicas_forgets_the_kernel(
        healthy_split_cluster):
    """The gateway goes down after a kernel start has recorded its replicas and before they have
    answered, so its client never got a 201. Restarted, the gateway must not have the kernel, and
    the replicas that start launched are stopped as orphans."""
    c = healthy_split_cluster
    m = kill_gateway_during(c, "POST", "/api/kernels", {"name": "nbos"},
                            r"kernel (\S+): waiting for its replicas\b")
    c.gateway = c.start_gateway()
    c.wait_servers()
    assert rest_call(c.url, c.token, "GET", "/api/kernels") == (200, [])
    assert rest_call(c.url, c.token, "GET", f"/api/kernels/{m.group(1)}")[0] == 404
    gateway_log = pathlib.Path(c.ps.root, "gateway.log")
    assert "its start was cut off" in gateway_log.read_text(errors="replace")
    c.wait_no_replicas()


def test_a_gateway_killed_while_a_restart_is_under_way_restarts_the_kernel_again(
        healthy_split_cluster):
    """The gateway goes down after a kernel restart has stopped the kernel's replicas and before
    its new ones have answered. Restarted, the gateway must still have the kernel and restart it
    again: a cell runs on a fresh namespace, and only the kernel's three new replicas run."""
    c = healthy_split_cluster
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    kid = model["id"]
    ks = KernelSocket(c.url, kid, c.token, timeout=60)
    reply, _ = ks.execute("before_restart = 41")
    assert reply["content"]["status"] == "ok", reply["content"]
    ks.close()
    kill_gateway_during(c, "POST", f"/api/kernels/{kid}/restart", {},
                        f"kernel {kid}: restarting; its replicas are stopped")
    c.gateway = c.start_gateway()
    c.wait_servers()
    assert rest_call(c.url, c.token, "GET", f"/api/kernels/{kid}")[0] == 200
    # The restored gateway's own restart closes the sockets of clients that came before it.
    deadline = time.time() + 120
    while True:
        try:
            ks = KernelSocket(c.url, kid, c.token, timeout=10)
            cells = [ks.execute("before_restart")[0], ks.execute("after_restart = 1")[0]]
            ks.close()
            break
        except (OSError, ValueError, websocket.WebSocketException, AssertionError) as e:
            assert time.time() < deadline, f"the kernel runs no cell after the gateway restart: {e}"
    assert cells[0]["content"]["ename"] == "NameError", cells[0]["content"]
    assert cells[1]["content"]["status"] == "ok", cells[1]["content"]
    gateway_log = pathlib.Path(c.ps.root, "gateway.log")
    while f"kernel {kid} restarted" not in (text := gateway_log.read_text(errors="replace")):
        assert time.time() < deadline, "the restored gateway did not restart the kernel"
        time.sleep(0.1)
    assert "its restart was cut off" in text
    deadline = time.time() + 30
    while len(c.replicas()) != 3:
        assert time.time() < deadline, f"replicas besides the kernel's three: {c.replicas()}"
        time.sleep(0.2)
    status, body = rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")
    assert status == 204, body
    c.wait_no_replicas()


def test_a_gateway_killed_while_a_delete_stops_the_replicas_does_not_bring_the_kernel_back(
        healthy_split_cluster):
    """The gateway goes down while a kernel delete stops the kernel's replicas. Restarted, the
    gateway must not have the kernel, and the replicas the delete did not stop are stopped as
    orphans."""
    c = healthy_split_cluster
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    kid = model["id"]
    kill_gateway_during(c, "DELETE", f"/api/kernels/{kid}", None, f"kernel {kid}: deleting")
    c.gateway = c.start_gateway()
    c.wait_servers()
    assert rest_call(c.url, c.token, "GET", "/api/kernels") == (200, [])
    assert rest_call(c.url, c.token, "GET", f"/api/kernels/{kid}")[0] == 404
    c.wait_no_replicas()


def test_a_delete_the_database_cannot_record_is_refused_and_leaves_the_kernel_running(
        healthy_split_cluster):
    """Another process holds the gateway database's write lock: a delete gets a clear error and
    the kernel keeps running; once the lock is gone the delete goes through."""
    c = healthy_split_cluster
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    kid = model["id"]
    db = sqlite3.connect(f"{c.ps.root}/gateway/gateway.db", isolation_level=None)
    try:
        db.execute("BEGIN IMMEDIATE")
        status, body = rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")
        assert status == 503, (status, body)
        assert "gateway database" in body["message"], body
    finally:
        db.execute("ROLLBACK")
        db.close()
    assert len(c.replicas()) == 3
    ks = KernelSocket(c.url, kid, c.token, timeout=60)
    reply, _ = ks.execute("1 + 1")
    assert reply["content"]["status"] == "ok", reply["content"]
    ks.close()
    status, body = rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")
    assert status == 204, body
    c.wait_no_replicas()


def test_replicas_of_a_kernel_the_gateway_does_not_know_are_stopped(healthy_split_cluster):
    c = healthy_split_cluster
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    kept = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})[1]["id"]
    assert len(c.replicas()) == 6
    c.kill_gateway()
    # The database loses one kernel (e.g. restored from an older copy).
    db = sqlite3.connect(f"{c.ps.root}/gateway/gateway.db")
    with db:
        assert db.execute("DELETE FROM kernels WHERE id = ?", (model["id"],)).rowcount == 1
    db.close()
    c.gateway = c.start_gateway()
    c.wait_servers()
    deadline = time.time() + 30
    while len(c.replicas()) != 3:
        assert time.time() < deadline, f"replicas of the lost kernel still run: {c.replicas()}"
        time.sleep(0.2)
    status, kernels = rest_call(c.url, c.token, "GET", "/api/kernels")
    assert [k["id"] for k in kernels] == [kept]
    status, body = rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kept}")
    assert status == 204, body
    c.wait_no_replicas()


def test_a_replica_that_cannot_start_fails_the_kernel_start_quickly(faulty_cluster):
    url, token, ps = faulty_cluster
    status, body = rest_call(url, token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 503, (status, body)
    assert "replica 2" in body["message"] and "host-2" in body["message"], body
    # The daemon's report ends the wait, not the start timeout ("did not answer ... in time").
    assert "will not be restarted" in body["message"], body
    status, body = rest_call(url, token, "GET", "/api/nbos/cluster")
    assert status == 200
    assert body["kernels"] == [], "a failed start leaves no kernel behind"
    for server in body["servers"]:
        assert server["gpus_committed"] == 0
    replicas = [p for p in os.listdir("/proc") if p.isdigit() and is_replica_of(p, ps.root)]
    deadline = time.time() + 20
    while replicas:
        assert time.time() < deadline, f"replica processes left: {replicas}"
        time.sleep(0.2)
        replicas = [p for p in replicas if is_replica_of(p, ps.root)]
    assert rest_call(url, token, "GET", "/api/kernels")[0] == 200


def test_a_frozen_daemon_stalls_no_kernel_session(healthy_split_cluster):
    """A cell whose grant is asked of a daemon that stopped answering (SIGSTOP: the RPC hangs
    until its deadline) waits off the kernel's session: an interrupt is answered at once with
    KeyboardInterrupt, and another kernel's cells run meanwhile."""
    c = healthy_split_cluster
    a = rest_call(c.url, c.token, "POST", "/api/kernels",
                  {"name": "nbos", "env": {"KERNEL_GPUS": "1"}})[1]["id"]
    b = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})[1]["id"]
    ka, kb = KernelSocket(c.url, a, c.token), KernelSocket(c.url, b, c.token)
    view = rest_call(c.url, c.token, "GET", "/api/nbos/cluster")[1]
    target = next(k for k in view["kernels"] if k["id"] == a)["replicas"][0]
    frozen = c.daemons[int(target["server_id"].split("-")[1])]
    freeze([frozen.pid])
    try:
        msg_id = ka.send("execute_request", {
            "code": "1", "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": True},
            metadata={"nbos": {"target_replica": target["replica_id"]}})
        # Kernel a's own session answers an interrupt of the waiting cell before the hung
        # Grant returns (its 5 s deadline): the cell ends with KeyboardInterrupt, not with the
        # RPC's failure, nor runs on another replica once the RPC failed.
        int_id = ka.send("interrupt_request", {}, channel="control")
        reply, _ = ka.wait_for(msg_id)
        assert reply["content"].get("ename") == "KeyboardInterrupt", reply["content"]
        assert "waiting for an executor" in reply["content"]["evalue"], reply["content"]
        while True:  # the gateway answers an interrupt itself: a reply, no busy/idle
            m = ka.recv()
            if m.get("parent_header", {}).get("msg_id") == int_id:
                break
        assert m["msg_type"] == "interrupt_reply" and m["content"]["status"] == "ok", m
        # Kernel b (no GPUs: no daemon call) runs a cell with output while a's grant hangs.
        reply, iopub = kb.execute("for i in range(5): print(i)")
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
        assert text == "0\n1\n2\n3\n4\n", text
    finally:
        frozen.send_signal(signal.SIGCONT)
    reply, _ = ka.execute("2", metadata={"nbos": {"gpus": 0}})
    assert reply["content"]["status"] == "ok", reply["content"]
    ka.close()
    kb.close()
    for k in (a, b):
        assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{k}")[0] == 204


@pytest.mark.parametrize("cell_s", [1.5, 4])  # done before the gateway is back, or still running
def test_a_gateway_killed_mid_cell_gives_the_reconnecting_client_the_cells_reply(
        healthy_split_cluster, cell_s):
    """The replicas finish the cell while the gateway is down. The restarted gateway reaches them
    again (before, their ZeroMQ sockets still held the dead gateway's identity and ignored the new
    one), asks them for the cell it had in flight and gives its reply to the client that
    reconnects; every replica holds the cell's effect, and the next cell runs where it is asked
    to (execution ids do not repeat across gateway restarts)."""
    c = healthy_split_cluster
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    ks = KernelSocket(c.url, model["id"], c.token)
    msg_id = ks.send("execute_request", {
        "code": f"import time\ntime.sleep({cell_s})\nx = 42\nx", "silent": False,
        "store_history": True, "user_expressions": {}, "allow_stdin": False,
        "stop_on_error": True}, metadata={"nbos": {"target_replica": 1}})
    time.sleep(1)  # the cell is running
    c.kill_gateway()
    c.gateway = c.start_gateway()
    c.wait_servers()
    ks = KernelSocket(c.url, model["id"], c.token, ready=False)  # a client reconnecting
    reply, iopub = ks.wait_for(msg_id)
    assert reply["content"]["status"] == "ok", reply["content"]
    assert reply["content"]["execution_count"] == 1
    assert reply["metadata"]["nbos"]["executor"] == 1
    # Outputs the cell made while no gateway listened are lost; later ones come through.
    states = [m["content"]["execution_state"] for m in iopub if m["msg_type"] == "status"]
    assert states[-1:] == ["idle"], iopub
    reply, _ = ks.execute("y = 1", metadata={"nbos": {"target_replica": 2}})
    assert reply["metadata"]["nbos"]["executor"] == 2, reply["metadata"]
    for target in (1, 2, 3):
        reply, iopub = ks.execute("print(x)", metadata={"nbos": {"target_replica": target}})
        assert reply["content"]["status"] == "ok", reply["content"]
        text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
        assert text == "42\n", (target, text)
    ks.close()
    assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{model['id']}")[0] == 204
    c.wait_no_replicas()
