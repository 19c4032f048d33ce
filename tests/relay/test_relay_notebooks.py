"""The relay's lifecycle as a KernelManager sees it (interrupt by signal, restart, shutdown,
SIGTERM) and its message authentication. (Every notebook of tests/notebooks runs through the relay
kernelspec there, its executor rotating, and must give ipykernel's outputs.)"""

import os
import signal
import subprocess
import time

import jupyter_client
import pytest

from conftest import RELAY_SPEC, install_relay_kernelspec, nbos_bin, write_connection_file


def wait_until(predicate, timeout=30, what="condition"):
    deadline = time.time() + timeout
    while not predicate():
        assert time.time() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def gateway_kernels(cluster):
    status, kernels = cluster.request("GET", "/api/kernels")
    assert status == 200, (status, kernels)
    return {k["id"] for k in kernels}


@pytest.fixture(autouse=True)
def no_kernel_left_behind(cluster, relay_spec):
    """Every test must leave the gateway without kernels: the relay deletes its kernel."""
    before = gateway_kernels(cluster)
    yield
    wait_until(lambda: gateway_kernels(cluster) <= before, timeout=30,
               what="the relay's gateway kernels to be deleted")


def test_interrupt_restart_and_shutdown_through_a_kernel_manager(cluster):
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name=RELAY_SPEC, startup_timeout=60)
    try:
        first = gateway_kernels(cluster)
        assert len(first) >= 1
        reply = kc.execute_interactive("x = 41", timeout=60)
        assert reply["content"]["status"] == "ok"

        # interrupt_mode "signal": SIGINT to the relay becomes POST /interrupt.
        kc.execute("import time; time.sleep(60)")
        time.sleep(2)
        km.interrupt_kernel()
        reply = kc.get_shell_msg(timeout=30)
        assert reply["content"]["status"] == "error"
        assert reply["content"]["ename"] == "KeyboardInterrupt"

        # stdin round trip: input_request reaches this client, its input_reply the kernel.
        reply = kc.execute_interactive("y = input('name? ')", allow_stdin=True, timeout=60,
                                       stdin_hook=lambda m: kc.input("relay"))
        assert reply["content"]["status"] == "ok"
        reply = kc.execute_interactive("assert y == 'relay'; x + 1", timeout=60)
        assert reply["content"]["status"] == "ok"

        # A restart is a new relay process and a new gateway kernel; the old one is deleted.
        km.restart_kernel()
        kc.wait_for_ready(timeout=60)
        wait_until(lambda: len(gateway_kernels(cluster) & first) == 0, timeout=30,
                   what="the old kernel to be deleted after restart")
        reply = kc.execute_interactive("'x' in globals()", timeout=60)
        assert reply["content"]["status"] == "ok"
    finally:
        kc.stop_channels()
        t = time.time()
        km.shutdown_kernel()
        # Within shutdown_wait_time: the relay exits by itself, it is not killed.
        assert time.time() - t < 5


def test_messages_with_a_bad_signature_are_dropped(cluster):
    km, kc = jupyter_client.manager.start_new_kernel(kernel_name=RELAY_SPEC, startup_timeout=60)
    forger = km.client()
    forger.session.key = b"not-the-key"
    forger.start_channels()
    try:
        msg_id = forger.kernel_info()
        with pytest.raises(Exception):  # queue.Empty: nothing comes back
            while True:
                reply = forger.get_shell_msg(timeout=3)
                assert reply["parent_header"].get("msg_id") != msg_id
        # The relay is still fine for the real client.
        reply = kc.execute_interactive("1 + 1", timeout=60)
        assert reply["content"]["status"] == "ok"
    finally:
        forger.stop_channels()
        kc.stop_channels()
        km.shutdown_kernel()


def test_sigterm_deletes_the_gateway_kernel(cluster):
    before = gateway_kernels(cluster)
    conn = write_connection_file()
    proc = subprocess.Popen([nbos_bin(), "relay", "-f", conn, "--gateway", cluster.url,
                             "--token", cluster.token], stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(gateway_kernels(cluster) - before) == 1, timeout=60,
                   what="the relay's kernel")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0, proc.stderr.read()
        assert gateway_kernels(cluster) <= before
    finally:
        if proc.poll() is None:
            proc.kill()
        os.unlink(conn)


def test_bad_token_ends_the_relay_with_a_clear_message(cluster):
    conn = write_connection_file()
    try:
        proc = subprocess.run([nbos_bin(), "relay", "-f", conn, "--gateway", cluster.url,
                               "--token", "wrong-token"],
                              capture_output=True, text=True, timeout=60)
    finally:
        os.unlink(conn)
    assert proc.returncode != 0
    assert "HTTP 403" in proc.stderr and "token" in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1, proc.stderr

    # Through a kernelspec, a KernelManager sees the kernel die at start-up.
    install_relay_kernelspec(cluster, name="nbos-relay-bad-token", token="wrong-token")
    with pytest.raises(RuntimeError, match="died"):
        jupyter_client.manager.start_new_kernel(kernel_name="nbos-relay-bad-token",
                                                startup_timeout=60)


def test_token_from_the_environment(cluster, monkeypatch):
    """A kernelspec installed without --token reads NBOS_TOKEN when the relay starts."""
    conn = write_connection_file()
    monkeypatch.setenv("NBOS_TOKEN", cluster.token)
    before = gateway_kernels(cluster)
    proc = subprocess.Popen([nbos_bin(), "relay", "-f", conn, "--gateway", cluster.url],
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_until(lambda: len(gateway_kernels(cluster) - before) == 1, timeout=60,
                   what="the relay's kernel")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
        os.unlink(conn)
