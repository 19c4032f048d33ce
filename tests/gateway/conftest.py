import os
import subprocess
import sys
import tempfile

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "notebooks"))

import cluster as cluster_helpers  # noqa: E402
from cluster import Cluster, JupyterServer, nbos_bin  # noqa: E402

_FIRST_LOG_ROOT = pytest.StashKey[int]()

# CTest's e2e_gateway_netns runs these again, as root, with the gateway and each daemon in a
# network namespace of its own (their other tests as here): CTest's e2e_gateway leaves them to it.
NETNS_SUITES = ["test_faults.py", "test_migration.py", "test_self_healing.py", "test_suspend.py"]
if os.environ.get("NBOS_NETNS_SUITE_RUNS") == "1" and os.geteuid() == 0:
    collect_ignore = NETNS_SUITES


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    item.stash[_FIRST_LOG_ROOT] = len(cluster_helpers.LOG_ROOTS)
    yield


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """A failed test's report carries the tails of the logs of the processes it started."""
    outcome = yield
    report = outcome.get_result()
    if report.failed and call.when == "call":
        roots = cluster_helpers.LOG_ROOTS[item.stash.get(_FIRST_LOG_ROOT, 0):]
        if roots:
            report.sections.append(("nbos logs", cluster_helpers.log_tails(roots)))


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
