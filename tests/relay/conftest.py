"""Fixtures of the relay suites: an `nbos up` cluster per module and a relay kernelspec
("nbos-relay", `nbos kernelspec install --gateway`) pointing at it, in a private JUPYTER_PATH."""

import json
import os
import shutil
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TESTS = os.path.dirname(HERE)
for d in ("gateway", "notebooks", "conformance"):
    if os.path.join(TESTS, d) not in sys.path:
        sys.path.insert(0, os.path.join(TESTS, d))

from cluster import Cluster, free_ports, nbos_bin  # noqa: E402

RELAY_SPEC = "nbos-relay"


def install_relay_kernelspec(cluster, name=RELAY_SPEC, token=None):
    """Installs a relay kernelspec for `cluster` into a fresh prefix put first on JUPYTER_PATH."""
    prefix = tempfile.mkdtemp(prefix="nbos-relay-spec-")
    subprocess.run([nbos_bin(), "kernelspec", "install", "--prefix", prefix, "--name", name,
                    "--gateway", cluster.url, "--token", cluster.token if token is None else token],
                   check=True, stdout=subprocess.DEVNULL)
    share = os.path.join(prefix, "share", "jupyter")
    os.environ["JUPYTER_PATH"] = share + os.pathsep + os.environ.get("JUPYTER_PATH", "")
    with open(os.path.join(share, "kernels", name, "kernel.json")) as f:
        return json.load(f)


def write_connection_file(key="relay-test-key"):
    shell, iopub, stdin, control, hb = free_ports(5)
    info = {"transport": "tcp", "ip": "127.0.0.1", "shell_port": shell, "iopub_port": iopub,
            "stdin_port": stdin, "control_port": control, "hb_port": hb, "key": key,
            "signature_scheme": "hmac-sha256", "kernel_name": RELAY_SPEC}
    fd, path = tempfile.mkstemp(prefix="nbos-relay-conn-", suffix=".json")
    with os.fdopen(fd, "w") as f:
        json.dump(info, f)
    return path


def start_cluster():
    # Three hosts: each kernel has three replicas. Few GPUs keep the process count down on
    # small CI machines. Cells leave files for the tests in `shared`, a directory every
    # replica's sandbox may write.
    shared = tempfile.mkdtemp(prefix="nbos-shared-")
    os.chmod(shared, 0o1777)
    c = Cluster(hosts=3, gpus_per_host=1, extra=("--sandbox-share", shared))
    c.shared = shared
    return c


def stop_cluster(c):
    rc = c.stop()
    shutil.rmtree(c.shared, ignore_errors=True)
    assert rc == 0, f"nbos up exited with {rc}"


@pytest.fixture(scope="module")
def cluster():
    c = start_cluster()
    yield c
    stop_cluster(c)


@pytest.fixture(scope="module")
def relay_spec(cluster):
    return install_relay_kernelspec(cluster)
