"""A distributed kernel: three `nbos replica` processes on loopback, one Raft group, one blob
store. This suite plays the gateway's part: it sends every execute_request to all three replicas,
names the executor with `nbos.target_replica`, and checks that after every cell all three
namespaces are equal (per-name digests from nbos_namespace_request), that only the executor
produces output, and what happens when replicas die.
"""

import contextlib
import json
import os
import pathlib
import re
import shutil
import signal
import socket
import sqlite3
import subprocess
import sys
import tempfile
import time
import uuid

import pytest
from jupyter_client import BlockingKernelClient
from jupyter_client.connect import write_connection_file

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from conftest import free_ports, freeze, nbos_bin  # noqa: E402

TIMEOUT = 60


def free_port_pair():
    """A loopback port p with p + 1 free too (a replica serves forwarded proposals there)."""
    return free_ports(1, pairs=True)[0]


def write_kernel_connection_file(path, key):
    shell, iopub, stdin, control, hb = free_ports(5)
    write_connection_file(path, key=key, shell_port=shell, iopub_port=iopub, stdin_port=stdin,
                          control_port=control, hb_port=hb)


class Replica:
    def __init__(self, group, replica_id):
        self.group = group
        self.id = replica_id
        self.dir = os.path.join(group.dir, f"replica-{replica_id}")
        os.makedirs(self.dir, exist_ok=True)
        self.connection_file = os.path.join(self.dir, "kernel.json")
        write_kernel_connection_file(self.connection_file, group.key.encode())
        self.proc = None
        self.client = None
        self.store_url = None  # the group's store unless set
        # A replica that joins an existing group (added by a membership request) starts with an
        # empty log and no --peer flags.
        self.join = False

    def start(self):
        try:
            self._start()
        except RuntimeError:
            # A restarted replica's old Jupyter ports may have been taken meanwhile: those are
            # the client's to choose, so pick new ones once (the Raft address is its identity).
            if "Address already in use" not in self.stderr():
                raise
            self.client.stop_channels()
            write_kernel_connection_file(self.connection_file, self.group.key.encode())
            self._start()

    def _start(self):
        stderr = open(os.path.join(self.dir, "stderr.log"), "ab")
        self.proc = subprocess.Popen(
            [nbos_bin(), "replica", "-f", self.connection_file, "--id", str(self.id),
             "--raft", self.group.addresses[self.id], "--data-dir",
             os.path.join(self.group.raft_root or self.dir, f"raft-{self.id}"),
             "--blob-store", self.store_url or self.group.store_url,
             "--log-level", "info"] + self.group.extra_args +
            ([] if self.join else
             [f"--peer={i}={a}" for i, a in self.group.addresses.items()]),
            stdout=subprocess.DEVNULL, stderr=stderr, cwd=self.dir,
            # Blob hints are off by default; this suite runs every cell with them unless told
            # otherwise (bench/replication_bench.py reuses it).
            env={**os.environ, "NBOS_BLOB_HINTS": os.environ.get("NBOS_BLOB_HINTS", "on")})
        stderr.close()
        self.client = BlockingKernelClient(connection_file=self.connection_file)
        self.client.load_connection_file()
        self.client.start_channels()
        # jupyter_client calls a kernel dead when one heartbeat is late, which happens while a
        # slow (sanitizer) build starts three replicas on two cores; the process is the truth.
        deadline = time.monotonic() + TIMEOUT
        while True:
            try:
                self.client.wait_for_ready(timeout=max(1, deadline - time.monotonic()))
                break
            except RuntimeError:
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"replica {self.id} did not start:\n" + self.stderr())

    def kill(self):
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait()
        self.client.stop_channels()
        self.client = None

    def alive(self):
        return self.proc is not None and self.proc.poll() is None

    def stderr(self):
        return pathlib.Path(self.dir, "stderr.log").read_text(errors="replace")

    def request(self, msg_type, content, channel="shell"):
        msg = self.client.session.msg(msg_type, content)
        getattr(self.client, f"{channel}_channel").send(msg)
        get = self.client.get_shell_msg if channel == "shell" else self.client.get_control_msg
        deadline = time.monotonic() + TIMEOUT
        while True:
            reply = get(timeout=max(0.1, deadline - time.monotonic()))
            if reply["parent_header"].get("msg_id") == msg["header"]["msg_id"]:
                return reply

    def digests(self):
        content = self.request("nbos_namespace_request", {})["content"]
        assert content.get("status") == "ok", content
        return content["digests"]


class Group:
    """`n` replicas of one kernel in a new temporary directory; their Raft logs there too, or
    in `raft_root` (which the caller owns) when given."""

    def __init__(self, n=3, extra_args=(), store_url=None, raft_root=None):
        self.extra_args = list(extra_args)
        self.raft_root = raft_root
        self.dir = tempfile.mkdtemp(prefix="nbos-replicas-")
        self.key = uuid.uuid4().hex
        self.store_url = store_url or "dir://" + os.path.join(self.dir, "blobs")
        self.addresses = {i: f"127.0.0.1:{free_port_pair()}" for i in range(1, n + 1)}
        self.replicas = {i: Replica(self, i) for i in self.addresses}
        try:
            for r in self.replicas.values():
                r.start()
        except BaseException:
            self.close()  # the caller gets no group to close: stop the replicas started so far
            raise

    def live(self):
        return [r for r in self.replicas.values() if r.alive()]

    def send_execute(self, code, target, replicas=None, user_expressions=None, previous=None,
                     exec_id=None):
        """`previous`: the exec id of the cell before, as the gateway names it (decision 0012)."""
        exec_id = exec_id or uuid.uuid4().hex
        sent = {}
        for r in replicas or self.live():
            content = {"code": code, "silent": False, "store_history": True,
                       "user_expressions": user_expressions or {}, "allow_stdin": False,
                       "stop_on_error": True}
            msg = r.client.session.msg("execute_request", content)
            msg["metadata"] = {"nbos": {"exec_id": exec_id, "target_replica": target}}
            if previous is not None:
                msg["metadata"]["nbos"]["previous_exec_id"] = previous
            r.client.shell_channel.send(msg)
            sent[r.id] = msg["header"]["msg_id"]
        return exec_id, sent

    def collect(self, sent):
        """Per replica: (execute_reply, iopub messages for the request up to idle)."""
        out = {}
        for rid, msg_id in sent.items():
            r = self.replicas[rid]
            deadline = time.monotonic() + TIMEOUT
            while True:
                reply = r.client.get_shell_msg(timeout=max(0.1, deadline - time.monotonic()))
                if reply["parent_header"].get("msg_id") == msg_id:
                    break
            outputs = []
            while True:
                m = r.client.get_iopub_msg(timeout=max(0.1, deadline - time.monotonic()))
                if m["parent_header"].get("msg_id") != msg_id:
                    continue
                outputs.append(m)
                if m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                    break
            out[rid] = (reply, outputs)
        return out

    def execute(self, code, target):
        _, sent = self.send_execute(code, target)
        return self.collect(sent)

    def assert_converged(self):
        digests = {r.id: r.digests() for r in self.live()}
        reference = next(iter(digests.values()))
        for rid, d in digests.items():
            assert d == reference, f"replica {rid} differs: " + str(
                {k: (d.get(k), reference.get(k)) for k in set(d) | set(reference)
                 if d.get(k) != reference.get(k)})
        return reference

    def close(self):
        for r in self.replicas.values():
            if r.alive():
                r.proc.kill()
                r.proc.wait()
            if r.client is not None:
                r.client.stop_channels()


@pytest.fixture
def group(kernelspec_dir):
    g = Group()
    yield g
    g.close()


def stream_text(outputs):
    return "".join(m["content"]["text"] for m in outputs if m["msg_type"] == "stream")


def check_cell(results, executor, expect_status="ok"):
    reply, outputs = results[executor]
    assert reply["content"]["status"] == expect_status, reply["content"]
    assert reply["metadata"]["nbos"]["role"] == "executor"
    for rid, (r, outs) in results.items():
        assert r["metadata"]["nbos"]["executor"] == executor
        assert r["content"]["status"] == reply["content"]["status"]
        assert r["content"]["execution_count"] == reply["content"]["execution_count"]
        if rid != executor:
            # Standbys stay silent: busy and idle only.
            assert [m["msg_type"] for m in outs] == ["status", "status"], outs
    return reply, outputs


CELLS = [
    ("x = 41\nitems = [1, 2]\nprint('hello from', x)", None),
    ("x += 1\nitems.append(x)\nalias = items", None),
    ("def square(v):\n    return v * v\nclass Point:\n    def __init__(self, a):\n"
     "        self.a = a\n    def norm(self):\n        return square(self.a)\n"
     "p = Point(x)\nf = lambda k: k + x", None),
    ("import numpy as np\nsmall = np.arange(10)\nbig = np.random.default_rng(0)"
     ".standard_normal((512, 512))\nbig[0, 0] = p.norm()", None),
    ("import pandas as pd\ndf = pd.DataFrame({'a': range(5), 'b': list('vwxyz')})\n"
     "df['c'] = df['a'] * 2", None),
    ("import torch\ntorch.manual_seed(0)\nmodel = torch.nn.Sequential(torch.nn.Linear(8, 16), "
     "torch.nn.ReLU(), torch.nn.Linear(16, 1))", None),
    ("opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)\n"
     "data = torch.randn(64, 8)\ntarget = torch.randn(64, 1)", None),
    ("for _ in range(3):\n    opt.zero_grad()\n    loss = ((model(data) - target) ** 2).mean()\n"
     "    loss.backward()\n    opt.step()\nprint(round(loss.item(), 6))", None),
    ("del small\nitems.append(f(1))", None),
    ("print(alias is items, square(3), p.norm(), len(df))", "True 9 1764 5\n"),
]


def test_forced_targets_keep_namespaces_equal(group):
    for n, (code, expected_stdout) in enumerate(CELLS):
        target = 1 + n % 3
        results = group.execute(code, target)
        reply, outputs = check_cell(results, target)
        assert reply["content"]["execution_count"] == n + 1
        if expected_stdout is not None:
            assert stream_text(outputs) == expected_stdout
        digests = group.assert_converged()
        assert "small" not in digests or n < 8
    # The optimizer on every replica drives that replica's model parameters: one more step on a
    # different replica than the last gives the same model everywhere.
    results = group.execute("opt.zero_grad()\nloss = ((model(data) - target) ** 2).mean()\n"
                            "loss.backward()\nopt.step()\nw = model[0].weight.sum().item()", 2)
    check_cell(results, 2)
    group.assert_converged()
    results = group.execute("print(round(w, 5) == round(model[0].weight.sum().item(), 5))", 3)
    assert stream_text(check_cell(results, 3)[1]) == "True\n"
    # `big` (2 MB) travelled through the blob store, fetched ahead by the standbys.
    assert "prefetching" in group.replicas[1].stderr() + group.replicas[3].stderr()


def test_large_tensors_written_in_place_on_a_standby(group):
    """A 24 MiB tensor travels through the blob store as a hash tree of chunks and becomes, on
    the standbys, a copy-on-write mapping of the blob file: writing to it there changes that
    replica's tensor alone, never the stored blob the other replicas read."""
    check_cell(group.execute("import torch\nt = torch.arange(6 << 20, dtype=torch.float32)\n"
                             "u = t.clone()", 1), 1)
    group.assert_converged()
    # The executor announced both blobs as it stored them, before its delta; each standby was
    # told of both (counts as of the next cell's election).
    results = group.execute("pass", 1)
    check_cell(results, 1)
    blobs = {rid: reply["metadata"]["nbos"]["blobs"] for rid, (reply, _) in results.items()}
    assert blobs[1]["announced"] == 2, blobs
    assert blobs[2]["hinted"] == 2 and blobs[3]["hinted"] == 2, blobs
    check_cell(group.execute("t[0] = -1.0\nt[-1] = 7.0\nfirst = float(t[0])", 2), 2)
    group.assert_converged()
    results = group.execute("print(float(t[0]), float(t[-1]), bool((t[1:-1] == u[1:-1]).all()),"
                            " float(u[-1]))", 3)
    assert stream_text(check_cell(results, 3)[1]) == f"-1.0 7.0 True {float((6 << 20) - 1)}\n"
    group.assert_converged()


def test_errors_replicate_as_errors(group):
    results = group.execute("y = 1\nraise ValueError('boom')", 2)
    reply, outputs = check_cell(results, 2, expect_status="error")
    assert reply["content"]["ename"] == "ValueError"
    assert any(m["msg_type"] == "error" for m in outputs)
    group.assert_converged()


def test_all_replicas_yield(group):
    results = group.execute("z = 1", 99)  # nobody is targeted: every replica yields
    for reply, _ in results.values():
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "NoReplicaCanExecute"
    results = group.execute("z = 2", 1)
    check_cell(results, 1)


def election_table(group, replica):
    """The elections `replica` has applied, by execution id: the first entry of a checkpoint of
    its replicated state (u32 size, then format, type, u32 header size, JSON header)."""
    reply = group.replicas[replica].request("nbos_checkpoint_request", {}, channel="control")
    assert reply["content"]["status"] == "ok", reply["content"]
    key = reply["content"]["key"]
    data = pathlib.Path(group.dir, "blobs", key[:2], key).read_bytes()
    entry = data[4:4 + int.from_bytes(data[:4], "big")]
    header = json.loads(entry[6:6 + int.from_bytes(entry[2:6], "big")])
    return {e["id"]: e for e in header["meta"]["elections"]}


def test_only_the_targeted_replica_proposes_in_an_election(group):
    """A targeted member's LEAD alone decides its election, so the others add no YIELD to the
    log; a target that is no member still gets every replica's YIELD, which fails the election."""
    exec_ids = {}
    for target in (1, 2, 99):
        exec_ids[target], sent = group.send_execute("pass", target)
        group.collect(sent)
    elections = election_table(group, 3)
    for target in (1, 2):
        e = elections[exec_ids[target]]
        assert (e["winner"], e["leads"], e["yields"]) == (target, [target], []), e
    e = elections[exec_ids[99]]
    assert e["failed"] and sorted(e["yields"]) == [1, 2, 3] and not e["leads"], e
    # Named the cell it ran before, a replica without --run-ahead still waits for its LEAD.
    _, sent = group.send_execute("pass", 1, previous=exec_ids[1])
    assert not check_cell(group.collect(sent), 1)[0]["metadata"]["nbos"]["ran_ahead"]


@pytest.fixture
def ahead_group(kernelspec_dir):
    g = Group(extra_args=["--run-ahead", "on"])
    yield g
    g.close()


def test_a_sticky_executor_runs_ahead_of_its_lead(ahead_group):
    """Named the previous cell, which it ran, the target runs the cell before its LEAD commits
    and commits the LEAD with the effects; a replica that did not run the previous cell takes the
    LEAD round first. Without --run-ahead (the default) it never does."""
    group = ahead_group
    first, sent = group.send_execute("x = 1", 1)
    assert not check_cell(group.collect(sent), 1)[0]["metadata"]["nbos"]["ran_ahead"]
    second, sent = group.send_execute("x += 1\nprint(x)", 1, previous=first)
    reply, outputs = check_cell(group.collect(sent), 1)
    assert reply["metadata"]["nbos"]["ran_ahead"] and stream_text(outputs) == "2\n"
    _, sent = group.send_execute("x *= 10", 2, previous=second)
    assert not check_cell(group.collect(sent), 2)[0]["metadata"]["nbos"]["ran_ahead"]
    results = group.execute("print(x)", 3)
    assert stream_text(check_cell(results, 3)[1]) == "20\n"
    group.assert_converged()
    e = election_table(group, 2)[second]
    assert (e["winner"], e["leads"], e["overtaken"]) == (1, [1], False), e


def test_a_cell_run_ahead_on_an_out_of_date_namespace_is_discarded_everywhere(ahead_group):
    """Replica 1 runs cell B ahead of its LEAD while replica 2's cell C commits: B's LEAD lands
    after C's effects, so B's election fails on every replica, its effects count nowhere, and
    replica 1 goes back to the replicated state (with C's effects) and says so."""
    group = ahead_group
    first, sent = group.send_execute("y = 0", 1)
    check_cell(group.collect(sent), 1)
    r1, r2, r3 = (group.replicas[i] for i in (1, 2, 3))
    b = uuid.uuid4().hex
    _, sent_b = group.send_execute("import time\ntime.sleep(2)\ny = 'B'\nz = 1", 1,
                                   replicas=[r1], previous=first, exec_id=b)
    time.sleep(0.5)  # replica 1 runs B
    _, sent_c = group.send_execute("y = 'C'", 2)
    _, sent_b_rest = group.send_execute("import time\ntime.sleep(2)\ny = 'B'\nz = 1", 1,
                                        replicas=[r2, r3], previous=first, exec_id=b)
    # Each replica answers in the order it took the requests (collect drops other replies).
    results_c = group.collect({rid: sent_c[rid] for rid in (2, 3)})
    results_b = group.collect({**sent_b, **sent_b_rest})
    results_c.update(group.collect({1: sent_c[1]}))
    reply_b = results_b[1][0]
    assert reply_b["content"]["ename"] == "ReplicationError", reply_b["content"]
    assert "another cell's effects" in reply_b["content"]["evalue"]
    assert reply_b["metadata"]["nbos"]["ran_ahead"]
    for rid in (2, 3):
        assert results_b[rid][0]["content"]["ename"] == "NoReplicaCanExecute", results_b[rid]
    check_cell(results_c, 2)
    e = election_table(group, 3)[b]
    assert e["failed"] and e["overtaken"] and e["winner"] is None, e
    results = group.execute("print(y, 'z' in globals())", 1)
    assert stream_text(check_cell(results, 1)[1]) == "C False\n"
    group.assert_converged()
    # Replica 1's history holds the log's cells: C took the line B had used.
    history = r1.request("history_request", {"hist_access_type": "range", "session": 0,
                                             "start": 1, "raw": True, "output": False})
    assert [code for _, _, code in history["content"]["history"]] == [
        "y = 0", "y = 'C'", "print(y, 'z' in globals())"], history["content"]


def test_standby_killed_and_restarted_catches_up(group):
    check_cell(group.execute("a = [1]", 1), 1)
    group.replicas[3].kill()
    for i in range(5):
        check_cell(group.execute(f"a.append({i})\nb{i} = {i}", 1 + i % 2), 1 + i % 2)
    group.replicas[3].start()  # from its data directory
    deadline = time.monotonic() + TIMEOUT
    while time.monotonic() < deadline:
        d = {r.id: r.digests() for r in group.live()}
        if d[3] == d[1]:
            break
        time.sleep(0.2)
    group.assert_converged()
    check_cell(group.execute("a.append(len(a))", 3), 3)
    group.assert_converged()


def test_executor_killed_between_cells(group):
    check_cell(group.execute("state = {'n': 1}", 1), 1)
    group.replicas[1].kill()
    results = group.execute("state['n'] += 1\nprint(state['n'])", 2)
    reply, outputs = check_cell(results, 2)
    assert stream_text(outputs) == "2\n"
    group.assert_converged()


def test_executor_killed_mid_cell(group):
    check_cell(group.execute("counter = 10", 1), 1)
    exec_id, sent = group.send_execute(
        "counter = 99\nimport time\ntime.sleep(60)", 1)
    time.sleep(2.0)
    group.replicas[1].kill()
    # The gateway's part: tell the survivors the executor is gone.
    for rid in (2, 3):
        group.replicas[rid].request("nbos_cancel_request", {"exec_id": exec_id},
                                    channel="control")
    del sent[1]
    for rid, (reply, outputs) in group.collect(sent).items():
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "ExecutorLost"
    # The survivors keep the last committed state and keep working.
    results = group.execute("print(counter)", 2)
    reply, outputs = check_cell(results, 2)
    assert stream_text(outputs) == "10\n"
    group.assert_converged()


def test_a_cell_the_log_cancelled_runs_nowhere_even_when_its_executor_comes_back(group):
    """The executor is frozen before it reads the cell; the gateway, taking it for lost, tells
    the standbys to cancel through the log. A CANCEL committed before any LEAD is a promise: the
    standbys answer that the cell did not run, and the executor, thawed, reads the cell, finds
    its election cancelled and does not run it either."""
    check_cell(group.execute("counter = 10", 1), 1)
    executor = group.replicas[1]
    freeze([executor.proc.pid])
    try:
        exec_id, sent = group.send_execute("counter += 1", 1)
        for rid in (2, 3):
            group.replicas[rid].request("nbos_cancel_request",
                                        {"exec_id": exec_id, "decide": True}, channel="control")
        for rid, (r, _) in group.collect({2: sent[2], 3: sent[3]}).items():
            assert r["content"]["ename"] == "CellCancelled", (rid, r["content"])
            assert "did not run" in r["content"]["evalue"], (rid, r["content"])
    finally:
        executor.proc.send_signal(signal.SIGCONT)
    reply, _ = group.collect({1: sent[1]})[1]
    assert reply["content"]["ename"] == "CellCancelled", reply["content"]
    results = group.execute("print(counter)", 2)
    assert stream_text(check_cell(results, 2)[1]) == "10\n"
    group.assert_converged()


def test_an_executor_that_cannot_get_its_cell_elected_says_it_did_not_run_and_never_runs_it(group):
    """Both standbys are frozen before the cell arrives: the executor's LEAD cannot commit, and
    after its proposal times out it answers that the cell did not run. Once the standbys are
    back the LEAD may well commit, but that request is done: no replica runs the cell."""
    check_cell(group.execute("counter = 10", 1), 1)
    standbys = [group.replicas[rid] for rid in (2, 3)]
    freeze([r.proc.pid for r in standbys])
    try:
        exec_id, sent = group.send_execute("counter += 1", 1)
        reply, _ = group.collect({1: sent[1]})[1]
    finally:
        for r in standbys:
            r.proc.send_signal(signal.SIGCONT)
    assert reply["content"]["ename"] == "ReplicasUnavailable", reply["content"]
    assert "did not run" in reply["content"]["evalue"], reply["content"]
    assert reply["metadata"]["nbos"]["role"] == "executor", reply["metadata"]
    # The gateway's part: the standbys stop waiting for the executor's effects.
    for rid in (2, 3):
        group.replicas[rid].request("nbos_cancel_request", {"exec_id": exec_id},
                                    channel="control")
    group.collect({rid: sent[rid] for rid in (2, 3)})
    results = group.execute("print(counter)", 2)
    assert stream_text(check_cell(results, 2)[1]) == "10\n"
    group.assert_converged()


def test_an_executor_whose_effects_cannot_be_committed_goes_back_to_the_replicated_state(group):
    """The two standbys freeze (SIGSTOP) while a cell runs: it ends, but its effects cannot be
    committed. The executor answers so and drops them, so that once the standbys are back all
    three hold the state of the last completed cell, on which the next cells build."""
    check_cell(group.execute("x = 1\nlog = ['a']", 1), 1)
    exec_id, sent = group.send_execute("import time\ntime.sleep(1.5)\nx = 2\nlog.append('b')", 1)
    time.sleep(0.5)
    freeze([group.replicas[rid].proc.pid for rid in (2, 3)])
    try:
        reply, _ = group.collect({1: sent[1]})[1]
    finally:
        for rid in (2, 3):
            group.replicas[rid].proc.send_signal(signal.SIGCONT)
    assert reply["content"]["ename"] == "ReplicationError", reply["content"]
    assert "went back to the state of the last completed cell" in reply["content"]["evalue"]
    # The gateway's part: the standbys are told the cell will not finish.
    for rid in (2, 3):
        group.replicas[rid].request("nbos_cancel_request", {"exec_id": exec_id},
                                    channel="control")
    for rid, (r, _) in group.collect({2: sent[2], 3: sent[3]}).items():
        assert r["content"]["ename"] == "ExecutorLost", (rid, r["content"])
    group.assert_converged()
    results = group.execute("log.append(x)\nprint(x, log)", 1)
    assert stream_text(check_cell(results, 1)[1]) == "1 ['a', 1]\n"
    group.assert_converged()


def test_an_executor_cut_off_mid_cell_cannot_roll_back_the_cells_run_without_it(group):
    """The executor freezes mid-cell; the standbys, told it is lost, answer "not known" and run
    the next cells between them. Thawed, it finishes its cell and its effects reach the log after
    theirs: computed on a namespace without those cells, they would overwrite them everywhere
    (an acknowledged cell lost). The log discards them and the executor says so."""
    check_cell(group.execute("L = [0]", 1), 1)
    executor = group.replicas[1]
    exec_id, sent = group.send_execute("import time\ntime.sleep(1.5)\nL.append(1)", 1)
    time.sleep(0.5)
    freeze([executor.proc.pid])
    try:
        for rid in (2, 3):
            group.replicas[rid].request("nbos_cancel_request",
                                        {"exec_id": exec_id, "decide": True}, channel="control")
        for rid, (r, _) in group.collect({2: sent[2], 3: sent[3]}).items():
            assert r["content"]["ename"] == "ExecutorLost", (rid, r["content"])
            assert "not known" in r["content"]["evalue"], (rid, r["content"])
        for seq in (2, 3):
            _, later = group.send_execute(f"L.append({seq})", 2, replicas=[group.replicas[2],
                                                                          group.replicas[3]])
            check_cell(group.collect(later), 2)
    finally:
        executor.proc.send_signal(signal.SIGCONT)
    reply, _ = group.collect({1: sent[1]})[1]
    assert reply["content"]["ename"] == "ReplicationError", reply["content"]
    assert "discarded on every replica" in reply["content"]["evalue"], reply["content"]
    assert "not known" in reply["content"]["evalue"], reply["content"]
    for rid in (1, 2, 3):
        results = group.execute("print(L)", rid)
        assert stream_text(check_cell(results, rid)[1]) == "[0, 2, 3]\n", rid
    group.assert_converged()


def test_process_state_outside_the_namespace_follows_the_executor(group):
    code = ("import os, sys\n%cd /tmp\nos.environ['NBOS_REPLICATED'] = 'yes'\n"
            "os.environ.pop('NBOS_GONE', None)\nsys.path.append('/opt/nbos-test')")
    check_cell(group.execute(code, 1), 1)
    results = group.execute(
        "print(os.getcwd(), os.environ.get('NBOS_REPLICATED'), sys.path[-1])", 3)
    reply, outputs = check_cell(results, 3)
    assert stream_text(outputs) == "/tmp yes /opt/nbos-test\n"


def test_cells_still_run_after_one_removed_the_working_directory(group):
    check_cell(group.execute("import os, shutil, tempfile\nd = tempfile.mkdtemp()\nos.chdir(d)", 1),
               1)
    check_cell(group.execute("shutil.rmtree(d)", 2), 2)
    results = group.execute("print(os.path.exists(d))", 3)
    assert stream_text(check_cell(results, 3)[1]) == "False\n"
    group.assert_converged()


def test_a_standby_writes_its_input_history_in_batches_and_loses_none(kernelspec_dir,
                                                                     monkeypatch, tmp_path):
    # Each replica writes its own session to the history database; here all three share one.
    monkeypatch.setenv("IPYTHONDIR", str(tmp_path))
    db = tmp_path / "profile_default" / "history.sqlite"

    def rows_by_session(want, timeout=TIMEOUT):
        """{session: inputs written}, once `want` holds for it."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.closing(sqlite3.connect(db)) as c:
                rows = dict(c.execute("SELECT session, 0 FROM sessions").fetchall())
                rows.update(c.execute("SELECT session, COUNT(*) FROM history GROUP BY session"))
            if want(sorted(rows.values())) or time.monotonic() > deadline:
                return rows
            time.sleep(0.05)

    g = Group()
    try:
        for n in range(3):
            check_cell(g.execute(f"a = {n}", 1), 1)
        # The executor writes each cell's input; the standbys keep theirs for now.
        assert sorted(rows_by_session(lambda r: r == [0, 0, 3]).values()) == [0, 0, 3]
        time.sleep(0.5)
        assert sorted(rows_by_session(lambda r: False, timeout=0).values()) == [0, 0, 3]
        # A history request reads them all, and writes them.
        tail = g.replicas[2].request("history_request", {
            "hist_access_type": "tail", "n": 10, "raw": True, "output": False})["content"]
        by_session = {}
        for session, line, code in tail["history"]:
            by_session.setdefault(session, []).append((line, code))
        # Its own session beside the executor's, which this shared database also holds.
        assert list(by_session.values()) == [[(1, "a = 0"), (2, "a = 1"), (3, "a = 2")]] * 2
        assert sorted(rows_by_session(lambda r: r == [0, 3, 3]).values()) == [0, 3, 3]
        # A standby that runs a cell writes what it kept with it.
        check_cell(g.execute("a = 3", 3), 3)
        assert sorted(rows_by_session(lambda r: r == [3, 3, 4]).values()) == [3, 3, 4]
        # However long a replica stays a standby, it keeps at most a batch unwritten.
        for n in range(4, 40):
            check_cell(g.execute(f"a = {n}", 3), 3)
        rows = rows_by_session(lambda r: r[0] >= 32 and r[2] == 40)
        assert 32 <= min(rows.values()) < 40 and max(rows.values()) == 40, rows
        # A standby shut down writes what it kept.
        for r in (g.replicas[1], g.replicas[2]):
            r.request("shutdown_request", {"restart": False}, channel="control")
            r.proc.wait(timeout=TIMEOUT)
        assert sorted(rows_by_session(lambda r: r == [40, 40, 40]).values()) == [40, 40, 40]
    finally:
        g.close()


def test_unreplicable_names_are_reported_and_fail_clearly_elsewhere(group):
    results = group.execute("fh = open('/etc/hostname')\nn = 5", 1)
    reply, outputs = check_cell(results, 1)
    stderr = "".join(m["content"]["text"] for m in outputs
                     if m["msg_type"] == "stream" and m["content"]["name"] == "stderr")
    assert "cannot replicate 'fh'" in stderr, stderr
    results = group.execute("print(n)\nfh.read()", 2)
    reply, outputs = check_cell(results, 2, expect_status="error")
    assert "5\n" == stream_text([m for m in outputs if m["msg_type"] == "stream"
                                 and m["content"]["name"] == "stdout"])
    assert "replica 1" in reply["content"]["evalue"] or "cannot" in reply["content"]["evalue"]


def test_restart_catches_up_from_snapshot_and_checkpoint():
    # Small thresholds: checkpoints every 2 journal records, Raft snapshots every 8 entries, so
    # the restarted replica gets a snapshot (checkpoint + journal) instead of the whole log.
    group = Group(extra_args=["--checkpoint-every", "2", "--snapshot-threshold", "8"])
    try:
        check_cell(group.execute("import numpy as np\nacc = np.zeros(4)\nseen = []", 1), 1)
        group.replicas[3].kill()
        # Process state changed once, long before the checkpoint the restarted replica gets: the
        # checkpoint must carry it, as no journal record after it does.
        check_cell(group.execute(f"import os, sys\nos.environ['NBOS_EARLY'] = 'yes'\n"
                                 f"os.chdir({group.dir!r})\nsys.path.append('/nbos-early')", 1), 1)
        for i in range(12):
            target = 1 + i % 2
            check_cell(group.execute(f"acc += {i}\nseen.append({i})\nimport os\n"
                                     f"os.environ['NBOS_STEP'] = '{i}'", target), target)
        group.replicas[3].start()
        deadline = time.monotonic() + TIMEOUT
        while time.monotonic() < deadline:
            if group.replicas[3].digests() == group.replicas[1].digests():
                break
            time.sleep(0.2)
        group.assert_converged()
        assert "restoring the namespace from a snapshot" in group.replicas[3].stderr()
        results = group.execute(
            "print(acc[0], len(seen), os.environ['NBOS_STEP'], os.environ.get('NBOS_EARLY'),\n"
            "      os.getcwd(), sys.path[-1])", 3)
        reply, outputs = check_cell(results, 3)
        assert stream_text(outputs) == f"66.0 12 11 yes {group.dir} /nbos-early\n"
    finally:
        group.close()


def run_lone_replica(*args):
    """Runs a one-member replica with `args` that should keep it from starting; its result."""
    d = tempfile.mkdtemp(prefix="nbos-lone-")
    conn = os.path.join(d, "kernel.json")
    write_kernel_connection_file(conn, b"k")
    return subprocess.run(
        [nbos_bin(), "replica", "-f", conn, "--id", "1", "--raft",
         f"127.0.0.1:{free_port_pair()}", "--data-dir", os.path.join(d, "raft"), *args],
        capture_output=True, text=True, timeout=TIMEOUT)


def start_redis(port):
    """redis-server on 127.0.0.1:port, without persistence, once it accepts connections."""
    redis = subprocess.Popen(["/usr/bin/redis-server", "--port", str(port), "--bind", "127.0.0.1",
                              "--save", "", "--appendonly", "no"],
                             stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return redis
        time.sleep(0.05)
    redis.kill()
    redis.wait()
    raise RuntimeError(f"redis-server did not listen on port {port}")


def test_redis_blob_store_and_a_missing_store():
    port = free_port_pair()
    redis = start_redis(port)
    try:
        group = Group(store_url=f"redis://127.0.0.1:{port}/0")
        try:
            check_cell(group.execute("import numpy as np\nw = np.arange(1 << 20, dtype='f8')", 1),
                       1)
            check_cell(group.execute("w *= 2\ntotal = float(w.sum())", 2), 2)
            digests = group.assert_converged()
            assert "w" in digests and "total" in digests
        finally:
            group.close()
    finally:
        redis.kill()
        redis.wait()
    # No store reachable: the replica refuses to start and says why.
    dead = free_port_pair()
    result = run_lone_replica("--blob-store", f"redis://127.0.0.1:{dead}/0")
    assert result.returncode != 0
    assert f"127.0.0.1:{dead}" in result.stderr, result.stderr


def test_a_store_that_goes_away_loses_no_cell_and_large_pickles_go_to_the_store():
    """A pickle of tens of MB (a long list) goes to the store by key, not into one Raft entry
    (libraft crashed the executor on one of about 37 MB), and so does a source over 1 MiB in the
    history the other replicas keep. With the store gone, a cell's arrays
    and pickles go through the replication log up to 12 MB, so no name is lost; past that every
    name the cell changed is reported, and once the store is back cells replicate as before."""
    port = free_port_pair()
    redis = start_redis(port)
    group = Group(store_url=f"redis://127.0.0.1:{port}/0")
    try:
        check_cell(group.execute("import numpy as np\nbig = list(range(8_000_000))", 1), 1)
        # Each standby runs a cell on its copy (digests of the whole list would take seconds).
        for rid in (2, 3):
            _, outputs = check_cell(group.execute("print(len(big), big[-1])", rid), rid)
            assert stream_text(outputs) == "8000000 7999999\n"
        check_cell(group.execute("del big", 1), 1)
        redis.kill()
        redis.wait()
        _, outputs = check_cell(group.execute(
            "a = np.arange(1 << 18, dtype='f8')\nwords = [str(i) for i in range(500_000)]\n"
            "n = 1", 2), 2)
        assert "went through the replication log instead" in stream_text(outputs)
        digests = group.assert_converged()
        assert {"a", "words", "n"} <= set(digests)
        _, outputs = check_cell(group.execute("huge = np.ones(3 << 20)\nn = 2", 2), 2)
        text = stream_text(outputs)
        assert "cannot replicate 'huge'" in text and "cannot replicate 'n'" in text, text
        assert "over the 12.0 MB the replication log takes instead" in text, text
        redis = start_redis(port)
        check_cell(group.execute("del huge\nn = 3\nb = np.ones(1 << 18)", 3), 3)
        assert "b" in group.assert_converged()
        # A source over 1 MiB goes to the store too; the other replicas' history has it.
        source = "n = 4  # " + "x" * (2 << 20)

        def stored_blobs():
            return int(subprocess.run(["redis-cli", "-p", str(port), "dbsize"], text=True,
                                      capture_output=True, check=True).stdout)
        before = stored_blobs()
        check_cell(group.execute(source, 1), 1)
        assert stored_blobs() == before + 1
        _, outputs = check_cell(group.execute("print(len(In[-2]), n)", 2), 2)
        assert stream_text(outputs) == f"{len(source)} 4\n"
        # So does a reply over 1 MiB; the standbys answer with all of it.
        before = stored_blobs()
        _, sent = group.send_execute("n = 5", 1, user_expressions={"big": "'y' * (2 << 20)"})
        results = group.collect(sent)
        check_cell(results, 1)
        assert stored_blobs() == before + 1
        for rid, (reply, _) in results.items():
            big = reply["content"]["user_expressions"]["big"]["data"]["text/plain"]
            assert len(big) == (2 << 20) + 2, rid
        assert "blob store failed" in group.replicas[2].stderr()
    finally:
        group.close()
        redis.kill()
        redis.wait()


def group_with_replica_3_on_an_empty_store():
    """A group whose replica 3 reads a blob store of its own, empty: it cannot apply what the
    executor put in the shared one. Returns the group and that store's directory."""
    group = Group()
    try:
        lonely = os.path.join(group.dir, "replica-3-blobs")
        os.makedirs(lonely)
        group.replicas[3].kill()
        group.replicas[3].store_url = "dir://" + lonely
        group.replicas[3].start()
    except BaseException:
        group.close()
        raise
    return group, lonely


def test_a_replica_that_could_not_apply_a_cell_rebuilds_before_it_runs_one():
    """Replica 3 reads a store without the executor's blobs, so it cannot apply the cell that
    made `a`. Elected next, it does not run the cell on the namespace that lacks `a` but says
    why, and the other replicas, told through the log, answer the same at once; once the blobs
    are there, it rebuilds its namespace from the log and runs the cell."""
    group, lonely = group_with_replica_3_on_an_empty_store()
    try:
        check_cell(group.execute("import numpy as np\na = np.arange(100_000.0)\nn = 1", 1), 1)
        _, sent = group.send_execute("n += 1\nprint(float(a.sum()), n)", 3)
        reply, outputs = group.collect({3: sent[3]})[3]
        assert reply["content"]["ename"] == "ReplicaOutOfSync", reply["content"]
        assert "could not apply an earlier cell's effects" in reply["content"]["evalue"]
        assert "The cell did not run" in reply["content"]["evalue"]
        assert reply["metadata"]["nbos"]["diverged"], reply["metadata"]
        assert stream_text(outputs) == ""
        for rid, (r, _) in group.collect({1: sent[1], 2: sent[2]}).items():
            assert r["content"]["ename"] == "ReplicaOutOfSync", (rid, r["content"])
            assert "diverged" not in r["metadata"]["nbos"], (rid, r["metadata"])
        shutil.copytree(os.path.join(group.dir, "blobs"), lonely, dirs_exist_ok=True)
        _, outputs = check_cell(group.execute("n += 1\nprint(float(a.sum()), n)", 3), 3)
        assert stream_text(outputs) == "4999950000.0 2\n"
        assert "rebuilding it" in group.replicas[3].stderr()
        group.assert_converged()
    finally:
        group.close()


def test_a_replica_that_could_not_apply_a_cell_heals_while_idle_once_the_store_is_back():
    """Replica 3 reads a store without the executor's blobs, so it cannot apply the cell that
    made `a`, and its replies say so (the gateway would replace it). Once the blobs are there it
    rebuilds its namespace from the log on its own, with no cell routed to it: its replies as a
    standby no longer say it diverged, and it holds `a`."""
    group, lonely = group_with_replica_3_on_an_empty_store()
    try:
        results = group.execute("import numpy as np\na = np.arange(100_000.0)\nn = 1", 1)
        check_cell(results, 1)
        assert results[3][0]["metadata"]["nbos"]["diverged"], results[3][0]["metadata"]
        time.sleep(3)  # a rebuild while the blobs are still missing fails again
        shutil.copytree(os.path.join(group.dir, "blobs"), lonely, dirs_exist_ok=True)
        deadline = time.time() + 30
        while True:
            results = group.execute("n += 1", 1)
            check_cell(results, 1)
            if "diverged" not in results[3][0]["metadata"]["nbos"]:
                break
            assert time.time() < deadline, results[3][0]["metadata"]
            time.sleep(0.5)
        assert "rebuilding it" in group.replicas[3].stderr()
        _, outputs = check_cell(group.execute("print(float(a.sum()))", 3), 3)
        assert stream_text(outputs) == "4999950000.0\n"
        group.assert_converged()
    finally:
        group.close()


def test_a_journal_of_large_deltas_is_checkpointed_before_64_cells():
    """Deltas of 2.5 MB each (a list's pickle, inline in the log): once 16 MiB of them are in the
    journal the executor takes a checkpoint, instead of after 64 records, so the Raft snapshot
    (checkpoint and journal) stays small."""
    group = Group()
    try:
        for i in range(8):
            check_cell(group.execute(f"words = [str(i + {i}) for i in range(300_000)]", 1), 1)
        taken = re.findall(r"proposing a checkpoint of \d+ bytes after (\d+) journal records "
                           r"\((\d+) bytes\)", group.replicas[1].stderr())
        assert len(taken) == 1, taken
        records, journal_bytes = map(int, taken[0])
        assert 6 <= records <= 7 and journal_bytes >= 16 << 20, taken
        _, outputs = check_cell(group.execute("print(words[0], len(words))", 3), 3)
        assert stream_text(outputs) == "7 300000\n"
    finally:
        group.close()


def test_a_checkpoint_starts_a_new_group_with_the_namespace():
    """Suspend and resume at the replica level: a checkpoint of the replicated state goes to the
    blob store (nbos_checkpoint_request), the group stops, and three new replicas started from
    it (--restore-from) hold the same namespace and go on from it. A key that is not in the store
    keeps the replica from starting, with the reason."""
    group = Group()
    try:
        check_cell(group.execute("import numpy as np\nbig = np.arange(1 << 20, dtype='f8')\n"
                                 "words = ['x'] * 3\nimport os\nos.environ['NBOS_MARK'] = 'kept'",
                                 1), 1)
        for i in range(3):
            target = 1 + i % 3
            check_cell(group.execute(f"big += {i}\nwords.append('{i}')", target), target)
        before = group.assert_converged()
        reply = group.replicas[2].request("nbos_checkpoint_request", {}, channel="control")
        assert reply["content"]["status"] == "ok", reply["content"]
        key = reply["content"]["key"]
    finally:
        group.close()

    resumed = Group(extra_args=["--restore-from", key], store_url=group.store_url)
    try:
        assert resumed.assert_converged() == before
        results = resumed.execute("print(float(big[0]), ''.join(words), os.environ['NBOS_MARK'])",
                                  3)
        _, outputs = check_cell(results, 3)
        assert stream_text(outputs) == "3.0 xxx012 kept\n"
    finally:
        resumed.close()

    result = run_lone_replica("--blob-store", group.store_url, "--restore-from", "0" * 64)
    assert result.returncode != 0
    assert "checkpoint to restore" in result.stderr, result.stderr
