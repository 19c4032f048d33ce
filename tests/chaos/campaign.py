"""A nemesis campaign against a live nbos cluster, checked by what its clients were told.

A gateway and HOSTS daemons (1 virtual GPU each) are started one by one, each daemon and the
gateway in a network namespace of its own when the campaign runs as root (so a server can be cut
off with nftables), with a Redis blob store. KERNELS kernels each run cells that append their
sequence number to a list `L` (every fifth cell also rebinds a blob-sized value), one cell at a
time, while a nemesis, seeded, injects overlapping faults: a replica killed, a server killed and
started again (daemon and replicas), a server frozen, a server cut off, the gateway killed and
started again, a daemon alone killed and started again, the blob store stopped and started again.
A server restart destroys its replicas and their logs, so it is made only while every kernel has
three live replicas (three replicas survive one such loss at a time); every other fault overlaps
freely.

After the last fault everything is healed and the checker verifies, per kernel:
- every cell answered ok is in `L` exactly once, in order, on every live replica, and the
  replicas hold the same list;
- no cell answered with a promise that it did not run ("did not run" in its error) is in `L`;
- a cell answered "not known", or whose answer was lost with the client's connection, may go
  either way; any other error counts as "not known" and is reported as a vague answer;
- no answer took longer than the cell's own run time plus 2 s (the client's connection lost
  with the gateway excepted);
- the kernel runs cells again, with three live replicas, within 30 s of the last fault.

Everything the clients and the nemesis did goes to a history file (JSON lines); the report names
the first violation with the events around it. The schedule of faults follows from the seed.
"""

import ast
import contextlib
import glob
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid

import websocket

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "gateway"))

import cluster as cl  # noqa: E402

# What an answer promises, by the words users read in it.
DID_NOT_RUN = "did not run"
NOT_KNOWN = "not known"
ANSWER_SLACK_S = 2.0
READ_TIMEOUT_S = 30.0
# What each kind of violation breaks: safety (what users were told is not what the replicas hold),
# liveness (a kernel does not come back), latency (an answer took too long), vague (an answer that
# promises nothing).
CLASSES = {
    "acknowledged cells missing": "safety", "cell applied twice": "safety",
    "cells applied out of order": "safety", "cell answered 'did not run' was applied": "safety",
    "replicas differ": "safety", "kernel did not recover": "liveness",
    "replica could not be read": "liveness", "fewer than three live replicas at the end": "liveness",
    "answer slower than its run time plus 2 s": "latency",
    "error that says neither 'did not run' nor 'not known'": "vague",
}
RECOVERY_S = 30.0
# After a server restart, the next one waits this long and for every kernel to be whole again.
DESTRUCTIVE_SETTLE_S = 10.0


class History:
    """Events in order, each a dict with `t` (seconds since the campaign began) and `kind`;
    written as JSON lines. Thread-safe."""

    def __init__(self, path):
        self.path = path
        self.t0 = time.monotonic()
        self.events = []
        self._mu = threading.Lock()
        self._file = open(path, "w", buffering=1)  # each event on disk as it happens

    def now(self):
        return time.monotonic() - self.t0

    def add(self, kind, **fields):
        event = {"t": round(self.now(), 3), "kind": kind, **fields}
        with self._mu:
            self.events.append(event)
            if not self._file.closed:
                self._file.write(json.dumps(event) + "\n")
        return event

    def close(self):
        with self._mu:
            self._file.close()

    def around(self, t, window_s=10.0, kernel=None, limit=60):
        """Faults, heals and this kernel's answers within `window_s` of time `t`, runs of ok
        answers folded into one line each; at most `limit` lines, those nearest `t` kept."""
        with self._mu:
            near = [e for e in self.events if abs(e["t"] - t) <= window_s and e["kind"] != "send"
                    and (e.get("kernel") in (None, kernel))]
        folded = []
        for e in near:
            if e["kind"] == "answer" and e["outcome"] == "ok":
                if folded and folded[-1].get("kind") == "ok answers":
                    folded[-1]["last_seq"], folded[-1]["until"] = e["seq"], e["t"]
                    continue
                e = {"t": e["t"], "kind": "ok answers", "kernel": e["kernel"],
                     "first_seq": e["seq"], "last_seq": e["seq"], "until": e["t"]}
            folded.append(e)
        folded.sort(key=lambda e: abs(e["t"] - t))
        return sorted(folded[:limit], key=lambda e: e["t"])


class Redis:
    """A redis-server with an append-only file, so a restart keeps its blobs."""

    def __init__(self, bind_ip, root):
        self.ip = bind_ip
        self.port = cl.free_port()
        self.dir = os.path.join(root, "redis")
        os.makedirs(self.dir, exist_ok=True)
        self.proc = None
        self.start()

    def start(self):
        self.proc = subprocess.Popen(
            ["redis-server", "--bind", self.ip, "--port", str(self.port), "--dir", self.dir,
             "--appendonly", "yes", "--appendfsync", "always", "--save", "",
             "--protected-mode", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
        deadline = time.time() + 20
        while True:
            ping = subprocess.run(["redis-cli", "-h", self.ip, "-p", str(self.port), "ping"],
                                  capture_output=True, text=True, timeout=10)
            if ping.stdout.strip() == "PONG":
                return
            assert time.time() < deadline, "redis-server did not start"
            time.sleep(0.1)

    def kill(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    @property
    def url(self):
        return f"redis://{self.ip}:{self.port}/0"


class KernelClient:
    """One kernel's client: cells one at a time, each answer recorded in the history; reconnects
    when the gateway goes away."""

    def __init__(self, campaign, kernel_id, index):
        self.c = campaign
        self.kernel = kernel_id
        self.index = index
        self.ws = None
        self.session = uuid.uuid4().hex
        self.seq = 0
        self.cells = {}  # seq -> {"outcome": ok|not_run|unknown, ...}
        self.thread = threading.Thread(target=self._run, name=f"client-{index}", daemon=True)

    def connect(self, deadline):
        while True:
            try:
                self.ws = websocket.create_connection(
                    self.c.url.replace("http://", "ws://") + f"/api/kernels/{self.kernel}/channels",
                    header=[f"Authorization: token {self.c.token}"], timeout=5)
                return
            except (OSError, websocket.WebSocketException):
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)

    def send(self, msg_type, content, metadata=None, channel="shell"):
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                       "username": "chaos", "version": "5.3",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())},
            "parent_header": {}, "metadata": metadata or {}, "content": content,
            "channel": channel, "buffers": []}))
        return msg_id

    def execute(self, code, timeout_s, metadata=None):
        """(reply message or None, stdout text); None: no reply within `timeout_s`. Raises on a
        lost connection."""
        msg_id = self.send("execute_request", {
            "code": code, "silent": False, "store_history": True, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": False}, metadata)
        deadline = time.monotonic() + timeout_s
        reply, out, idle = None, [], False
        while reply is None or not idle:
            left = deadline - time.monotonic()
            if left <= 0:
                return reply, "".join(out)
            self.ws.settimeout(left)
            try:
                m = json.loads(self.ws.recv())
            except websocket.WebSocketTimeoutException:
                return reply, "".join(out)
            if m.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if m["channel"] == "shell":
                reply = m
            elif m["msg_type"] == "stream":
                out.append(m["content"]["text"])
            elif m["msg_type"] == "status" and m["content"]["execution_state"] == "idle":
                idle = True
        return reply, "".join(out)

    def cell_code(self, seq):
        code = f"L.append({seq})"
        if seq % 5 == 0:  # a value large enough to go to the blob store
            code += f"\nB = bytes(200_000) + b'{seq}'"
        return code

    def _run(self):
        h = self.c.history
        while not self.c.stop_clients.is_set():
            self.seq += 1
            seq = self.seq
            h.add("send", kernel=self.index, seq=seq)
            sent = time.monotonic()
            try:
                if self.ws is None:
                    self.connect(time.monotonic() + 120)
                    sent = time.monotonic()  # the wait for the gateway is not the cell's
                reply, _ = self.execute(self.cell_code(seq), timeout_s=120)
            except (OSError, websocket.WebSocketException) as e:
                self.record(seq, "unknown", sent, why=f"connection lost: {e}", lost=True)
                self.drop()
                continue
            if reply is None:
                self.record(seq, "unknown", sent, why="no reply within 120 s")
                continue
            self.record_reply(seq, sent, reply)
            if self.cells[seq]["outcome"] != "ok":
                time.sleep(0.3)  # as a user would, before running the cell again

    def drop(self):
        with contextlib.suppress(Exception):
            self.ws.close()
        self.ws = None
        time.sleep(0.2)

    def record_reply(self, seq, sent, reply):
        content = reply["content"]
        run_ms = reply.get("metadata", {}).get("nbos", {}).get("timings_ms", {}).get("run", 0)
        if content.get("status") == "ok":
            self.record(seq, "ok", sent, run_ms=run_ms)
            return
        text = f"{content.get('ename')}: {content.get('evalue')}"
        if NOT_KNOWN in text:
            outcome = "unknown"
        elif DID_NOT_RUN in text:
            outcome = "not_run"
        else:
            outcome = "vague"
        self.record(seq, outcome, sent, why=text[:400], run_ms=run_ms)

    def record(self, seq, outcome, sent, why="", run_ms=0, lost=False):
        waited = time.monotonic() - sent
        self.cells[seq] = {"outcome": outcome, "waited_s": waited, "run_ms": run_ms,
                           "lost_connection": lost}
        self.c.history.add("answer", kernel=self.index, seq=seq, outcome=outcome,
                           waited_s=round(waited, 3), why=why)


class Nemesis:
    """Seeded faults, each on a thread of its own (so they overlap): the kind, the target and
    every delay come from the seed. At most `max_servers_down` servers are faulted at once."""

    KINDS = [("kill_replica", 3), ("kill_server", 2), ("freeze_server", 2), ("cut_server", 2),
             ("kill_gateway", 1), ("restart_daemon", 1), ("restart_blob_store", 1)]

    def __init__(self, campaign, seed, interval_s=(4.0, 9.0), max_servers_down=2):
        self.c = campaign
        self.rng = random.Random(seed)
        self.interval_s = interval_s
        self.max_servers_down = max_servers_down
        self.busy = set()  # servers (numbers) and "gateway", "store" while a fault holds them
        self.destructive_since = None  # a server restart under way
        self.destructive_healed = -DESTRUCTIVE_SETTLE_S  # when the last one ended
        self.mu = threading.Lock()
        self.threads = []
        self.faults = 0
        self.kinds = [k for k, _ in self.KINDS if k != "cut_server" or campaign.net is not None]
        self.weights = [w for k, w in self.KINDS if k in self.kinds]

    def run(self, duration_s):
        end = time.monotonic() + duration_s
        while True:
            time.sleep(self.rng.uniform(*self.interval_s))
            if time.monotonic() >= end:
                break
            kind = self.rng.choices(self.kinds, self.weights)[0]
            hold = self.rng.uniform(3.0, 8.0)
            pick, pick_replica = self.rng.random(), self.rng.random()
            target = self._claim(kind, pick)
            if target is None:
                self.c.history.add("fault-skipped", what=kind)
                continue
            self.faults += 1
            t = threading.Thread(target=self._inject, args=(kind, target, hold, pick_replica),
                                 daemon=True)
            t.start()
            self.threads.append(t)
        for t in self.threads:
            t.join()

    DESTRUCTIVE = ("kill_server", "restart_daemon")  # the server's replicas go, with their logs

    def _every_kernel_whole(self):
        """Whether every kernel has three live replicas: a server restart destroys the replicas
        on it, and three replicas survive one such loss at a time, not two before the first is
        replaced. Freezes, cuts and the gateway's and store's faults overlap freely."""
        view = self.c.cluster_view()
        return view is not None and all(
            self.c.live_replicas(view, client.kernel) >= 3 for client in self.c.clients)

    def _claim(self, kind, pick):
        """The fault's target, now held by it, or None when the fault must be skipped."""
        destructive = kind in self.DESTRUCTIVE
        if destructive:
            # One at a time, and only once the last one's losses were seen and replaced: the
            # cluster view lags a restart by a few heartbeats.
            with self.mu:
                settled = (self.destructive_since is None and
                           time.monotonic() - self.destructive_healed >= DESTRUCTIVE_SETTLE_S)
            if not settled or not self._every_kernel_whole():
                return None
        with self.mu:
            if kind == "kill_gateway" or kind == "restart_blob_store":
                name = "gateway" if kind == "kill_gateway" else "store"
                if name in self.busy:
                    return None
                self.busy.add(name)
                return name
            free = [i for i in range(1, self.c.hosts + 1) if i not in self.busy]
            down = sum(1 for b in self.busy if isinstance(b, int))
            if not free or (kind != "kill_replica" and down >= self.max_servers_down):
                return None
            target = free[int(pick * len(free))]
            if kind != "kill_replica":
                self.busy.add(target)
            if destructive:
                self.destructive_since = time.monotonic()
            return target

    def _inject(self, kind, target, hold, pick_replica):
        h = self.c.history
        try:
            if kind == "kill_replica":
                self.kill_replica(target, pick_replica)
            else:
                getattr(self, kind)(target, hold)
        except Exception as e:  # a fault that could not be made is recorded, not fatal
            h.add("fault-error", what=kind, target=target, error=repr(e))
        finally:
            with self.mu:
                self.busy.discard(target)
                if kind in self.DESTRUCTIVE:
                    self.destructive_since = None
                    self.destructive_healed = time.monotonic()

    def kill_replica(self, host, pick):
        pids = sorted(self.c.cluster.host_replicas(host))
        if not pids:
            self.c.history.add("fault-skipped", what="kill_replica", target=host)
            return
        pid = pids[int(pick * len(pids))]
        self.c.history.add("fault", what="kill_replica", target=host, pid=pid)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)

    def _fault(self, what, target, hold, make, undo):
        """Records the fault, makes it, holds it `hold` s, undoes it and records the heal."""
        where = {} if target is None else {"target": target}
        self.c.history.add("fault", what=what, hold_s=round(hold, 2), **where)
        make()
        time.sleep(hold)
        undo()
        self.c.history.add("heal", what=what, **where)

    def kill_server(self, host, hold):
        self._fault("kill_server", host, hold, lambda: self.c.cluster.kill_host(host),
                    lambda: self.c.cluster.start_daemon(host))

    def freeze_server(self, host, hold):
        pids = []

        def make():
            pids.extend([self.c.cluster.daemons[host].pid] + self.c.cluster.host_replicas(host))
            cl.freeze(pids)

        def undo():
            for pid in pids + self.c.cluster.host_replicas(host):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)

        self._fault("freeze_server", host, hold, make, undo)

    def cut_server(self, host, hold):
        self._fault("cut_server", host, hold, lambda: self.c.net.cut(host),
                    lambda: self.c.net.heal(host))

    def restart_daemon(self, host, hold):
        def make():
            d = self.c.cluster.daemons.pop(host)
            d.kill()
            d.wait()
            self.c.cluster.ps.procs.remove(d)

        self._fault("restart_daemon", host, hold / 3, make,
                    lambda: self.c.cluster.start_daemon(host))

    def kill_gateway(self, _target, hold):
        def undo():
            self.c.cluster.gateway = self.c.cluster.start_gateway()

        self._fault("kill_gateway", None, hold / 4, self.c.cluster.kill_gateway, undo)

    def restart_blob_store(self, _target, hold):
        self._fault("restart_blob_store", None, hold / 2, self.c.redis.kill, self.c.redis.start)

class Campaign:
    """One seeded campaign: start(), run(), then check() for the violations; close() always."""

    def __init__(self, seed, duration_s=60.0, kernels=3, hosts=5, history_path=None,
                 interval_s=(4.0, 9.0), netns=None, gpu_kernels=True):
        self.seed = seed
        self.duration_s = duration_s
        self.kernels = kernels
        self.hosts = hosts
        self.interval_s = interval_s
        self.root = tempfile.mkdtemp(prefix="nbos-chaos-")
        self.history = History(history_path or os.path.join(
            tempfile.gettempdir(), f"nbos-chaos-{seed}-{os.getpid()}.jsonl"))
        self.netns = os.geteuid() == 0 if netns is None else netns
        self.gpu_kernels = gpu_kernels  # every other kernel asks for a GPU per cell
        self.net = self.redis = self.cluster = None
        self.clients = []
        self.stop_clients = threading.Event()
        self.last_fault_end = None
        self.readback = {}  # kernel index -> {replica id: list or error text}
        self.read_logs = {}  # kernel index -> log lines when its first read failed
        self.recovery_s = {}

    @property
    def url(self):
        return self.cluster.url

    @property
    def token(self):
        return self.cluster.token

    def start(self):
        if self.netns:
            self.net = cl.Network(self.hosts, gateway_host=True)
            self.redis = Redis(self.net.gateway_ip, self.root)
            self.cluster = cl.NetnsCluster(self.hosts, net=self.net, blob_store=self.redis.url)
        else:
            self.redis = Redis("127.0.0.1", self.root)
            self.cluster = cl.SplitCluster(hosts=self.hosts, blob_store=self.redis.url)
        for k in range(self.kernels):
            env = {"KERNEL_GPUS": "1"} if k % 2 and self.gpu_kernels else {}
            status, model = cl.rest_call(self.url, self.token, "POST", "/api/kernels",
                                         {"name": "nbos", "env": env})
            assert status == 201, (status, model)
            client = KernelClient(self, model["id"], k)
            client.connect(time.monotonic() + 60)
            reply, _ = client.execute("L = []", timeout_s=120)
            assert reply and reply["content"]["status"] == "ok", reply
            self.clients.append(client)
        self.history.add("started", seed=self.seed, kernels=[c.kernel for c in self.clients],
                         netns=self.netns)

    def run(self):
        for client in self.clients:
            client.thread.start()
        nemesis = Nemesis(self, self.seed, self.interval_s)
        nemesis.run(self.duration_s)
        self.faults = nemesis.faults
        self.last_fault_end = self.history.now()
        self.history.add("quiet")
        self.wait_recovered()
        self.stop_clients.set()
        for client in self.clients:
            client.thread.join(timeout=180)
        self.read_back()

    def wait_recovered(self):
        """Each kernel: an ok answer after the last fault and three live replicas; how long after
        the last fault that took (None: not within RECOVERY_S plus a margin)."""
        deadline = time.monotonic() + RECOVERY_S + 30
        pending = {c.index for c in self.clients}
        while pending and time.monotonic() < deadline:
            view = self.cluster_view()
            for c in self.clients:
                if c.index not in pending:
                    continue
                answered = any(e["kind"] == "answer" and e["kernel"] == c.index and
                               e["outcome"] == "ok" and e["t"] > self.last_fault_end
                               for e in self.history.events[-2000:])
                if answered and self.live_replicas(view, c.kernel) == 3:
                    self.recovery_s[c.index] = self.history.now() - self.last_fault_end
                    pending.discard(c.index)
            time.sleep(0.5)
        for index in pending:
            self.recovery_s[index] = None

    def cluster_view(self):
        try:
            status, view = cl.rest_call(self.url, self.token, "GET", "/api/nbos/cluster")
        except OSError:
            return None
        return view if status == 200 else None

    @staticmethod
    def live_replicas(view, kernel_id, ids=False):
        if not view:
            return [] if ids else 0
        k = next((k for k in view["kernels"] if k["id"] == kernel_id), None)
        live = [r["replica_id"] for r in (k or {}).get("replicas", []) if r["state"] == "live"]
        return live if ids else len(live)

    def read_back(self):
        """`L` as each live replica holds it, read by a cell run there."""
        view = self.cluster_view()
        for c in self.clients:
            lists = {}
            reader = KernelClient(self, c.kernel, c.index)
            try:
                reader.connect(time.monotonic() + 60)
                for rid in self.live_replicas(view, c.kernel, ids=True):
                    lists[rid] = self.read_on(reader, rid)
                    if not isinstance(lists[rid], list):
                        self.read_logs.setdefault(c.index, self.log_excerpt(c.kernel, rid))
            finally:
                reader.drop()
            self.readback[c.index] = lists

    def log_excerpt(self, kernel_id, rid, lines=25):
        """The gateway's last lines on `kernel_id` and the last lines of replica `rid`'s log."""
        root = self.cluster.ps.root
        out = []
        with contextlib.suppress(OSError):
            with open(os.path.join(root, "gateway.log"), errors="replace") as f:
                out += [line.rstrip() for line in f if kernel_id in line][-lines:]
        for path in glob.glob(os.path.join(root, "host-*", "replicas", f"{kernel_id}-{rid}",
                                           "replica.log")):
            with contextlib.suppress(OSError), open(path, errors="replace") as f:
                out += [f"{path}:"] + [line.rstrip() for line in f][-lines:]
        return out

    @staticmethod
    def read_on(reader, rid):
        reply, out = reader.execute("print(repr(L))", timeout_s=READ_TIMEOUT_S,
                                    metadata={"nbos": {"target_replica": rid}})
        if reply is None or reply["content"].get("status") != "ok":
            return f"could not read: {reply and reply['content']}"
        ran_on = reply.get("metadata", {}).get("nbos", {}).get("target_replica")
        if ran_on != rid:
            return f"the read ran on replica {ran_on}, not {rid}"
        return ast.literal_eval(out.strip())

    def close(self):
        self.stop_clients.set()
        for c in self.clients:
            c.drop()
        if self.cluster is not None:
            # SIGCONT first: a frozen server cannot stop.
            for i in list(self.cluster.daemons):
                with contextlib.suppress(Exception):
                    self.cluster.signal_host(i, signal.SIGCONT)
            self.cluster.close()
        elif self.net is not None:
            self.net.close()
        if self.redis is not None:
            self.redis.kill()
        self.history.close()
        shutil.rmtree(self.root, ignore_errors=True)


LOST_FOR_GOOD = "cannot form again"


def lost_for_good(campaign, client):
    """Whether the kernel said, in its last answer, that a majority of its replicas is gone with
    their logs: it cannot come back, and what it held cannot be read back."""
    last = next((e for e in reversed(campaign.history.events)
                 if e["kind"] == "answer" and e["kernel"] == client.index), None)
    return last is not None and LOST_FOR_GOOD in last.get("why", "")


def check(campaign):
    """The violations, each a dict with `what`, `kernel`, `t` (when it shows in the history) and
    details, earliest first. A kernel lost for good (it says so) is only checked for its
    answers."""
    violations = []
    campaign.lost_for_good = {c.index for c in campaign.clients if lost_for_good(campaign, c)}
    for c in campaign.clients:
        if c.index not in campaign.lost_for_good:
            violations += check_kernel(campaign, c)
        violations += check_answers(campaign.history, c)
    for v in violations:
        campaign.history.add("violation", **{k: x for k, x in v.items() if k != "t"}, at=v["t"])
    for index, took in campaign.recovery_s.items():
        if index in campaign.lost_for_good:
            continue
        if took is None or took > RECOVERY_S:
            violations.append({"what": "kernel did not recover", "kernel": index,
                               "t": campaign.last_fault_end, "took_s": took})
    return sorted(violations, key=lambda v: v["t"])


def _answer_time(history, kernel, seq):
    for e in history.events:
        if e["kind"] == "answer" and e["kernel"] == kernel and e["seq"] == seq:
            return e["t"]
    return 0.0


def check_kernel(campaign, client):
    h, k = campaign.history, client.index
    out = []
    lists = campaign.readback.get(k, {})
    good = {rid: v for rid, v in lists.items() if isinstance(v, list)}
    for rid, v in lists.items():
        if not isinstance(v, list):
            out.append({"what": "replica could not be read", "kernel": k, "replica": rid,
                        "t": h.now(), "why": v})
    if len(lists) < 3:
        out.append({"what": "fewer than three live replicas at the end", "kernel": k,
                    "t": h.now(), "replicas": sorted(lists)})
    if not good:
        return out
    reference_rid, reference = next(iter(good.items()))
    for rid, v in good.items():
        if v != reference:
            first = next((i for i, (a, b) in enumerate(zip(v, reference)) if a != b),
                         min(len(v), len(reference)))
            out.append({"what": "replicas differ", "kernel": k, "t": h.now(),
                        "replicas": [reference_rid, rid], "first_index": first,
                        "lengths": [len(reference), len(v)]})
    for rid, v in good.items():
        out += check_list(h, client, rid, v)
    return out


def check_list(h, client, rid, applied):
    k = client.index
    out = []
    seen = set()
    for i, seq in enumerate(applied):
        if seq in seen:
            out.append({"what": "cell applied twice", "kernel": k, "replica": rid, "seq": seq,
                        "t": _answer_time(h, k, seq)})
        elif i and seq < applied[i - 1]:
            out.append({"what": "cells applied out of order", "kernel": k, "replica": rid,
                        "seq": seq, "t": _answer_time(h, k, seq)})
        seen.add(seq)
    missing = [seq for seq, cell in sorted(client.cells.items())
               if cell["outcome"] == "ok" and seq not in seen]
    if missing:
        out.append({"what": "acknowledged cells missing", "kernel": k, "replica": rid,
                    "seqs": _ranges(missing), "count": len(missing),
                    "t": _answer_time(h, k, missing[0])})
    for seq, cell in sorted(client.cells.items()):
        if cell["outcome"] == "not_run" and seq in seen:
            out.append({"what": "cell answered 'did not run' was applied", "kernel": k,
                        "replica": rid, "seq": seq, "t": _answer_time(h, k, seq)})
    return out


def check_answers(h, client):
    """Answers slower than the cell's run time plus ANSWER_SLACK_S (the connection lost with the
    gateway excepted) and answers that promise nothing."""
    out = []
    for seq, cell in sorted(client.cells.items()):
        limit = cell["run_ms"] / 1000 + ANSWER_SLACK_S
        if not cell["lost_connection"] and cell["waited_s"] > limit:
            out.append({"what": "answer slower than its run time plus 2 s", "kernel": client.index,
                        "seq": seq, "waited_s": round(cell["waited_s"], 2),
                        "outcome": cell["outcome"], "t": _answer_time(h, client.index, seq)})
        if cell["outcome"] == "vague":
            out.append({"what": "error that says neither 'did not run' nor 'not known'",
                        "kernel": client.index, "seq": seq,
                        "t": _answer_time(h, client.index, seq)})
    return out


def _ranges(seqs):
    """[1, 2, 3, 7] -> "1-3, 7"."""
    parts, start = [], seqs[0]
    for prev, cur in zip(seqs, seqs[1:] + [None]):
        if cur != prev + 1 if cur is not None else True:
            parts.append(f"{start}-{prev}" if start != prev else f"{start}")
            start = cur
    return ", ".join(parts)


def summary(campaign, violations):
    """A few lines on the campaign and the first violation with the events around it."""
    cells = [cell for c in campaign.clients for cell in c.cells.values()]
    counts = {}
    for cell in cells:
        counts[cell["outcome"]] = counts.get(cell["outcome"], 0) + 1
    lines = [f"seed {campaign.seed}: {len(cells)} cells {counts}, {campaign.faults} faults, "
             f"recovery after the last fault (s): {campaign.recovery_s}, "
             f"kernels lost for good (and saying so): {sorted(campaign.lost_for_good)}",
             f"history: {campaign.history.path}", f"violations: {len(violations)}"]
    kinds = {}
    for v in violations:
        kinds[v["what"]] = kinds.get(v["what"], 0) + 1
    lines += [f"  {n} x {what}" for what, n in kinds.items()]
    lines += ["  " + json.dumps(v)[:400] for v in violations[:20]]
    if violations:
        first = violations[0]
        lines.append(f"first violation: {json.dumps(first)}")
        lines.append("events around it:")
        lines += ["  " + json.dumps(e) for e in campaign.history.around(first["t"],
                                                                         kernel=first["kernel"])]
    for index, logs in sorted(campaign.read_logs.items())[:1]:
        lines.append(f"logs when a read of kernel {index} failed first:")
        lines += ["  " + line[:300] for line in logs]
    return "\n".join(lines)
