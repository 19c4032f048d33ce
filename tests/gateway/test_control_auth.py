"""The control plane answers only members of the cluster: gateway and daemons share a cluster
credential (`nbos credential create`), speak TLS and send its token with every call. A daemon
without it, or with another cluster's, cannot register; a gRPC caller without it cannot call the
gateway or a daemon; the refusals are logged and counted."""

import json
import os
import re
import stat
import subprocess
import time
import urllib.request

import grpc
import pytest

from cluster import KernelSocket, SplitCluster, nbos_bin, rest_call


def create_credential(path):
    out = subprocess.run([nbos_bin(), "credential", "create", str(path)], capture_output=True,
                         text=True, check=True)
    assert "cluster credential written" in out.stdout
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    return json.loads(open(path).read())


def call(address, method, credentials=None, ca=None, token=None):
    """One unary call with an empty request; returns the gRPC status code."""
    if ca is None:
        channel = grpc.insecure_channel(address)
    else:
        creds = grpc.ssl_channel_credentials(root_certificates=ca.encode())
        channel = grpc.secure_channel(address, creds,
                                      options=[("grpc.ssl_target_name_override", "nbos-cluster")])
    try:
        metadata = [("authorization", f"Bearer {token}")] if token else None
        channel.unary_unary(method, request_serializer=lambda b: b,
                            response_deserializer=lambda b: b)(b"", timeout=5, metadata=metadata)
        return grpc.StatusCode.OK
    except grpc.RpcError as e:
        return e.code()
    finally:
        channel.close()


def metric(c, name):
    req = urllib.request.Request(c.url + "/metrics", headers={"Authorization": f"token {c.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        text = resp.read().decode()
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    return float(m.group(1)) if m else None


@pytest.fixture
def credentials(tmp_path):
    return (tmp_path / "cluster.credential", create_credential(tmp_path / "cluster.credential"),
            tmp_path / "other.credential", create_credential(tmp_path / "other.credential"))


def test_only_cluster_members_reach_the_control_plane(credentials):
    path, cred, other_path, other = credentials
    c = SplitCluster(hosts=3, gateway_args=("--credential", str(path)),
                     daemon_args=("--credential", str(path)))
    try:
        # Members work together as before, over TLS.
        status, model = rest_call(c.url, c.token, "POST", "/api/kernels", {"name": "nbos"})
        assert status == 201, model
        ks = KernelSocket(c.url, model["id"], c.token)
        reply, _ = ks.execute("print(6 * 7)")
        assert reply["content"]["status"] == "ok", reply["content"]
        ks.close()

        # Daemons without the credential, or with another cluster's, never register.
        c.stores[8] = c.stores[9] = c.stores[1]
        c.daemon_args = ()
        c.start_daemon(8)
        c.daemon_args = ("--credential", str(other_path))
        c.start_daemon(9)
        time.sleep(4)
        status, view = rest_call(c.url, c.token, "GET", "/api/nbos/cluster")
        assert sorted(s["server_id"] for s in view["servers"]) == ["host-1", "host-2", "host-3"]
        for i in (8, 9):
            log = open(os.path.join(c.ps.root, f"host-{i}.log")).read()
            assert "cannot register" in log or "unreachable" in log, log[-2000:]

        # A gRPC caller: plaintext cannot connect; TLS without the token, or with another
        # cluster's, is refused and counted.
        register = "/nbos.control.Gateway/Register"
        assert call(c.control, register) == grpc.StatusCode.UNAVAILABLE
        assert call(c.control, register, ca=cred["ca_cert"]) == grpc.StatusCode.UNAUTHENTICATED
        assert call(c.control, register, ca=cred["ca_cert"],
                    token=other["token"]) == grpc.StatusCode.UNAUTHENTICATED
        assert metric(c, "nbos_control_calls_refused_total") == 2
        gateway_log = open(os.path.join(c.ps.root, "gateway.log")).read()
        assert "gateway: refused a control call without the cluster credential" in gateway_log

        # The same for a daemon's service; a member's token gets through.
        daemon_address = c.daemons[1].stdout.readline().split(": ")[1].strip()
        status_call = "/nbos.control.Daemon/Status"
        assert call(daemon_address, status_call) == grpc.StatusCode.UNAVAILABLE
        assert call(daemon_address, status_call,
                    ca=cred["ca_cert"]) == grpc.StatusCode.UNAUTHENTICATED
        assert call(daemon_address, status_call, ca=cred["ca_cert"],
                    token=cred["token"]) == grpc.StatusCode.OK
        log = open(os.path.join(c.ps.root, "host-1.log")).read()
        assert "daemon host-1: refused a control call without the cluster credential" in log
        assert "1 so far" in log
    finally:
        c.ps.stop()
