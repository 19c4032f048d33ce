"""Live migration of a replica: a new `nbos replica` starts without peers, any live replica is
asked on its control channel (nbos_membership_request) to add it, then to remove an old one. The
suite plays the gateway's part, as test_replicated_kernel does.
"""

import os
import pathlib
import subprocess
import sys
import tempfile

from jupyter_client import BlockingKernelClient

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from conftest import nbos_bin  # noqa: E402
from test_replicated_kernel import (TIMEOUT, Group, Replica, check_cell,  # noqa: E402
                                    free_port_pair, stream_text,
                                    write_kernel_connection_file)


def membership(replica, content):
    reply = replica.request("nbos_membership_request", content, channel="control")
    assert reply["msg_type"] == "nbos_membership_reply"
    return reply["content"]


def add_replica(group, replica_id):
    """Starts replica `replica_id` without peers; it is not a member until added."""
    group.addresses[replica_id] = f"127.0.0.1:{free_port_pair()}"
    r = Replica(group, replica_id)
    r.join = True
    group.replicas[replica_id] = r
    r.start()
    return r


def stop(replica):
    replica.proc.terminate()
    replica.proc.wait()
    replica.client.stop_channels()
    replica.client = None


def migrate_and_check(group):
    """Cells on 1..3 (blob-sized array, list, function), then 1 -> 4, then a cell on 4."""
    check_cell(group.execute("import numpy as np\nbig = np.arange(1 << 18, dtype='f8')\n"
                             "items = [1, 2]", 2), 2)
    check_cell(group.execute("items.append(3)\ndef twice(v):\n    return 2 * v", 3), 3)
    # Replica 1 executes last, several cells in a row, so that it asks to lead the Raft group:
    # its removal then goes through a leadership transfer.
    for i in range(3):
        check_cell(group.execute(f"items.append({4 + i})\nbig[{i}] = -1", 1), 1)
    group.assert_converged()

    r4 = add_replica(group, 4)
    # Asked who the members are, each replica answers the group it knows, at once: the same
    # committed configuration and term everywhere, and one of them leads.
    answers = {rid: membership(group.replicas[rid], {"op": "members"}) for rid in (1, 2, 3)}
    for rid, content in answers.items():
        assert set(content) == {"status", "members", "committed", "leading", "term"}, content
        assert content["status"] == "ok" and content["members"] == [1, 2, 3], (rid, content)
        assert content["committed"] is True and content["term"] >= 1, (rid, content)
    assert len({content["term"] for content in answers.values()}) == 1, answers
    assert sum(content["leading"] for content in answers.values()) == 1, answers
    content = membership(group.replicas[2], {"op": "add", "replica_id": 4,
                                             "raft_address": group.addresses[4]})
    assert content == {"status": "ok"}, content
    assert sorted(membership(group.replicas[3], {"op": "members"})["members"]) == [1, 2, 3, 4]
    # Adding it again is fine; at another address it is not.
    content = membership(group.replicas[3], {"op": "add", "replica_id": 4,
                                             "raft_address": group.addresses[4]})
    assert content == {"status": "ok"}, content
    content = membership(group.replicas[3], {"op": "add", "replica_id": 4,
                                             "raft_address": group.addresses[1]})
    assert content["status"] == "error" and "already" in content["evalue"], content

    content = membership(group.replicas[2], {"op": "remove", "replica_id": 1})
    assert content == {"status": "ok"}, content
    assert sorted(membership(group.replicas[2], {"op": "members"})["members"]) == [2, 3, 4]
    stop(group.replicas[1])
    # Removing it again, or an id that never was a member, is fine.
    assert membership(r4, {"op": "remove", "replica_id": 1}) == {"status": "ok"}
    assert membership(r4, {"op": "remove", "replica_id": 77}) == {"status": "ok"}

    results = group.execute("items.append(twice(len(items)))\nprint(items, big[:4].tolist(), "
                            "float(big.sum()))", 4)
    reply, outputs = check_cell(results, 4)
    assert set(results) == {2, 3, 4}
    total = float(sum(range(1 << 18)) - (0 + 1 + 2) - 3)
    assert stream_text(outputs) == f"[1, 2, 3, 4, 5, 6, 12] [-1.0, -1.0, -1.0, 3.0] {total}\n"
    group.assert_converged()
    # Elections among {2, 3, 4} keep working, whoever executes.
    check_cell(group.execute("items.append(0)", 2), 2)
    check_cell(group.execute("print(len(items))", 3), 3)
    group.assert_converged()
    return r4


def test_migrate_a_replica(kernelspec_dir):
    group = Group()
    try:
        migrate_and_check(group)
    finally:
        group.close()


def test_migrate_a_replica_caught_up_from_a_snapshot(kernelspec_dir):
    # Small thresholds: the new replica gets a Raft snapshot (checkpoint + journal) and entries.
    group = Group(extra_args=["--checkpoint-every", "2", "--snapshot-threshold", "8"])
    try:
        migrate_and_check(group)
        assert "restoring the namespace from a snapshot" in group.replicas[4].stderr()
    finally:
        group.close()


def test_malformed_membership_requests(kernelspec_dir):
    group = Group()
    try:
        r = group.replicas[2]
        bad = [
            ({"replica_id": 4, "raft_address": "127.0.0.1:9000"}, "op"),
            ({"op": "grow", "replica_id": 4}, "grow"),
            ({"op": "remove", "replica_id": 0}, "replica_id"),
            ({"op": "add", "replica_id": 4}, "raft_address"),
            ({"op": "add", "replica_id": 4, "raft_address": "somewhere:9000"}, "somewhere"),
            ({"op": "add", "replica_id": 4, "raft_address": "127.0.0.1:70000"}, "70000"),
            # The address of a member under another id.
            ({"op": "add", "replica_id": 9, "raft_address": group.addresses[1]}, "replica 1"),
        ]
        for content, mentioned in bad:
            reply = membership(r, content)
            assert reply["status"] == "error", (content, reply)
            assert reply["ename"] == "ValueError", (content, reply)
            assert mentioned in reply["evalue"], (content, reply)
            assert reply["traceback"] == []
        # The group is unchanged and still works.
        check_cell(group.execute("ok = True", 1), 1)
        group.assert_converged()
    finally:
        group.close()


def test_standalone_kernel_refuses_membership_requests(kernelspec_dir):
    d = tempfile.mkdtemp(prefix="nbos-standalone-")
    conn = os.path.join(d, "kernel.json")
    write_kernel_connection_file(conn, b"key")
    proc = subprocess.Popen([nbos_bin(), "kernel", "-f", conn], stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    client = BlockingKernelClient(connection_file=conn)
    client.load_connection_file()
    client.start_channels()
    try:
        client.wait_for_ready(timeout=TIMEOUT)
        msg = client.session.msg("nbos_membership_request", {"op": "remove", "replica_id": 1})
        client.control_channel.send(msg)
        while True:
            reply = client.get_control_msg(timeout=TIMEOUT)
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                break
        assert reply["msg_type"] == "nbos_membership_reply"
        assert reply["content"]["status"] == "error"
        assert "not replicated" in reply["content"]["evalue"]
    finally:
        client.stop_channels()
        proc.kill()
        proc.wait()
