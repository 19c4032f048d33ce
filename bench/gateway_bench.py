#!/usr/bin/python3
"""Gateway latency of `nbos up`: interactivity delay with free GPUs, and the round trip of an
empty cell through an unmodified `jupyter server --gateway-url` versus plain ipykernel behind a
plain `jupyter server`, each beside its baseline measured in the same run.

  1. interactivity delay  N cells of `pass` on a kernel started at the gateway with
                          KERNEL_GPUS=1 (WebSocket straight to the gateway). From the
                          execute_reply's metadata:
                            gateway  = nbos.gateway_us.sent - .received   (queue + plan + grant;
                                       split at .planned when the gateway reports it)
                            transit  = metadata.started - nbos.gateway_us.sent  (the replica's
                                       receipt of the request; same machine, same clock; only if
                                       `started` has microsecond precision)
                            elect    = nbos.timings_ms.elect  (the executor's committed LEAD)
                            delay    = gateway + transit + elect  (request at the gateway ->
                                       executor starts user code)
                          Also: commit (nbos.timings_ms.commit), run, release (.replied -
                          .releasing when reported; 0 where the gateway releases grants
                          after the reply) and the client's own round trip.
                          Design target (DESIGN.md §9): delay p50 <= 2 ms, p99 <= 10 ms.
  2. empty-cell overhead  round trip of `pass` (execute_request sent on the WebSocket ->
                          execute_reply AND iopub `status: idle` received) on three kernels,
                          interleaved (every iteration runs the cell once on each, rotating
                          which goes first):
                            nbos via jupyter server   `jupyter server --gateway-url` -> `nbos up`
                            ipykernel via jupyter server   the baseline: Debian's plain
                                                      `jupyter server` with kernelspec python3
                            nbos direct to the gateway     reference, no jupyter server between
                          Design target: nbos / ipykernel <= 1.5x (compare ratios, not times).

Round trips include whatever TCP does between the hops: a server socket with Nagle's algorithm
on, meeting the client's delayed ACK, adds up to ~40 ms per cell on Linux. --quickack (a
diagnostic; real frontends do not do it) has this client ACK at once, which removes that stall
on the client's own hop only.

Every process used (nbos up and its daemons and replicas, both jupyter servers, the ipykernel)
is started here and stopped at the end; `nbos up` gets SIGTERM and the run checks that no
process of its state directory, and no kernel of either jupyter server, is left.

Run from the repository root with Debian's Python (it has websocket-client and jupyter_server):

    /usr/bin/python3 bench/gateway_bench.py [--quick] [--json out.json]

Exit status: 0 on success (targets missed are reported, not fatal); 1 if a process fails to
start, a cell fails or times out, or a process is left behind; 2 on usage errors.
"""

from __future__ import annotations

import argparse
import calendar
import contextlib
import json
import os
import pathlib
import platform
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
from kernel_roundtrip import percentile  # noqa: E402  (one definition for all benches)

DELAY_P50_TARGET_MS = 2.0
DELAY_P99_TARGET_MS = 10.0
OVERHEAD_RATIO_TARGET = 1.5
LAB_DIR = ROOT / "tests" / "jupyterlab"  # JupyterLab's client, installed by its test suite
JUPYTER = "/usr/bin/jupyter"


class BenchError(RuntimeError):
    """A process or kernel misbehaved (did not start, died, timed out, a cell failed)."""


# --------------------------------------------------------------------------- small helpers


def summarize(values):
    s = sorted(v for v in values if v is not None)
    if not s:
        return {"n": 0}
    return {"n": len(s), "p50": percentile(s, 50), "p90": percentile(s, 90),
            "p99": percentile(s, 99), "mean": sum(s) / len(s), "min": s[0], "max": s[-1]}


def f(v, digits=3):
    return "-" if v is None or v != v else f"{v:.{digits}f}"


def table(header, rows, left=(0,)):
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h)
              for i, h in enumerate(header)]

    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    return "\n".join([fmt(header), "  ".join("-" * w for w in widths)] + [fmt(r) for r in rows])


def tail(path, n=3000):
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - n))
            text = fh.read().decode("utf-8", "replace")
        return text if text.strip() else "<empty>"
    except OSError as e:
        return f"<cannot read {path}: {e}>"


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def log(msg):
    print(msg, flush=True)


_ISO_US = re.compile(r"^(\d{4})-(\d{2})-(\d{2})T(\d{2}):(\d{2}):(\d{2})\.(\d{6})(Z|[+-]00:?00)?$")


def iso_to_epoch_us(text):
    """Microseconds since the epoch of an ISO-8601 UTC time with exactly 6 fractional digits;
    None for anything less precise (or not UTC)."""
    m = _ISO_US.match(text or "")
    if not m:
        return None
    y, mo, d, h, mi, s, frac = (int(x) for x in m.groups()[:7])
    return calendar.timegm((y, mo, d, h, mi, s, 0, 0, 0)) * 1_000_000 + frac


def processes_matching(needle):
    """(pid, cmdline) of live processes, other than this one, whose command line has `needle`."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmd = fh.read().replace(b"\0", b" ").decode(errors="replace")
            with open(f"/proc/{pid}/stat") as fh:
                if fh.read().rsplit(")", 1)[1].split()[0] == "Z":
                    continue  # a zombie is not running
        except (OSError, IndexError):
            continue
        if needle in cmd:
            out.append((int(pid), cmd.strip()))
    return out


def http(method, url, token, body=None, timeout=120):
    h = {"Authorization": f"token {token}"}
    data = None
    if body is not None:
        data = json.dumps(body).encode()
        h["Content-Type"] = "application/json"
    req = urllib.request.Request(url, method=method, headers=h, data=data)
    try:
        with urllib.request.urlopen(req, timeout=timeout) as resp:
            payload = resp.read()
            return resp.status, (json.loads(payload) if payload else None)
    except urllib.error.HTTPError as e:
        payload = e.read().decode(errors="replace")
        with contextlib.suppress(ValueError):
            payload = json.loads(payload)
        return e.code, payload


def wait_until(pred, timeout, what, check=None, interval=0.1):
    deadline = time.monotonic() + timeout
    while True:
        if check is not None:
            check()
        with contextlib.suppress(Exception):
            if pred():
                return
        if time.monotonic() > deadline:
            raise BenchError(f"{what} within {timeout:.0f}s")
        time.sleep(interval)


# --------------------------------------------------------------------------- processes


class NbosUp:
    """`nbos up` with a private state directory; stdout/stderr go to a file (never a pipe that
    could fill up)."""

    def __init__(self, nbos, workdir, hosts, gpus_per_host, timeout, raft_log_dir="auto"):
        self.state_dir = os.path.join(workdir, "nbos-state")
        os.makedirs(self.state_dir)
        self.log_path = os.path.join(workdir, "nbos-up.log")
        self.hosts = hosts
        self.url = self.token = None
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(
            [nbos, "up", "--hosts", str(hosts), "--gpus-per-host", str(gpus_per_host),
             "--port", "0", "--state-dir", self.state_dir, "--raft-log-dir", raft_log_dir,
             "--log-level", "info"],
            stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)

        def first_line():
            with open(self.log_path, errors="replace") as fh:
                for line in fh:
                    m = re.search(r"gateway: (http://\S+) token: (\S+)", line)
                    if m:
                        self.url, self.token = m.group(1), m.group(2)
                        return True
            return False

        wait_until(first_line, timeout, "nbos up did not print its gateway address",
                   check=self.check_alive)
        wait_until(lambda: len(self.get("/api/nbos/cluster")["servers"]) >= hosts, timeout,
                   "the daemons did not register with the gateway", check=self.check_alive)

    def check_alive(self):
        rc = self.proc.poll()
        if rc is not None:
            raise BenchError(f"nbos up exited with status {rc}\n--- tail of {self.log_path} ---\n"
                             f"{tail(self.log_path)}")

    def request(self, method, path, body=None):
        return http(method, self.url + path, self.token, body)

    def get(self, path):
        status, body = self.request("GET", path)
        if status != 200:
            raise BenchError(f"GET {path} on the gateway: {status} {body}")
        return body

    def start_kernel(self, env=None):
        status, model = self.request("POST", "/api/kernels", {"name": "nbos", "env": env or {}})
        if status != 201:
            raise BenchError(f"the gateway did not start a kernel: {status} {model}")
        return model["id"]

    def stop(self):
        """SIGTERM, then checks that nothing of this state directory still runs. Returns
        (exit status, leftovers); leftovers are killed (they are ours) but still reported."""
        rc = self.proc.poll()
        if rc is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                rc = self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                rc = self.proc.wait()
                rc = f"{rc} (SIGKILLed after 60 s)"
        self._log.close()
        left = []
        with contextlib.suppress(BenchError):
            wait_until(lambda: not processes_matching(self.state_dir), 10, "")
        left = processes_matching(self.state_dir)
        for pid, _ in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return rc, left


class JupyterServer:
    """Debian's `jupyter server` in private config/runtime/root dirs; with gateway=(url, token)
    it runs in gateway mode in front of `nbos up`."""

    def __init__(self, label, workdir, timeout, gateway=None, nodelay=False):
        self.label = label
        self.port = free_port()
        self.token = uuid.uuid4().hex
        base = os.path.join(workdir, label)
        self.root = os.path.join(base, "root")
        self.runtime_dir = os.path.join(base, "runtime")
        for d in (self.root, self.runtime_dir, os.path.join(base, "config"),
                  os.path.join(base, "data"), os.path.join(base, "ipython")):
            os.makedirs(d, exist_ok=True)
        env = dict(os.environ)
        env.update(JUPYTER_CONFIG_DIR=os.path.join(base, "config"),
                   JUPYTER_RUNTIME_DIR=self.runtime_dir,
                   JUPYTER_DATA_DIR=os.path.join(base, "data"),
                   IPYTHONDIR=os.path.join(base, "ipython"),
                   PYDEVD_DISABLE_FILE_VALIDATION="1", PYTHONUNBUFFERED="1")
        env.pop("JUPYTER_PATH", None)
        if nodelay:
            shutil.copyfile(ROOT / "apps" / "nbos" / "jupyter_frontend_config.py",
                            os.path.join(base, "config", "jupyter_server_config.py"))
        argv = [JUPYTER, "server", "--allow-root", "--no-browser", "--ip=127.0.0.1",
                f"--port={self.port}", "--port-retries=0", f"--ServerApp.token={self.token}",
                f"--ServerApp.root_dir={self.root}"]
        if gateway is not None:
            argv += [f"--gateway-url={gateway[0]}", f"--GatewayClient.auth_token={gateway[1]}"]
        self.log_path = os.path.join(base, "jupyter-server.log")
        self._log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(argv, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, env=env, cwd=self.root)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_until(lambda: http("GET", self.url + "/api", self.token, timeout=2)[0] == 200,
                   timeout, f"{label}: jupyter server did not start", check=self.check_alive,
                   interval=0.2)
        self.version = http("GET", self.url + "/api", self.token)[1].get("version")

    def check_alive(self):
        rc = self.proc.poll()
        if rc is not None:
            raise BenchError(f"{self.label}: jupyter server exited with status {rc}\n"
                             f"--- tail of {self.log_path} ---\n{tail(self.log_path)}")

    def start_kernel(self, name):
        status, model = http("POST", self.url + "/api/kernels", self.token, {"name": name})
        if status != 201:
            raise BenchError(f"{self.label}: POST /api/kernels {name}: {status} {model}\n"
                             f"--- tail of {self.log_path} ---\n{tail(self.log_path)}")
        return model["id"]

    def delete_kernel(self, kernel_id):
        return http("DELETE", f"{self.url}/api/kernels/{kernel_id}", self.token)[0]

    def stop(self):
        """Returns processes left behind that ran from this server's runtime dir (killed)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self._log.close()
        with contextlib.suppress(BenchError):
            wait_until(lambda: not processes_matching(self.runtime_dir), 10, "")
        left = processes_matching(self.runtime_dir)
        for pid, _ in left:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        return left


# --------------------------------------------------------------------------- the client


class KernelWs:
    """One Jupyter kernel WebSocket (legacy JSON framing, binary frames understood too)."""

    def __init__(self, label, base_url, kernel_id, token, timeout, check=None, quickack=False):
        import websocket

        self._ws_mod = websocket
        self.label, self.timeout, self.check = label, timeout, check
        self.quickack = quickack and hasattr(socket, "TCP_QUICKACK")
        url = base_url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels"
        self.ws = websocket.create_connection(url, header=[f"Authorization: token {token}"],
                                              timeout=timeout)
        self.session = uuid.uuid4().hex
        self.wait_ready()

    def wait_ready(self, attempts=120):
        """kernel_info_request until one is answered, as Jupyter frontends do (jupyter_server
        1.23 may drop what arrives before its upstream connection is up)."""
        self.ws.settimeout(1)
        try:
            for _ in range(attempts):
                if self.check is not None:
                    self.check()
                msg_id = self.send("kernel_info_request", {})
                try:
                    while True:
                        m = self.recv()
                        if m.get("channel") == "shell" and \
                                m.get("parent_header", {}).get("msg_id") == msg_id:
                            break
                except self._ws_mod.WebSocketTimeoutException:
                    continue
                # Let the idle of that request (and any late earlier ones) go by.
                self.ws.settimeout(0.2)
                with contextlib.suppress(self._ws_mod.WebSocketTimeoutException):
                    while True:
                        self.recv()
                return
            raise BenchError(f"{self.label}: the kernel never answered kernel_info_request")
        finally:
            self.ws.settimeout(self.timeout)

    def send(self, msg_type, content, metadata=None):
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                       "username": "bench", "version": "5.3",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())},
            "parent_header": {}, "metadata": metadata or {}, "content": content,
            "channel": "shell", "buffers": []}))
        return msg_id

    def recv(self):
        if self.quickack:
            # Diagnostic (--quickack): ACK at once, so that a server that leaves Nagle's
            # algorithm on does not wait for this side's delayed ACK (~40 ms on Linux).
            self.ws.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_QUICKACK, 1)
        frame = self.ws.recv()
        if isinstance(frame, bytes):
            n = int.from_bytes(frame[:4], "big")
            offsets = [int.from_bytes(frame[4 + 4 * i:8 + 4 * i], "big") for i in range(n)]
            end = offsets[1] if n > 1 else len(frame)
            return json.loads(frame[offsets[0]:end])
        return json.loads(frame)

    def roundtrip(self, code, store_history=True):
        """execute_request -> execute_reply and iopub idle; returns (seconds, reply)."""
        content = {"code": code, "silent": False, "store_history": store_history,
                   "user_expressions": {}, "allow_stdin": False, "stop_on_error": True}
        t0 = time.perf_counter()
        msg_id = self.send("execute_request", content)
        reply, idle = None, False
        try:
            while reply is None or not idle:
                m = self.recv()
                if m.get("parent_header", {}).get("msg_id") != msg_id:
                    continue
                ch = m.get("channel")
                if ch == "shell":
                    reply = m
                elif ch == "iopub" and m.get("msg_type") == "status" and \
                        m["content"].get("execution_state") == "idle":
                    idle = True
        except self._ws_mod.WebSocketTimeoutException:
            if self.check is not None:
                self.check()
            raise BenchError(f"{self.label}: no reply+idle to {code!r} within"
                             f" {self.timeout:.0f}s (reply={'yes' if reply else 'no'},"
                             f" idle={'yes' if idle else 'no'})") from None
        except self._ws_mod.WebSocketException as e:
            if self.check is not None:
                self.check()
            raise BenchError(f"{self.label}: WebSocket failed: {type(e).__name__}: {e}") from None
        elapsed = time.perf_counter() - t0
        if reply.get("msg_type") != "execute_reply" or reply["content"].get("status") != "ok":
            raise BenchError(f"{self.label}: bad reply to {code!r}: {reply.get('msg_type')}"
                             f" {json.dumps(reply.get('content'))[:500]}")
        return elapsed, reply

    def close(self):
        with contextlib.suppress(Exception):
            self.ws.close()


# --------------------------------------------------------------------------- phases


def phase_delay(up, args):
    """1. Interactivity delay on a KERNEL_GPUS=1 kernel, WebSocket straight to the gateway."""
    kernel_id = up.start_kernel({"KERNEL_GPUS": "1"})
    ks = None
    try:
        ks = KernelWs("nbos gpu kernel (gateway)", up.url, kernel_id, up.token, args.timeout,
                      check=up.check_alive, quickack=args.quickack)
        rows, raw_started, fields_seen = [], set(), set()
        for i in range(args.warmup + args.iterations):
            rtt, reply = ks.roundtrip("pass", args.store_history)
            if i < args.warmup:
                continue
            md = reply.get("metadata", {})
            nb = md.get("nbos") or {}
            hops = nb.get("gateway_us") or {}
            tm = nb.get("timings_ms") or {}
            fields_seen |= set(hops)
            if not {"received", "sent"} <= set(hops) or "elect" not in tm:
                raise BenchError(f"execute_reply metadata lacks nbos.gateway_us"
                                 f" received/sent or nbos.timings_ms.elect: {json.dumps(md)[:600]}")
            if len(nb.get("gpu_ids") or []) != 1:
                raise BenchError(f"a cell of a KERNEL_GPUS=1 kernel ran with gpu_ids="
                                 f"{nb.get('gpu_ids')} (GPUs should be free)")
            started = md.get("started")
            raw_started.add(str(started)[:40])
            started_us = iso_to_epoch_us(started) if isinstance(started, str) else None
            r = {"rtt_ms": rtt * 1e3,
                 "gateway_ms": (hops["sent"] - hops["received"]) / 1e3,
                 "elect_ms": float(tm["elect"]),
                 "run_ms": float(tm["run"]) if "run" in tm else None,
                 "commit_ms": float(tm["commit"]) if "commit" in tm else None,
                 "transit_ms": (started_us - hops["sent"]) / 1e3 if started_us else None,
                 "executor": nb.get("executor"), "server": nb.get("server"),
                 "gpu_ids": nb.get("gpu_ids"), "hops_us": hops}
            if "planned" in hops:
                r["plan_ms"] = (hops["planned"] - hops["received"]) / 1e3
                r["grant_send_ms"] = (hops["sent"] - hops["planned"]) / 1e3
            if "releasing" in hops and "replied" in hops:
                r["release_ms"] = (hops["replied"] - hops["releasing"]) / 1e3
            if "replied" in hops:
                r["gateway_total_ms"] = (hops["replied"] - hops["received"]) / 1e3
            rows.append(r)
    finally:
        if ks is not None:
            ks.close()
        status = up.request("DELETE", f"/api/kernels/{kernel_id}")[0]
        if status != 204:
            log(f"  warning: DELETE of the gpu kernel answered {status}")

    # Transit is only meaningful with microsecond timestamps from one clock: a clearly
    # negative value means the clocks (or the formats) are not comparable.
    transits = [r["transit_ms"] for r in rows]
    transit_ok = all(t is not None for t in transits) and min(transits) > -0.5
    if not transit_ok:
        why = ("metadata.started lacks microsecond precision (e.g. " +
               ", ".join(sorted(raw_started)[:2]) + ")"
               if any(t is None for t in transits) else
               f"started - sent is negative (min {min(transits):.3f} ms): clocks not comparable")
    for r in rows:
        r["delay_ms"] = r["gateway_ms"] + r["elect_ms"] + (r["transit_ms"] if transit_ok else 0.0)
    keys = ["delay_ms", "gateway_ms", "plan_ms", "grant_send_ms", "transit_ms", "elect_ms",
            "run_ms", "commit_ms", "release_ms", "gateway_total_ms", "rtt_ms"]
    res = {"kernel_id": kernel_id, "transit_included": transit_ok,
           "transit_note": None if transit_ok else why,
           "gateway_us_fields": sorted(fields_seen),
           "executors": sorted({str(r["executor"]) for r in rows}),
           "servers": sorted({str(r["server"]) for r in rows}),
           "stats": {k: summarize([r.get(k) for r in rows]) for k in keys
                     if any(r.get(k) is not None for r in rows)},
           "samples": rows}
    return res


def phase_overhead(up, jgw, jplain, args):
    """2. `pass` round trip: nbos via jupyter server, ipykernel via jupyter server, nbos direct."""
    kernels = {}   # label -> (server-ish, kernel id)
    sockets = {}
    try:
        kid = jgw.start_kernel("nbos")
        kernels["nbos via jupyter server"] = (jgw, kid)
        kid = jplain.start_kernel("python3")
        kernels["ipykernel via jupyter server"] = (jplain, kid)
        kid = up.start_kernel()
        kernels["nbos direct to gateway"] = (up, kid)

        def checker(srv):
            def check():
                up.check_alive()
                if isinstance(srv, JupyterServer):
                    srv.check_alive()
            return check

        for label, (srv, kid) in kernels.items():
            token = srv.token
            sockets[label] = KernelWs(label, srv.url, kid, token, args.timeout,
                                      check=checker(srv), quickack=args.quickack)
        labels = list(sockets)
        samples = {k: [] for k in labels}
        for i in range(args.warmup + args.iterations):
            shift = i % len(labels)
            for label in labels[shift:] + labels[:shift]:
                dt, _ = sockets[label].roundtrip("pass", args.store_history)
                if i >= args.warmup:
                    samples[label].append(dt * 1e3)
        out = overhead_stats(samples)
        out["kernel_ids"] = {k: v[1] for k, v in kernels.items()}
        for sock in sockets.values():
            sock.close()
        sockets.clear()
        if LAB_DIR.joinpath("node_modules", "@jupyterlab", "services").is_dir():
            out["lab"] = lab_roundtrips(kernels, args)
        else:
            log(f"   JupyterLab's client not installed ({LAB_DIR}: npm install): its series skipped")
        return out
    finally:
        for s in sockets.values():
            s.close()
        for label, (srv, kid) in kernels.items():
            try:
                if isinstance(srv, JupyterServer):
                    status = srv.delete_kernel(kid)
                else:
                    status = srv.request("DELETE", f"/api/kernels/{kid}")[0]
                if status != 204:
                    log(f"  warning: DELETE of the kernel '{label}' answered {status}")
            except Exception as e:  # never mask the original failure
                log(f"  warning: DELETE of the kernel '{label}' failed: {e}")


def overhead_stats(samples):
    stats = {k: summarize(v) for k, v in samples.items()}
    base = stats["ipykernel via jupyter server"]
    ratios = {k: {q: stats[k][q] / base[q] for q in ("p50", "p90", "p99", "mean")}
              for k in samples}
    return {"stats": stats, "ratio_over_ipykernel": ratios, "samples": samples}


def lab_roundtrips(kernels, args):
    """The same three kernels with JupyterLab's @jupyterlab/services (bench/lab_roundtrip.cjs)."""
    targets = [{"label": label, "url": srv.url, "token": srv.token, "kernel_id": kid}
               for label, (srv, kid) in kernels.items()]
    proc = subprocess.run(
        ["node", str(ROOT / "bench" / "lab_roundtrip.cjs"), str(LAB_DIR), str(args.iterations),
         str(args.warmup), json.dumps(targets), str(args.timeout)],
        capture_output=True, text=True, timeout=args.timeout * (args.iterations + args.warmup))
    if proc.returncode != 0:
        raise BenchError(f"JupyterLab's client failed: {proc.stderr[-2000:]}")
    return overhead_stats(json.loads(proc.stdout.strip().splitlines()[-1]))  # after its logs


# --------------------------------------------------------------------------- report


def overhead_table(o):
    rows = []
    for label, s in o["stats"].items():
        r = o["ratio_over_ipykernel"][label]
        if label == "nbos via jupyter server":
            note = (f"target <= {OVERHEAD_RATIO_TARGET:g}x (p50): "
                    + ("MET" if r["p50"] <= OVERHEAD_RATIO_TARGET else "MISSED"))
        else:
            note = "baseline" if label.startswith("ipykernel") else "reference"
        rows.append([label, str(s["n"]), f(s["p50"]), f(s["p90"]), f(s["p99"]), f(s["mean"]),
                     f"{r['p50']:.2f}x", f"{r['p99']:.2f}x", f"{r['mean']:.2f}x", note])
    return (table(["kernel", "n", "p50", "p90", "p99", "mean", "p50 ratio", "p99 ratio",
                   "mean ratio", ""], rows, left=(0, 9))
            + "\n   ratio = kernel / ipykernel via jupyter server (same run, same client)")


def report(res):
    out = []
    m = res["meta"]
    out.append(f"nbos {m['nbos']}; nbos up --hosts {m['hosts']} --gpus-per-host"
               f" {m['gpus_per_host']}; {m['cpus']} CPUs; python {m['python']};"
               f" jupyter_server {m.get('jupyter_server_version')};"
               f" --raft-log-dir {m.get('raft_log_dir')};"
               f" N={m['iterations']} (+{m['warmup']} warm-up); store_history={m['store_history']}"
               + ("; client TCP_QUICKACK (diagnostic)" if m.get("quickack") else ""))

    d = res.get("delay")
    if d:
        st = d["stats"]
        out.append("\n1. Interactivity delay with free GPUs: `pass` on a KERNEL_GPUS=1 kernel,"
                   " WebSocket to the gateway (ms)")
        rows = []

        def add(label, key, note=""):
            s = st.get(key)
            if s and s.get("n"):
                rows.append([label, str(s["n"]), f(s["p50"]), f(s["p90"]), f(s["p99"]),
                             f(s["mean"]), f(s["max"]), note])

        p50, p99 = st["delay_ms"]["p50"], st["delay_ms"]["p99"]
        met = p50 <= DELAY_P50_TARGET_MS and p99 <= DELAY_P99_TARGET_MS
        add("delay: request at gateway -> executor starts code"
            + ("" if d["transit_included"] else " (WITHOUT transit)"), "delay_ms",
            f"target p50<={DELAY_P50_TARGET_MS:g}, p99<={DELAY_P99_TARGET_MS:g}: "
            + ("MET" if met else "MISSED"))
        add("  gateway queue + plan + grant (sent - received)", "gateway_ms")
        add("    queue + plan (planned - received)", "plan_ms")
        add("    grant + send (sent - planned)", "grant_send_ms")
        if d["transit_included"]:
            add("  transit gateway -> replica (started - sent)", "transit_ms")
        add("  election: committed LEAD (elect)", "elect_ms")
        add("the cell itself (run)", "run_ms")
        add("commit: delta + ExecDone via Raft (commit)", "commit_ms")
        add("gateway release of the GPUs (replied - releasing)", "release_ms")
        add("gateway total (replied - received)", "gateway_total_ms")
        add("client round trip (sent -> reply + idle)", "rtt_ms")
        out.append(table(["component", "n", "p50", "p90", "p99", "mean", "max", ""], rows,
                         left=(0, 7)))
        if not d["transit_included"]:
            out.append(f"   transit not included: {d['transit_note']}")
        rtt, gw = st.get("rtt_ms", {}).get("p50"), st.get("gateway_total_ms", {}).get("p50")
        if rtt is not None and gw is not None and rtt - gw > 20:
            out.append(f"   NOTE: the client's round trip exceeds the gateway's own time (received"
                       f" -> replied) by {rtt - gw:.1f} ms at p50: a sign of Nagle's algorithm on"
                       f" a server\n   socket meeting the client's delayed ACK (~40 ms on Linux);"
                       f" the round trips of 2. then carry it too. Compare a run with --quickack.")
        out.append(f"   gateway_us fields reported: {', '.join(d['gateway_us_fields'])};"
                   f" executor replica(s): {', '.join(d['executors'])};"
                   f" server(s): {', '.join(d['servers'])}")

    o = res.get("overhead")
    if o:
        out.append("\n2. Empty cell `pass`: WebSocket execute_request -> execute_reply and iopub"
                   " idle (ms), the three kernels interleaved")
        out.append(overhead_table(o))
        if o.get("lab"):
            out.append("\n2b. The same with JupyterLab's client (@jupyterlab/services under Node):"
                       " requestExecute -> done (ms)")
            out.append(overhead_table(o["lab"]))
        for label, series in (("websocket-client", o), ("@jupyterlab/services", o.get("lab"))):
            if series:
                r = series["ratio_over_ipykernel"]["nbos via jupyter server"]
                met = r["p50"] <= 1.1 and r["p99"] <= 1.1
                out.append(f"   {label}: nbos via jupyter server p50 {r['p50']:.2f}x, p99"
                           f" {r['p99']:.2f}x ipykernel's; <= 1.1x both: "
                           + ("MET" if met else "MISSED"))


    lines = []
    if d:
        st = d["stats"]["delay_ms"]
        lines.append(f"  interactivity delay p50 <= {DELAY_P50_TARGET_MS:g} ms: {st['p50']:.3f} ms"
                     f" -> {'MET' if st['p50'] <= DELAY_P50_TARGET_MS else 'MISSED'}")
        lines.append(f"  interactivity delay p99 <= {DELAY_P99_TARGET_MS:g} ms: {st['p99']:.3f} ms"
                     f" -> {'MET' if st['p99'] <= DELAY_P99_TARGET_MS else 'MISSED'}"
                     + ("" if d["transit_included"] else "  (without transit)"))
    if o:
        r = o["ratio_over_ipykernel"]["nbos via jupyter server"]
        lines.append(f"  empty cell via jupyter server <= {OVERHEAD_RATIO_TARGET:g}x ipykernel:"
                     f" p50 {r['p50']:.2f}x (p99 {r['p99']:.2f}x, mean {r['mean']:.2f}x) -> "
                     + ("MET" if r["p50"] <= OVERHEAD_RATIO_TARGET else "MISSED"))
    if lines:
        out.append("\nTargets (DESIGN.md §9):")
        out.extend(lines)
    cl = res.get("cleanup")
    if cl:
        out.append(f"\nCleanup: nbos up exit status {cl['nbos_up_exit']};"
                   f" processes left behind: {len(cl['left'])}"
                   + "".join(f"\n  LEFT: {pid} {cmd[:160]}" for pid, cmd in cl["left"]))
    return "\n".join(out)


# --------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog=__doc__.split("\n\n", 1)[1])
    p.add_argument("--nbos", default=str(ROOT / "build" / "bin" / "nbos"),
                   help="nbos binary (default build/bin/nbos)")
    p.add_argument("--quick", action="store_true",
                   help="short run: 40 cells per series, 5 warm-up (explicit flags win)")
    p.add_argument("--iterations", type=int, help="measured cells per series (default 200)")
    p.add_argument("--warmup", type=int, help="warm-up cells per series (default 20)")
    p.add_argument("--phases", default="delay,overhead",
                   help="comma-separated subset of delay,overhead")
    p.add_argument("--hosts", type=int, default=4, help="nbos up --hosts (4)")
    p.add_argument("--gpus-per-host", type=int, default=2, help="nbos up --gpus-per-host (2)")
    p.add_argument("--timeout", type=float, default=60.0, help="per-request timeout, s (60)")
    p.add_argument("--startup-timeout", type=float, default=120.0,
                   help="timeout for a process or kernel to start, s (120)")
    p.add_argument("--no-store-history", dest="store_history", action="store_false",
                   help="send store_history=false (skips IPython's sqlite history write)")
    p.add_argument("--quickack", action="store_true",
                   help="diagnostic: the client sets TCP_QUICKACK before every read, so that"
                        " servers without TCP_NODELAY are not stalled by its delayed ACKs"
                        " (real frontends do not do this)")
    p.add_argument("--server-nodelay", action="store_true",
                   help="both jupyter servers get apps/nbos/jupyter_frontend_config.py (what"
                        " `nbos up --frontend` gives its front end): TCP_NODELAY on their"
                        " kernel WebSockets, and no permessage-deflate on the gateway's")
    p.add_argument("--raft-log-dir", default="auto",
                   help="nbos up --raft-log-dir: auto (RAM where /dev/shm allows), state (disk)"
                        " or a directory")
    p.add_argument("--json", metavar="PATH", help="also write the results, with raw samples"
                   " ('-' for stdout)")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs)")
    a = p.parse_args(argv)
    a.iterations = a.iterations if a.iterations is not None else (40 if a.quick else 200)
    a.warmup = a.warmup if a.warmup is not None else (5 if a.quick else 20)
    a.phases = [s.strip() for s in a.phases.split(",") if s.strip()]
    if any(s not in ("delay", "overhead") for s in a.phases) or not a.phases:
        p.error("--phases: choose from delay, overhead")
    if a.iterations < 1 or a.warmup < 0 or a.hosts < 3 or a.gpus_per_host < 1:
        p.error("iterations >= 1, warmup >= 0, hosts >= 3 (3 replicas), gpus-per-host >= 1")
    return a


def run(args, workdir, res):
    nbos = os.path.abspath(args.nbos)
    if not (os.path.isfile(nbos) and os.access(nbos, os.X_OK)):
        raise BenchError(f"nbos binary not found or not executable: {nbos}")
    if "overhead" in args.phases and not os.access(JUPYTER, os.X_OK):
        raise BenchError(f"{JUPYTER} not found (Debian's jupyter-server package)")
    res["meta"] = {
        "nbos": nbos, "python": platform.python_version(), "python_executable": sys.executable,
        "cpus": os.cpu_count(), "host": platform.node(), "iterations": args.iterations,
        "warmup": args.warmup, "hosts": args.hosts, "gpus_per_host": args.gpus_per_host,
        "store_history": args.store_history, "quickack": args.quickack, "phases": args.phases,
        "server_nodelay": args.server_nodelay, "raft_log_dir": args.raft_log_dir,
        "unix_time": time.time(),
        "definitions": {
            "delay": "(gateway_us.sent - gateway_us.received) + (metadata.started - sent)"
                     " + timings_ms.elect",
            "roundtrip": "execute_request sent on the WebSocket -> execute_reply and iopub"
                         " idle received",
        }}
    up = jgw = jplain = None
    servers = []
    try:
        t = time.perf_counter()
        up = NbosUp(nbos, workdir, args.hosts, args.gpus_per_host, args.startup_timeout,
                    args.raft_log_dir)
        log(f"nbos up: gateway {up.url}, {args.hosts} daemons registered"
            f" ({time.perf_counter() - t:.1f}s)")
        if "delay" in args.phases:
            t = time.perf_counter()
            log("1. interactivity delay (KERNEL_GPUS=1, WebSocket to the gateway)")
            res["delay"] = phase_delay(up, args)
            log(f"   done in {time.perf_counter() - t:.1f}s")
        if "overhead" in args.phases:
            t = time.perf_counter()
            jgw = JupyterServer("jupyter-gateway", workdir, args.startup_timeout,
                                gateway=(up.url, up.token), nodelay=args.server_nodelay)
            servers.append(jgw)
            jplain = JupyterServer("jupyter-plain", workdir, args.startup_timeout,
                                   nodelay=args.server_nodelay)
            servers.append(jplain)
            res["meta"]["jupyter_server_version"] = jplain.version
            log(f"jupyter servers: {jgw.url} (--gateway-url), {jplain.url} (plain)"
                f" ({time.perf_counter() - t:.1f}s)")
            t = time.perf_counter()
            log("2. empty-cell round trip (interleaved)")
            res["overhead"] = phase_overhead(up, jgw, jplain, args)
            log(f"   done in {time.perf_counter() - t:.1f}s")
        return res
    finally:
        left = []
        for s in reversed(servers):
            try:
                left += s.stop()
            except Exception as e:
                log(f"warning: stopping {s.label} failed: {e}")
        if up is not None:
            rc, more = up.stop()
            left += more
            res["cleanup"] = {"nbos_up_exit": rc, "left": left}
        elif left:
            res["cleanup"] = {"nbos_up_exit": None, "left": left}


def main(argv):
    args = parse_args(argv)
    try:
        import websocket  # noqa: F401
    except ImportError:
        print(f"error: websocket-client is not importable by {sys.executable};"
              " run with /usr/bin/python3", file=sys.stderr)
        return 1

    def on_term(signum, frame):
        raise SystemExit(f"terminated by signal {signum}")

    signal.signal(signal.SIGTERM, on_term)
    workdir = tempfile.mkdtemp(prefix="nbos-gwbench-")
    ok = False
    res = {}
    try:
        t0 = time.perf_counter()
        try:
            run(args, workdir, res)
        finally:
            left = res.get("cleanup", {}).get("left")
            if left:
                print("\nPROCESSES LEFT BEHIND (killed): " + "; ".join(
                    f"{pid} {cmd[:160]}" for pid, cmd in left), file=sys.stderr)
        res["meta"]["wall_s"] = time.perf_counter() - t0
        print()
        print(report(res))
        print(f"\n(total {res['meta']['wall_s']:.0f}s)")
        if args.json:
            if args.json == "-":
                json.dump(res, sys.stdout, indent=1, default=str)
                print()
            else:
                with open(args.json, "w") as fh:
                    json.dump(res, fh, indent=1, default=str)
                print(f"wrote {args.json}")
        if res["cleanup"]["left"] or res["cleanup"]["nbos_up_exit"] != 0:
            print("\nBENCHMARK FAILED: nbos up did not exit cleanly or left processes behind",
                  file=sys.stderr)
            return 1
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
