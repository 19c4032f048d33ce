"""Unmodified Jupyter Server (Debian's, with --gateway-url) in front of `nbos up`: notebooks give
the same outputs as on ipykernel; interrupt, restart and shutdown work through its REST API."""

import asyncio
import base64
import json
import os
import re
import socket
import struct
import time
import uuid

import pytest

import test_differential as diff
from cluster import JupyterServer, KernelSocket, run_notebook

# The notebooks whose messages take paths of their own through Jupyter Server (displays and their
# updates, stdin, errors, the notebook's directory); every notebook runs on a replicated kernel,
# its executor rotating, in tests/notebooks.
NOTEBOOKS = [p for p in diff.NOTEBOOKS
             if p.stem in ("errors", "rich_display", "stdin", "workspace_files")]


def test_kernelspecs_come_from_the_gateway(jupyter_server):
    # Jupyter Server adopts the gateway's default while answering its first listing.
    jupyter_server.cluster_like.request("GET", "/api/kernelspecs")
    status, specs = jupyter_server.cluster_like.request("GET", "/api/kernelspecs")
    assert status == 200
    assert specs["default"] == "nbos"
    assert {"nbos", "python3"} <= set(specs["kernelspecs"]), specs
    assert specs["kernelspecs"]["python3"]["spec"]["display_name"].endswith(" as python3")


def test_a_notebook_naming_python3_opens_on_a_fresh_server_at_once(cluster):
    """What a notebook from anywhere does: its metadata says python3, and the front end's first
    call to a Jupyter Server that has never listed kernelspecs opens a session for it."""
    js = JupyterServer(cluster)
    try:
        status, session = js.cluster_like.request("POST", "/api/sessions", {
            "path": "from-elsewhere.ipynb", "type": "notebook", "name": "",
            "kernel": {"name": "python3"}})
        assert status == 201, session
        assert session["kernel"]["name"] == "python3", session
        ks = KernelSocket(js.url, session["kernel"]["id"], js.token)
        reply, iopub = ks.execute("print(6 * 7)")
        ks.close()
        assert reply["content"]["status"] == "ok", reply["content"]
        assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == ["42\n"]
        # The gateway ran it as its own replicated kernel, under the name asked for.
        status, model = cluster.request("GET", f"/api/kernels/{session['kernel']['id']}")
        assert status == 200 and model["name"] == "python3", model
        assert reply["metadata"]["nbos"]["executor"] in (1, 2, 3), reply["metadata"]
        assert js.cluster_like.request("DELETE", f"/api/sessions/{session['id']}")[0] == 204
        assert cluster.request("GET", f"/api/kernels/{session['kernel']['id']}")[0] == 404
        # Names the gateway does not serve are still refused.
        status, _ = cluster.request("POST", "/api/kernels", {"name": "julia-1.9"})
        assert status == 404
    finally:
        js.stop()


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_through_jupyter_server_matches_ipykernel(path, jupyter_server, cluster,
                                                           monkeypatch):
    monkeypatch.delenv("PYTEST_CURRENT_TEST", raising=False)
    rest = jupyter_server.cluster_like
    status, model = rest.request("POST", "/api/kernels", {"name": "nbos"})
    assert status == 201, model
    kernel_id = model["id"]
    try:
        got = run_notebook(jupyter_server.url, jupyter_server.token, kernel_id, path)
    finally:
        assert rest.request("DELETE", f"/api/kernels/{kernel_id}")[0] == 204
    reports = _take_replication_reports(got["nb"])
    ref = asyncio.run(diff._run_one(path, "python3", None))
    assert ref["error"] is None, ref["error"]
    problems = []
    for g, w in zip(diff._cells(got), diff._cells(ref)):
        fields = [f for f in ("execution_count", "outputs", "reply") if g[f] != w[f]]
        if fields:
            problems.append(f"--- cell {g['index']}: {', '.join(fields)} differ\n{g['source']}\n"
                            + "".join(f"  [{f}] nbos:\n{diff._show(g[f])}\n  [{f}] ipykernel:\n"
                                      f"{diff._show(w[f])}\n" for f in fields))
    assert not problems, f"{path.name}: cells differ\n" + "\n".join(problems)
    for index, line in reports:
        # Only objects that cannot be pickled are reported, each by name.
        assert re.match(r"nbos: cannot replicate '\w+' \(\w+\): ", line), (index, line)


REPORT = re.compile(r"^nbos: cannot replicate .*\n", re.M)


def _take_replication_reports(nb):
    """Removes the stderr lines a replicated kernel adds for names it cannot replicate
    (DESIGN.md §4: reported by name, never silently dropped); ipykernel has no such lines.
    Returns them as (cell index, line)."""
    reports = []
    for index, cell in enumerate(nb.cells):
        kept = []
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream" and out.get("name") == "stderr":
                reports += [(index, m.group(0)) for m in REPORT.finditer(out["text"])]
                out["text"] = REPORT.sub("", out["text"])
                if not out["text"]:
                    continue
            kept.append(out)
        if cell.cell_type == "code":
            cell.outputs = kept
    return reports


def test_interrupt_restart_and_shutdown_through_jupyter_server(jupyter_server, cluster):
    rest = jupyter_server.cluster_like
    status, model = rest.request("POST", "/api/kernels", {"name": "nbos"})
    assert status == 201
    kernel_id = model["id"]
    ks = KernelSocket(jupyter_server.url, kernel_id, jupyter_server.token)
    reply, _ = ks.execute("x = 5")
    assert reply["content"]["status"] == "ok"

    msg_id = ks.send("execute_request", {"code": "import time\nfor _ in range(600): time.sleep(0.1)",
                                         "silent": False, "store_history": True,
                                         "user_expressions": {}, "allow_stdin": False,
                                         "stop_on_error": True})
    time.sleep(2)
    started = time.time()
    assert rest.request("POST", f"/api/kernels/{kernel_id}/interrupt", {})[0] == 204
    reply, _ = ks.wait_for(msg_id)
    assert reply["content"]["status"] == "error"
    assert reply["content"]["ename"] == "KeyboardInterrupt"
    assert time.time() - started < 30
    reply, _ = ks.execute("x + 1")
    assert reply["content"]["status"] == "ok"
    ks.close()

    status, model = rest.request("POST", f"/api/kernels/{kernel_id}/restart", {})
    assert status == 200, model
    ks = KernelSocket(jupyter_server.url, kernel_id, jupyter_server.token)
    reply, _ = ks.execute("x")
    assert reply["content"]["ename"] == "NameError", "a restarted kernel starts empty"
    assert reply["content"]["execution_count"] == 1
    ks.close()

    assert rest.request("DELETE", f"/api/kernels/{kernel_id}")[0] == 204
    kernels = cluster.get("/api/nbos/cluster")["kernels"]
    assert kernel_id not in [k["id"] for k in kernels]
    deadline = time.time() + 30
    while any(kernel_id in cmd for _, cmd in cluster.nbos_processes()):
        assert time.time() < deadline, "replica processes outlived their kernel"
        time.sleep(0.2)


FRONTEND_CONFIG = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "apps",
                               "nbos", "jupyter_frontend_config.py")


def test_a_message_sent_with_the_websocket_upgrade_is_answered_with_nbos_config(cluster):
    """jupyter server 1.x queues a message that arrives before it has begun connecting to the
    gateway on a future nothing completes; the configuration nbos ships for jupyter servers
    (apps/nbos/jupyter_frontend_config.py) makes such messages wait for the connection. The
    client here sends kernel_info_request in the same write as the upgrade request, so it is
    always first; without the configuration none of these was answered."""
    js = JupyterServer(cluster, config=FRONTEND_CONFIG)
    try:
        status, model = js.cluster_like.request("POST", "/api/kernels", {"name": "nbos"})
        assert status == 201, model
        path = f"/api/kernels/{model['id']}/channels?token={js.token}"
        answered = [_first_message_answered(js.port, path) for _ in range(3)]
        assert answered == [True] * 3, answered
        assert js.cluster_like.request("DELETE", f"/api/kernels/{model['id']}")[0] == 204
    finally:
        js.stop()


def _first_message_answered(port, path, timeout_s=20):
    """Upgrades `path` and sends kernel_info_request in the same write; whether its reply came."""
    msg_id = uuid.uuid4().hex
    request = json.dumps({
        "header": {"msg_id": msg_id, "msg_type": "kernel_info_request", "username": "u",
                   "session": uuid.uuid4().hex, "version": "5.3", "date": ""},
        "parent_header": {}, "metadata": {}, "content": {}, "channel": "shell"}).encode()
    mask = os.urandom(4)
    frame = (bytes([0x81, 0x80 | 126]) + struct.pack(">H", len(request)) + mask +
             bytes(b ^ mask[i % 4] for i, b in enumerate(request)))
    key = base64.b64encode(os.urandom(16)).decode()
    upgrade = (f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
               f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
               "Sec-WebSocket-Version: 13\r\n\r\n").encode()
    with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
        s.sendall(upgrade + frame)
        data = b""
        while b"\r\n\r\n" not in data:
            data += s.recv(65536)
        head, data = data.split(b"\r\n\r\n", 1)
        assert head.startswith(b"HTTP/1.1 101"), head
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            while len(data) >= 4 and len(data) >= _frame_end(data):
                end = _frame_end(data)
                payload, data = data[_frame_start(data):end], data[end:]
                message = json.loads(payload) if payload[:1] == b"{" else {}
                if message.get("parent_header", {}).get("msg_id") == msg_id and \
                        message["msg_type"] == "kernel_info_reply":
                    return True
            try:
                chunk = s.recv(65536)
            except socket.timeout:
                return False
            if not chunk:
                return False
            data += chunk
    return False


def _frame_start(data):
    """Offset of an unmasked server frame's payload (RFC 6455 5.2)."""
    n = data[1] & 0x7F
    return 2 if n < 126 else 4 if n == 126 else 10


def _frame_end(data):
    n = data[1] & 0x7F
    if n == 126:
        n = struct.unpack(">H", data[2:4])[0]
    elif n == 127:
        if len(data) < 10:
            return len(data) + 1
        n = struct.unpack(">Q", data[2:10])[0]
    return _frame_start(data) + n
