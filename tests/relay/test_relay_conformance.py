"""jupyter_kernel_test conformance through the relay: the samples of
tests/conformance/test_kernel_conformance.py, against the relay kernelspec ("nbos-relay",
`nbos relay` in front of a gateway kernel) instead of `nbos kernel`."""

import pytest

import test_kernel_conformance as conformance  # tests/conformance, on sys.path via conftest.py
from conftest import RELAY_SPEC, install_relay_kernelspec, start_cluster, stop_cluster


@pytest.fixture(scope="module", autouse=True)
def relay_kernelspec():
    # Module-scoped fixtures run before the class's setUpClass, which starts the kernel.
    c = start_cluster()
    install_relay_kernelspec(c)
    yield c
    stop_cluster(c)


class RelayKernelTests(conformance.NbosKernelTests):
    kernel_name = RELAY_SPEC
