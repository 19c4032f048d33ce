"""`nbos replay` drives a trace against the live cluster and sets it beside `nbos sim` on the same
slice and cluster: sessions become kernels, trainings cells holding their GPUs for their
(compressed) duration. A trace built so that one cell must wait for a GPU shows the wait in both;
a slice of the Adobe trace runs end to end; bad input is refused before anything starts, and a
stopped replay deletes its kernels."""

import json
import os
import pathlib
import signal
import subprocess
import tempfile
import time

import pytest

from cluster import Cluster, nbos_bin

ADOBE = pathlib.Path(__file__).resolve().parents[3] / "shared/traces/notebookos-adobe-idlt" \
    / "sensei_june_60sec.csv"


def template(sessions):
    """A session template (tick 1 s): sessions = [(id, [(start_tick, ticks, gpus), ...])]."""
    doc = {"workloadTitle": "replay test", "tick_ms": 1000, "sessions": []}
    for sid, trainings in sessions:
        doc["sessions"].append({
            "id": sid, "start_tick": 0,
            "stop_tick": max(s + d for s, d, _ in trainings) + 1,
            "trainings": [{"start_tick": s, "duration_in_ticks": d, "gpus": g}
                          for s, d, g in trainings]})
    f = tempfile.NamedTemporaryFile("w", suffix=".json", delete=False)
    json.dump(doc, f)
    f.close()
    return f.name


def replay(c, trace, *args, timeout=240):
    out = tempfile.mktemp(suffix=".json")
    p = subprocess.run([nbos_bin(), "replay", "--trace", trace, "--gateway", c.url, "--token",
                        c.token, "--out", out, *args],
                       capture_output=True, text=True, timeout=timeout)
    results = json.loads(pathlib.Path(out).read_text()) if os.path.exists(out) else None
    return p, results


def kernels_left(c):
    return c.get("/api/kernels")


@pytest.fixture(scope="module")
def one_gpu_servers():
    c = Cluster(hosts=3, gpus_per_host=1)
    try:
        yield c
    finally:
        c.stop()


def test_a_cell_that_must_wait_waits_live_and_in_the_simulation(one_gpu_servers):
    c = one_gpu_servers
    # Three sessions take the three GPUs for 6 s; a fourth session's cell comes a second later.
    trace = template([("a", [(2, 6, 1)]), ("b", [(2, 6, 1)]), ("c", [(2, 6, 1)]),
                      ("d", [(3, 1, 1), (10, 1, 1)])])
    p, r = replay(c, trace)
    assert p.returncode == 0, p.stderr
    live, simulated = r["live"], r["simulated"]
    assert live["cells"] == simulated["cells"] == 5
    assert live["cells_failed"] == 0
    # d's first cell waited about 5 s for a GPU in both; every other cell got its GPU at once.
    assert live["pct_immediate"] == simulated["pct_immediate"] == 80.0
    assert live["not_immediate"]["migration_wait"] == 1
    assert 3.0 < live["delay_s"]["p99"] < 15.0
    assert 3.0 < simulated["delay_s"]["p99"] < 8.0
    assert live["gpu_hours_oracle"] == pytest.approx(simulated["gpu_hours_oracle"], rel=1e-6)
    # Three servers of one GPU all along.
    hours = live["simulated_hours"]
    assert live["gpu_hours_provisioned"] == pytest.approx(3 * hours, rel=0.15)
    assert live["peak_servers"] == 3 and r["servers"] == 3 and r["gpus_per_server"] == 1
    assert "immediate %" in p.stdout and "live/sim" in p.stdout
    assert kernels_left(c) == []


def test_bad_input_is_refused_before_anything_starts(one_gpu_servers):
    c = one_gpu_servers
    trace = template([("big", [(1, 1, 2)])])
    p, _ = replay(c, trace)
    assert p.returncode == 2
    assert "wants 2 GPUs" in p.stderr and "at most 1" in p.stderr
    p = subprocess.run([nbos_bin(), "replay", "--trace", trace, "--gateway", c.url, "--token",
                        "wrong"], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "/api/nbos/cluster" in p.stderr, p.stderr
    p = subprocess.run([nbos_bin(), "replay", "--trace", trace, "--gateway",
                        "http://127.0.0.1:1", "--token", "t"],
                       capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "127.0.0.1:1" in p.stderr, p.stderr
    for window, what in (("5h-1h", "ends before it starts"), ("1x-2h", "unit"),
                         ("100h-101h", "no cell")):
        p, _ = replay(c, trace, "--window", window)
        assert p.returncode == 2 and what in p.stderr, (window, p.stderr)
    assert kernels_left(c) == []


def test_a_stopped_replay_deletes_its_kernels(one_gpu_servers):
    c = one_gpu_servers
    trace = template([("long", [(1, 120, 1)]), ("other", [(1, 120, 1)])])
    proc = subprocess.Popen([nbos_bin(), "replay", "--trace", trace, "--gateway", c.url,
                             "--token", c.token], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 90
        while not any(k["execution_state"] == "busy" for k in kernels_left(c)):
            assert time.time() < deadline, "the replay's cells never started"
            time.sleep(0.2)
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signal.SIGINT
    assert kernels_left(c) == []


@pytest.mark.skipif(not ADOBE.exists(), reason="the Adobe trace is not here")
def test_a_slice_of_the_adobe_trace_runs_end_to_end():
    sliced = ["--window", "400h-403h", "--speedup", "600", "--sessions", "4"]
    expected = json.loads(subprocess.run(
        [nbos_bin(), "sim", "--trace", str(ADOBE), *sliced, "--fixed-hosts", "3",
         "--gpus-per-host", "8", "--json"], capture_output=True, text=True, check=True,
        timeout=60).stdout)
    c = Cluster(hosts=3, gpus_per_host=8)
    try:
        p, r = replay(c, str(ADOBE), *sliced)
        assert p.returncode == 0, p.stderr
        assert r["live"]["cells"] == r["simulated"]["cells"] == expected["cells"] > 10
        assert r["live"]["cells_failed"] == 0
        assert r["live"]["gpu_hours_oracle"] == pytest.approx(expected["gpu_hours_oracle"])
        assert r["simulated"]["sessions"] == r["live"]["sessions"] == 4
        assert r["live"]["gpu_hours_committed"] > 0
        assert kernels_left(c) == []
    finally:
        c.stop()
