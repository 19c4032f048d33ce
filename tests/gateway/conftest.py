import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))

from cluster import Cluster, JupyterServer, nbos_bin  # noqa: E402


@pytest.fixture(scope="module")
def cluster():
    journal = tempfile.mktemp(prefix="nbos-journal-", suffix=".jsonl")
    c = Cluster(hosts=4, gpus_per_host=2, extra=("--decision-journal", journal))
    yield c
    rc = c.stop()
    assert rc == 0, f"nbos up exited with {rc}"
    left = c.nbos_processes()
    assert not left, f"processes left running after nbos up stopped: {left}"
    # Every decision the gateway took in this module is what the shared core decides.
    done = subprocess.run([nbos_bin(), "sim", "replay", "--journal", journal],
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"the gateway's decisions do not replay: {done.stdout}{done.stderr}"


@pytest.fixture(scope="module")
def jupyter_server(cluster):
    s = JupyterServer(cluster)
    yield s
    s.stop()
