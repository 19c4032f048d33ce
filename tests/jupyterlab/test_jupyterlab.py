"""JupyterLab's client library (@jupyterlab/services from npm, under Node) against `nbos up`:
start a kernel, execute, interrupt, shut down. npm installs the pinned packages on first run."""

import json
import os
import pathlib
import shutil
import subprocess
import sys

import pytest

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "gateway"))
from cluster import Cluster  # noqa: E402


@pytest.fixture(scope="module")
def node_modules():
    assert shutil.which("node") and shutil.which("npm"), "node and npm are required"
    if not (HERE / "node_modules" / "@jupyterlab" / "services").is_dir():
        subprocess.run(["npm", "install", "--no-audit", "--no-fund", "--loglevel=error"],
                       cwd=HERE, check=True, timeout=600)
    return HERE / "node_modules"


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(hosts=3, gpus_per_host=1)
    yield c
    assert c.stop() == 0
    assert not c.nbos_processes()


def test_jupyterlab_services_runs_a_kernel(cluster, node_modules):
    done = subprocess.run(["node", str(HERE / "lab_client.mjs"), cluster.url, cluster.token],
                          cwd=HERE, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stdout + done.stderr
    # The library logs its own lines ("Starting WebSocket: ...") to stdout too.
    steps = {s["step"]: s for s in map(json.loads, (line for line in done.stdout.splitlines()
                                                      if line.startswith("{")))}
    assert steps["info"]["implementation"] == "nbos"
    assert steps["info"]["language"] == "python"
    assert steps["execute"] == {"step": "execute", "status": "ok", "outputs": ["hi\n", "42"],
                                "execution_count": 1}
    assert steps["interrupted"]["status"] == "error"
    assert steps["interrupted"]["ename"] == "KeyboardInterrupt"
    assert steps["interrupted"]["seconds"] < 30
    assert steps["after"]["outputs"] == ["43"]
    assert steps["shutdown"]["still_listed"] is False
    assert cluster.get("/api/nbos/cluster")["kernels"] == []
