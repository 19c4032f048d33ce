"""Shared fixtures for the end-to-end suites: the nbos binary and its kernelspec.

Every suite runs against a kernelspec installed into a private JUPYTER_PATH, so tests never
touch the user's Jupyter configuration and always use the binary under test ($NBOS_BIN).
"""

import atexit
import contextlib
import os
import pathlib
import random
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def nbos_bin():
    path = os.environ.get("NBOS_BIN") or str(ROOT / "build" / "bin" / "nbos")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"nbos binary not found at {path}; build first or set NBOS_BIN")
    return path


def port_is_free(port):
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


_PORTS = random.Random(os.getpid())
_PORTS_TAKEN = set()


def free_ports(n, pairs=False):
    """n distinct free loopback ports, never handed out before by this process (with `pairs`,
    each port p also has p + 1 free and reserved). A port from bind(0) lies in the kernel's
    ephemeral range, where any outgoing connection (Raft, Redis, ZeroMQ, HTTP) may take it before
    the process under test binds it. These come from 10000-19999, below that range and below the
    ports the daemons of `nbos up` hand out (20000-32767), as in src/common/test_ports.h."""
    ports = []
    while len(ports) < n:
        port = _PORTS.randrange(10000, 19999)
        wanted = (port, port + 1) if pairs else (port,)
        if any(p in _PORTS_TAKEN or not port_is_free(p) for p in wanted):
            continue
        _PORTS_TAKEN.update(wanted)
        ports.append(port)
    return ports


def freeze(pids, timeout_s=10):
    """Sends SIGSTOP to each pid and returns once every thread of each has stopped. kill()
    returns before that: one thread starts the group stop when it next runs, and on a loaded
    machine the others may first serve a request sent after the kill (a process already gone
    is skipped)."""
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout_s
    for pid in pids:
        while not _all_threads_stopped(pid):
            assert time.monotonic() < deadline, f"process {pid} did not stop"
            time.sleep(0.001)


def _all_threads_stopped(pid):
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except FileNotFoundError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                # The state follows the command name, which is in parentheses and may hold any
                # character: the text after the last ')'.
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, IndexError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


# Every temporary directory a test makes (kernelspecs, cluster state, Raft logs of stopped
# replicas: often 100 MB and more each) goes under one directory that is removed when the session
# ends, so repeated runs do not fill the disk. NBOS_KEEP_TEST_DIRS=1 keeps it for a look after.
# Only Python's own tempfile calls move; the processes the tests start keep their TMPDIR.
# Helpers load this file a second time under another name (cluster.py, `from conftest import`
# once pytest has put a suite's own conftest in its place): every copy in this process must use
# the one directory that the copy pytest runs removes.
_SESSION = os.environ.get("NBOS_TESTS_SESSION_TMP", "").partition(":")
if _SESSION[0] == str(os.getpid()) and os.path.isdir(_SESSION[2]):
    SESSION_TMP = _SESSION[2]
else:
    SESSION_TMP = tempfile.mkdtemp(prefix="nbos-tests-")
    os.chmod(SESSION_TMP, 0o755)  # as /tmp: sandboxed replicas below it run as other users
    os.environ["NBOS_TESTS_SESSION_TMP"] = f"{os.getpid()}:{SESSION_TMP}"
    if os.environ.get("NBOS_KEEP_TEST_DIRS") != "1":
        # At exit, not at the session's end: pytest's own exit handler still cleans its
        # tmp_path directories in here, and handlers registered earlier run later.
        atexit.register(shutil.rmtree, SESSION_TMP, ignore_errors=True)
tempfile.tempdir = SESSION_TMP


def pytest_sessionfinish(session, exitstatus):
    if os.environ.get("NBOS_KEEP_TEST_DIRS") == "1":
        print(f"\nnbos: test directories kept in {SESSION_TMP}")


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
