"""Shared fixtures for the end-to-end suites: the nbos binary and its kernelspec.

Every suite runs against a kernelspec installed into a private JUPYTER_PATH, so tests never
touch the user's Jupyter configuration and always use the binary under test ($NBOS_BIN).
"""

import os
import pathlib
import subprocess
import tempfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


def nbos_bin():
    path = os.environ.get("NBOS_BIN") or str(ROOT / "build" / "bin" / "nbos")
    if not os.access(path, os.X_OK):
        raise RuntimeError(f"nbos binary not found at {path}; build first or set NBOS_BIN")
    return path


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
