"""`nbos up --frontend` (what `make run` starts): Debian's Jupyter Notebook on the gateway. Its
URL is printed beside the gateway's; through it a notebook whose kernelspec is python3 gets a
replicated kernel and runs a cell; stopping `nbos up` stops it too."""

import os
import re
import urllib.request

from cluster import Cluster, KernelSocket, rest_call, wait_answering


def test_the_frontend_runs_a_python3_notebook_and_stops_with_nbos_up():
    c = Cluster(hosts=3, gpus_per_host=1, extra=("--frontend",))
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


def _cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""
