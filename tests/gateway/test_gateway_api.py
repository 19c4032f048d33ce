"""The gateway's own REST and WebSocket API against `nbos up`: kernels with resource requests,
the cluster view and metrics, bad input (wrong token, unknown kernels, malformed JSON and
frames, oversized bodies, impossible requests), a gateway restart that keeps every kernel, and
a kernel restart that keeps the kernel listed."""

import json
import os
import signal
import socket
import subprocess
import tempfile
import threading
import time

import websocket

from cluster import KernelSocket, nbos_bin, processes_under


def test_token_is_required(cluster):
    status, body = cluster.request("GET", "/api/kernels", token="")
    assert status == 403 and "token" in body["message"]
    status, body = cluster.request("GET", "/api/kernels", token="wrong")
    assert status == 403 and body["message"] == "invalid token"
    status, _ = cluster.request("GET", f"/api/kernels?token={cluster.token}", token="")
    assert status == 200
    assert cluster.request("GET", "/api", token="")[0] == 200  # the health check is public
    try:
        websocket.create_connection(
            cluster.url.replace("http", "ws") + "/api/kernels/x/channels",
            header=["Authorization: token wrong"], timeout=10)
        raise AssertionError("a websocket without the token was accepted")
    except websocket.WebSocketBadStatusException as e:
        assert e.status_code == 403


def test_bad_requests_get_clear_errors_and_the_gateway_keeps_serving(cluster):
    assert cluster.request("GET", "/api/kernels/no-such-kernel")[0] == 404
    assert cluster.request("DELETE", "/api/kernels/no-such-kernel")[0] == 404
    assert cluster.request("POST", "/api/kernels/no-such-kernel/interrupt", {})[0] == 404
    assert cluster.request("POST", "/api/kernels/no-such-kernel/restart", {})[0] == 404
    assert cluster.request("GET", "/api/kernelspecs/no-such-spec")[0] == 404
    status, body = cluster.request("POST", "/api/kernels", raw=b"{not json")
    assert status == 400 and "JSON" in body["message"]
    status, body = cluster.request("POST", "/api/kernels", {"name": "nbos", "env": []})
    assert status == 400
    status, body = cluster.request("POST", "/api/kernels", {"name": "nope"})
    assert status == 404
    status, body = cluster.request("POST", "/api/kernels", {"name": "nbos",
                                                            "env": {"KERNEL_GPUS": "64"}})
    assert status == 400 and "GPU" in body["message"], body
    status, body = cluster.request("POST", "/api/kernels", {"name": "nbos",
                                                            "env": {"KERNEL_GPUS": "two"}})
    assert status == 400 and "KERNEL_GPUS" in body["message"]
    # An oversized body is refused from its Content-Length, before it is read.
    host, port = cluster.url.split("//")[1].split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(f"POST /api/kernels HTTP/1.1\r\nHost: x\r\nAuthorization: token {cluster.token}"
                  f"\r\nContent-Type: application/json\r\nContent-Length: {65 << 20}\r\n\r\n"
                  .encode() + b"{" * 4096)
        assert s.recv(100).startswith(b"HTTP/1.1 413")
    try:
        websocket.create_connection(
            cluster.url.replace("http", "ws") + "/api/kernels/no-such-kernel/channels",
            header=[f"Authorization: token {cluster.token}"], timeout=10)
        raise AssertionError("a websocket to an unknown kernel was accepted")
    except websocket.WebSocketBadStatusException as e:
        assert e.status_code == 404
    # Malformed HTTP on a raw socket.
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(b"THIS IS NOT HTTP\r\n\r\n")
        assert s.recv(100).startswith(b"HTTP/1.1 400")
    assert cluster.request("GET", "/api/kernels")[0] == 200


def test_malformed_frames_close_only_that_websocket(cluster):
    kernel_id = cluster.start_kernel()
    try:
        good = KernelSocket(cluster.url, kernel_id, cluster.token)
        reply, _ = good.execute("a = 1")
        assert reply["content"]["status"] == "ok"
        for frame in ("{not json", json.dumps({"channel": "shell", "header": {}}),
                      json.dumps([1, 2, 3])):
            bad = KernelSocket(cluster.url, kernel_id, cluster.token)
            bad.ws.send(frame)
            assert close_code(bad) == 1007, frame
            bad.close()
        bad = KernelSocket(cluster.url, kernel_id, cluster.token)
        bad.ws.send_binary(b"\x00\x00\x00\x05garbage")
        assert close_code(bad) == 1007
        bad.close()
        reply, _ = good.execute("a + 1")
        assert reply["content"]["status"] == "ok", "the other client's kernel kept working"
        good.close()
    finally:
        assert cluster.request("DELETE", f"/api/kernels/{kernel_id}")[0] == 204


def close_code(ks):
    """Reads until the server's close frame (skipping output still on its way); its code."""
    while True:
        opcode, data = ks.ws.recv_data(control_frame=True)
        if opcode == websocket.ABNF.OPCODE_CLOSE:
            return int.from_bytes(data[:2], "big")


def test_execute_reply_says_who_ran_the_cell_with_which_gpus(cluster):
    kernel_id = cluster.start_kernel({"KERNEL_GPUS": "1"})
    try:
        ks = KernelSocket(cluster.url, kernel_id, cluster.token)
        reply, iopub = ks.execute("import os\nprint(os.environ['NBOS_GPU_IDS'])")
        nbos = reply["metadata"]["nbos"]
        assert nbos["role"] == "executor"
        assert len(nbos["gpu_ids"]) == 1
        assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == [
            f"{nbos['gpu_ids'][0]}\n"]
        hops = nbos["gateway_us"]
        assert hops["received"] <= hops["sent"] <= hops["replied"]
        assert {"elect", "run", "commit"} <= set(nbos["timings_ms"])
        # One session id for the kernel, whichever replica sent a message.
        sessions = {m["header"]["session"] for m in iopub} | {reply["header"]["session"]}
        assert len(sessions) == 1
        # Operators and tests may name the executor; each replica can run cells.
        for target in (2, 3, 1):
            reply, _ = ks.execute("b = 2", metadata={"nbos": {"target_replica": target}})
            assert reply["metadata"]["nbos"]["executor"] == target
        view = cluster.get("/api/nbos/cluster")
        kernel = next(k for k in view["kernels"] if k["id"] == kernel_id)
        assert kernel["executor"] == 1
        assert sorted(r["replica_id"] for r in kernel["replicas"]) == [1, 2, 3]
        assert len({r["server_id"] for r in kernel["replicas"]}) == 3
        assert all(r["pid"] > 0 and r["process_state"] == "running" and r["state"] == "live" for r in kernel["replicas"])
        assert all(r["reachable"] for r in kernel["replicas"]), kernel["replicas"]
        assert [r["role"] for r in kernel["replicas"]].count("executor") == 1
        metrics = urllib_get(cluster, "/metrics")
        assert "nbos_server_gpus{" in metrics and "nbos_gpu_grants_total" in metrics
        ks.close()
    finally:
        cluster.request("DELETE", f"/api/kernels/{kernel_id}")
    assert all(s["gpus_committed"] == 0 for s in cluster.get("/api/nbos/cluster")["servers"])


def test_a_kernel_with_kernel_run_ahead_runs_repeat_cells_ahead_of_the_election(cluster):
    """KERNEL_RUN_AHEAD=on reaches the replicas, and the gateway names each previous cell, so a
    repeat executor runs its cell before its LEAD commits (decision 0012); other kernels do not."""
    ahead = cluster.start_kernel({"KERNEL_RUN_AHEAD": "on"})
    plain = cluster.start_kernel()
    try:
        for kernel_id, want in ((ahead, [False, True, True]), (plain, [False, False, False])):
            ks = KernelSocket(cluster.url, kernel_id, cluster.token)
            seen = []
            for code in ("x = 1", "x += 1", "print(x)"):
                reply, iopub = ks.execute(code)
                assert reply["content"]["status"] == "ok", reply["content"]
                seen.append(reply["metadata"]["nbos"]["ran_ahead"])
            assert seen == want, (kernel_id, seen)
            assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == ["2\n"]
            # A standby holds what the executor computed.
            standby = 1 + reply["metadata"]["nbos"]["executor"] % 3
            reply, iopub = ks.execute("print(x)", metadata={"nbos": {"target_replica": standby}})
            assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == ["2\n"]
            ks.close()
    finally:
        for kernel_id in (ahead, plain):
            cluster.request("DELETE", f"/api/kernels/{kernel_id}")


def urllib_get(cluster, path):
    import urllib.request
    req = urllib.request.Request(cluster.url + path,
                                 headers={"Authorization": f"token {cluster.token}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        return resp.read().decode()


def test_gateway_restart_keeps_kernels(cluster):
    kernel_id = cluster.start_kernel({"KERNEL_MARK": "kept"})
    try:
        ks = KernelSocket(cluster.url, kernel_id, cluster.token)
        reply, _ = ks.execute("kept = 'state'")
        assert reply["content"]["status"] == "ok"
        ks.close()
        gateway = [pid for pid, cmd in cluster.nbos_processes() if " gateway " in cmd]
        assert len(gateway) == 1
        os.kill(gateway[0], signal.SIGKILL)  # `nbos up` restarts it
        deadline = time.time() + 60
        while True:
            try:
                status, model = cluster.request("GET", f"/api/kernels/{kernel_id}")
                if status == 200:
                    break
            except OSError:
                pass
            assert time.time() < deadline, "the gateway did not come back with the kernel"
            time.sleep(0.2)
        ks = KernelSocket(cluster.url, kernel_id, cluster.token)
        reply, iopub = ks.execute("print(kept)")
        assert reply["content"]["status"] == "ok"
        assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == ["state\n"]
        ks.close()
        # A kernel restart after the gateway's restart starts its replicas with the kernel's
        # start environment, read back from the gateway's database.
        status, body = cluster.request("POST", f"/api/kernels/{kernel_id}/restart", {})
        assert status == 200, body
        ks = KernelSocket(cluster.url, kernel_id, cluster.token)
        for target in (1, 2, 3):
            reply, iopub = ks.execute("import os\nprint(os.environ.get('KERNEL_MARK'))",
                                      metadata={"nbos": {"target_replica": target}})
            assert reply["content"]["status"] == "ok", reply["content"]
            text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
            assert text == "kept\n", (target, text)
        ks.close()
    finally:
        cluster.request("DELETE", f"/api/kernels/{kernel_id}")


def test_a_restarting_kernel_stays_listed_with_its_state(cluster):
    """jupyter server forgets a kernel missing from the gateway's list as one the gateway culled:
    while a restart runs, the kernel stays in the list and its model answers, `restarting`."""
    kernel_id = cluster.start_kernel()
    try:
        answers = []
        restart = threading.Thread(target=lambda: answers.append(
            cluster.request("POST", f"/api/kernels/{kernel_id}/restart", {})))
        restart.start()
        states = set()
        while restart.is_alive():
            status, kernels = cluster.request("GET", "/api/kernels")
            assert status == 200 and kernel_id in [k["id"] for k in kernels], kernels
            status, model = cluster.request("GET", f"/api/kernels/{kernel_id}")
            assert status == 200, model
            states.add(model["execution_state"])
        restart.join()
        assert answers[0][0] == 200, answers
        assert "restarting" in states, states
    finally:
        cluster.request("DELETE", f"/api/kernels/{kernel_id}")


def test_kernels_start_from_warm_replica_processes(cluster):
    def warm_pools():
        return {s["server_id"]: s["warm_pool"] for s in cluster.get("/api/nbos/cluster")["servers"]}

    def all_filled():
        pools = warm_pools()
        return len(pools) == cluster.hosts and all(w["ready"] == w["target"] > 0
                                                   for w in pools.values())

    deadline = time.time() + 60
    while not all_filled():
        assert time.time() < deadline, f"warm pools never filled: {warm_pools()}"
        time.sleep(0.2)
    before = warm_pools()
    kernel_id = cluster.start_kernel({"KERNEL_MARK": "warm"})
    try:
        after = warm_pools()
        view = cluster.get("/api/nbos/cluster")
        kernel = next(k for k in view["kernels"] if k["id"] == kernel_id)
        for r in kernel["replicas"]:
            server = r["server_id"]
            assert after[server]["promoted"] == before[server]["promoted"] + 1, (server, after)
            assert after[server]["cold"] == before[server]["cold"], (server, after)
        ks = KernelSocket(cluster.url, kernel_id, cluster.token)
        for target in (1, 2, 3):
            reply, iopub = ks.execute(
                "import os\nprint(os.environ['NBOS_KERNEL_ID'], os.environ['NBOS_REPLICA_ID'],"
                " os.environ.get('KERNEL_MARK'), os.getcwd())",
                metadata={"nbos": {"target_replica": target}})
            assert reply["content"]["status"] == "ok"
            text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
            # A promoted warm process runs in its kernel's workspace, as a cold one would.
            workspace = os.path.realpath(cluster.workspace)
            assert text == f"{kernel_id} {target} warm {workspace}\n"
        ks.close()
        deadline = time.time() + 60
        while not all(w["ready"] == w["target"] for w in warm_pools().values()):
            assert time.time() < deadline, f"warm pools were not topped up: {warm_pools()}"
            time.sleep(0.2)
    finally:
        cluster.request("DELETE", f"/api/kernels/{kernel_id}")
    assert "nbos_replica_launches_total{" in urllib_get(cluster, "/metrics")


def test_nbos_up_on_a_port_another_program_holds_fails_clearly_and_leaves_nothing():
    """The port accepts connections and never answers (before, nbos up waited for it forever)."""
    with socket.socket() as taken, tempfile.TemporaryDirectory(prefix="nbos-up-") as state:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        up = subprocess.run([nbos_bin(), "up", "--hosts", "3", "--port", str(port),
                             "--state-dir", state, "--token", "T"],
                            capture_output=True, text=True, timeout=120)
        assert up.returncode == 1, up
        assert "the gateway did not start" in up.stderr, up.stderr
        with open(f"{state}/logs/gateway.log") as log:
            assert f"cannot listen on 127.0.0.1:{port}" in log.read()
        assert not processes_under(state)
