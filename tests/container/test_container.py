"""The nbos container image (scripts/build-image: Debian packages, no registry) runs a gateway and
three daemons as containers with host networking, their control plane under a cluster
credential; a notebook executes through them as a Jupyter client would run it."""

import os
import shutil
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.join(HERE, "..", "..")
sys.path.insert(0, os.path.join(ROOT, "tests", "gateway"))

from cluster import free_port, nbos_bin, rest_call, run_notebook  # noqa: E402

ENGINE_ENV = {**os.environ, "CONTAINERS_CONF": os.path.join(HERE, "containers.conf")}


def podman(*args, check=True):
    return subprocess.run(["podman", *args], env=ENGINE_ENV, capture_output=True, text=True,
                          timeout=300, check=check)


def build_image():
    out = subprocess.run(["bash", os.path.join(ROOT, "scripts", "build-image"), nbos_bin()],
                         capture_output=True, text=True, timeout=1200)
    assert out.returncode == 0, out.stderr[-3000:]
    return out.stdout.strip().splitlines()[-1]


def test_gateway_and_daemons_in_containers_run_a_notebook():
    image = build_image()
    work = tempfile.mkdtemp(prefix="nbos-containers-")
    subprocess.run([nbos_bin(), "credential", "create", f"{work}/cluster.credential"],
                   check=True, capture_output=True)
    prefix = f"nbos-test-{os.getpid()}"
    names = []
    port, control = free_port(), free_port()
    common = ["run", "-d", "--network", "host", "-v", f"{work}:/work"]
    try:
        names.append(f"{prefix}-gateway")
        podman(*common, "--name", names[-1], image, "gateway", "--address", "127.0.0.1",
               "--port", str(port), "--control-address", f"127.0.0.1:{control}", "--state-dir",
               "/work/gateway", "--token", "container-token", "--credential",
               "/work/cluster.credential")
        for i in (1, 2, 3):
            names.append(f"{prefix}-host-{i}")
            first = 24000 + 300 * i
            podman(*common, "--name", names[-1], image, "daemon", "--server-id", f"host-{i}",
                   "--gateway", f"127.0.0.1:{control}", "--gpus", "1", "--virtual-gpus",
                   "--state-dir", f"/work/host-{i}", "--blob-store", "dir:///work/blobs",
                   "--replica-ports", f"{first}-{first + 299}", "--credential",
                   "/work/cluster.credential")
        url, token = f"http://127.0.0.1:{port}", "container-token"
        deadline = time.time() + 120
        while True:
            try:
                status, view = rest_call(url, token, "GET", "/api/nbos/cluster")
                if status == 200 and len(view["servers"]) == 3:
                    break
            except OSError:
                pass
            assert time.time() < deadline, podman("logs", names[0], check=False).stderr[-3000:]
            time.sleep(0.5)
        status, model = rest_call(url, token, "POST", "/api/kernels", {"name": "nbos"})
        assert status == 201, model
        result = run_notebook(url, token, model["id"], os.path.join(ROOT, "examples",
                                                                    "hello.ipynb"))
        assert all(r["status"] == "ok" for r in result["replies"].values()), result["replies"]
        outputs = [o for c in result["nb"].cells if c.cell_type == "code" for o in c.outputs]
        text = "".join(o.get("text", "") for o in outputs if o.get("output_type") == "stream")
        assert "Python 3.11" in text and "mean=" in text, text
        assert any("image/png" in o.get("data", {}) for o in outputs), "no plot came back"
        # The replicas ran inside the daemons' containers, not on this machine.
        top = podman("top", names[1], "args", check=False).stdout
        assert "nbos replica" in top or "replica" in top, top
        assert rest_call(url, token, "DELETE", f"/api/kernels/{model['id']}")[0] == 204
    finally:
        for name in names:
            podman("rm", "-f", "-t", "5", name, check=False)
        shutil.rmtree(work, ignore_errors=True)
