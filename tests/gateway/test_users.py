"""Many users on one `nbos up`: a users file names alice and bob (users) and ops (an admin). A
kernel belongs to whoever started it: other users do not see it, get 404 for its REST routes and
its WebSocket, and cannot interrupt, restart, delete or migrate it; admins see and manage every
kernel. Ownership survives a gateway restart; quotas refuse with a clear message; the users file is
re-read on SIGHUP; no token is on any command line."""

import json
import os
import signal
import time

import pytest
import websocket

from cluster import KernelSocket, rest_call, users_cluster

TOKENS = {"alice": "alice-token-0123456789", "bob": "bob-token-0123456789ab",
          "ops": "ops-token-0123456789abc", "carol": "carol-token-0123456789"}


def users_json(names):
    return json.dumps({"users": [{"name": n, "token": TOKENS[n], "admin": n == "ops"}
                                 for n in names]})


@pytest.fixture(scope="module")
def cluster():
    with users_cluster({n: (TOKENS[n], n == "ops") for n in ("alice", "bob", "ops")},
                       hosts=3, gpus_per_host=2,
                       extra=("--max-kernels-per-user", "2", "--max-gpus-per-user", "1")) as c:
        yield c


def call(c, user, method, path, body=None):
    return rest_call(c.url, TOKENS.get(user, c.token), method, path, body)


def start(c, user, env=None):
    status, model = call(c, user, "POST", "/api/kernels", {"name": "nbos", "env": env or {}})
    assert status == 201, (user, status, model)
    return model["id"]


def listed(c, user):
    status, kernels = call(c, user, "GET", "/api/kernels")
    assert status == 200, kernels
    return {k["id"] for k in kernels}


def ws_refusal(c, user, kernel_id):
    url = c.url.replace("http://", "ws://") + f"/api/kernels/{kernel_id}/channels"
    with pytest.raises(websocket.WebSocketBadStatusException) as refused:
        websocket.create_connection(url, header=[f"Authorization: token {TOKENS[user]}"],
                                    timeout=30)
    return refused.value.status_code


def test_users_see_and_manage_only_their_own_kernels(cluster):
    c = cluster
    a = start(c, "alice", {"KERNEL_GPUS": "1"})
    b = start(c, "bob")
    assert listed(c, "alice") == {a}
    assert listed(c, "bob") == {b}
    assert {a, b} <= listed(c, "ops") and {a, b} <= listed(c, None)

    # Bob cannot reach alice's kernel in any way; it answers as if it did not exist.
    for method, path, body in [("GET", f"/api/kernels/{a}", None),
                               ("POST", f"/api/kernels/{a}/interrupt", {}),
                               ("POST", f"/api/kernels/{a}/restart", {}),
                               ("POST", f"/api/nbos/kernels/{a}/migrate", {}),
                               ("DELETE", f"/api/kernels/{a}", None)]:
        status, body = call(c, "bob", method, path, body)
        assert status == 404, (method, path, status, body)
        assert body["message"] == f"no kernel {a}", body
    assert ws_refusal(c, "bob", a) == 404
    status, _ = call(c, "bob", "POST", "/api/nbos/servers/host-1/drain", {})
    assert status == 403

    # The cluster view shows bob his kernel only; the admin sees both with their owners.
    assert [k["id"] for k in call(c, "bob", "GET", "/api/nbos/cluster")[1]["kernels"]] == [b]
    owners = {k["id"]: k["owner"] for k in call(c, "ops", "GET", "/api/nbos/cluster")[1]["kernels"]}
    assert owners[a] == "alice" and owners[b] == "bob", owners

    # Alice runs a cell on her kernel; the admin can drive it too.
    ks = KernelSocket(c.url, a, TOKENS["alice"])
    reply, _ = ks.execute("x = 6 * 7")
    assert reply["content"]["status"] == "ok", reply["content"]
    ks.close()
    assert call(c, "ops", "POST", f"/api/kernels/{a}/interrupt", {})[0] == 204

    # Quotas: alice's kernels hold her 1 GPU; bob may have 2 kernels; the admin is not limited.
    status, body = call(c, "alice", "POST", "/api/kernels", {"env": {"KERNEL_GPUS": "1"}})
    assert status == 403 and body["reason"] == "quota", body
    assert "alice's kernels hold 1 of 1 GPUs" in body["message"], body
    b2 = start(c, "bob")
    status, body = call(c, "bob", "POST", "/api/kernels", {})
    assert status == 403 and "bob has 2 of 2 kernels" in body["message"], body
    o1 = start(c, "ops", {"KERNEL_GPUS": "1"})
    o2 = start(c, "ops", {"KERNEL_GPUS": "1"})
    o3 = start(c, "ops")

    # The admin deletes bob's second kernel; bob's first is still his alone.
    for k in (b2, o1, o2, o3):
        assert call(c, "ops", "DELETE", f"/api/kernels/{k}")[0] == 204
    assert listed(c, "bob") == {b}
    c.kernels = (a, b)


def test_ownership_survives_a_gateway_restart(cluster):
    c = cluster
    a, b = c.kernels
    gateway = next(pid for pid, cmd in c.nbos_processes() if " gateway " in f" {cmd} ")
    os.kill(gateway, signal.SIGKILL)
    deadline = time.time() + 60
    while True:  # nbos up restarts the gateway; it restores its kernels from its database
        try:
            if call(c, "alice", "GET", "/api/kernels")[0] == 200 and listed(c, "alice") == {a}:
                break
        except OSError:
            pass
        assert time.time() < deadline, "the gateway did not come back with alice's kernel"
        time.sleep(0.2)
    assert listed(c, "bob") == {b}
    assert call(c, "bob", "GET", f"/api/kernels/{a}")[0] == 404
    assert ws_refusal(c, "bob", a) == 404
    ks = KernelSocket(c.url, a, TOKENS["alice"])
    reply, iopub = ks.execute("print(x)")
    text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    assert reply["content"]["status"] == "ok" and text == "42\n", (reply["content"], text)
    ks.close()


def test_sighup_rereads_the_users_file_and_no_token_is_on_a_command_line(cluster):
    c = cluster
    assert call(c, "carol", "GET", "/api/kernels")[0] == 403
    with open(c.users_file, "w") as f:
        f.write(users_json(["alice", "bob", "ops", "carol"]))
    c.proc.send_signal(signal.SIGHUP)
    deadline = time.time() + 30
    while call(c, "carol", "GET", "/api/kernels")[0] != 200:
        assert time.time() < deadline, "carol's token was not accepted after SIGHUP"
        time.sleep(0.2)
    assert listed(c, "carol") == set()
    # A broken file is refused and the users already loaded stay.
    with open(c.users_file, "w") as f:
        f.write("{not json")
    c.proc.send_signal(signal.SIGHUP)
    time.sleep(1)
    assert call(c, "carol", "GET", "/api/kernels")[0] == 200
    assert call(c, "nobody", "GET", "/api/kernels")[0] == 200  # the admin token (c.token)
    for pid, cmd in c.nbos_processes():
        assert c.token not in cmd, (pid, cmd)
        for token in TOKENS.values():
            assert token not in cmd, (pid, cmd)
    for k in c.kernels:
        assert call(c, "ops", "DELETE", f"/api/kernels/{k}")[0] == 204
