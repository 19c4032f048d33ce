"""The gateway and `nbos sim` share one scheduling core: the decisions a live gateway took
(its decision journal) are re-derived exactly by `nbos sim replay`, and a journal whose recorded
decision differs from what the core decides is caught."""

import json
import subprocess
import tempfile

from cluster import Cluster, KernelSocket, nbos_bin


def replay(path):
    return subprocess.run([nbos_bin(), "sim", "replay", "--journal", path],
                          capture_output=True, text=True, timeout=120)


def test_live_gateway_decisions_replay_through_the_simulator_core():
    journal = tempfile.mktemp(prefix="nbos-journal-", suffix=".jsonl")
    c = Cluster(hosts=3, gpus_per_host=2, extra=("--decision-journal", journal, "--warm-pool", "0"))
    try:
        first = c.start_kernel({"KERNEL_GPUS": "2"})
        second = c.start_kernel({"KERNEL_GPUS": "1"})
        for kernel_id in (first, second):
            ks = KernelSocket(c.url, kernel_id, c.token)
            for target in (1, 2, 3, None):
                meta = {"nbos": {"target_replica": target}} if target else None
                reply, _ = ks.execute("x = 1", metadata=meta)
                assert reply["content"]["status"] == "ok"
            ks.close()
        assert c.request("DELETE", f"/api/kernels/{first}")[0] == 204
    finally:
        assert c.stop() == 0
    with open(journal) as f:
        lines = f.read().splitlines()
    events = [json.loads(line)["event"] for line in lines[1:]]
    for kind in ("server_joined", "placement", "kernel_placed", "executor",
                 "grant_committed", "grant_released", "kernel_removed"):
        assert kind in events, (kind, sorted(set(events)))
    done = replay(journal)
    assert done.returncode == 0, done.stdout + done.stderr
    assert f"replayed {len(lines) - 1} decisions" in done.stdout, done.stdout

    # Tamper with one executor decision: the replay must name that record.
    for i, line in enumerate(lines[1:], start=1):
        record = json.loads(line)
        candidates = (record["outcome"].get("decision") or {}).get("candidates")
        if record["event"] == "executor" and candidates and len(candidates) > 1:
            record["outcome"]["decision"]["candidates"] = list(reversed(candidates))
            lines[i] = json.dumps(record, sort_keys=True)
            seq = record["seq"]
            break
    else:
        raise AssertionError("no executor decision with several candidates")
    tampered = journal + ".tampered"
    with open(tampered, "w") as f:
        f.write("\n".join(lines) + "\n")
    done = replay(tampered)
    assert done.returncode != 0
    assert str(seq) in done.stdout + done.stderr, done.stdout + done.stderr
