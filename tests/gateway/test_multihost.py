"""nbos across hosts with no loopback between them: the gateway and each of four daemons run in a
network namespace of their own with their own address on one bridge (all made by the test), the
control plane speaks TLS with a cluster credential, and the blob store is S3 (npm's s3rver on the
bridge). A kernel's three replicas sit in three namespaces; it runs cells, moves a replica to the
fourth, and loses a whole namespace and heals, its state identical on every replica."""

import os
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from cluster import Network, NetnsCluster, free_port, nbos_bin, rest_call
from test_s3_store import S3RVER
from test_self_healing import (digests_by_replica, expected_digest, kernel_view,
                               kernel_with_state, wait_migration_done, wait_whole)

HOSTS = 4


@pytest.fixture
def network():
    net = Network(HOSTS, gateway_host=True)
    yield net
    net.close()


def start_s3rver(address, data):
    port = free_port()
    proc = subprocess.Popen([S3RVER, "-d", data, "-a", address, "-p", str(port),
                             "--configure-bucket", "nbos", "--silent"], start_new_session=True)
    deadline = time.time() + 30
    while True:
        try:
            socket.create_connection((address, port), timeout=1).close()
            return proc, f"http://{address}:{port}"
        except OSError:
            assert proc.poll() is None and time.time() < deadline, "s3rver did not start"
            time.sleep(0.1)


def test_a_kernel_across_namespaces_runs_moves_and_survives_a_lost_host(network, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "S3RVER")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "S3RVER")
    work = tempfile.mkdtemp(prefix="nbos-multihost-")
    credential = os.path.join(work, "cluster.credential")
    subprocess.run([nbos_bin(), "credential", "create", credential], check=True,
                   capture_output=True)
    s3, endpoint = start_s3rver(network.gateway_ip, os.path.join(work, "s3"))
    c = None
    try:
        c = NetnsCluster(HOSTS, net=network, gateway_args=("--credential", credential),
                         daemon_args=("--credential", credential),
                         blob_store=f"s3://nbos/multihost?endpoint={endpoint}")
        assert c.url.startswith(f"http://{network.host_ip(0)}:"), c.url
        kid, ks, kernel = kernel_with_state(c)
        # Each replica process lives in the namespace of its server, none on this machine's.
        homes = {}
        for r in kernel["replicas"]:
            i = int(r["server_id"].split("-")[1])
            pids = c.host_replicas(i)
            assert pids and all(c.host_of(p) == i for p in pids), (i, pids)
            homes[r["replica_id"]] = i
        assert len(set(homes.values())) == 3
        assert os.listdir(os.path.join(work, "s3", "nbos", "multihost")), "no blob in S3"

        # A replica moves to the fourth host and catches up from S3.
        spare = ({f"host-{i}" for i in range(1, HOSTS + 1)} -
                 {r["server_id"] for r in kernel["replicas"]}).pop()
        status, body = rest_call(c.url, c.token, "POST", f"/api/nbos/kernels/{kid}/migrate",
                                 {"to_server_id": spare})
        assert status == 202, body
        after = wait_migration_done(c, kid, set())
        assert spare in {r["server_id"] for r in after.values()}, after

        # A whole host goes; its replica is replaced on the one left, through the majority.
        lost = sorted(r["server_id"] for r in after.values())[0]
        c.kill_host(int(lost.split("-")[1]))
        whole = wait_whole(c, kid, {lost}, set())
        digests = digests_by_replica(ks, whole)
        assert set(digests.values()) == {expected_digest()}, digests
        ks.close()
        assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")[0] == 204
    finally:
        if c is not None:
            c.ps.stop()
        os.killpg(s3.pid, signal.SIGKILL)
        s3.wait()
        subprocess.run(["rm", "-rf", work], check=False)
