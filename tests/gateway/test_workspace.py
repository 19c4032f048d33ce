"""A kernel runs in its notebook's directory, which every replica sees at the same path
(DESIGN.md §11, docs/decisions/0015): through `nbos up --frontend` and its Jupyter, a notebook in
a subdirectory reads the data file beside it, a cell writes a checkpoint there, a later cell on
another replica loads it, and the front end lists the file. Each replica has a /tmp of its own that
its cells can write. A working directory outside the workspace is refused at start, a missing one
says the workspace may not be mounted."""

import os
import re
import shutil
import tempfile

import pytest

from cluster import Cluster, KernelSocket, rest_call, wait_answering

SANDBOX_USERS = os.geteuid() == 0 and os.path.exists("/usr/bin/bwrap")


@pytest.fixture(scope="module")
def frontend():
    workspace = tempfile.mkdtemp(prefix="nbos-frontend-")
    os.makedirs(os.path.join(workspace, "project"))
    with open(os.path.join(workspace, "project", "data.csv"), "w") as f:
        f.write("a,b\n1,2\n3,4\n")
    c = Cluster(hosts=3, gpus_per_host=1, extra=("--frontend", "--frontend-dir", workspace))
    try:
        line = c.proc.stdout.readline()
        m = re.match(r"frontend: (http://127\.0\.0\.1:\d+)/\?token=(\S+)$", line.strip())
        assert m, f"nbos up printed {line!r}"
        url, token = m.group(1), m.group(2)
        wait_answering(f"{url}/api/status?token={token}", "the front end")
        yield c, url, token, os.path.realpath(workspace)
    finally:
        assert c.stop() == 0
        shutil.rmtree(workspace, ignore_errors=True)


def run(ks, code, replica):
    reply, iopub = ks.execute(code, metadata={"nbos": {"target_replica": replica}})
    text = "".join(m["content"]["text"] for m in iopub if m["msg_type"] == "stream")
    return reply["content"], text


def test_a_notebook_in_a_subdirectory_uses_its_files_on_every_replica(frontend):
    c, url, token, workspace = frontend
    status, session = rest_call(url, token, "POST", "/api/sessions", {
        "path": "project/analysis.ipynb", "type": "notebook", "name": "",
        "kernel": {"name": "python3"}})
    assert status == 201, session
    ks = KernelSocket(url, session["kernel"]["id"], token)
    try:
        project = os.path.join(workspace, "project")
        content, text = run(ks, "import os, pandas as pd\ndf = pd.read_csv('data.csv')\n"
                                "print(os.getcwd(), int(df.b.sum()))", 1)
        assert content["status"] == "ok", content
        assert text == f"{project} 6\n"
        content, _ = run(ks, "import torch\ntorch.save({'w': torch.arange(4)}, 'ckpt.pt')", 1)
        assert content["status"] == "ok", content
        content, text = run(ks, "print(torch.load('ckpt.pt')['w'].tolist(), os.getcwd())", 2)
        assert content["status"] == "ok", content
        assert text == f"[0, 1, 2, 3] {project}\n"
        status, listing = rest_call(url, token, "GET", "/api/contents/project")
        assert status == 200, listing
        assert {"ckpt.pt", "data.csv"} <= {e["name"] for e in listing["content"]}
        if SANDBOX_USERS:
            # Written under the kernel's own user id, owned on disk by the workspace's owner.
            assert os.stat(os.path.join(project, "ckpt.pt")).st_uid == os.stat(project).st_uid

        # A /tmp of its own on each replica, as on any machine.
        content, text = run(ks, "%%writefile /tmp/notes.txt\nkept here\n", 3)
        assert content["status"] == "ok", content
        content, text = run(ks, "import tempfile\nfd, path = tempfile.mkstemp()\n"
                                "os.write(fd, b'x')\nos.close(fd)\n"
                                "print(open('/tmp/notes.txt').read(), end='')", 3)
        assert content["status"] == "ok", content
        assert text == "kept here\n"
    finally:
        ks.close()


def test_a_working_directory_outside_the_workspace_or_missing_is_refused_at_start(frontend):
    c, _, _, workspace = frontend
    status, body = c.request("POST", "/api/kernels",
                             {"name": "nbos", "env": {"KERNEL_WORKING_DIR": "/etc"}})
    assert status == 400, body
    assert "outside the workspace" in body["message"], body
    status, body = c.request("POST", "/api/kernels", {
        "name": "nbos", "env": {"KERNEL_WORKING_DIR": os.path.join(workspace, "not-there")}})
    assert status >= 400 and "mounted" in body["message"], (status, body)
    assert not c.get("/api/kernels") or all(
        k["execution_state"] != "starting" for k in c.get("/api/kernels"))
