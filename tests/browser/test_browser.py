"""What people see, in a real browser: Debian's Chromium driven by npm's puppeteer-core
(browser.cjs). The notebook front end of `nbos up --frontend` creates a notebook and runs a
cell with output and a matplotlib plot; the dashboard shows the servers and the kernel, a cell's
GPUs as committed while it runs and a migration among the events; the simulation page shows a
`nbos sim report`. Screenshots go to build/artifacts/browser/ (NBOS_ARTIFACTS overrides)."""

import json
import os
import pathlib
import re
import signal
import subprocess
import tempfile
import threading

import nbformat

from cluster import Cluster, KernelSocket, nbos_bin, wait_answering

HERE = pathlib.Path(__file__).resolve().parent
NPM = HERE.parent.parent / ".cache" / "npm" / "node_modules"
CHROMIUM = os.environ.get("NBOS_CHROMIUM", "/usr/bin/chromium")


def shots_dir():
    root = os.environ.get("NBOS_ARTIFACTS") or pathlib.Path(nbos_bin()).resolve().parent.parent / "artifacts"
    d = pathlib.Path(root) / "browser"
    d.mkdir(parents=True, exist_ok=True)
    return d


class Browser:
    """One browser.cjs scenario in its own process group; `expect` reads its progress lines."""

    def __init__(self, scenario, **args):
        args.update(shots=str(shots_dir()), chromium=CHROMIUM)
        self.lines = []
        self.proc = subprocess.Popen(
            ["node", str(HERE / "browser.cjs"), scenario, json.dumps(args)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            env={**os.environ, "NODE_PATH": str(NPM)}, start_new_session=True)

    def expect(self, wanted, timeout=240):
        timer = threading.Timer(timeout, self.kill)
        timer.start()
        try:
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("failed"):
                    break
                if line.rstrip() == f"step {wanted}":
                    return
        finally:
            timer.cancel()
        raise AssertionError(f"the browser never reached {wanted}:\n" + "\n".join(self.lines))

    def go(self):
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()

    def line_starting(self, prefix):
        return next(l[len(prefix):] for l in self.lines if l.startswith(prefix))

    def kill(self):
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass

    def finish(self):
        self.expect("done")
        assert self.proc.wait(timeout=30) == 0, "\n".join(self.lines)


def test_notebook_frontend_and_dashboard_in_chromium():
    notebooks = tempfile.mkdtemp(prefix="nbos-browser-")
    c = Cluster(hosts=4, gpus_per_host=2, extra=("--frontend", "--frontend-dir", notebooks))
    browsers = []
    try:
        line = c.proc.stdout.readline().strip()
        m = re.match(r"frontend: (http://127\.0\.0\.1:\d+)/\?token=(\S+)$", line)
        assert m, f"nbos up printed {line!r}"
        frontend = m.group(1)
        wait_answering(f"{frontend}/api/status?token={c.token}", "the front end")

        nb = Browser("notebook", frontend=frontend, token=c.token)
        browsers.append(nb)
        nb.finish()
        saved = nbformat.read(os.path.join(notebooks, nb.line_starting("saved ")), as_version=4)
        assert saved.metadata.kernelspec.name == "python3"
        outputs = [o for cell in saved.cells for o in cell.outputs]
        assert {"output_type": "stream", "name": "stdout", "text": "45\n"} in outputs, outputs
        assert any("image/png" in o.get("data", {}) for o in outputs), outputs

        kernel_id = c.start_kernel({"KERNEL_GPUS": "1"})
        dash = Browser("dashboard", gateway=c.url, token=c.token, kernel=kernel_id, servers=4)
        browsers.append(dash)
        dash.expect("dashboard-ready")
        ks = KernelSocket(c.url, kernel_id, c.token)
        msg_id = ks.send("execute_request", {"code": "import time\ntime.sleep(6)", "silent": False,
                                             "store_history": True, "user_expressions": {},
                                             "allow_stdin": False, "stop_on_error": True})
        dash.go()
        dash.expect("gpus-committed")
        reply, _ = ks.wait_for(msg_id)
        assert reply["content"]["status"] == "ok"
        ks.close()
        status, moved = c.request("POST", f"/api/nbos/kernels/{kernel_id}/migrate", {})
        assert status == 202, moved
        dash.go()
        dash.expect("migration-shown")
        dash.finish()

        report = pathlib.Path(notebooks) / "report"
        trace = pathlib.Path(notebooks) / "t.csv"
        trace.write_text("job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n"
                         "0,8,0,0,m,30,0\n1,4,40,0,m,20,0\n2,2,100,0,m,10,0\n3,1,5,0,m,3,0\n")
        subprocess.run([nbos_bin(), "sim", "report", "--trace", str(trace), "--out", str(report),
                        "--hosts", "3", "--policies", "reservation", "notebookos"],
                       check=True, capture_output=True, timeout=300)
        sim = Browser("sim", gateway=c.url, token=c.token, results=str(report / "results.json"))
        browsers.append(sim)
        sim.finish()
        shown = json.loads(sim.line_starting("policies "))
        assert shown == [r["policy"] + (f" (idle {r['idle_reclaim_min']} min)" if r["idle_reclaim_min"] else "")
                         for r in json.loads((report / "results.json").read_text())]
    finally:
        for b in browsers:
            b.kill()
        assert c.stop() == 0
    assert not c.nbos_processes()
    for name in ("notebook-2-outputs", "dashboard-2-gpus-committed", "dashboard-3-migration",
                 "sim-report"):
        assert (shots_dir() / f"{name}.png").stat().st_size > 10_000, name
