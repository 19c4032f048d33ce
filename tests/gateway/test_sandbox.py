"""Replicas are sandboxed: on `nbos up` (run as root, so with per-kernel user ids and cgroups),
a cell of alice's kernel tries to reach bob's kernel and the cluster's state: bob's replica
directories, /proc/<pid>/environ of bob's replicas, the gateway's database, the cluster
credential, the blob store's listing, signalling bob's replicas, bob's part of the workspace and
bob's /tmp, and bob's replicas' Raft and forwarding ports. Everything fails, and bob's kernel keeps
its state. A cell allocating more memory than its kernel subscribed (KERNEL_MEMORY)
is stopped with an error saying so, and the other kernels on those servers keep running."""

import glob
import json
import os

import pytest

from cluster import KernelSocket, raft_log_roots, rest_call, users_cluster

TOKENS = {"alice": "alice-token-sandbox-0123", "bob": "bob-token-sandbox-01234",
          "ops": "ops-token-sandbox-012345"}

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or not os.path.exists("/usr/bin/bwrap"),
                                reason="per-kernel users and cgroups need root and bubblewrap")


@pytest.fixture(scope="module")
def cluster():
    with users_cluster({n: (t, n == "ops") for n, t in TOKENS.items()}, hosts=3,
                       gpus_per_host=1, extra=("--sandbox", "on")) as c:
        yield c


def start(c, user, env=None):
    status, model = rest_call(c.url, TOKENS[user], "POST", "/api/kernels",
                              {"name": "nbos", "env": env or {}})
    assert status == 201, (user, status, model)
    return model["id"], KernelSocket(c.url, model["id"], TOKENS[user])


def run(ks, code):
    reply, iopub = ks.execute(code)
    text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    return reply["content"], text


def replica_pids(kernel_id):
    """Host pids of a kernel's replica processes (as root): those writing to its replica logs
    (they run in the kernel's workspace, not in their replica directories)."""
    pids = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                argv = f.read().split(b"\0")
            files = [os.readlink(f"/proc/{p}/fd/{fd}") for fd in os.listdir(f"/proc/{p}/fd")]
        except OSError:
            continue
        if argv[1:2] == [b"replica"] and any(
                f.endswith("/replica.log") and
                os.path.basename(os.path.dirname(f)).startswith(kernel_id + "-") for f in files):
            pids.append(int(p))
    return pids


ATTACK = r'''
import glob, json, os, signal
tried = {}
def attempt(name, f):
    try:
        tried[name] = "succeeded: " + repr(f())[:80]
    except Exception as e:
        tried[name] = type(e).__name__
for d in TARGET_DIRS:
    attempt("list " + d, lambda: os.listdir(d))
    attempt("read " + d, lambda: open(d + "/connection.json").read())
    attempt("write " + d, lambda: open(d + "/planted.py", "w").write("x"))
for d in RAFT_DIRS:
    attempt("list " + d, lambda: os.listdir(d))
    attempt("read " + d, lambda: open(d + "/metadata1", "rb").read())
    attempt("write " + d, lambda: open(d + "/planted", "w").write("x"))
for pid in TARGET_PIDS:
    attempt("environ %d" % pid, lambda: open("/proc/%d/environ" % pid, "rb").read())
    attempt("kill %d" % pid, lambda: os.kill(pid, signal.SIGKILL))
for path in SECRET_FILES:
    attempt("read " + path, lambda: open(path, "rb").read() or 1 / 0)
attempt("list blobs", lambda: os.listdir(BLOBS) or 1 / 0)
attempt("list a blob fan-out dir", lambda: os.listdir(BLOBS + "/00") or 1 / 0)
attempt("write /usr", lambda: open("/usr/nbos-planted", "w"))
tried["processes visible"] = len([p for p in os.listdir("/proc") if p.isdigit()])
tried["uid"] = os.getuid()
tried["secrets in env"] = sorted(k for k in os.environ if "TOKEN" in k or k.startswith("AWS"))
print(json.dumps(tried))
'''


def test_a_cell_cannot_reach_another_users_kernel_or_the_clusters_state(cluster):
    c = cluster
    bob_id, bob = start(c, "bob")
    content, _ = run(bob, "secret = 'bob-was-here'\nopen('mine.txt', 'w').write(secret)")
    assert content["status"] == "ok", content
    alice_id, alice = start(c, "alice")
    bob_dirs = sorted(glob.glob(f"{c.state_dir}/host-*/replicas/{bob_id}-*"))
    roots = raft_log_roots(c.state_dir)
    bob_raft_dirs = sorted(d for root in roots for d in glob.glob(f"{root}/{bob_id}-*"))
    bob_pids = replica_pids(bob_id)
    assert len(bob_dirs) == 3 and len(bob_pids) == 3, (bob_dirs, bob_pids)
    assert len(bob_raft_dirs) == (3 if roots else 0), (roots, bob_raft_dirs)  # 0: in bob_dirs
    gateway_files = [p for p in glob.glob(f"{c.state_dir}/gateway/*") if os.path.isfile(p)]
    assert gateway_files, "the gateway keeps its database in its state directory"
    code = (f"TARGET_DIRS = {bob_dirs!r}\nRAFT_DIRS = {bob_raft_dirs!r}\n"
            f"TARGET_PIDS = {bob_pids!r}\n"
            f"SECRET_FILES = {gateway_files + [c.state_dir + '/cluster.credential']!r}\n"
            f"BLOBS = {c.state_dir + '/blobs'!r}\n" + ATTACK)
    content, text = run(alice, code)
    assert content["status"] == "ok", content
    tried = json.loads(text)
    print(json.dumps(tried, indent=1))
    succeeded = {k: v for k, v in tried.items() if isinstance(v, str) and "succeeded" in v}
    assert not succeeded, succeeded
    assert tried["processes visible"] <= 3, tried  # bubblewrap's init, the replica, maybe a child
    assert tried["uid"] != 0 and tried["secrets in env"] == [], tried

    # Bob's kernel did not notice: same processes, same state, its files untouched.
    assert sorted(replica_pids(bob_id)) == sorted(bob_pids)
    content, text = run(bob, "print(secret, open('mine.txt').read(), "
                             "__import__('os').path.exists('planted.py'))")
    assert content["status"] == "ok" and text == "bob-was-here bob-was-here False\n", (content,
                                                                                     text)
    # Kernels of different users run as different users, and no replica as root.
    bob_uids = {os.stat(d).st_uid for d in bob_dirs}
    content, text = run(alice, "import os; print(os.getuid())")
    assert len(bob_uids) == 1 and int(text) not in bob_uids | {0}, (bob_uids, text)
    for ks, kid, user in ((alice, alice_id, "alice"), (bob, bob_id, "bob")):
        ks.close()
        assert rest_call(c.url, TOKENS[user], "DELETE", f"/api/kernels/{kid}")[0] == 204


def test_a_cell_over_its_memory_is_stopped_with_a_clear_error_and_neighbours_run_on(cluster):
    c = cluster
    bob_id, bob = start(c, "bob")
    assert run(bob, "total = sum(range(10))")[0]["status"] == "ok"
    hog_id, hog = start(c, "alice", {"KERNEL_MEMORY": "300"})
    assert run(hog, "kept = 41")[0]["status"] == "ok"
    content, _ = run(hog, "x = b'\\x01' * (600 << 20)\nprint(len(x))")
    assert content["status"] == "error", content
    assert "out of memory" in content["evalue"] and "300 MB" in content["evalue"], content
    # Its kernel goes on from the last completed cell; bob's never stopped.
    content, text = run(hog, "print(kept + 1)")
    assert content["status"] == "ok" and text == "42\n", (content, text)
    content, text = run(bob, "print(total)")
    assert content["status"] == "ok" and text == "45\n", (content, text)
    logs = "".join(open(p).read() for p in glob.glob(f"{c.state_dir}/logs/host-*.log"))
    assert "out of memory" in logs
    for ks, kid, user in ((hog, hog_id, "alice"), (bob, bob_id, "bob")):
        ks.close()
        assert rest_call(c.url, TOKENS[user], "DELETE", f"/api/kernels/{kid}")[0] == 204


WORKSPACE_PROBE = r'''
import json, os
seen = {"cwd": os.getcwd(), "root": sorted(os.listdir(ROOT))}
for name, path in (("bob's notes", ROOT + "/bob/notes.txt"), ("bob's tmp", "/tmp/bob.txt")):
    try:
        seen[name] = "read: " + open(path).read()
    except OSError as e:
        seen[name] = type(e).__name__
print(json.dumps(seen))
'''


def test_a_user_sees_only_their_own_part_of_the_workspace_and_their_own_tmp(cluster):
    c = cluster
    root = os.path.realpath(c.workspace)
    bob_id, bob = start(c, "bob")
    content, text = run(bob, "import os\nopen('notes.txt', 'w').write('for bob')\n"
                             "open('/tmp/bob.txt', 'w').write('bob tmp')\nprint(os.getcwd())")
    assert content["status"] == "ok" and text == f"{root}/bob\n", (content, text)
    alice_id, alice = start(c, "alice")
    content, text = run(alice, f"ROOT = {root!r}\n" + WORKSPACE_PROBE)
    assert content["status"] == "ok", content
    assert json.loads(text) == {"cwd": f"{root}/alice", "root": ["alice"],
                                "bob's notes": "FileNotFoundError",
                                "bob's tmp": "FileNotFoundError"}, text
    status, body = rest_call(c.url, TOKENS["alice"], "POST", "/api/kernels", {
        "name": "nbos", "env": {"KERNEL_WORKING_DIR": f"{root}/bob"}})
    assert status == 400 and f"{root}/alice" in body["message"], (status, body)
    # An admin's kernel sees the whole workspace.
    ops_id, ops = start(c, "ops")
    content, text = run(ops, f"import os\nprint(sorted(os.listdir({root!r})))")
    assert content["status"] == "ok" and {"alice", "bob"} <= set(eval(text)), (content, text)
    for ks, kid, user in ((alice, alice_id, "alice"), (bob, bob_id, "bob"), (ops, ops_id, "ops")):
        ks.close()
        assert rest_call(c.url, TOKENS[user], "DELETE", f"/api/kernels/{kid}")[0] == 204


def raft_address(pid, replica_dir):
    """The Raft address ("IP:port") replica `pid` listens on, found as a cell would find it (in
    /proc/net/tcp) and told apart from its Jupyter ports (its connection file): the lower of the
    two other ports it listens on (Raft and, one above, forwarded proposals)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(link[len("socket:["):-1])
    listening = {}
    with open(f"/proc/{pid}/net/tcp") as f:
        for line in f.readlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:
                ip_hex, port_hex = fields[1].split(":")
                ip = ".".join(str(b) for b in reversed(bytes.fromhex(ip_hex)))
                listening[int(port_hex, 16)] = ip
    with open(f"{replica_dir}/connection.json") as f:
        conn = json.load(f)
    jupyter = {conn[k] for k in ("shell_port", "iopub_port", "stdin_port", "control_port",
                                 "hb_port")}
    others = sorted(set(listening) - jupyter)
    assert len(others) == 2 and others[1] == others[0] + 1, (listening, jupyter)
    return f"{listening[others[0]]}:{others[0]}"


FORGE = r'''
import json, socket, struct, zmq
def forge(targets):
    def u64(v):
        return struct.pack("<Q", v)
    def preamble(member_id, address):
        a = address.encode() + b"\0"
        a += b"\0" * (-len(a) % 8)
        return u64(1) + u64(member_id) + u64(len(a)) + a
    def disruptive_vote(candidate):
        big = 1 << 40
        return u64(3) + u64(40) + u64(big) + u64(candidate) + u64(big) + u64(big) + u64(1)
    seen = {}
    for address, claimed in targets:
        host, port = address.rsplit(":", 1)
        s = socket.create_connection((host, int(port)), timeout=10)
        s.sendall(preamble(claimed, address) + b"x" * 32 + disruptive_vote(claimed))
        got, how = b"", "closed"
        try:
            while True:
                chunk = s.recv(256)
                if not chunk:
                    break
                got += chunk
        except ConnectionResetError:
            how = "reset"
        except socket.timeout:
            how = "still open"
        s.close()
        answers = []
        d = zmq.Context.instance().socket(zmq.DEALER)
        d.linger = 0
        d.connect("tcp://%s:%d" % (host, int(port) + 1))
        for request in ([b"1", b"", b"forged entry"], [b"2", b"", b"", b"remove", str(claimed).encode()]):
            d.send_multipart(request)
            answers.append([f.decode() for f in d.recv_multipart()] if d.poll(10000) else None)
        d.close()
        seen[address] = {"raft": [len(got), how], "router": answers}
    return seen
print(json.dumps(forge(TARGETS)))
del forge
'''


def test_a_cell_cannot_speak_to_another_kernels_consensus(cluster):
    """Alice's cell connects to each of bob's replicas' Raft and forwarding ports, claims to be
    one of bob's replicas and sends a vote request for a far later term, a proposal and the
    removal of a member. Raft closes each connection after its challenge, the forwarding port
    answers "refused"; bob's replicas count and log it, and bob's kernel runs on unchanged."""
    c = cluster
    bob_id, bob = start(c, "bob")
    assert run(bob, "counter = 41")[0]["status"] == "ok"
    pids = replica_pids(bob_id)
    dirs = sorted(glob.glob(f"{c.state_dir}/host-*/replicas/{bob_id}-*"))
    assert len(pids) == 3 and len(dirs) == 3, (pids, dirs)
    # Which pid runs in which directory does not matter: the Jupyter ports of all three are
    # excluded by trying each directory.
    addresses = []
    for pid in pids:
        for d in dirs:
            try:
                addresses.append(raft_address(pid, d))
                break
            except AssertionError:
                continue
    assert len(set(addresses)) == 3, addresses
    # Each claims to be replica 2 (ids are 1-3 at the start): a member the target knows.
    targets = [(a, 2) for a in addresses]
    alice_id, alice = start(c, "alice")
    content, text = run(alice, f"TARGETS = {targets!r}\n" + FORGE)
    assert content["status"] == "ok", content
    seen = json.loads(text)
    print(json.dumps(seen, indent=1))
    for address, _ in targets:
        received, how = seen[address]["raft"]
        assert received <= 32 and how in ("closed", "reset"), (address, seen[address])
        for answer in seen[address]["router"]:
            assert answer is not None and answer[1] == "refused", (address, seen[address])

    # Bob's kernel: the same state, three members, and the refusals counted and logged. Bob
    # connects again: his socket sat unread through alice's cell, which is not what is tested.
    bob.close()
    bob = KernelSocket(c.url, bob_id, TOKENS["bob"], timeout=60)
    reply, iopub = bob.execute("counter += 1\nprint(counter)")
    text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    assert reply["content"]["status"] == "ok" and text == "42\n", (reply["content"], text)
    assert reply["metadata"]["nbos"]["peers_refused"] >= 3, reply["metadata"]
    assert len(replica_pids(bob_id)) == 3
    logs = {p: open(p).read() for p in
            glob.glob(f"{c.state_dir}/host-*/replicas/{bob_id}-*/replica.log")}
    assert len(logs) == 3, sorted(logs)
    for path, log in logs.items():
        assert "refused a Raft connection from replica" in log, (path, log[-2000:])
        assert "refused a forwarded request" in log, (path, log[-2000:])
    for ks, kid, user in ((alice, alice_id, "alice"), (bob, bob_id, "bob")):
        ks.close()
        assert rest_call(c.url, TOKENS[user], "DELETE", f"/api/kernels/{kid}")[0] == 204
