import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))

from cluster import Cluster, JupyterServer  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    c = Cluster(hosts=4, gpus_per_host=2)
    yield c
    rc = c.stop()
    assert rc == 0, f"nbos up exited with {rc}"
    left = c.nbos_processes()
    assert not left, f"processes left running after nbos up stopped: {left}"


@pytest.fixture(scope="module")
def jupyter_server(cluster):
    s = JupyterServer(cluster)
    yield s
    s.stop()
