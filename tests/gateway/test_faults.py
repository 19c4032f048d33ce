"""Faults below the gateway, with `nbos gateway` and `nbos daemon` started one by one: a server
whose data store is unreachable makes kernel starts fail at once with a clear error (not after
the start timeout), nothing is left behind, and the gateway keeps serving."""

import os
import re
import signal
import subprocess
import tempfile
import time

import pytest

from cluster import free_port, nbos_bin, rest_call


class Processes:
    def __init__(self):
        self.procs = []
        self.root = tempfile.mkdtemp(prefix="nbos-faults-")

    def start(self, name, *args):
        log = open(os.path.join(self.root, f"{name}.log"), "w")
        p = subprocess.Popen([nbos_bin(), *args], stdout=subprocess.PIPE, stderr=log, text=True)
        self.procs.append(p)
        return p

    def stop(self):
        for p in reversed(self.procs):
            p.send_signal(signal.SIGTERM)
        for p in self.procs:
            try:
                p.wait(timeout=30)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()


@pytest.fixture
def split_cluster():
    ps = Processes()
    token = "faults-token"
    control = f"127.0.0.1:{free_port()}"
    gw = ps.start("gateway", "gateway", "--port", "0", "--control-address", control,
                  "--state-dir", f"{ps.root}/gateway", "--token", token)
    m = re.match(r"gateway: (http://\S+) control:", gw.stdout.readline())
    assert m
    url = m.group(1)
    dead_store = f"redis://127.0.0.1:{free_port()}/0"  # nothing listens there
    for i in (1, 2, 3):
        store = dead_store if i == 2 else f"dir://{ps.root}/blobs"
        ps.start(f"host-{i}", "daemon", "--server-id", f"host-{i}", "--gateway", control,
                 "--gpus", "1", "--virtual-gpus", "--state-dir", f"{ps.root}/host-{i}",
                 "--blob-store", store, "--replica-ports", f"{21000 + 500 * i}-{21499 + 500 * i}")
    deadline = time.time() + 60
    while True:
        status, body = rest_call(url, token, "GET", "/api/nbos/cluster")
        if status == 200 and len(body["servers"]) == 3:
            break
        assert time.time() < deadline, "daemons did not register"
        time.sleep(0.1)
    yield url, token, ps
    ps.stop()


def test_a_replica_that_cannot_start_fails_the_kernel_start_quickly(split_cluster):
    url, token, ps = split_cluster
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
    replicas = [p for p in os.listdir("/proc") if p.isdigit() and _is_replica_of(p, ps.root)]
    deadline = time.time() + 20
    while replicas:
        assert time.time() < deadline, f"replica processes left: {replicas}"
        time.sleep(0.2)
        replicas = [p for p in replicas if _is_replica_of(p, ps.root)]
    assert rest_call(url, token, "GET", "/api/kernels")[0] == 200


def _is_replica_of(pid, root):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().decode(errors="replace").split("\0")
    except OSError:
        return False
    return len(argv) > 1 and argv[1] == "replica" and any(root in a for a in argv)
