"""`nbos up --frontend` (what `make run` starts): Debian's Jupyter Notebook on the gateway. Its
URL is printed beside the gateway's; through it a notebook whose kernelspec is python3 gets a
replicated kernel and runs a cell; stopping `nbos up` stops it too."""

import base64
import os
import re
import socket
import urllib.request

from cluster import Cluster, KernelSocket, rest_call, wait_answering


def test_the_frontend_runs_a_python3_notebook_and_stops_with_nbos_up(tmp_path):
    c = Cluster(hosts=3, gpus_per_host=1, extra=("--frontend", "--frontend-dir", str(tmp_path)))
    frontend_pid = None
    try:
        line = c.proc.stdout.readline()
        m = re.match(r"frontend: (http://127\.0\.0\.1:(\d+))/\?token=(\S+)$", line.strip())
        assert m, f"nbos up printed {line!r}"
        url, port, token = m.group(1), m.group(2), m.group(3)
        wait_answering(f"{url}/api/status?token={token}", "the front end")
        # Its kernel WebSockets are set TCP_NODELAY (apps/nbos/jupyter_frontend_config.py).
        config = os.path.join(c.state_dir, "frontend", "config", "jupyter_notebook_config.py")
        with open(config) as f:
            assert "set_nodelay(True)" in f.read()
        frontend_pid = next(int(p) for p in filter(str.isdigit, os.listdir("/proc"))
                            if f"--port={port}".encode() in _cmdline(p))
        # The tree page a browser opens first.
        with urllib.request.urlopen(f"{url}/tree?token={token}", timeout=10) as page:
            assert page.status == 200 and b"Jupyter" in page.read()
        status, specs = rest_call(url, token, "GET", "/api/kernelspecs")
        assert status == 200 and {"nbos", "python3"} <= set(specs["kernelspecs"]), specs
        status, session = rest_call(url, token, "POST", "/api/sessions", {
            "path": "Untitled.ipynb", "type": "notebook", "name": "",
            "kernel": {"name": "python3"}})
        assert status == 201, session
        # A client offering permessage-deflate (browsers, JupyterLab's client under Node) does
        # not get it: jupyter server's gateway handler would deflate every message of a cell.
        headers = _upgrade(int(port), f"/api/kernels/{session['kernel']['id']}/channels"
                           f"?token={token}", "permessage-deflate; client_max_window_bits")
        assert headers.startswith("HTTP/1.1 101"), headers
        assert "permessage-deflate" not in headers.lower(), headers
        ks = KernelSocket(url, session["kernel"]["id"], token)
        reply, iopub = ks.execute("import os\nprint(sum(range(10)))")
        ks.close()
        assert reply["content"]["status"] == "ok", reply["content"]
        assert [m["content"]["text"] for m in iopub if m["msg_type"] == "stream"] == ["45\n"]
        assert reply["metadata"]["nbos"]["executor"] in (1, 2, 3)
        assert c.get(f"/api/kernels/{session['kernel']['id']}")["name"] == "python3"
    finally:
        assert c.stop() == 0
    assert frontend_pid is not None and not os.path.exists(f"/proc/{frontend_pid}")
    assert not c.nbos_processes()


def _upgrade(port, path, extensions):
    """The response head to a WebSocket upgrade of path that offers extensions."""
    key = base64.b64encode(os.urandom(16)).decode()
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall((f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                   f"Connection: Upgrade\r\nSec-WebSocket-Key: {key}\r\n"
                   f"Sec-WebSocket-Version: 13\r\nSec-WebSocket-Extensions: {extensions}\r\n"
                   "\r\n").encode())
        head = b""
        while b"\r\n\r\n" not in head:
            chunk = s.recv(4096)
            if not chunk:
                break
            head += chunk
    return head.split(b"\r\n\r\n")[0].decode("latin-1")


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
