"""Helpers of the gateway suites: an `nbos up` cluster, a `jupyter server --gateway-url` in front
of it, REST calls, and a notebook runner that speaks the Jupyter WebSocket protocol."""

import contextlib
import glob
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
import uuid

import nbformat
import websocket


def _top_conftest():
    """The top-level conftest.py, loaded under a name of its own (each suite has a conftest)."""
    import importlib.util
    path = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conftest.py")
    spec = importlib.util.spec_from_file_location("nbos_tests_conftest", path)
    module = sys.modules.get(spec.name)
    if module is None:
        module = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = module
        spec.loader.exec_module(module)
    return module


def nbos_bin():
    """The binary under test, as the top-level conftest.py finds it."""
    return _top_conftest().nbos_bin()


def freeze(pids):
    """SIGSTOP to each pid, returning once each has stopped (the top-level conftest.py's)."""
    _top_conftest().freeze(pids)


def free_ports(n, pairs=False):
    return _top_conftest().free_ports(n, pairs)


def free_port():
    return free_ports(1)[0]


def processes_under(path):
    """(pid, command line) of each process whose command line names `path` or whose working
    directory is (or is under) it."""
    out = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().replace(b"\0", b" ").decode(errors="replace")
            cwd = os.readlink(f"/proc/{pid}/cwd")
        except OSError:
            continue
        if path in cmd or cwd.startswith(path):
            out.append((int(pid), cmd))
    return out


class ClusterApi:
    """What tests ask of any cluster: its gateway's REST API (`url`, `token`) and the processes
    of it still alive (`state_dir` is in their command line or holds their working directory)."""

    def request(self, method, path, body=None, token=None, headers=None, raw=None):
        return rest_call(self.url, self.token if token is None else token, method, path, body,
                         headers, raw)

    def get(self, path):
        status, body = self.request("GET", path)
        assert status == 200, (status, body)
        return body

    def start_kernel(self, env=None):
        status, model = self.request("POST", "/api/kernels", {"name": "nbos", "env": env or {}})
        assert status == 201, (status, model)
        return model["id"]

    def nbos_processes(self):
        """Processes of this cluster (warm replica processes included)."""
        return processes_under(self.state_dir)


class Cluster(ClusterApi):
    """`nbos up` on this machine, in a private state directory."""

    def __init__(self, hosts=4, gpus_per_host=2, extra=(), env=None):
        self.state_dir = tempfile.mkdtemp(prefix="nbos-up-")
        # Kernels run in a workspace of the test's own (nbos up's default is its current
        # directory), unless the test names one.
        self.workspace = None
        if "--workspace-root" not in extra and "--frontend" not in extra:
            self.workspace = tempfile.mkdtemp(prefix="nbos-workspace-")
            extra = ("--workspace-root", self.workspace, *extra)
        self.proc = subprocess.Popen(
            [nbos_bin(), "up", "--hosts", str(hosts), "--gpus-per-host", str(gpus_per_host),
             "--port", "0", "--state-dir", self.state_dir, "--log-level", "info", *extra],
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env=None if env is None else {**os.environ, **env})
        m, said = None, []  # what nbos up says before its address (a gateway started again)
        for line in iter(self.proc.stdout.readline, ""):
            if m := re.match(r"gateway: (http://\S+) token: (\S+)", line):
                break
            said.append(line)
        assert m, f"nbos up printed {''.join(said)!r}\n{log_tails([self.state_dir + '/logs'])}"
        self.url, self.token = m.group(1), m.group(2)
        self.hosts = hosts
        deadline = time.time() + 60
        while len(self.get("/api/nbos/cluster")["servers"]) < hosts:
            assert time.time() < deadline, "daemons did not register"
            time.sleep(0.1)

    def stop(self):
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        # A daemon a test killed outright leaves its Raft logs in RAM (the next daemon started
        # on the machine would remove them): they go here instead.
        for root in raft_log_roots(self.state_dir):
            shutil.rmtree(root, ignore_errors=True)
        if self.workspace:
            shutil.rmtree(self.workspace, ignore_errors=True)
        return self.proc.returncode


def raft_log_roots(state_dir):
    """The directories outside `state_dir` where its daemons kept their replicas' Raft logs."""
    roots = []
    for log in glob.glob(f"{state_dir}/logs/host-*.log") + glob.glob(f"{state_dir}/host-*.log"):
        with open(log, errors="replace") as f:
            roots += [line.split(" in ")[-1].strip() for line in f
                      if "replicas keep their Raft logs in /" in line]
    return roots


def wait_answering(url, what, proc=None, timeout=60):
    """Polls `url` until it answers; fails when `proc` (if given) exits or `timeout` passes."""
    deadline = time.time() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=2)
            return
        except OSError:
            assert proc is None or proc.poll() is None, f"{what} exited"
            assert time.time() < deadline, f"{what} did not answer"
            time.sleep(0.2)


@contextlib.contextmanager
def users_cluster(users, extra=(), **kwargs):
    """`nbos up --users FILE` for `users` ({name: (token, admin)}), stopped and checked for
    leftover processes at the end; its `users_file` is the file's path."""
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump({"users": [{"name": n, "token": t, "admin": a}
                         for n, (t, a) in users.items()]}, f)
    f.close()
    try:
        c = Cluster(extra=("--users", f.name, *extra), **kwargs)
        c.users_file = f.name
        for name in users:  # each user's kernels run in their own part of the workspace
            if c.workspace:
                os.makedirs(os.path.join(c.workspace, name), exist_ok=True)
        try:
            yield c
        finally:
            assert c.stop() == 0
        assert not c.nbos_processes()
    finally:
        os.unlink(f.name)


class JupyterServer:
    """Debian's `jupyter server` with --gateway-url pointing at a cluster (and --config=`config`
    when given)."""

    def __init__(self, cluster, config=None):
        self.port = free_port()
        self.token = uuid.uuid4().hex
        # Its notebooks live in the cluster's workspace, as the kernels must run there.
        self.root = tempfile.mkdtemp(prefix="nbos-jupyter-root-",
                                     dir=getattr(cluster, "workspace", None))
        env = dict(os.environ)
        env["JUPYTER_CONFIG_DIR"] = tempfile.mkdtemp(prefix="nbos-jupyter-config-")
        env["JUPYTER_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="nbos-jupyter-runtime-")
        self.log = open(os.path.join(self.root, "..", f"jupyter-server-{self.port}.log"), "w")
        self.proc = subprocess.Popen(
            ["/usr/bin/jupyter", "server", f"--gateway-url={cluster.url}",
             f"--GatewayClient.auth_token={cluster.token}", f"--ServerApp.token={self.token}",
             f"--port={self.port}", "--ip=127.0.0.1", "--no-browser", "--allow-root",
             f"--ServerApp.root_dir={self.root}"] + ([f"--config={config}"] if config else []),
            stdout=self.log, stderr=subprocess.STDOUT, env=env)
        self.url = f"http://127.0.0.1:{self.port}"
        wait_answering(f"{self.url}/api?token={self.token}", "jupyter server", self.proc)
        self.cluster_like = _Rest(self.url, self.token)

    def stop(self):
        self.proc.send_signal(signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.log.close()


class _Rest:
    def __init__(self, url, token):
        self.url, self.token = url, token

    def request(self, method, path, body=None):
        return rest_call(self.url, self.token, method, path, body)


def rest_call(url, token, method, path, body=None, headers=None, raw=None):
    """One REST call with `Authorization: token T`; returns (status, JSON body or text)."""
    h = {"Authorization": f"token {token}"}
    h.update(headers or {})
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else None)
    if data is not None:
        h.setdefault("Content-Type", "application/json")
    req = urllib.request.Request(url + path, method=method, headers=h, data=data)
    try:
        with urllib.request.urlopen(req, timeout=120) as resp:
            payload = resp.read()
            return resp.status, (json.loads(payload) if payload else None)
    except urllib.error.HTTPError as e:
        payload = e.read()
        try:
            return e.code, json.loads(payload)
        except ValueError:
            return e.code, payload.decode(errors="replace")


class KernelSocket:
    """One Jupyter kernel WebSocket (the legacy JSON framing)."""

    def __init__(self, base_url, kernel_id, token, timeout=180, ready=True):
        ws_url = base_url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels"
        self.timeout = timeout
        self.ws = websocket.create_connection(ws_url, header=[f"Authorization: token {token}"],
                                              timeout=timeout)
        self.session = uuid.uuid4().hex
        if ready:
            self.wait_ready()

    def wait_ready(self, attempts=60):
        """What Jupyter frontends do on connecting: kernel_info_request until one is answered (a
        proxy such as jupyter_server may drop what is sent before its upstream is connected)."""
        self.ws.settimeout(1)
        try:
            for _ in range(attempts):
                msg_id = self.send("kernel_info_request", {})
                try:
                    while True:
                        m = self.recv()
                        if (m["channel"] == "shell" and
                                m.get("parent_header", {}).get("msg_id") == msg_id):
                            return
                except websocket.WebSocketTimeoutException:
                    continue
            raise AssertionError("the kernel never answered kernel_info")
        finally:
            self.ws.settimeout(self.timeout)

    def send(self, msg_type, content, channel="shell", metadata=None):
        msg_id = uuid.uuid4().hex
        self.ws.send(json.dumps({
            "header": {"msg_id": msg_id, "msg_type": msg_type, "session": self.session,
                       "username": "test", "version": "5.3",
                       "date": time.strftime("%Y-%m-%dT%H:%M:%S.000000Z", time.gmtime())},
            "parent_header": {}, "metadata": metadata or {}, "content": content,
            "channel": channel, "buffers": []}))
        return msg_id

    def recv(self):
        frame = self.ws.recv()
        if isinstance(frame, bytes):
            # Binary framing: offsets, then the JSON; buffers are not needed here.
            n = int.from_bytes(frame[:4], "big")
            offsets = [int.from_bytes(frame[4 + 4 * i:8 + 4 * i], "big") for i in range(n)]
            end = offsets[1] if n > 1 else len(frame)
            return json.loads(frame[offsets[0]:end])
        return json.loads(frame)

    def execute(self, code, metadata=None, silent=False, stop_on_error=True):
        """Runs one cell; returns (reply, iopub messages of it in order)."""
        msg_id = self.send("execute_request", {
            "code": code, "silent": silent, "store_history": not silent, "user_expressions": {},
            "allow_stdin": False, "stop_on_error": stop_on_error}, metadata=metadata)
        return self.wait_for(msg_id)

    def wait_for(self, msg_id):
        reply, iopub, idle = None, [], False
        while reply is None or not idle:
            m = self.recv()
            if m.get("parent_header", {}).get("msg_id") != msg_id:
                continue
            if m["channel"] in ("shell", "control"):
                assert reply is None, f"two replies to one request: {m['msg_type']}"
                reply = m
            elif m["channel"] == "iopub":
                if m["msg_type"] == "status":
                    state = m["content"]["execution_state"]
                    assert not idle, "a second idle for one request"
                    idle = state == "idle"
                    assert idle or not iopub, "busy after other output"
                iopub.append(m)
        return reply, iopub

    def close(self):
        self.ws.close()


def run_notebook(base_url, token, kernel_id, path):
    """Executes every code cell of the notebook at `path` like nbclient (allow_errors) and
    returns the executed notebook, the execute_reply contents by cell index, and the kernel's
    working directory."""
    nb = nbformat.read(str(path), as_version=4)
    ks = KernelSocket(base_url, kernel_id, token)
    try:
        reply, iopub = ks.execute("import os as _o; print(_o.getcwd(), end='')", silent=True)
        workdir = "".join(m["content"].get("text", "") for m in iopub if m["msg_type"] == "stream")
        replies = {}
        displays = {}  # display_id -> outputs showing it, in any cell so far
        for index, cell in enumerate(nb.cells):
            if cell.cell_type != "code":
                continue
            reply, iopub = ks.execute(cell.source)
            cell.outputs = _outputs(iopub, displays)
            cell.execution_count = reply["content"].get("execution_count")
            replies[index] = reply["content"]
        return {"nb": nb, "replies": replies, "workdir": workdir, "error": None}
    finally:
        ks.close()


def _outputs(iopub, displays):
    """Cell outputs from iopub messages, as nbclient assembles them (clear_output with and
    without wait, update_display_data by display_id in this or any earlier cell)."""
    outputs, clear_pending = [], False
    for m in iopub:
        kind, content = m["msg_type"], m["content"]
        if kind == "clear_output":
            if content.get("wait"):
                clear_pending = True
            else:
                outputs.clear()
            continue
        if kind == "update_display_data":
            display_id = content.get("transient", {}).get("display_id")
            for shown in displays.get(display_id, []):
                shown["data"] = content["data"]
                shown["metadata"] = content["metadata"]
            continue
        if kind not in ("stream", "display_data", "execute_result", "error"):
            continue
        if clear_pending:
            outputs.clear()
            clear_pending = False
        out = nbformat.v4.output_from_msg({"msg_type": kind, "content": content,
                                           "header": m["header"]})
        display_id = content.get("transient", {}).get("display_id") if isinstance(
            content.get("transient"), dict) else None
        if display_id:
            displays.setdefault(display_id, []).append(out)
        outputs.append(out)
    return outputs


# The log directory of every Processes made, in order: a failed test shows the tails of the logs
# its clusters wrote (conftest.py), so that a failure seen once can be understood.
LOG_ROOTS = []


def log_tails(roots, lines=40):
    """The last `lines` lines of each *.log under `roots`, one titled block per file."""
    blocks = []
    for root in roots:
        for name in sorted(os.listdir(root)) if os.path.isdir(root) else []:
            if not name.endswith(".log"):
                continue
            with open(os.path.join(root, name), errors="replace") as f:
                tail = f.readlines()[-lines:]
            blocks.append(f"--- {root}/{name} (last {len(tail)} lines)\n" + "".join(tail))
    return "\n".join(blocks)


class Processes:
    def __init__(self):
        self.procs = []
        self.root = tempfile.mkdtemp(prefix="nbos-faults-")
        LOG_ROOTS.append(self.root)

    def start(self, name, *args, prefix=()):
        # Appended to: a process restarted under the same name keeps what the one before it said.
        log = open(os.path.join(self.root, f"{name}.log"), "a")
        p = subprocess.Popen([*prefix, nbos_bin(), *args], stdout=subprocess.PIPE, stderr=log,
                             text=True)
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGCONT)  # a frozen process cannot act on SIGTERM
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


class SplitCluster(ClusterApi):
    """A gateway and `hosts` daemons (1 virtual GPU each) started one by one, so that a test can
    kill, freeze or restart any of them; `dead_store_host` (a host number or None) gets a blob
    store nothing listens on."""

    def __init__(self, dead_store_host=None, hosts=3, control_ip="127.0.0.1", gateway_args=(),
                 daemon_args=(), blob_store=None):
        self.hosts = hosts
        self.gateway_args = tuple(gateway_args)
        self.daemon_args = tuple(daemon_args)
        self.daemons = {}
        self.ps = Processes()
        self.state_dir = self.ps.root
        self.token = "faults-token"
        self.control = f"{control_ip}:{free_port()}"
        self.port = free_port()
        self.gateway = self.start_gateway()
        dead_store = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
        store = blob_store or f"dir://{self.ps.root}/blobs"
        self.stores = {i: dead_store if i == dead_store_host else store
                       for i in range(1, hosts + 1)}
        for i in range(1, hosts + 1):
            self.start_daemon(i)
        self.wait_servers()

    def close(self):
        self.ps.stop()
        for root in raft_log_roots(self.state_dir):
            shutil.rmtree(root, ignore_errors=True)

    def stop(self):
        """Stops every process; returns the gateway's exit status."""
        self.close()
        return self.gateway.returncode

    def start_daemon(self, i, prefix=(), address=("127.0.0.1:0", "127.0.0.1")):
        self.daemons[i] = self.ps.start(
            f"host-{i}", "daemon", "--server-id", f"host-{i}", "--gateway", self.control,
            "--gpus", "1", "--virtual-gpus", "--state-dir", f"{self.ps.root}/host-{i}",
            "--blob-store", self.stores[i], "--replica-ports",
            f"{21000 + 500 * i}-{21499 + 500 * i}", "--listen", address[0], "--advertise-ip",
            address[1], *self.daemon_args, prefix=prefix)

    def host_replicas(self, i):
        """Pids of the replica processes that host-`i`'s daemon started."""
        return [int(p) for p in os.listdir("/proc")
                if p.isdigit() and is_replica_of(p, f"{self.ps.root}/host-{i}/")]

    def signal_host(self, i, sig):
        """Sends `sig` to host-`i`'s daemon and its replicas (SIGSTOP: the server freezes, and
        has when this returns)."""
        if sig == signal.SIGSTOP:
            return freeze([self.daemons[i].pid] + self.host_replicas(i))
        for pid in [self.daemons[i].pid] + self.host_replicas(i):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)

    def kill_host(self, i):
        """The whole server goes down: its daemon and its replicas, killed at once."""
        d = self.daemons.pop(i)
        victims = [d.pid] + self.host_replicas(i)
        for pid in victims:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        d.wait()
        self.ps.procs.remove(d)

    def start_gateway(self):
        gw = self.ps.start("gateway", "gateway", "--port", str(self.port), "--control-address",
                           self.control, "--state-dir", f"{self.ps.root}/gateway", "--token",
                           self.token, *self.gateway_args)
        m = re.match(r"gateway: (http://\S+) control:", gw.stdout.readline())
        assert m
        self.url = m.group(1)
        return gw

    def wait_servers(self):
        deadline = time.time() + 60
        while True:
            status, body = rest_call(self.url, self.token, "GET", "/api/nbos/cluster")
            if status == 200 and len(body["servers"]) == self.hosts:
                return
            assert time.time() < deadline, "daemons did not register"
            time.sleep(0.1)

    def kill_gateway(self):
        self.gateway.kill()
        self.gateway.wait()
        self.ps.procs.remove(self.gateway)

    def replicas(self):
        return [p for p in os.listdir("/proc") if p.isdigit() and is_replica_of(p, self.ps.root)]

    def wait_no_replicas(self, timeout=30):
        deadline = time.time() + timeout
        while self.replicas():
            assert time.time() < deadline, f"replica processes left: {self.replicas()}"
            time.sleep(0.2)


def is_replica_of(pid, root):
    """Whether `pid` is an `nbos replica` process with `root` in its command line."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return len(argv) > 1 and argv[1] == "replica" and any(root in a for a in argv)


class Network:
    """A bridge with one network namespace per host behind a veth pair, all made by this test:
    host i is 10.(N).0.(10+i) in namespace `nbos-<pid>-h<i>`, the bridge (this machine's side)
    10.(N).0.1. With `gateway_host`, host 0 (10.(N).0.10) is one more namespace, for the gateway.
    cut(i) drops every packet in and out of host i with nftables inside its namespace (loopback
    excepted), heal(i) removes that rule. close() deletes namespaces and bridge."""

    def __init__(self, hosts, gateway_host=False):
        tag = os.getpid() % 100000
        self.subnet = f"10.{200 + os.getpid() % 50}.{os.getpid() % 250}"
        self.bridge = f"nbosbr{tag}"
        self.namespaces = {i: f"nbos-{tag}-h{i}"
                           for i in range(0 if gateway_host else 1, hosts + 1)}
        self.gateway_ip = f"{self.subnet}.1"
        try:
            self._ip("link", "add", self.bridge, "type", "bridge")
            self._ip("addr", "add", f"{self.gateway_ip}/24", "dev", self.bridge)
            self._ip("link", "set", self.bridge, "up")
            for i, ns in self.namespaces.items():
                self._add_host(i, ns)
        except BaseException:
            self.close()
            raise

    def _veth(self, i):
        return f"nbosv{os.getpid() % 100000}h{i}"

    def _add_host(self, i, ns):
        outside, inside = self._veth(i), "eth0"
        self._ip("netns", "add", ns)
        self._ip("link", "add", outside, "type", "veth", "peer", "name", inside, "netns", ns)
        self._ip("link", "set", outside, "master", self.bridge)
        self._ip("link", "set", outside, "up")
        self._ip("-n", ns, "addr", "add", f"{self.host_ip(i)}/24", "dev", inside)
        self._ip("-n", ns, "link", "set", inside, "up")
        self._ip("-n", ns, "link", "set", "lo", "up")

    @staticmethod
    def _ip(*args):
        subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)

    def host_ip(self, i):
        return f"{self.subnet}.{10 + i}"

    def prefix(self, i):
        return ("ip", "netns", "exec", self.namespaces[i])

    def cut(self, i):
        rules = ("table inet nbos_cut {\n"
                 " chain in { type filter hook input priority 0; policy drop; iif lo accept; }\n"
                 " chain out { type filter hook output priority 0; policy drop; oif lo accept; }\n"
                 "}\n")
        subprocess.run([*self.prefix(i), "nft", "-f", "-"], input=rules, text=True, check=True,
                       capture_output=True, timeout=30)

    def heal(self, i):
        subprocess.run([*self.prefix(i), "nft", "delete", "table", "inet", "nbos_cut"],
                       check=True, capture_output=True, timeout=30)

    def close(self):
        for i, ns in self.namespaces.items():
            # A namespace outlives `ip netns del` while the kernel still holds it (sockets
            # closing), and its veth pair with it: delete the pair explicitly.
            subprocess.run(["ip", "link", "del", self._veth(i)], capture_output=True, timeout=30)
            subprocess.run(["ip", "netns", "del", ns], capture_output=True, timeout=30)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True, timeout=30)


class NetnsCluster(SplitCluster):
    """A SplitCluster whose daemons (and so their replicas) run each in its own network
    namespace (Network), reached over a bridge. The gateway runs on this machine (HTTP on
    127.0.0.1), or, when `net` has a gateway host, in that namespace at its own address."""

    def __init__(self, hosts, net=None, **kwargs):
        self.net = net or Network(hosts)
        self.own_gateway_ns = 0 in self.net.namespaces
        ip = self.net.host_ip(0) if self.own_gateway_ns else self.net.gateway_ip
        try:
            super().__init__(hosts=hosts, control_ip=ip, **kwargs)
        except BaseException:
            self.close()
            raise

    def start_gateway(self):
        if not self.own_gateway_ns:
            return super().start_gateway()
        gw = self.ps.start("gateway", "gateway", "--address", self.net.host_ip(0), "--port",
                           str(self.port), "--control-address", self.control, "--state-dir",
                           f"{self.ps.root}/gateway", "--token", self.token, *self.gateway_args,
                           prefix=self.net.prefix(0))
        m = re.match(r"gateway: (http://\S+) control:", gw.stdout.readline())
        assert m
        self.url = m.group(1)
        return gw

    def start_daemon(self, i, prefix=(), address=None):
        ip = self.net.host_ip(i)
        super().start_daemon(i, prefix=self.net.prefix(i), address=(f"{ip}:0", ip))

    def host_of(self, pid):
        """The host number whose namespace `pid` runs in, or None."""
        try:
            link = os.readlink(f"/proc/{pid}/ns/net")
        except OSError:
            return None
        for i, ns in self.net.namespaces.items():
            if os.stat(f"/run/netns/{ns}").st_ino == int(link.split("[")[1].rstrip("]")):
                return i
        return None

    def close(self):
        with contextlib.suppress(AttributeError):
            self.ps.stop()
        self.net.close()


def split_cluster(hosts=3, **kwargs):
    """A SplitCluster; with NBOS_TEST_NETNS=1 a NetnsCluster whose gateway and daemons each run in
    a network namespace of their own (no loopback between them). Stop it with close()."""
    if os.environ.get("NBOS_TEST_NETNS") == "1":
        return NetnsCluster(hosts, net=Network(hosts, gateway_host=True), **kwargs)
    return SplitCluster(hosts=hosts, **kwargs)
