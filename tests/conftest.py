"""Shared fixtures for the end-to-end suites: the nbos binary and its kernelspec.

Every suite runs against a kernelspec installed into a private JUPYTER_PATH, so tests never
touch the user's Jupyter configuration and always use the binary under test ($NBOS_BIN).
"""

import os
import pathlib
import shutil
import subprocess
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def nbos_bin():
    path = os.environ.get("NBOS_BIN") or str(ROOT / "build" / "bin" / "nbos")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"nbos binary not found at {path}; build first or set NBOS_BIN")
    return path


# Every temporary directory a test makes (kernelspecs, cluster state, Raft logs of stopped
# replicas: often 100 MB and more each) goes under one directory that is removed when the session
# ends, so repeated runs do not fill the disk. NBOS_KEEP_TEST_DIRS=1 keeps it for a look after.
# Only Python's own tempfile calls move; the processes the tests start keep their TMPDIR.
SESSION_TMP = tempfile.mkdtemp(prefix="nbos-tests-")
os.chmod(SESSION_TMP, 0o755)  # as /tmp: sandboxed replicas below it run as other users
tempfile.tempdir = SESSION_TMP


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("NBOS_KEEP_TEST_DIRS") == "1":
        print(f"\nnbos: test directories kept in {SESSION_TMP}")
        return
    tempfile.tempdir = None
    shutil.rmtree(SESSION_TMP, ignore_errors=True)


def _install_kernelspec():
    prefix = tempfile.mkdtemp(prefix="nbos-kernelspec-")
    subprocess.run([nbos_bin(), "kernelspec", "install", "--prefix", prefix], check=True,
                   stdout=subprocess.DEVNULL)
    share = os.path.join(prefix, "share", "jupyter")
    os.environ["JUPYTER_PATH"] = share + os.pathsep + os.environ.get("JUPYTER_PATH", "")
    # Keep IPython's history and config of test kernels out of the user's home.
    os.environ.setdefault("IPYTHONDIR", tempfile.mkdtemp(prefix="nbos-ipython-"))
    return share


# Installed at import time so that test classes which start kernels in setUpClass (as
# jupyter_kernel_test does) already see the spec.
KERNELSPEC_DIR = _install_kernelspec()


@pytest.fixture(scope="session")
def kernelspec_dir():
    return KERNELSPEC_DIR
