"""`nbos status` against `nbos up`: the servers, a running kernel with its owner and replicas,
the executor marked; --json is the gateway's document; --watch redraws until Ctrl-C; a wrong
token and an unreachable gateway give clear errors."""

import json
import re
import signal
import subprocess
import time

from cluster import KernelSocket, free_port, nbos_bin


def status(cluster, *args, token=None):
    return subprocess.run([nbos_bin(), "status", "--gateway", cluster.url, "--token",
                           cluster.token if token is None else token, *args],
                          capture_output=True, text=True, timeout=60)


def test_status_shows_servers_and_a_kernels_replicas(cluster):
    kernel_id = cluster.start_kernel()
    try:
        ks = KernelSocket(cluster.url, kernel_id, cluster.token)
        reply, _ = ks.execute("x = 1")
        ks.close()
        executor = reply["metadata"]["nbos"]["executor"]
        out = status(cluster)
        assert out.returncode == 0, out.stderr
        text = out.stdout
        servers = cluster.get("/api/nbos/cluster")["servers"]
        assert re.search(rf"^nbos at {re.escape(cluster.url)}: {len(servers)} servers "
                         rf"\({len(servers)} alive, 0 pending\)", text), text
        for s in servers:
            assert re.search(rf"^{s['server_id']}\s+alive\s+\d+/\d+/{s['spec']['gpus']}\s", text,
                             re.M), text
        row = next(line for line in text.splitlines() if line.startswith(kernel_id))
        assert " admin " in row and " nbos " in row and " idle " in row, row
        replicas = re.findall(r"(\d)@(host-\d):(\w+)(\*?)", row)
        assert len(replicas) == 3 and all(state == "live" for _, _, state, _ in replicas), row
        assert [r for r, _, _, star in replicas if star] == [str(executor)], row

        doc = json.loads(status(cluster, "--json").stdout)
        assert kernel_id in {k["id"] for k in doc["kernels"]}
    finally:
        assert cluster.request("DELETE", f"/api/kernels/{kernel_id}")[0] == 204


def test_status_watch_redraws_until_interrupted(cluster):
    proc = subprocess.Popen([nbos_bin(), "status", "--gateway", cluster.url, "--token",
                             cluster.token, "--watch", "0.2"], stdout=subprocess.PIPE, text=True)
    time.sleep(1.5)
    proc.send_signal(signal.SIGINT)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0
    assert out.count("\x1b[H\x1b[2J") >= 3 and out.count("nbos at ") >= 3, out


def test_status_errors_are_clear(cluster):
    out = status(cluster, token="not-the-token")
    assert out.returncode == 2 and "refused the token" in out.stderr, out
    nowhere = f"http://127.0.0.1:{free_port()}"
    out = subprocess.run([nbos_bin(), "status", "--gateway", nowhere], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode == 1 and f"cannot read {nowhere}" in out.stderr, out
