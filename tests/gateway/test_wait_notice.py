"""A cell that has to wait for GPUs says so: while every GPU is committed to other kernels'
cells, the waiting cell's notebook gets one status line ("waiting for 1 GPU: ..."), cleared when
the cell starts, so that its outputs end up as its real output only; the reply's metadata keeps
the line and how long it stood. The dashboard's history saw the cell waiting."""

import threading
import time

from cluster import Cluster, KernelSocket


def apply_outputs(iopub):
    """The outputs a notebook front end keeps (nbclient's rules for these message types)."""
    outputs, by_display = [], {}
    for m in iopub:
        t, c = m["msg_type"], m["content"]
        if t == "clear_output":
            outputs, by_display = [], {}
        elif t in ("display_data", "stream", "execute_result", "error"):
            outputs.append((t, c.get("text") or c.get("data", {}).get("text/plain") or c.get("ename")))
            display_id = c.get("transient", {}).get("display_id")
            if display_id:
                by_display[display_id] = len(outputs) - 1
        elif t == "update_display_data":
            i = by_display.get(c.get("transient", {}).get("display_id"))
            if i is not None:
                outputs[i] = ("display_data", c["data"]["text/plain"])
    return outputs


def test_a_cell_waiting_for_gpus_shows_a_status_line_then_only_its_output():
    c = Cluster(hosts=3, gpus_per_host=1)
    holders, threads = [], []
    try:
        kernels = [c.start_kernel({"KERNEL_GPUS": "1"}) for _ in range(4)]
        sockets = [KernelSocket(c.url, k, c.token) for k in kernels]
        # Three cells take the cluster's three GPUs, one server each.
        for i, ks in enumerate(sockets[:3]):
            msg_id = ks.send("execute_request", {"code": "import time\ntime.sleep(8)",
                                                 "silent": False, "store_history": True,
                                                 "user_expressions": {}, "allow_stdin": False,
                                                 "stop_on_error": True})
            holders.append((ks, msg_id))
            deadline = time.time() + 60
            while committed(c) < i + 1:
                assert time.time() < deadline, c.get("/api/nbos/cluster")["servers"]
                time.sleep(0.05)
        results = []
        for ks, msg_id in holders:
            t = threading.Thread(target=lambda ks=ks, m=msg_id: results.append(ks.wait_for(m)))
            t.start()
            threads.append(t)

        reply, iopub = sockets[3].execute("print('the real output')")
        assert reply["content"]["status"] == "ok", reply["content"]
        types = [m["msg_type"] for m in iopub]
        notice = next(m for m in iopub if m["msg_type"] == "display_data")
        line = notice["content"]["data"]["text/plain"]
        assert line.startswith("waiting for 1 GPU: "), line
        assert notice["content"]["transient"]["display_id"].startswith("nbos-wait-")
        assert "clear_output" in types and types.index("display_data") < types.index("clear_output")
        assert types.index("clear_output") < types.index("stream"), types
        assert apply_outputs(iopub) == [("stream", "the real output\n")], iopub
        waits = reply["metadata"]["nbos"]["waits"]
        assert waits and waits[0]["for"] == line and waits[0]["ms"] >= 0, waits
        assert all(w["for"].startswith("waiting for 1 GPU: ") for w in waits), waits

        for t in threads:
            t.join(timeout=120)
        assert [r[0]["content"]["status"] for r in results] == ["ok"] * 3, results
        for ks in sockets:
            ks.close()
        time.sleep(1.5)  # the dashboard's next sample takes the last delays
        history = c.get("/api/nbos/history")["history"]
        assert max(history["cells_waiting"]) >= 1, history["cells_waiting"]
        assert sum(history["executions"]) >= 4, history["executions"]
        assert max(d for d in history["delay_p99_ms"] if d is not None) > 0
    finally:
        assert c.stop() == 0
    assert not c.nbos_processes()


def committed(c):
    return sum(s["gpus_committed"] for s in c.get("/api/nbos/cluster")["servers"])
