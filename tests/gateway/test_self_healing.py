"""Self-healing (DESIGN.md §5): a server that is lost for good (daemon and replicas killed, kept
down) has its kernels' replicas replaced through the migration path, with no client action; the
kernel keeps its state on every replica. With no server left to take a replacement the kernel
goes on with its live majority, and when the lost server comes back its stale replica is stopped
and the kernel is whole again."""

import hashlib
import os
import pathlib
import re
import signal
import time
import urllib.request

import pytest
from jupyter_client import BlockingKernelClient

from cluster import KernelSocket, rest_call, split_cluster

HOSTS = 4
STATE = ("import numpy as np, torch\n"
         "a = np.arange(1_000_000, dtype=np.float64) * 3\n"
         "t = torch.arange(100_000, dtype=torch.float32)\n"
         "words = ['heal'] * 5\n")
DIGEST = ("import hashlib as _h\n"
          "print(_h.sha256(a.tobytes() + t.numpy().tobytes() + ','.join(words).encode())"
          ".hexdigest(), end='')")


@pytest.fixture
def cluster():
    c = split_cluster(hosts=HOSTS)
    yield c
    c.close()


def kernel_view(c, kernel_id):
    status, body = rest_call(c.url, c.token, "GET", "/api/nbos/cluster")
    assert status == 200, body
    return next(k for k in body["kernels"] if k["id"] == kernel_id), body


def wait_whole(c, kernel_id, avoid, seen_states, timeout=90):
    """Waits until the kernel has three live replicas on servers not in `avoid`, each reachable
    from the kernel's session (it answers heartbeats there, so cells may go to it); collects the
    replica states seen meanwhile in `seen_states`. Returns the replicas by id."""
    deadline = time.time() + timeout
    while True:
        kernel, _ = kernel_view(c, kernel_id)
        replicas = {r["replica_id"]: r for r in kernel["replicas"]}
        seen_states.update(r["state"] for r in replicas.values())
        if (len(replicas) == 3
                and all(r["state"] == "live" and r["reachable"] for r in replicas.values())
                and not {r["server_id"] for r in replicas.values()} & avoid):
            return replicas
        assert time.time() < deadline, f"the kernel did not heal: {kernel}"
        time.sleep(0.1)


def digests_by_replica(ks, replicas):
    out = {}
    for rid in sorted(replicas):
        reply, iopub = ks.execute(DIGEST, metadata={"nbos": {"target_replica": rid}})
        assert reply["content"]["status"] == "ok", (rid, reply["content"])
        assert reply["metadata"]["nbos"]["executor"] == rid
        out[rid] = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    return out


def expected_digest():
    import numpy as np
    a = (np.arange(1_000_000, dtype=np.float64) * 3).tobytes()
    t = np.arange(100_000, dtype=np.float32).tobytes()
    return hashlib.sha256(a + t + b"heal,heal,heal,heal,heal").hexdigest()


def kernel_with_state(c, state=STATE):
    """A new kernel that ran `state`: (its id, a socket to it, its entry in the cluster view)."""
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    ks = KernelSocket(c.url, model["id"], c.token)
    reply, _ = ks.execute(state)
    assert reply["content"]["status"] == "ok", reply["content"]
    return model["id"], ks, kernel_view(c, model["id"])[0]


def test_lost_servers_replicas_are_replaced_and_the_kernel_keeps_its_state(cluster):
    c = cluster
    kid, ks, kernel = kernel_with_state(c)
    first = {r["server_id"]: r["replica_id"] for r in kernel["replicas"]}
    assert len(first) == 3

    # One server is lost for good: a new replica takes its place on the spare server.
    lost1 = sorted(first)[0]
    c.kill_host(int(lost1.split("-")[1]))
    killed_at = time.time()
    seen = set()
    healed = wait_whole(c, kid, {lost1}, seen)
    took_s = time.time() - killed_at
    assert "lost" in seen or "leaving" in seen, seen
    assert first[lost1] not in healed, "the lost replica was replaced"
    _, view = kernel_view(c, kid)
    print(f"server killed -> three live replicas: {took_s:.1f} s, of which loss seen -> "
          f"replaced: {view['migrations']['replacement_ms']} ms")
    assert view["migrations"]["replacements_done"] == 1, view["migrations"]
    assert len(view["migrations"]["replacement_ms"]) == 1
    digests = digests_by_replica(ks, healed)
    assert set(digests.values()) == {expected_digest()}, digests
    req = urllib.request.Request(c.url + "/metrics",
                                 headers={"Authorization": f"token {c.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        metrics = resp.read().decode()
    families = [line.split()[2] for line in metrics.splitlines() if line.startswith("# HELP ")]
    assert len(families) == len(set(families)), "a metric family is exposed twice"
    assert "nbos_replica_replacements_total 1" in metrics, metrics
    assert 'nbos_servers{state="lost"} 1' in metrics, metrics
    assert 'nbos_replicas{state="live"} 3' in metrics, metrics

    # A second server is lost; no server is left to take a replacement, so the kernel runs on
    # its live majority and says what it waits for in the view.
    lost2 = next(r["server_id"] for r in healed.values())
    c.kill_host(int(lost2.split("-")[1]))
    deadline = time.time() + 30
    while True:
        kernel, _ = kernel_view(c, kid)
        states = {r["server_id"]: r["state"] for r in kernel["replicas"]}
        if states.get(lost2) == "lost":
            break
        assert time.time() < deadline, kernel
        time.sleep(0.1)
    reply, iopub = ks.execute("b = float(a.sum())\nprint(b, end='')")
    assert reply["content"]["status"] == "ok", reply["content"]
    text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    assert text == str(float(3 * (999_999 * 1_000_000 // 2))), text

    # The first server comes back with its stale replica: that replica is stopped (it left the
    # group), and the kernel gets its third replica on the returning server.
    c.start_daemon(int(lost1.split("-")[1]))
    healed2 = wait_whole(c, kid, {lost2}, seen)
    stale = first[lost1]
    deadline = time.time() + 30
    while any(_replica_dir(pid) == f"{kid}-{stale}"
              for pid in c.host_replicas(int(lost1.split("-")[1]))):
        assert time.time() < deadline, "the stale replica still runs"
        time.sleep(0.2)
    assert stale not in healed2
    digests = digests_by_replica(ks, healed2)
    assert set(digests.values()) == {expected_digest()}, digests
    ks.close()
    assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")[0] == 204


def _replica_dir(pid):
    """The replica directory name (<kernel>-<replica>) a replica process runs in, or ''."""
    try:
        return os.path.basename(os.readlink(f"/proc/{pid}/cwd"))
    except OSError:
        return ""


def kernel_with_x(c):
    """A new kernel that ran `x = 41`: (kernel id, its socket, the executor, host by replica)."""
    status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    kid = model["id"]
    ks = KernelSocket(c.url, kid, c.token)
    reply, _ = ks.execute("x = 41")
    assert reply["content"]["status"] == "ok", reply["content"]
    kernel, _ = kernel_view(c, kid)
    host = {r["replica_id"]: int(r["server_id"].split("-")[1]) for r in kernel["replicas"]}
    return kid, ks, reply["metadata"]["nbos"]["executor"], host


def x_on_every_replica(c, ks, kid):
    """Once the kernel is whole again: the values of x its replicas print, as a set."""
    wait_whole(c, kid, set(), set())
    values = set()
    for rid in sorted(r["replica_id"] for r in kernel_view(c, kid)[0]["replicas"]):
        reply, iopub = ks.execute("print(x, end='')", metadata={"nbos": {"target_replica": rid}})
        assert reply["content"]["status"] == "ok", (rid, reply["content"])
        values.add("".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream"))
    return values


def test_a_server_restarted_at_once_has_its_replicas_replaced(cluster):
    """A server goes down with its replicas and its daemon is started again before the gateway
    misses a heartbeat: the daemon starts empty (a restarted daemon forgets its replicas and
    their logs), so the kernel's replica there is gone for good. The gateway sees it missing from
    the server's reports and replaces it, instead of counting it unreachable for ever."""
    c = cluster
    kid, ks, kernel = kernel_with_state(c)
    first = {r["server_id"]: r["replica_id"] for r in kernel["replicas"]}
    restarted = sorted(first)[0]
    host = int(restarted.split("-")[1])
    c.kill_host(host)
    c.start_daemon(host)
    deadline = time.time() + 90
    while True:
        kernel, _ = kernel_view(c, kid)
        healed = {r["replica_id"]: r for r in kernel["replicas"]}
        if (first[restarted] not in healed and len(healed) == 3
                and all(r["state"] == "live" and r["reachable"] for r in healed.values())):
            break
        assert time.time() < deadline, f"the forgotten replica was not replaced: {kernel}"
        time.sleep(0.2)
    digests = digests_by_replica(ks, healed)
    assert set(digests.values()) == {expected_digest()}, digests


@pytest.mark.parametrize("frozen", ["standbys", "executor"])
def test_frozen_servers_give_a_clear_error_then_the_kernel_resumes(cluster, frozen):
    """Two of three servers stop answering (SIGSTOP) just before a cell is sent. The gateway's
    heartbeats notice within about a second and a half, long before the daemons' loss is declared:
    with the executor live, it is asked whether it began the cell and, as it had not, the cell is
    answered as not run; with the executor frozen, the answer says whether it ran is not known.
    Later cells are refused at once. Once the servers are back every replica holds the same x."""
    c = cluster
    kid, ks, executor, host = kernel_with_x(c)
    others = sorted(h for rid, h in host.items() if rid != executor)
    frozen_hosts = others if frozen == "standbys" else [host[executor], others[0]]
    try:
        for i in frozen_hosts:
            c.signal_host(i, signal.SIGSTOP)
        # The executor is sticky: the cell goes to the same replica as the last one.
        sent = time.time()
        reply, iopub = ks.execute("x += 1")
        print(f"answer of a cell sent as 2 of 3 servers froze ({frozen}): "
              f"{time.time() - sent:.2f} s")
        assert reply["content"]["status"] == "error", reply["content"]
        ename = "ReplicasUnavailable" if frozen == "standbys" else "ExecutorLost"
        assert reply["content"]["ename"] == ename, reply["content"]
        assert "2 of 3 replicas" in reply["content"]["evalue"], reply["content"]
        expected = "did not run" if frozen == "standbys" else "not known"
        assert expected in reply["content"]["evalue"], reply["content"]
        assert any(m["msg_type"] == "error" for m in iopub)
        sent = time.time()
        reply, _ = ks.execute("x += 1")
        print(f"answer of the next cell: {time.time() - sent:.2f} s")
        assert reply["content"]["ename"] == "ReplicasUnavailable", reply["content"]
        assert "did not run" in reply["content"]["evalue"], reply["content"]
        deadline = time.time() + 30
        while sum(r["state"] == "lost" for r in kernel_view(c, kid)[0]["replicas"]) < 2:
            assert time.time() < deadline, kernel_view(c, kid)[0]
            time.sleep(0.1)
        # Lost for good now (the daemons missed their heartbeats): no cell goes to them, and one
        # is still refused, still at once.
        # (A replacement the gateway may have begun meanwhile is listed as joining.)
        frozen_view = [r for r in kernel_view(c, kid)[0]["replicas"] if r["replica_id"] in host]
        assert sum(not r["reachable"] for r in frozen_view) == 2, frozen_view
        reply, _ = ks.execute("x += 1")
        assert reply["content"]["ename"] == "ReplicasUnavailable", reply["content"]
    finally:
        for i in frozen_hosts:
            c.signal_host(i, signal.SIGCONT)
    values = x_on_every_replica(c, ks, kid)
    # A cell answered as not run did not run anywhere; one whose fate was not known ran on every
    # replica or on none.
    assert values == {"41"} if frozen == "standbys" else values in ({"41"}, {"42"}), values
    reply, iopub = ks.execute("x = 50\nprint(x, end='')")
    assert reply["content"]["status"] == "ok", reply["content"]
    ks.close()


def test_standbys_frozen_mid_cell_leave_the_kernel_at_its_last_completed_cell(cluster):
    """Both standbys' servers freeze (SIGSTOP) while a cell runs: the cell ends on the executor,
    but its effects cannot be committed. The client is told so, the executor drops the effects,
    and once the servers are back every replica holds the state of the last completed cell."""
    c = cluster
    kid, ks, executor, host = kernel_with_x(c)
    standby_hosts = sorted(h for rid, h in host.items() if rid != executor)
    msg_id = ks.send("execute_request", {
        "code": "import time\ntime.sleep(2)\nx = 42", "silent": False, "store_history": True,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    time.sleep(0.7)
    try:
        for i in standby_hosts:
            c.signal_host(i, signal.SIGSTOP)
        reply, _ = ks.wait_for(msg_id)
    finally:
        for i in standby_hosts:
            c.signal_host(i, signal.SIGCONT)
    assert reply["content"]["ename"] == "ReplicationError", reply["content"]
    assert "went back to the state of the last completed cell" in reply["content"]["evalue"]
    assert x_on_every_replica(c, ks, kid) == {"41"}
    ks.close()


def test_an_executor_frozen_mid_cell_is_answered_for_and_its_late_effects_change_nothing(cluster):
    """The executor's server freezes (SIGSTOP) while a cell runs and the other two answer: the
    gateway's heartbeats notice within about a second, and the standbys answer for the cell
    through the log (whether it ran is not known), long before the server's loss would be
    declared. The next cell runs on a standby. Thawed, the executor finishes its cell, and its
    effects reach the log after the next cell's: they are discarded everywhere, so the next
    cell's x stays on every replica."""
    c = cluster
    kid, ks, executor, host = kernel_with_x(c)
    msg_id = ks.send("execute_request", {
        "code": "import time\ntime.sleep(1.5)\nx = 42", "silent": False, "store_history": True,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    time.sleep(0.5)
    try:
        c.signal_host(host[executor], signal.SIGSTOP)
        sent = time.time()
        reply, _ = ks.wait_for(msg_id)
        print(f"answer of a cell whose executor froze: {time.time() - sent:.2f} s")
        assert reply["content"]["ename"] == "ExecutorLost", reply["content"]
        assert "not known" in reply["content"]["evalue"], reply["content"]
        assert "stopped answering the gateway's heartbeats" in reply["content"]["evalue"]
        reply, _ = ks.execute("x = 50")
        assert reply["content"]["status"] == "ok", reply["content"]
        assert reply["metadata"]["nbos"]["executor"] != executor, reply["metadata"]
    finally:
        c.signal_host(host[executor], signal.SIGCONT)
    assert x_on_every_replica(c, ks, kid) == {"50"}
    ks.close()


def runs_cells_with_one_more_server_frozen(c, kid, replicas):
    """A kernel whole on `replicas` runs a cell, then one more on its executor with another of its
    servers frozen: its Raft group has a majority without that one."""
    ks = KernelSocket(c.url, kid, c.token)
    reply, _ = ks.execute("x = 50")
    assert reply["content"]["status"] == "ok", reply["content"]
    current = reply["metadata"]["nbos"]["executor"]
    frozen = int(next(r["server_id"] for rid, r in sorted(replicas.items())
                      if rid != current).split("-")[1])
    try:
        c.signal_host(frozen, signal.SIGSTOP)
        reply, _ = ks.execute("x += 1", metadata={"nbos": {"target_replica": current}})
        assert reply["content"]["status"] == "ok", reply["content"]
    finally:
        c.signal_host(frozen, signal.SIGCONT)
    ks.close()


def test_a_gateway_killed_after_a_replacement_joined_leaves_no_dead_voter(cluster):
    """A standby's server restarts, without its replicas; the replacement joins the kernel's
    Raft group and the migration waits for the running cell before it lets the lost one go. The
    gateway is killed then, before it recorded the new member, and the kernel's two other servers
    freeze. Restarted, the gateway does not know the new replica, and no live replica can take it
    out of the Raft group: it keeps it running (stopped, it would be a dead voter) until the
    servers thaw, then takes it out and stops it. So the kernel, whole again, still runs cells
    with one more server frozen; a group that kept a dead voter would have no majority left."""
    c = cluster
    kid, ks, executor, host = kernel_with_x(c)
    lost = next(rid for rid in sorted(host) if rid != executor)
    other = next(rid for rid in sorted(host) if rid not in (executor, lost))
    ks.send("execute_request", {
        "code": "import time\ntime.sleep(25)", "silent": False, "store_history": True,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    time.sleep(0.5)
    c.kill_host(host[lost])
    c.start_daemon(host[lost])  # it starts empty: the replica there is gone for good
    deadline = time.time() + 60
    while not any(r["state"] == "joining" for r in kernel_view(c, kid)[0]["replicas"]):
        assert time.time() < deadline, kernel_view(c, kid)[0]
        time.sleep(0.1)
    time.sleep(8)  # the new member joins; the migration then waits for the cell to end
    ks.close()
    c.kill_gateway()
    frozen = [host[executor], host[other]]
    for h in frozen:
        c.signal_host(h, signal.SIGSTOP)
    try:
        c.gateway = c.start_gateway()
        gateway_log = pathlib.Path(c.ps.root, "gateway.log")
        deadline = time.time() + 60
        while not re.search(rf"kernel {kid}: replica \d+ on host-\d+, which the gateway does not "
                            r"know, keeps running", gateway_log.read_text(errors="replace")):
            assert time.time() < deadline, "the restarted gateway never met the new replica"
            time.sleep(0.2)
    finally:
        for h in frozen:
            c.signal_host(h, signal.SIGCONT)
    runs_cells_with_one_more_server_frozen(c, kid, wait_whole(c, kid, set(), set(), timeout=150))


def remove_behind_the_gateways_back(c, kid, via, host, removed):
    """Takes `removed` out of the kernel's Raft group through replica `via`'s control channel,
    as a membership change that committed after the gateway stopped waiting for it would."""
    conn = f"{c.ps.root}/host-{host[via]}/replicas/{kid}-{via}/connection.json"
    client = BlockingKernelClient(connection_file=conn)
    client.load_connection_file()
    client.start_channels()
    try:
        for rid in removed:
            msg = client.session.msg("nbos_membership_request",
                                     {"op": "remove", "replica_id": rid})
            client.control_channel.send(msg)
            reply = client.get_control_msg(timeout=60)
            assert reply["content"] == {"status": "ok"}, (rid, reply["content"])
    finally:
        client.stop_channels()


def test_members_removed_behind_the_gateways_back_are_found_and_replaced(cluster):
    """Two replicas of a kernel leave its Raft group by changes the gateway never saw commit: the
    group is the executor alone, while the gateway counts three live members. Changes asked
    through either of the two would never commit, and the next loss would leave a kernel the
    gateway thinks has its majority stopped for good. The gateway's periodic check of the group
    learns it from the group's leader and replaces both through the member left: the kernel is
    whole again, with its state on every replica, and runs cells with another server frozen."""
    c = cluster
    kid, ks, executor, host = kernel_with_x(c)
    removed = {rid for rid in host if rid != executor}
    remove_behind_the_gateways_back(c, kid, executor, host, sorted(removed))
    deadline = time.time() + 150
    while True:
        replicas = wait_whole(c, kid, set(), set(), timeout=150)
        if not removed & set(replicas):
            break
        assert time.time() < deadline, f"replicas removed from the group still counted: {replicas}"
        time.sleep(0.5)
    gateway_log = pathlib.Path(c.ps.root, "gateway.log").read_text(errors="replace")
    for rid in removed:
        assert re.search(rf"kernel {kid}: replica {rid} is no longer a member of the Raft group",
                         gateway_log), rid
    assert x_on_every_replica(c, ks, kid) == {"41"}
    ks.close()
    runs_cells_with_one_more_server_frozen(c, kid, wait_whole(c, kid, set(), set()))


def test_a_replica_that_left_the_group_stays_out_after_a_gateway_restart(cluster):
    """A standby's server freezes; the migration that replaces it first takes the lost replica
    out of the Raft group, then waits for the running cell. The server thaws, its replica runs
    again, and the gateway is killed before it recorded the replacement. Restarted, it must not
    count the replica that left as live (it is no member any more): it replaces it, so the
    kernel still runs cells with one more server frozen."""
    c = cluster
    kid, ks, executor, host = kernel_with_x(c)
    left = next(rid for rid in sorted(host) if rid != executor)
    ks.send("execute_request", {
        "code": "import time\ntime.sleep(25)", "silent": False, "store_history": True,
        "user_expressions": {}, "allow_stdin": False, "stop_on_error": True})
    time.sleep(0.5)
    c.signal_host(host[left], signal.SIGSTOP)
    try:
        deadline = time.time() + 60
        while not any(r["state"] == "joining" for r in kernel_view(c, kid)[0]["replicas"]):
            assert time.time() < deadline, kernel_view(c, kid)[0]
            time.sleep(0.1)
        time.sleep(3)  # the new member joins; the migration then waits for the cell to end
    finally:
        c.signal_host(host[left], signal.SIGCONT)
    time.sleep(2)  # the thawed server reports its replica running again
    ks.close()
    c.kill_gateway()
    c.gateway = c.start_gateway()
    replicas = wait_whole(c, kid, set(), set(), timeout=150)
    assert left not in replicas, replicas
    runs_cells_with_one_more_server_frozen(c, kid, replicas)


def test_a_gateway_restarted_while_a_server_is_down_for_good_replaces_its_replicas(cluster):
    """The gateway is down when a standby's server goes down for good. Restarted, it never hears
    from that server: once the server timeout passes it counts the replica there lost and
    replaces it, so the kernel is whole again (three live replicas, none on the lost server) with
    its state on each, and runs on with one more server frozen."""
    c = cluster
    kid, ks, executor, host = kernel_with_x(c)
    lost = next(rid for rid in sorted(host) if rid != executor)
    ks.close()
    c.kill_gateway()
    c.kill_host(host[lost])
    c.gateway = c.start_gateway()
    replicas = wait_whole(c, kid, {f"host-{host[lost]}"}, set(), timeout=150)
    assert lost not in replicas, replicas
    ks = KernelSocket(c.url, kid, c.token)
    assert x_on_every_replica(c, ks, kid) == {"41"}
    ks.close()
    runs_cells_with_one_more_server_frozen(c, kid, replicas)


def test_replicas_their_daemons_gave_up_are_launched_again_when_the_kernel_needs_them():
    """Two of a kernel's replicas die on daemons that restart a replica no more
    (`--max-restarts 0`, as any daemon after a burst of kills): the kernel has no majority, so
    no replacement can join. The gateway launches the given-up replicas again, from their own
    logs, and the kernel runs cells with its state."""
    c = split_cluster(hosts=3, daemon_args=("--max-restarts", "0"))
    try:
        kid, ks, executor, host = kernel_with_x(c)
        ks.close()
        pids = {r["replica_id"]: r["pid"] for r in kernel_view(c, kid)[0]["replicas"]}
        victims = [rid for rid in sorted(pids) if rid != executor]
        for rid in victims:
            os.kill(pids[rid], signal.SIGKILL)
        # Each runs again in a new process its daemon did not start on its own (it restarts
        # none): the gateway launched it.
        deadline = time.time() + 90
        while True:
            replicas = wait_whole(c, kid, set(), set())
            if all(replicas[rid]["pid"] not in (0, pids[rid]) for rid in victims):
                break
            assert time.time() < deadline, replicas
            time.sleep(0.1)
        assert sorted(replicas) == sorted(pids), replicas  # the same replicas, not replacements
        assert all(replicas[rid]["restarts"] == 0 for rid in victims), replicas
        ks = KernelSocket(c.url, kid, c.token)
        assert x_on_every_replica(c, ks, kid) == {"41"}
        ks.close()
    finally:
        c.close()


def wait_migration_done(c, kid, seen):
    """Polls until the kernel has no migration running; collects what the view showed."""
    deadline = time.time() + 90
    while True:
        kernel, _ = kernel_view(c, kid)
        if kernel["migration"]:
            seen.add("migration")
        seen.update(r["state"] for r in kernel["replicas"])
        # Every replica listed has the same fields, a joining one too.
        assert len({frozenset(r) for r in kernel["replicas"]}) == 1, kernel["replicas"]
        if not kernel["migration"] and "migration" in seen:
            return {r["replica_id"]: r for r in kernel["replicas"]}
        assert time.time() < deadline, kernel
        time.sleep(0.05)


def test_operator_drains_a_server_and_migrates_a_replica(cluster):
    c = cluster
    kid, ks, kernel = kernel_with_state(c)
    servers = {r["server_id"]: r["replica_id"] for r in kernel["replicas"]}

    # Bad requests change nothing.
    call = lambda method, path, body=None: rest_call(c.url, c.token, method, path, body)  # noqa
    assert call("POST", "/api/nbos/servers/host-9/drain")[0] == 404
    assert call("POST", "/api/nbos/kernels/nope/migrate", {})[0] == 404
    for bad in ({"replica_id": "1"}, {"replica_id": 0}, {"replica_id": -1},
                {"to_server_id": 5}, [1]):
        status, body = call("POST", f"/api/nbos/kernels/{kid}/migrate", bad)
        assert status == 400 and body["message"], (bad, status, body)
    status, body = call("POST", f"/api/nbos/kernels/{kid}/migrate",
                        {"to_server_id": sorted(servers)[0]})
    assert status == 400 and "already holds" in body["message"], body
    assert call("POST", f"/api/nbos/kernels/{kid}/migrate", {"replica_id": 99})[0] == 404
    assert kernel_view(c, kid)[1]["migrations"]["done"] == 0

    # An operator moves a named replica to a named server (the spare one).
    moved_from = sorted(servers)[0]
    spare = ({f"host-{i}" for i in range(1, HOSTS + 1)} - set(servers)).pop()
    status, body = call("POST", f"/api/nbos/kernels/{kid}/migrate",
                        {"replica_id": servers[moved_from], "to_server_id": spare})
    assert status == 202, body
    assert body["from_server_id"] == moved_from and body["to_server_id"] == spare, body
    seen = set()
    after = wait_migration_done(c, kid, seen)
    assert "joining" in seen or "leaving" in seen, seen
    assert {r["server_id"] for r in after.values()} == set(servers) - {moved_from} | {spare}
    assert all(r["state"] == "live" for r in after.values()), after

    # Drain another server of the kernel: its replica moves to the one left free.
    drained = sorted(set(servers) - {moved_from})[0]
    status, body = call("POST", f"/api/nbos/servers/{drained}/drain")
    assert status == 202 and body["replicas_to_move"] == 1, body
    seen = set()
    after = wait_migration_done(c, kid, seen)
    assert {r["server_id"] for r in after.values()} == set(servers) - {drained} | {spare}
    assert all(r["state"] == "live" for r in after.values()), after
    view = kernel_view(c, kid)[1]
    server = next(s for s in view["servers"] if s["server_id"] == drained)
    assert server["draining"] and not server["accepting"], server
    assert view["migrations"]["done"] == 2 and view["migrations"]["replacements_done"] == 0
    deadline = time.time() + 30
    while c.host_replicas(int(drained.split("-")[1])):
        assert time.time() < deadline, "the drained server still runs replicas"
        time.sleep(0.2)
    # Nothing new goes to the drained server, and with it out no server is free for a move.
    status, body = call("POST", f"/api/nbos/kernels/{kid}/migrate", {})
    assert status == 409 and "no server" in body["message"], (status, body)
    status, other = call("POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, other
    other_servers = {r["server_id"] for r in kernel_view(c, other["id"])[0]["replicas"]}
    assert drained not in other_servers, other_servers
    assert call("DELETE", f"/api/kernels/{other['id']}")[0] == 204

    digests = digests_by_replica(ks, after)
    assert set(digests.values()) == {expected_digest()}, digests
    ks.close()
    assert call("DELETE", f"/api/kernels/{kid}")[0] == 204
