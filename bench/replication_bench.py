#!/usr/bin/python3
"""Replication cost of a distributed nbos kernel (three `nbos replica` processes, one Raft group),
each number beside a baseline measured in the same run.

  1. small-state sync   `x = i; lst.append(i)` run N times per executor placement: sticky on
                        the Raft leader, sticky on a follower (the leader is not exposed by the
                        replicas; it is found by probing: its cells commit fastest), and
                        rotating (1, 2, 3, 1, ...): p50/p90/p99 of the executor's `commit`
                        timing and of the round trip (request sent to all replicas -> the
                        executor's execute_reply received). Baseline: the same cells on the
                        standalone `nbos kernel`, each right after its replicated twin.
                        Design target: commit p99 <= 5 ms.
  2. large-object sync  a cell creating 8 float32 tensors of 64 MiB in all (8 x 8 MiB) and
                        then of 256 MiB (8 x 32 MiB) on the leader, repeated 3 times with fresh
                        content, each followed by a cell re-binding the SAME tensors (dedup; on
                        the leader and on a follower), on three blob stores: the directory store
                        on disk (`dir`, in /tmp), the directory store in RAM (`shm`, a tmpfs
                        directory in /dev/shm) and Redis (`redis`, a private redis-server).
                        Reported: executor sync time and MB/s, standby time until applied and
                        MB/s. Baselines: numpy .tofile() to the same filesystem of tensors of
                        the same shapes made just before (fresh, as the cell's are) and of the
                        bench's own tensors written again, pickle.dumps of the same tensors,
                        sha256 of the bytes, one copy into fresh memory and (for Redis) a raw
                        SET of the bytes over one connection. Targets: executor sync >= 1 GB/s
                        (1024 MB/s) to the RAM stores (shm, redis) and >= the fresh .tofile()
                        baseline on disk (dir, and >= 500 MB/s); standby ready <= 1.5 x the
                        executor's sync time.
  3. per-cell overhead  round trip of `pass` on the replicated kernel vs the standalone kernel.
  4. before/after       with --baseline-nbos B (another build, e.g. the one before a change):
                        the same cells on a replica group of B and one of this build, strictly
                        alternating, both executed by their Raft leader: `pass`; `pass` with
                        numpy, torch, pandas and matplotlib imported; a cell that binds a name
                        (this build also captures the process state after it); and a cell that
                        changes settings (seeds, print and display options), which this build
                        replicates.
                        p50 and mean of the round trip, and this build's over B's.

How the large-object numbers are derived (the executor's `nbos.timings_ms` are elect / run /
commit; standbys report elect / follow):
  * body      the cell's own code, timed inside the cell and printed (creating the tensors);
  * exec sync = (run - body) + commit: computing the namespace delta and writing its buffers to
              the blob store (this build does that at the end of `run`, in nbos_engine's
              _end_sync, NOT inside `commit`), plus committing the delta and ExecDone via Raft;
  * standby ready = (standby reply received - executor reply received) + exec sync: from the end
              of the cell body on the executor until the standby has fetched and applied the delta.
MB = 2**20 bytes throughout.

Run from the repository root with Debian's Python (it has jupyter_client, numpy and torch):

    /usr/bin/python3 bench/replication_bench.py [--quick] [--json out.json]

Exit status: 0 on success (targets missed are reported, not fatal); 1 if a replica or kernel
dies, times out or a cell fails; 2 on usage errors.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import pathlib
import pickle
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from queue import Empty

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from kernel_roundtrip import percentile  # noqa: E402  (one definition for all benches)

MB = float(1 << 20)

COMMIT_P99_TARGET_MS = 5.0
DIR_STORE_TARGET_MBPS = 500.0
RAM_STORE_TARGET_MBPS = 1024.0
STANDBY_READY_MAX_RATIO = 1.5
RAM_STORES = ("shm", "redis")


class BenchError(RuntimeError):
    """A replica or kernel misbehaved (died, timed out, a cell failed)."""


# --------------------------------------------------------------------------- small helpers


def summarize(values_ms):
    s = sorted(v for v in values_ms if v is not None)
    if not s:
        return {"n": 0}
    return {
        "n": len(s),
        "p50": percentile(s, 50),
        "p90": percentile(s, 90),
        "p99": percentile(s, 99),
        "mean": sum(s) / len(s),
        "min": s[0],
        "max": s[-1],
    }


def tail(path, n=3000):
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            text = f.read().decode("utf-8", "replace")
        return text if text.strip() else "<empty>"
    except OSError as e:
        return f"<cannot read {path}: {e}>"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def mbps(nbytes, ms):
    return nbytes / MB / (ms / 1e3) if ms and ms > 0 else float("nan")


def log(msg):
    print(msg, flush=True)


# --------------------------------------------------------------------------- processes


def import_test_module(nbos):
    """tests/replication/test_replicated_kernel.py (Group, Replica, free_port_pair)."""
    os.environ["NBOS_BIN"] = nbos
    sys.path.insert(0, str(ROOT / "tests" / "replication"))
    try:
        import test_replicated_kernel as T  # also imports tests/conftest.py (installs a kernelspec)
    except ImportError as e:
        raise BenchError(f"cannot import tests/replication/test_replicated_kernel.py: {e}"
                         f" (run with /usr/bin/python3, which has pytest and jupyter_client)")
    return T


class Endpoint:
    """One kernel process and its client, as the measuring code sees it."""

    def __init__(self, label, rid, proc, client, stderr_path):
        self.label, self.id, self.proc, self.client, self.stderr_path = (
            label, rid, proc, client, stderr_path)

    def check_alive(self):
        rc = self.proc.poll()
        if rc is not None:
            raise BenchError(f"{self.label} died (exit status {rc})\n"
                             f"--- tail of {self.stderr_path} ---\n{tail(self.stderr_path)}")


def make_group_class(T):
    class BenchGroup(T.Group):
        """The test suite's Group (it starts its replicas in __init__), with a chosen blob store.
        If a replica fails to start, the ones already started are killed and BenchError says
        why. close() also removes the group's directory unless keep=True."""

        def __init__(self, store_url=None, keep=False, raft_root=None):
            self._store_override = store_url
            self._keep = keep
            try:
                super().__init__(raft_root=raft_root)
            except Exception as e:
                why = f"{type(e).__name__}: {e}"
                logs = ""
                for r in getattr(self, "replicas", {}).values():
                    rc = r.proc.poll() if r.proc is not None else "not started"
                    logs += (f"--- replica {r.id} (exit status {rc}): tail of {r.dir}/stderr.log"
                             f" ---\n{tail(os.path.join(r.dir, 'stderr.log'))}\n")
                with contextlib.suppress(Exception):
                    self.close()
                raise BenchError(f"the replica group did not start ({why})\n{logs}") from None

        # Group.__init__ assigns the directory store's URL; an override wins.
        @property
        def store_url(self):
            return self._store_override or self._default_store_url

        @store_url.setter
        def store_url(self, value):
            self._default_store_url = value

        def endpoints(self):
            return {r.id: Endpoint(f"replica {r.id}", r.id, r.proc, r.client,
                                   os.path.join(r.dir, "stderr.log"))
                    for r in self.replicas.values()}

        def close(self):
            for r in getattr(self, "replicas", {}).values():
                if r.proc is not None and r.proc.poll() is None:
                    r.proc.kill()
                    r.proc.wait()
                if r.client is not None:
                    with contextlib.suppress(Exception):
                        r.client.stop_channels()
                    r.client = None
            if not self._keep and getattr(self, "dir", None):
                shutil.rmtree(self.dir, ignore_errors=True)

    return BenchGroup


class Standalone:
    """`nbos kernel -f CONN`: the same binary without replication."""

    def __init__(self, parent_dir):
        self.dir = tempfile.mkdtemp(prefix="standalone-", dir=parent_dir)
        self.proc = None
        self.client = None
        self.stderr_path = os.path.join(self.dir, "stderr.log")

    def start(self, nbos, timeout):
        from jupyter_client import BlockingKernelClient
        from jupyter_client.connect import write_connection_file

        cf = os.path.join(self.dir, "kernel.json")
        write_connection_file(cf, key=uuid.uuid4().hex.encode())
        with open(self.stderr_path, "ab") as err:
            self.proc = subprocess.Popen([nbos, "kernel", "-f", cf, "--log-level", "warn"],
                                         stdout=subprocess.DEVNULL, stderr=err, cwd=self.dir)
        self.client = BlockingKernelClient(connection_file=cf)
        self.client.load_connection_file()
        self.client.start_channels()
        try:
            self.client.wait_for_ready(timeout=timeout)
        except Exception as e:
            raise BenchError(f"standalone kernel did not become ready ({e}; exit status"
                             f" {self.proc.poll()})\n--- tail of {self.stderr_path} ---\n"
                             f"{tail(self.stderr_path)}") from None
        return self

    def endpoints(self):
        return {0: Endpoint("standalone kernel", 0, self.proc, self.client, self.stderr_path)}

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        if self.client is not None:
            with contextlib.suppress(Exception):
                self.client.stop_channels()


class RedisServer:
    def __init__(self, binary, parent_dir):
        self.binary = binary
        self.dir = tempfile.mkdtemp(prefix="redis-", dir=parent_dir)
        self.log_path = os.path.join(self.dir, "redis.log")
        self.port = None
        self.proc = None

    def start(self, timeout=20.0):
        if not os.access(self.binary, os.X_OK):
            raise BenchError(f"redis-server not found at {self.binary} (use --redis-server or"
                             " --stores dir)")
        self.port = free_port()
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                [self.binary, "--port", str(self.port), "--save", "", "--appendonly", "no",
                 "--bind", "127.0.0.1", "--dir", self.dir],
                stdout=logf, stderr=subprocess.STDOUT, cwd=self.dir)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            try:
                if self.command(b"PING") == b"+PONG\r\n":
                    return self
            except OSError:
                pass
            time.sleep(0.05)
        raise BenchError(f"redis-server on port {self.port} did not start (exit status"
                         f" {self.proc.poll()})\n--- tail of {self.log_path} ---\n"
                         f"{tail(self.log_path)}")

    @property
    def url(self):
        return f"redis://127.0.0.1:{self.port}/0"

    def _conn(self):
        return socket.create_connection(("127.0.0.1", self.port), timeout=60)

    def command(self, *args):
        """Sends one command (RESP), returns the raw first reply line."""
        with self._conn() as s:
            s.sendall(resp(*args))
            return _read_line(s)

    def set_many(self, items):
        """Raw SET of each (key, buffer) on one connection; what the store's writes cost at least."""
        with self._conn() as s:
            for key, data in items:
                mv = memoryview(data).cast("B")
                s.sendall(b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(key), key, mv.nbytes))
                s.sendall(mv)
                s.sendall(b"\r\n")
                line = _read_line(s)
                if not line.startswith(b"+OK"):
                    raise BenchError(f"redis SET failed: {line!r}")

    def close(self):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()


def resp(*args):
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        a = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(a), a))
    return b"".join(out)


def _read_line(s):
    buf = b""
    while not buf.endswith(b"\r\n"):
        chunk = s.recv(1)
        if not chunk:
            raise OSError("connection closed")
        buf += chunk
    return buf


# --------------------------------------------------------------------------- one cell


class Cell:
    """The outcome of one execute_request sent to every endpoint of a kernel."""

    def __init__(self, t_send, arrivals, replies, stdout, exec_id=None):
        self.exec_id = exec_id
        self.t_send = t_send
        self.arrivals = arrivals  # id -> perf_counter() when the execute_reply arrived
        self.replies = replies    # id -> execute_reply message
        self.stdout = stdout      # executor's stdout text

    def rtt_ms(self, rid):
        return (self.arrivals[rid] - self.t_send) * 1e3

    def all_ms(self):
        return (max(self.arrivals.values()) - self.t_send) * 1e3

    def timings(self, rid):
        t = self.replies[rid]["metadata"].get("nbos", {}).get("timings_ms")
        if t is None:
            raise BenchError("execute_reply metadata has no nbos.timings_ms: this nbos binary"
                             " predates the per-hop timings (rebuild it)")
        return t


def run_cell(endpoints, code, target, timeout, store_history=True, previous=None):
    """Sends `code` to every endpoint (target: the executor's replica id, or None for the
    standalone kernel), times each execute_reply's arrival, then drains iopub up to idle.
    `previous`: the exec id of the kernel's previous cell, which the gateway names so that its
    executor may run this one ahead of its LEAD (decision 0012); None as after an abandoned cell."""
    import zmq

    exec_id = uuid.uuid4().hex
    content = {"code": code, "silent": False, "store_history": store_history,
               "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
    msgs = {}
    for rid, ep in endpoints.items():
        m = ep.client.session.msg("execute_request", content)
        if target is not None:
            m["metadata"] = {"nbos": {"exec_id": exec_id, "target_replica": target}}
            if previous is not None:
                m["metadata"]["nbos"]["previous_exec_id"] = previous
        msgs[rid] = m
    poller = zmq.Poller()
    by_socket = {}
    for rid, ep in endpoints.items():
        sock = ep.client.shell_channel.socket
        poller.register(sock, zmq.POLLIN)
        by_socket[sock] = rid

    # The executor's copy goes first, as the gateway sends it: signing and sending a copy takes
    # this Python client about 0.1 ms, which a C++ gateway does not spend.
    order = sorted(endpoints, key=lambda rid: rid != target)
    t_send = time.perf_counter()
    for rid in order:
        endpoints[rid].client.shell_channel.send(msgs[rid])
    deadline = t_send + timeout
    arrivals, replies = {}, {}
    while len(replies) < len(endpoints):
        events = poller.poll(200)
        now = time.perf_counter()
        for sock, _ in events:
            rid = by_socket[sock]
            ep = endpoints[rid]
            while True:
                try:
                    msg = ep.client.get_shell_msg(timeout=0)
                except Empty:
                    break
                if msg["parent_header"].get("msg_id") == msgs[rid]["header"]["msg_id"]:
                    arrivals[rid], replies[rid] = now, msg
                    poller.unregister(sock)
                    break
        for rid, ep in endpoints.items():
            if rid not in replies:
                ep.check_alive()
        if now > deadline and len(replies) < len(endpoints):
            missing = [endpoints[r].label for r in endpoints if r not in replies]
            raise BenchError(
                f"timed out after {timeout:.0f}s waiting for execute_reply from"
                f" {', '.join(missing)} to {code[:120]!r}\n" + "".join(
                    f"--- tail of {endpoints[r].stderr_path} ---\n"
                    f"{tail(endpoints[r].stderr_path, 1500)}\n" for r in endpoints
                    if r not in replies))

    # iopub: up to idle on every endpoint; the executor's stdout is kept.
    stdout, errors = [], []
    executor = target if target is not None else next(iter(endpoints))
    for rid, ep in endpoints.items():
        want = msgs[rid]["header"]["msg_id"]
        while True:
            left = deadline - time.perf_counter()
            if left <= 0:
                raise BenchError(f"timed out waiting for iopub idle from {ep.label}")
            try:
                m = ep.client.get_iopub_msg(timeout=min(0.2, left))
            except Empty:
                ep.check_alive()
                continue
            if m["parent_header"].get("msg_id") != want:
                continue
            t = m["msg_type"]
            if t == "stream" and rid == executor:
                stdout.append(m["content"].get("text", ""))
            elif t == "error":
                errors.append(m["content"])
            elif t == "status" and m["content"].get("execution_state") == "idle":
                break

    for rid, r in replies.items():
        c = r["content"]
        if c.get("status") != "ok":
            tb = "\n".join(c.get("traceback", []))[-2000:]
            raise BenchError(f"{endpoints[rid].label}: cell {code[:120]!r} failed:"
                             f" {c.get('ename')}: {c.get('evalue')}\n{tb}\n"
                             f"--- tail of {endpoints[rid].stderr_path} ---\n"
                             f"{tail(endpoints[rid].stderr_path, 1500)}")
        if target is not None:
            nb = r["metadata"].get("nbos", {})
            want_role = "executor" if rid == target else "standby"
            if nb.get("executor") != target or nb.get("role") != want_role:
                raise BenchError(f"{endpoints[rid].label}: expected executor {target}, got"
                                 f" metadata {nb}")
    return Cell(t_send, arrivals, replies, "".join(stdout), exec_id)


def check_converged(group):
    """Per-name digests equal on every replica (not timed)."""
    digests = {r.id: r.digests() for r in group.live()}
    ref = digests[min(digests)]
    bad = sorted({k for d in digests.values() for k in set(d) | set(ref)
                  if any(d.get(k) != ref.get(k) for d in digests.values())})
    return (not bad), bad


# --------------------------------------------------------------------------- phase 1 & 3


def find_leader(group_eps, timeout, store_history, probes=5):
    """The replica whose cells commit fastest: the Raft leader (its `commit` needs no extra
    heartbeat for the commit index to reach it). Not exposed by the replicas, so probed with
    `pass` cells on each replica (these double as warm-up)."""
    med_commit = {}
    for rid in sorted(group_eps):
        vals = [run_cell(group_eps, "pass", rid, timeout, store_history).timings(rid)["commit"]
                for _ in range(probes)]
        med_commit[rid] = med(vals)
    leader = min(med_commit, key=med_commit.get)
    follower = min(r for r in group_eps if r != leader)
    return leader, follower, med_commit


def latency_modes(leader, follower):
    """(name, target for cell i) of the executor-placement series."""
    return [(f"sticky leader (r{leader})", lambda i: leader),
            (f"sticky follower (r{follower})", lambda i: follower),
            ("rotating (r1,r2,r3)", lambda i: 1 + i % 3)]


def cpu_ms(pid):
    """User + system CPU time a process has used so far (all its threads), ms."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) * 1000.0 / os.sysconf("SC_CLK_TCK")


def phase_latency(group_eps, standalone_eps, make_code, setup, n, warmup, timeout, modes,
                  store_history, run_ahead=False):
    """Per mode: warm-up + n cells, each run on the replicated kernel and then on the
    standalone kernel (strictly alternating, so neither kernel gets two requests back to back:
    a kernel's previous cell's background work, e.g. IPython's history write, would otherwise
    land in one kernel's numbers only)."""
    out = {}
    for mode, target_of in modes:
        if setup:
            run_cell(group_eps, setup, target_of(0), timeout, store_history)
            run_cell(standalone_eps, setup, None, timeout, store_history)
        rows, base = [], []
        eps_all = {**group_eps, 0: next(iter(standalone_eps.values()))}
        cpu_before = {k: cpu_ms(e.proc.pid) for k, e in eps_all.items()}
        t0 = time.perf_counter()
        previous = None
        for i in range(warmup + n):
            target = target_of(i)
            code = make_code(i)
            c = run_cell(group_eps, code, target, timeout, store_history, previous)
            previous = c.exec_id if run_ahead else None
            t = c.timings(target)
            stand = [c.timings(r) for r in group_eps if r != target]
            row = {
                "target": target,
                "rtt_ms": c.rtt_ms(target),
                "all_replied_ms": c.all_ms(),
                "elect_ms": t.get("elect"),
                "run_ms": t.get("run"),
                "commit_ms": t.get("commit"),
                "standby_follow_ms": max(x.get("follow", float("nan")) for x in stand),
                "ran_ahead": bool(c.replies[target]["metadata"].get("nbos", {}).get("ran_ahead")),
            }
            base_rtt = run_cell(standalone_eps, code, None, timeout, store_history).rtt_ms(0)
            if i + 1 == warmup:
                cpu_before = {k: cpu_ms(e.proc.pid) for k, e in eps_all.items()}
            if i >= warmup:
                rows.append(row)
                base.append(base_rtt)
        log(f"  {mode:<24} {warmup} warm-up + {n} measured cells (x2 kernels) in"
            f" {time.perf_counter() - t0:.1f}s")
        cpu = {k: (cpu_ms(e.proc.pid) - cpu_before[k]) / n for k, e in eps_all.items()}
        res = {"samples": rows, "standalone_rtt_ms": base,
               "cpu_ms_per_cell": {"replicas": sum(v for k, v in cpu.items() if k != 0),
                                   "standalone": cpu[0],
                                   "by_replica": {str(k): v for k, v in cpu.items() if k}}}
        for key in ("rtt_ms", "all_replied_ms", "elect_ms", "run_ms", "commit_ms",
                    "standby_follow_ms"):
            res[key] = summarize([r[key] for r in rows])
        res["standalone"] = summarize(base)
        res["ran_ahead_share"] = sum(r["ran_ahead"] for r in rows) / max(1, len(rows))
        targets = sorted({r["target"] for r in rows})
        if len(targets) > 1:
            res["by_target"] = {
                str(tg): {k: summarize([r[k] for r in rows if r["target"] == tg])
                          for k in ("commit_ms", "rtt_ms", "standby_follow_ms")}
                for tg in targets}
        out[mode] = res
    return out


# --------------------------------------------------------------------------- phase 2


BODY_RE = re.compile(r"NBOS_BENCH_BODY_MS=([0-9.]+)")


def phase_overhead(args, new_group, group, seps, modes):
    """3. `pass` on `group` (its Raft logs in args.raft_logs[0]), then on a new group for each
    other place in args.raft_logs, all beside the same standalone kernel."""
    out = {}
    for place in args.raft_logs:
        log(f"3. per-cell overhead (pass), {RAFT_LOG_PLACES[place]}")
        g = group if place == args.raft_logs[0] else new_group(place)
        geps = g.endpoints()
        if g is not group:
            leader, follower, _ = find_leader(geps, args.timeout, args.store_history)
            modes = latency_modes(leader, follower)
        for ahead in args.run_ahead:
            r = phase_latency(geps, seps, lambda i: "pass", None, args.iterations, args.warmup,
                              args.timeout, modes, args.store_history, ahead == "on")
            suffix = "" if ahead == "on" else ", LEAD round first"
            out.update({f"{mode}, {RAFT_LOG_PLACES[place]}{suffix}": v for mode, v in r.items()})
        if g is not group:
            g.close()
    return out


LIBRARIES = "import random, numpy as np, torch, pandas as pd, matplotlib"
SETTINGS = ("random.seed({i})\nnp.random.seed({i})\nnp.set_printoptions(precision={p})\n"
            "pd.set_option('display.precision', {p})\nmatplotlib.rcParams['lines.linewidth'] = {p}")
BEFORE_AFTER_CELLS = (
    ("pass", None, lambda i: "pass"),
    ("pass, libraries imported", LIBRARIES, lambda i: "pass"),
    ("a cell that binds a name, libraries imported", None, lambda i: f"y = {i} + np.pi"),
    ("a cell that changes settings", None, lambda i: SETTINGS.format(i=i, p=2 + i % 5)),
)


def phase_before_after(args, new_group):
    """4. Each cell of BEFORE_AFTER_CELLS on a group of --baseline-nbos and on one of this
    build, alternating, each on its group's Raft leader."""
    current = os.environ["NBOS_BIN"]
    os.environ["NBOS_BIN"] = args.baseline_nbos  # read as the group starts its replicas
    try:
        groups = {"before": new_group()}
    finally:
        os.environ["NBOS_BIN"] = current
    groups["after"] = new_group()
    eps = {k: g.endpoints() for k, g in groups.items()}
    leaders = {k: find_leader(e, args.timeout, args.store_history)[0] for k, e in eps.items()}
    out = {}
    for name, setup, make_code in BEFORE_AFTER_CELLS:
        log(f"4. before/after: {name}")
        samples = {"before": [], "after": []}
        for k in samples:
            if setup:
                run_cell(eps[k], setup, leaders[k], args.timeout, args.store_history)
        for i in range(args.warmup + args.iterations):
            for k in ("before", "after") if i % 2 else ("after", "before"):
                c = run_cell(eps[k], make_code(i), leaders[k], args.timeout, args.store_history)
                if i >= args.warmup:
                    samples[k].append(c.rtt_ms(leaders[k]))
        out[name] = {k: summarize(v) for k, v in samples.items()}
    for g in groups.values():
        g.close()
    return out


def large_cells(count, tensor_mb):
    rows = tensor_mb * 256  # rows x 1024 float32 = tensor_mb MiB
    create = ("_t0 = time.perf_counter()\n"
              f"ws = [torch.randn({rows}, 1024) for _ in range({count})]\n"
              "print('NBOS_BENCH_BODY_MS=%.3f' % ((time.perf_counter() - _t0) * 1e3))")
    rebind = ("_t0 = time.perf_counter()\n"
              "ws = list(ws)\n"
              "print('NBOS_BENCH_BODY_MS=%.3f' % ((time.perf_counter() - _t0) * 1e3))")
    return create, rebind


def large_sample(cell, executor, nbytes):
    m = BODY_RE.search(cell.stdout)
    if m is None:
        raise BenchError(f"the cell did not print its body time; stdout: {cell.stdout[:300]!r}")
    body = float(m.group(1))
    t = cell.timings(executor)
    exec_sync = max(0.0, t["run"] - body) + t["commit"]
    standbys = {}
    for rid, reply in cell.replies.items():
        if rid == executor:
            continue
        st = cell.timings(rid)
        lag = (cell.arrivals[rid] - cell.arrivals[executor]) * 1e3
        standbys[rid] = {"follow_ms": st.get("follow"), "elect_ms": st.get("elect"),
                         "lag_after_executor_reply_ms": lag, "ready_ms": lag + exec_sync}
    ready = max(s["ready_ms"] for s in standbys.values())
    return {
        "bytes": nbytes,
        "body_ms": body,
        "run_ms": t["run"],
        "commit_ms": t["commit"],
        "elect_ms": t["elect"],
        "exec_sync_ms": exec_sync,
        "exec_sync_mbps": mbps(nbytes, exec_sync),
        "commit_only_mbps": mbps(nbytes, t["commit"]),
        "rtt_ms": cell.rtt_ms(executor),
        "all_replied_ms": cell.all_ms(),
        "standby_follow_ms": max(s["follow_ms"] for s in standbys.values()),
        "standby_ready_ms": ready,
        "standby_mbps": mbps(nbytes, ready),
        "standbys": standbys,
    }


def baselines(tensors, nbytes, scratch_dir, redis):
    """The same bytes written with numpy .tofile(), pickled, hashed, and (Redis) SET raw; and
    tensors of the same shapes made just before, written with .tofile()."""
    import torch

    res = {}
    paths = [os.path.join(scratch_dir, f"baseline-{i}.f32") for i in range(len(tensors))]
    # The cell writes tensors it has just made. Here a write() of pages that were never handed to
    # the kernel before costs about 10x one of pages written before (docs/performance.md), so the
    # plain-write baseline for the cell's sync writes fresh tensors too, made outside the timing.
    # The bench's own tensors, written again each repeat, give the second, warm figure.
    for key, arrays in (("tofile_fresh_ms", [torch.randn_like(t).numpy() for t in tensors]),
                        ("tofile_ms", [t.numpy() for t in tensors])):
        t0 = time.perf_counter()
        for a, p in zip(arrays, paths):
            a.tofile(p)
        res[key] = (time.perf_counter() - t0) * 1e3
        for p in paths:
            os.unlink(p)
        del arrays
    arrays = [t.numpy() for t in tensors]
    t0 = time.perf_counter()
    data = pickle.dumps(tensors, protocol=pickle.HIGHEST_PROTOCOL)
    res["pickle_ms"] = (time.perf_counter() - t0) * 1e3
    res["pickle_bytes"] = len(data)
    del data
    t0 = time.perf_counter()
    for a in arrays:
        hashlib.sha256(memoryview(a).cast("B")).digest()
    res["sha256_ms"] = (time.perf_counter() - t0) * 1e3
    # One copy into freshly allocated memory (bytearray: 4 KiB pages, each first touch a page
    # fault): what every intermediate buffer on the blob path costs.
    t0 = time.perf_counter()
    for a in arrays:
        b = bytearray(memoryview(a).cast("B"))
        del b
    res["fresh_copy_ms"] = (time.perf_counter() - t0) * 1e3
    if redis is not None:
        keys = [b"nbos-bench-baseline-%d" % i for i in range(len(arrays))]
        t0 = time.perf_counter()
        redis.set_many(list(zip(keys, arrays)))
        res["redis_set_ms"] = (time.perf_counter() - t0) * 1e3
        redis.command(b"DEL", *keys)
    for k in list(res):
        if k.endswith("_ms"):
            res[k.replace("_ms", "_mbps")] = mbps(nbytes, res[k])
    return res


def phase_large(group, store_label, args, scratch_dir, redis, tensors_by_mb):
    """Runs every size in args.large_mb on this group; returns {"<store> <MB> MB": result}."""
    eps = group.endpoints()
    t_big = args.large_timeout
    sh = args.store_history
    leader, follower, probe = find_leader(eps, args.timeout, sh)
    log(f"  {store_label}: Raft leader looks like replica {leader} (median `pass` commit ms by"
        f" replica: { {k: round(v, 1) for k, v in probe.items()} })")
    if args.pin:
        pin_replicas(eps, leader)
    run_cell(eps, "import time\nimport torch", leader, t_big, sh)  # not what we measure
    # Warm-up: one small round through the same code paths (4 MiB).
    run_cell(eps, "ws = [torch.randn(1024, 1024)]", leader, t_big, sh)
    run_cell(eps, "del ws", leader, t_big, sh)
    out = {}
    for mb in args.large_mb:
        r = large_size(group, eps, store_label, args, scratch_dir, redis, tensors_by_mb[mb],
                       mb, leader, follower)
        r.update({"store": store_label, "leader_probe_commit_ms": probe})
        out[f"{store_label} {mb} MB"] = r
    return out


def pin_replicas(eps, executor):
    """Every thread of the executor's process on CPU 0, every standby thread on the other CPUs;
    threads started later inherit their creator's CPUs."""
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < 2:
        raise BenchError("--pin needs at least 2 CPUs")
    for rid, ep in eps.items():
        mask = {cpus[0]} if rid == executor else set(cpus[1:])
        for tid in os.listdir(f"/proc/{ep.proc.pid}/task"):
            with contextlib.suppress(ProcessLookupError):
                os.sched_setaffinity(int(tid), mask)
    log(f"  pinned: executor (replica {executor}) on CPU {cpus[0]}, standbys on {cpus[1:]}")


def large_size(group, eps, store_label, args, scratch_dir, redis, bench_tensors, large_mb,
               leader, follower):
    t_big, sh = args.large_timeout, args.store_history
    count, tensor_mb = args.large_tensors, large_mb // args.large_tensors
    nbytes = count * tensor_mb * (1 << 20)
    create, rebind = large_cells(count, tensor_mb)
    reps = []
    converged = None
    for rep in range(args.repeats):
        t0 = time.perf_counter()
        c = run_cell(eps, create, leader, t_big, sh)
        new = large_sample(c, leader, nbytes)
        if converged is None:  # once per store: did the standbys really get the tensors?
            ok, bad = check_converged(group)
            converged = {"ok": ok, "differing_names": bad}
            if not ok:
                log(f"  WARNING: {store_label}: namespaces differ after the large cell: {bad}")
        same = large_sample(run_cell(eps, rebind, leader, t_big, sh), leader, nbytes)
        other = large_sample(run_cell(eps, rebind, follower, t_big, sh), follower, nbytes)
        run_cell(eps, "del ws", leader, t_big, sh)
        base = baselines(bench_tensors, nbytes, scratch_dir, redis)
        reps.append({"new": new, "dedup_same_executor": same, "dedup_other_executor": other,
                     "baselines": base})
        log(f"  {store_label:<5} {large_mb} MB repeat {rep + 1}/{args.repeats}:"
            f" new {new['exec_sync_ms']:.0f} ms"
            f" exec sync, standby ready {new['standby_ready_ms']:.0f} ms;"
            f" dedup {same['exec_sync_ms']:.0f} ms ({time.perf_counter() - t0:.1f}s)")
    return {"store_url": group.store_url, "bytes": nbytes, "tensors": count,
            "tensor_mb": tensor_mb, "repeats": reps, "converged": converged,
            "executor": leader, "other_executor": follower}


# --------------------------------------------------------------------------- report


def table(headers, rows, left=(0,)):
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(headers)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    lines = [fmt(headers), "  ".join("-" * w for w in widths)]
    lines += [fmt(r) for r in rows]
    return "\n".join(lines)


def f(x, digits=2):
    if x is None or x != x:
        return "-"
    return f"{x:.{digits}f}"


def med(values):
    s = sorted(v for v in values if v is not None)
    return percentile(s, 50) if s else float("nan")


def large_verdicts(r, long=False):
    """The targets for new tensors on one store and size, each with its figure and MET/MISSED."""
    nb, reps, store = r["bytes"], r["repeats"], r.get("store", "dir")
    sync = med([x["new"]["exec_sync_ms"] for x in reps])
    ready = med([x["new"]["standby_ready_ms"] for x in reps])
    v = mbps(nb, sync)
    out = []

    def verdict(ok):
        return "MET" if ok else "MISSED"

    if store in RAM_STORES:
        out.append(f"exec sync >= {RAM_STORE_TARGET_MBPS:g} MB/s (RAM store): {v:.0f} MB/s -> "
                   + verdict(v >= RAM_STORE_TARGET_MBPS))
    else:
        b = mbps(nb, med([x["baselines"]["tofile_fresh_ms"] for x in reps]))
        out.append(f"exec sync >= .tofile() of fresh tensors {b:.0f} MB/s: {v:.0f} MB/s -> "
                   + verdict(v >= b))
        out.append(f"exec sync >= {DIR_STORE_TARGET_MBPS:g} MB/s: {v:.0f} MB/s -> "
                   + verdict(v >= DIR_STORE_TARGET_MBPS))
    ratio = ready / sync if sync > 0 else float("nan")
    out.append(f"standby ready <= {STANDBY_READY_MAX_RATIO:g}x exec sync: {ratio:.2f}x"
               + (f" ({ready:.0f} vs {sync:.0f} ms)" if long else "") + " -> "
               + verdict(ratio <= STANDBY_READY_MAX_RATIO))
    return out if long else [x.split(":")[0].replace("exec sync ", "") + " " + x.split()[-1]
                             for x in out]


def report(res):
    out = []
    meta = res["meta"]
    out.append(f"nbos {meta['nbos']}; {meta['cpus']} CPUs; python {meta['python']};"
               f" N={meta['iterations']} (+{meta['warmup']} warm-up) per series, each cell"
               f" alternating with the standalone kernel; store_history={meta['store_history']};"
               f" blob hints {meta.get('blob_hints')}; pinned {meta.get('pin')}")
    probe = meta.get("leader_probe_commit_ms")
    if probe:
        out.append("Raft leader probe (median `pass` commit ms by executor replica): " +
                   ", ".join(f"r{k}: {v:.1f}" for k, v in probe.items()))

    # 1
    s = res.get("small_state")
    if s:
        out.append("\n1. Small-state sync: `x = i; lst.append(i)`  (ms; rtt = request sent ->"
                   " executor's execute_reply)")
        rows = []
        for mode, r in s.items():
            def add(label, st, note=""):
                rows.append([label, str(st.get("n", 0)), f(st.get("p50")), f(st.get("p90")),
                             f(st.get("p99")), f(st.get("mean")), f(st.get("max")), note])
            p99 = r["commit_ms"].get("p99", float("nan"))
            verdict = "target p99<=5: " + ("MET" if p99 <= COMMIT_P99_TARGET_MS else "MISSED")
            add(f"{mode}: executor commit", r["commit_ms"], verdict)
            add(f"{mode}: executor elect", r["elect_ms"])
            add(f"{mode}: executor run", r["run_ms"])
            add(f"{mode}: rtt replicated", r["rtt_ms"])
            add(f"{mode}: rtt standalone (baseline)", r["standalone"])
            ratio = r["rtt_ms"]["p50"] / r["standalone"]["p50"]
            rows[-2][-1] = f"p50 {ratio:.2f}x standalone"
            add(f"{mode}: all 3 replied", r["all_replied_ms"])
            add(f"{mode}: standby follow (max)", r["standby_follow_ms"])
            for tgt, b in r.get("by_target", {}).items():
                add(f"{mode}: commit, executor={tgt}", b["commit_ms"])
            for tgt, b in r.get("by_target", {}).items():
                add(f"{mode}: rtt, executor={tgt}", b["rtt_ms"])
        out.append(table(["series", "n", "p50", "p90", "p99", "mean", "max", ""], rows,
                         left=(0, 7)))

    # 2
    L = res.get("large_object")
    if L:
        any_store = next(iter(L.values()))
        out.append(f"\n2. Large-object sync: {any_store['tensors']} float32 tensors per cell"
                   f" (sizes in the row names), median of {len(any_store['repeats'])} (min-max);"
                   f" MB = 2^20 B. dir = directory store in /tmp (disk), shm = directory store"
                   f" in tmpfs, redis = Redis")
        rows = []
        for store, r in L.items():
            reps = r["repeats"]
            nb = r["bytes"]

            def rng(vals):
                vals = [v for v in vals if v is not None]
                return f"{f(med(vals), 0)} ({f(min(vals), 0)}-{f(max(vals), 0)})"

            ex, other_ex = r.get("executor"), r.get("other_executor")
            for key, label in (("new", f"new tensors (exec r{ex})"),
                               ("dedup_same_executor", f"same tensors re-bound (dedup, r{ex})"),
                               ("dedup_other_executor",
                                f"same tensors re-bound (dedup, r{other_ex})")):
                xs = [x[key] for x in reps]
                es = [x["exec_sync_ms"] for x in xs]
                cs = [x["commit_ms"] for x in xs]
                rs = [x["standby_ready_ms"] for x in xs]
                fo = [x["standby_follow_ms"] for x in xs]
                note = ""
                if key == "new":
                    note = "; ".join(large_verdicts(r))
                rows.append([f"{store}: {label}", rng([x["body_ms"] for x in xs]),
                             rng(es), f(mbps(nb, med(es)), 0), rng(cs), f(mbps(nb, med(cs)), 0),
                             rng(fo), rng(rs), f(mbps(nb, med(rs)), 0), note])
            for key, label in (("tofile_fresh", "baseline: numpy .tofile() of fresh tensors"),
                               ("tofile", "baseline: numpy .tofile() again (same tensors)"),
                               ("pickle", "baseline: pickle.dumps(tensors)"),
                               ("sha256", "baseline: sha256 of the bytes"),
                               ("fresh_copy", "baseline: 1 copy into fresh memory"),
                               ("redis_set", "baseline: raw redis SET")):
                vals = [x["baselines"].get(key + "_ms") for x in reps]
                if all(v is None for v in vals):
                    continue
                rows.append([f"{store}: {label}", "", rng(vals), f(mbps(nb, med(vals)), 0),
                             "", "", "", "", "", ""])
            conv = r.get("converged") or {}
            if conv and not conv.get("ok"):
                rows.append([f"{store}: NAMESPACES DIFFER: {conv.get('differing_names')}"] +
                            [""] * 9)
        out.append(table(["store: cell", "body ms", "exec sync ms", "exec MB/s", "commit ms",
                          "commit-only MB/s", "standby follow ms", "standby ready ms",
                          "standby MB/s", ""],
                         rows, left=(0, 9)))
        out.append("   body = the cell's own code; exec sync = (run - body) + commit = delta +"
                   " blob writes + Raft;\n   commit = the executor's `commit` timing alone"
                   " (blob writes happen before it, in `run`);\n   standby ready = end of the"
                   " cell body on the executor -> standby has applied (see --help).")

    # 3
    o = res.get("overhead")
    if o:
        out.append("\n3. Per-cell overhead: `pass`  (ms, request sent -> executor's"
                   " execute_reply)")
        rows = []
        for mode, r in o.items():
            a, b = r["rtt_ms"], r["standalone"]
            rows.append([f"replicated, {mode}", str(a["n"]), f(a["p50"]), f(a["mean"]),
                         f(a["p99"]), f"{a['p50'] / b['p50']:.2f}x",
                         f"{a['mean'] / b['mean']:.2f}x", f(r["commit_ms"]["p50"]),
                         f(r["elect_ms"]["p50"]), f(r["all_replied_ms"]["p50"]),
                         f"{100 * r.get('ran_ahead_share', 0):.0f}",
                         f(r["cpu_ms_per_cell"]["replicas"])])
            rows.append(["  standalone (alternating)", str(b["n"]), f(b["p50"]),
                         f(b["mean"]), f(b["p99"]), "1.00x", "1.00x", "", "", "", "",
                         f(r["cpu_ms_per_cell"]["standalone"])])
        out.append(table(["kernel", "n", "p50", "mean", "p99", "p50 ratio", "mean ratio",
                          "commit p50", "elect p50", "all 3 replied p50", "ran ahead %",
                          "CPU ms/cell"],
                         rows))
        out.append("   CPU ms/cell = user + system CPU of the kernel's processes (all three"
                   " replicas for the replicated one) over the measured cells, per cell")

    # 4
    ba = res.get("before_after")
    if ba:
        out.append(f"\n4. Before/after ({res['meta']['baseline_nbos']} -> this build; ms,"
                   " request sent -> executor's execute_reply, alternating)")
        rows = []
        for name, r in ba.items():
            b, a = r["before"], r["after"]
            rows.append([name, str(a["n"]), f(b["p50"]), f(a["p50"]),
                         f"{a['p50'] / b['p50']:.3f}x", f(b["mean"]), f(a["mean"]),
                         f"{a['mean'] / b['mean']:.3f}x"])
        out.append(table(["cell", "n", "before p50", "after p50", "p50 ratio", "before mean",
                          "after mean", "mean ratio"], rows))

    # Targets
    lines = []
    if s:
        for mode, r in s.items():
            p99 = r["commit_ms"].get("p99", float("nan"))
            lines.append(f"  commit p99 <= {COMMIT_P99_TARGET_MS:g} ms, {mode}: {p99:.2f} ms -> "
                         + ("MET" if p99 <= COMMIT_P99_TARGET_MS else "MISSED"))
    for name, r in (L or {}).items():
        lines.extend(f"  {name}: {v}" for v in large_verdicts(r, long=True))
    if lines:
        out.append("\nTargets:")
        out.extend(lines)
    return "\n".join(out)


# --------------------------------------------------------------------------- main


RAFT_LOG_PLACES = {"ram": "Raft log in RAM", "disk": "Raft log on disk"}


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--nbos", default=str(ROOT / "build" / "bin" / "nbos"),
                   help="nbos binary (default build/bin/nbos)")
    p.add_argument("--quick", action="store_true",
                   help="short run: 30 cells per series, 3 warm-up, 64 MB cells x 1 repeat"
                        " (explicit flags win)")
    p.add_argument("--iterations", type=int, help="measured cells per series (default 200)")
    p.add_argument("--warmup", type=int, help="warm-up cells per series (default 10)")
    p.add_argument("--large-mb", help="MB per large cell, a comma-separated list (default"
                   " 64,256; --quick: 64)")
    p.add_argument("--large-tensors", type=int, default=8, help="tensors per large cell (8)")
    p.add_argument("--repeats", type=int, help="large-cell repeats per store (default 3)")
    p.add_argument("--stores", default="dir,shm,redis",
                   help="blob stores: dir (in /tmp), shm (a directory in --shm-dir), redis")
    p.add_argument("--shm-dir", default="/dev/shm", help="RAM-backed directory for `shm`")
    p.add_argument("--shm-spare-mb", type=int,
                   help="spare files of the `shm` store, MiB (default: the store's; 0: none)")
    p.add_argument("--raft-logs", default="ram,disk",
                   help="where replicas keep their Raft logs, a comma-separated list: ram (a"
                        " directory in --shm-dir, as daemons do by default), disk (the work"
                        " directory); the first for every phase, and the overhead phase once"
                        " per entry")
    p.add_argument("--run-ahead", default="on,off",
                   help="overhead phase: on (replicas run with --run-ahead on, and requests name"
                        " the previous cell as the gateway's do, so a sticky executor runs ahead"
                        " of its LEAD: decision 0012), off (requests do not: the LEAD round"
                        " first, nbos's default), or both (default)")
    p.add_argument("--phases", default="small,large,overhead",
                   help="comma-separated subset of small,large,overhead,before-after (the last"
                        " needs --baseline-nbos)")
    p.add_argument("--baseline-nbos", help="phase before-after: the nbos build to compare with")
    p.add_argument("--redis-server", default="/usr/bin/redis-server")
    p.add_argument("--timeout", type=float, default=60.0,
                   help="per-request timeout for small cells, seconds (60)")
    p.add_argument("--large-timeout", type=float, default=600.0,
                   help="per-request timeout for large cells, seconds (600)")
    p.add_argument("--no-store-history", dest="store_history", action="store_false",
                   help="send store_history=false (skips IPython's sqlite history writes)")
    p.add_argument("--blob-hints", choices=("on", "off"), default="off",
                   help="replicas' --blob-hints (default off, as nbos's)")
    p.add_argument("--pin", action="store_true",
                   help="large cells: the executor's threads on CPU 0, the standbys' on the "
                        "others (standbys not sharing the executor's core, as on other servers)")
    p.add_argument("--json", metavar="PATH", help="also write the results, with raw samples")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, stores)")
    a = p.parse_args(argv)
    q = a.quick
    a.iterations = a.iterations if a.iterations is not None else (30 if q else 200)
    a.warmup = a.warmup if a.warmup is not None else (3 if q else 10)
    a.large_mb = a.large_mb if a.large_mb is not None else ("64" if q else "64,256")
    try:
        a.large_mb = [int(x) for x in a.large_mb.split(",") if x.strip()]
    except ValueError:
        p.error("--large-mb: a comma-separated list of whole MB")
    a.repeats = a.repeats if a.repeats is not None else (1 if q else 3)
    a.stores = [s.strip() for s in a.stores.split(",") if s.strip()]
    os.environ["NBOS_BLOB_HINTS"] = a.blob_hints  # read by the replicas the test Group starts
    os.environ["KERNEL_RUN_AHEAD"] = "on"  # used only where a request names the previous cell
    a.phases = [s.strip() for s in a.phases.split(",") if s.strip()]
    if any(s not in ("dir", "shm", "redis") for s in a.stores):
        p.error("--stores: choose from dir, shm, redis")
    a.raft_logs = [s.strip() for s in a.raft_logs.split(",") if s.strip()]
    if not a.raft_logs or len(set(a.raft_logs)) != len(a.raft_logs) or any(
            s not in RAFT_LOG_PLACES for s in a.raft_logs):
        p.error("--raft-logs: one or both of ram, disk")
    a.run_ahead = [s.strip() for s in a.run_ahead.split(",") if s.strip()]
    if not a.run_ahead or any(s not in ("on", "off") for s in a.run_ahead):
        p.error("--run-ahead: on, off or on,off")
    if any(s not in ("small", "large", "overhead", "before-after") for s in a.phases):
        p.error("--phases: choose from small, large, overhead, before-after")
    if "before-after" in a.phases and not a.baseline_nbos:
        p.error("--phases before-after needs --baseline-nbos")
    if a.baseline_nbos:
        a.baseline_nbos = os.path.abspath(a.baseline_nbos)
        if "before-after" not in a.phases:
            a.phases.append("before-after")
    if a.iterations < 1 or a.warmup < 0 or a.repeats < 1 or a.large_tensors < 1:
        p.error("iterations, repeats and large-tensors must be >= 1, warmup >= 0")
    if not a.large_mb or any(mb % a.large_tensors or mb < a.large_tensors for mb in a.large_mb):
        p.error("--large-mb must be a positive multiple of --large-tensors")
    return a


def run(args, workdir):
    nbos = os.path.abspath(args.nbos)
    if not (os.path.isfile(nbos) and os.access(nbos, os.X_OK)):
        raise BenchError(f"nbos binary not found or not executable: {nbos}")
    os.environ["IPYTHONDIR"] = os.path.join(workdir, "ipython")  # before conftest's setdefault
    os.environ["PYTHONUNBUFFERED"] = "1"
    T = import_test_module(nbos)
    BenchGroup = make_group_class(T)
    import jupyter_client

    res = {"meta": {
        "nbos": nbos, "python": platform.python_version(), "python_executable": sys.executable,
        "jupyter_client": jupyter_client.__version__, "cpus": os.cpu_count(),
        "host": platform.node(), "iterations": args.iterations, "warmup": args.warmup,
        "large_mb": args.large_mb, "large_tensors": args.large_tensors,
        "repeats": args.repeats, "stores": args.stores, "phases": args.phases,
        "store_history": args.store_history, "blob_hints": args.blob_hints, "pin": args.pin,
        "raft_logs": args.raft_logs, "unix_time": time.time(),
        "definitions": {
            "rtt": "execute_request sent (to all replicas) -> the executor's execute_reply"
                   " received; iopub drained afterwards, untimed",
            "commit": "executor's nbos.timings_ms.commit",
            "exec_sync": "(run - body) + commit, body timed inside the cell",
            "standby_ready": "(standby reply - executor reply) + exec_sync",
        }}}
    standalone = group = redis = None
    cleanup = []

    def raft_root(place):
        if place == "disk":
            return None  # in the group's directory
        root = tempfile.mkdtemp(prefix="nbos-replbench-raft-", dir=args.shm_dir)
        cleanup.append(lambda: shutil.rmtree(root, ignore_errors=True))
        return root

    def new_group(place=args.raft_logs[0], store_url=None):
        g = BenchGroup(store_url=store_url, keep=args.keep, raft_root=raft_root(place))
        cleanup.append(g.close)
        return g

    try:
        need_standalone = "small" in args.phases or "overhead" in args.phases
        need_dir_group = need_standalone or ("large" in args.phases and "dir" in args.stores)
        if need_standalone:
            standalone = Standalone(workdir)
            cleanup.append(standalone.close)
            standalone.start(nbos, args.timeout)
        if need_dir_group:
            group = new_group()
            log(f"replicas up: {group.addresses}, store {group.store_url},"
                f" {RAFT_LOG_PLACES[args.raft_logs[0]]}")
        if need_standalone:
            seps, geps = standalone.endpoints(), group.endpoints()
            leader, follower, probe = find_leader(geps, args.timeout, args.store_history)
            res["meta"]["leader_probe_commit_ms"] = probe
            log(f"Raft leader looks like replica {leader} (median `pass` commit ms by replica:"
                f" { {k: round(v, 1) for k, v in probe.items()} })")
            modes = latency_modes(leader, follower)
        if "small" in args.phases:
            log("1. small-state sync")
            res["small_state"] = phase_latency(
                geps, seps, lambda i: f"x = {i}\nlst.append({i})", "lst = []",
                args.iterations, args.warmup, args.timeout, modes, args.store_history)
            ok, bad = check_converged(group)
            res["small_state_converged"] = {"ok": ok, "differing_names": bad}
            if not ok:
                log(f"  WARNING: namespaces differ after the small cells: {bad}")
        if "overhead" in args.phases:
            res["overhead"] = phase_overhead(args, new_group, group, seps, modes)
        if "before-after" in args.phases:
            res["meta"]["baseline_nbos"] = args.baseline_nbos
            res["before_after"] = phase_before_after(args, new_group)
        if standalone is not None:
            standalone.close()
        if "large" in args.phases:
            import torch

            log(f"2. large-object sync ({', '.join(map(str, args.large_mb))} MB per cell)")
            tensors_by_mb = {mb: [torch.randn(mb // args.large_tensors * 256, 1024)
                                  for _ in range(args.large_tensors)] for mb in args.large_mb}
            res["large_object"] = {}
            for store in args.stores:
                if group is not None and store != "dir":
                    group.close()
                    group = None
                redis = None
                scratch = None
                if store == "dir":
                    if group is None:
                        group = new_group()
                    scratch = group.dir
                elif store == "shm":
                    shm = tempfile.mkdtemp(prefix="nbos-replbench-shm-", dir=args.shm_dir)
                    cleanup.append(lambda d=shm: shutil.rmtree(d, ignore_errors=True))
                    scratch = os.path.join(shm, "scratch")
                    os.mkdir(scratch)
                    spare = "" if args.shm_spare_mb is None else f"?spare_mb={args.shm_spare_mb}"
                    group = new_group(store_url=f"dir://{shm}/blobs{spare}")
                else:
                    redis = RedisServer(args.redis_server, workdir)
                    cleanup.append(redis.close)
                    redis.start()
                    log(f"redis-server on port {redis.port}")
                    group = new_group(store_url=redis.url)
                    scratch = group.dir
                log(f"  {store}: blob store {group.store_url}")
                res["large_object"].update(phase_large(group, store, args, scratch, redis,
                                                       tensors_by_mb))
                group.close()
                group = None
                if redis is not None:
                    redis.close()
            del tensors_by_mb
        return res
    finally:
        for fn in reversed(cleanup):
            with contextlib.suppress(Exception):
                fn()
        # tests/conftest.py installed a kernelspec into a temporary prefix at import.
        ks = sys.modules.get("conftest")
        if ks is not None and getattr(ks, "KERNELSPEC_DIR", None):
            shutil.rmtree(os.path.dirname(os.path.dirname(ks.KERNELSPEC_DIR)),
                          ignore_errors=True)


def main(argv):
    args = parse_args(argv)
    import importlib.util

    if any(importlib.util.find_spec(m) is None for m in ("jupyter_client", "zmq")):
        print(f"error: jupyter_client/zmq not importable by {sys.executable};"
              " run with /usr/bin/python3", file=sys.stderr)
        return 1

    def on_term(signum, frame):
        raise SystemExit(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    workdir = tempfile.mkdtemp(prefix="nbos-replbench-")
    ok = False
    try:
        t0 = time.perf_counter()
        res = run(args, workdir)
        res["meta"]["wall_s"] = time.perf_counter() - t0
        print()
        print(report(res))
        print(f"\n(total {res['meta']['wall_s']:.0f}s)")
        if args.json:
            with open(args.json, "w") as fh:
                json.dump(res, fh, indent=1, default=str)
            print(f"wrote {args.json}")
        ok = True
        return 0
    except BenchError as e:
        print(f"\nBENCHMARK FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if ok and not args.keep:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"(work directory kept: {workdir})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
