"""A cluster whose servers share an S3 blob store (npm's s3rver, started here): large buffers of
a kernel's state go through S3, and a replica moved to a server that never held the kernel
catches up from it with the same state."""

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

import pytest

from cluster import Cluster, KernelSocket, free_port, rest_call
from test_self_healing import (digests_by_replica, expected_digest, kernel_view,
                               kernel_with_state, wait_migration_done)

S3RVER = os.environ.get("NBOS_S3RVER", os.path.join(
    os.path.dirname(__file__), "..", "..", ".cache", "npm", "node_modules", ".bin", "s3rver"))


@pytest.fixture
def s3():
    """(endpoint, bucket directory) of a fresh s3rver with bucket `nbos`."""
    assert os.access(S3RVER, os.X_OK), f"{S3RVER} missing: run `make bootstrap`"
    data = tempfile.mkdtemp(prefix="nbos-s3rver-")
    port = free_port()
    proc = subprocess.Popen([S3RVER, "-d", data, "-a", "127.0.0.1", "-p", str(port),
                             "--configure-bucket", "nbos", "--silent"], start_new_session=True)
    try:
        deadline = time.time() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                assert proc.poll() is None and time.time() < deadline, "s3rver did not start"
                time.sleep(0.1)
        yield f"http://127.0.0.1:{port}", os.path.join(data, "nbos")
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        shutil.rmtree(data, ignore_errors=True)


def test_a_replica_moved_to_a_new_server_catches_up_from_s3(s3):
    endpoint, bucket_dir = s3
    c = Cluster(hosts=4, gpus_per_host=1,
                extra=("--blob-store", f"s3://nbos/cluster?endpoint={endpoint}"),
                env={"AWS_ACCESS_KEY_ID": "S3RVER", "AWS_SECRET_ACCESS_KEY": "S3RVER"})
    try:
        kid, ks, kernel = kernel_with_state(c)
        objects = [f for f in os.listdir(os.path.join(bucket_dir, "cluster"))
                   if f.endswith("._S3rver_object")]
        assert objects, "no blob went to S3"
        servers = {r["server_id"] for r in kernel["replicas"]}
        spare = ({f"host-{i}" for i in range(1, 5)} - servers).pop()
        status, body = rest_call(c.url, c.token, "POST", f"/api/nbos/kernels/{kid}/migrate",
                                 {"to_server_id": spare})
        assert status == 202, body
        after = wait_migration_done(c, kid, set())
        assert spare in {r["server_id"] for r in after.values()}, after
        assert all(r["state"] == "live" for r in after.values()), after
        digests = digests_by_replica(ks, after)
        assert set(digests.values()) == {expected_digest()}, digests
        ks.close()
        assert rest_call(c.url, c.token, "DELETE", f"/api/kernels/{kid}")[0] == 204
    finally:
        assert c.stop() == 0
