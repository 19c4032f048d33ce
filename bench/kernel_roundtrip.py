#!/usr/bin/python3
"""Execute round-trip latency: the nbos kernel versus plain ipykernel, in one run.

For each kernel it times, from just before the execute_request is sent until BOTH the
execute_reply (shell) and the iopub ``status: idle`` for that request have arrived:

  empty  code ""                          (legal, the kernel still goes busy/idle)
  pass   code "pass"                      (a realistic minimal cell)
  1mb    code print("x" * 1_000_000)      (additionally waits for, and verifies, all
                                           1,000,001 characters of stdout on iopub)

Both kernels run at the same time and the measurements are interleaved: every
iteration runs the same cell on both kernels, alternating which goes first, so
machine noise is spread evenly. The client (jupyter_client's BlockingKernelClient,
same Session, same receive logic) is identical for both, so its overhead - including
Session's signature check and duplicate-signature history - is shared.

Run from the repository root (this is what `make bench` does):

    /usr/bin/python3 bench/kernel_roundtrip.py --nbos build/bin/nbos

Use /usr/bin/python3: it has Debian's jupyter_client and ipykernel (kernelspec
"python3"). The nbos kernelspec is installed into a temporary prefix which is put
first on JUPYTER_PATH; IPython's profile dir and Jupyter's runtime dir are temporary
too, so user configuration does not leak into either kernel.

Exit status: 0 on success; 1 if a kernel fails, times out, loses output or errors;
2 on usage errors.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from queue import Empty

ONE_MB_CODE = 'print("x" * 1_000_000)'
ONE_MB_EXPECTED = "x" * 1_000_000 + "\n"

# name -> (code, expected stdout or None)
WORKLOADS = {
    "empty": ("", None),
    "pass": ("pass", None),
    "1mb": (ONE_MB_CODE, ONE_MB_EXPECTED),
}


class BenchError(RuntimeError):
    """A kernel misbehaved (timeout, lost output, error reply, crash)."""


# --------------------------------------------------------------------------- helpers


def percentile(sorted_values: list[float], p: float) -> float:
    """Linear-interpolated percentile (same as numpy's default) of sorted data."""
    if not sorted_values:
        return float("nan")
    if len(sorted_values) == 1:
        return sorted_values[0]
    rank = (p / 100.0) * (len(sorted_values) - 1)
    lo = int(rank)
    hi = min(lo + 1, len(sorted_values) - 1)
    frac = rank - lo
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * frac


def summarize(samples_s: list[float]) -> dict:
    s = sorted(samples_s)
    ms = 1e3
    return {
        "n": len(s),
        "p50_ms": percentile(s, 50) * ms,
        "p90_ms": percentile(s, 90) * ms,
        "p99_ms": percentile(s, 99) * ms,
        "mean_ms": (sum(s) / len(s)) * ms if s else float("nan"),
        "min_ms": s[0] * ms if s else float("nan"),
        "max_ms": s[-1] * ms if s else float("nan"),
    }


def tail(path: str, n: int = 4000) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(0, os.SEEK_END)
            size = f.tell()
            f.seek(max(0, size - n))
            return f.read().decode("utf-8", "replace")
    except OSError as e:
        return f"<cannot read {path}: {e}>"


# --------------------------------------------------------------------------- kernels


class Kernel:
    """One running kernel plus its blocking client."""

    def __init__(self, label: str, kernel_name: str, workdir: str, startup_timeout: float):
        from jupyter_client.manager import KernelManager

        self.label = label
        self.kernel_name = kernel_name
        self.log_path = os.path.join(workdir, f"{label}.log")
        self.km = KernelManager(kernel_name=kernel_name)
        self.argv = list(self.km.kernel_spec.argv)
        self.kc = None
        self._log = open(self.log_path, "wb")
        try:
            self.km.start_kernel(stdout=self._log, stderr=subprocess.STDOUT, cwd=workdir)
            self.kc = self.km.client()
            self.kc.start_channels()
            try:
                self.kc.wait_for_ready(timeout=startup_timeout)
            except RuntimeError as e:
                raise BenchError(
                    f"{label}: kernel did not become ready within {startup_timeout:.0f}s: {e}\n"
                    f"--- kernel log tail ({self.log_path}) ---\n{tail(self.log_path)}"
                ) from None
            self.drain_iopub()
        except BaseException:
            self.shutdown()
            raise

    def drain_iopub(self) -> None:
        while True:
            try:
                self.kc.get_iopub_msg(timeout=0.05)
            except Empty:
                return

    def _fail(self, what: str, state: dict) -> BenchError:
        alive = self.km.is_alive()
        return BenchError(
            f"{self.label}: {what}\n"
            f"  state: reply={'yes' if state['reply'] is not None else 'no'}"
            f" idle={'yes' if state['idle'] else 'no'}"
            f" stream_chars={state['chars']} stream_msgs={state['chunks']}"
            f" kernel_alive={alive}\n"
            f"--- kernel log tail ({self.log_path}) ---\n{tail(self.log_path)}"
        )

    def roundtrip(self, code: str, expected_out: str | None, timeout: float,
                  store_history: bool = True) -> float:
        """Send one execute_request; return seconds until reply + idle (+ all output)."""
        kc = self.kc
        state = {"reply": None, "idle": False, "chars": 0, "chunks": 0}
        out_parts: list[str] = []
        need_chars = len(expected_out) if expected_out is not None else 0

        t0 = time.perf_counter()
        msg_id = kc.execute(code, silent=False, store_history=store_history, allow_stdin=False)
        deadline = t0 + timeout

        # iopub first: the reply (a single message) waits in the shell socket's queue
        # meanwhile, so the order of the two waits adds no latency to the measurement.
        while not state["idle"] or state["chars"] < need_chars:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise self._fail(f"timed out after {timeout:.0f}s waiting on iopub for {code!r}", state)
            try:
                msg = kc.get_iopub_msg(timeout=remaining)
            except Empty:
                continue
            if msg["parent_header"].get("msg_id") != msg_id:
                continue  # late message from an earlier request (should not happen)
            mtype = msg["msg_type"]
            content = msg["content"]
            if mtype == "status":
                if content.get("execution_state") == "idle":
                    state["idle"] = True
                    if state["chars"] < need_chars:
                        # Idle must come after all output of the request.
                        raise self._fail(
                            f"status idle arrived before all output: got {state['chars']}"
                            f" of {need_chars} chars for {code!r}",
                            state,
                        )
            elif mtype == "stream":
                text = content.get("text", "")
                if content.get("name") != "stdout":
                    raise self._fail(f"unexpected {content.get('name')} stream: {text[:200]!r}", state)
                out_parts.append(text)
                state["chars"] += len(text)
                state["chunks"] += 1
            elif mtype == "error":
                raise self._fail(
                    f"error executing {code!r}: {content.get('ename')}: {content.get('evalue')}", state
                )

        while state["reply"] is None:
            remaining = deadline - time.perf_counter()
            if remaining <= 0:
                raise self._fail(f"timed out after {timeout:.0f}s waiting for execute_reply to {code!r}", state)
            try:
                msg = kc.get_shell_msg(timeout=remaining)
            except Empty:
                continue
            if msg["parent_header"].get("msg_id") == msg_id:
                state["reply"] = msg
        elapsed = time.perf_counter() - t0

        reply = state["reply"]
        if reply["msg_type"] != "execute_reply" or reply["content"].get("status") != "ok":
            raise self._fail(
                f"bad reply to {code!r}: {reply['msg_type']} {json.dumps(reply['content'])[:500]}", state
            )
        got = "".join(out_parts)
        want = expected_out or ""
        if got != want:
            raise self._fail(
                f"wrong output for {code!r}: got {len(got)} chars in {state['chunks']} stream msgs,"
                f" expected {len(want)} chars (first diff at"
                f" {next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))})",
                state,
            )
        return elapsed

    def shutdown(self) -> None:
        if self.kc is not None:
            with contextlib.suppress(Exception):
                self.kc.stop_channels()
        try:
            if self.km.has_kernel:
                try:
                    self.km.shutdown_kernel(now=False)
                except Exception:
                    self.km.shutdown_kernel(now=True)
        except Exception as e:  # never mask the original failure
            print(f"warning: {self.label}: shutdown failed: {e}", file=sys.stderr)
        finally:
            with contextlib.suppress(Exception):
                self._log.close()


# --------------------------------------------------------------------------- main


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nbos", required=True, help="path to the nbos binary (e.g. build/bin/nbos)")
    p.add_argument("--baseline-kernel", default="python3", help="baseline kernelspec name (default: python3)")
    p.add_argument("--iterations", type=int, default=None,
                   help="measured iterations for the empty/pass cells (default 200)")
    p.add_argument("--iterations-1mb", type=int, default=None,
                   help="measured iterations for the 1 MB cell (default 30)")
    p.add_argument("--warmup", type=int, default=None, help="warm-up iterations per workload (default 20)")
    p.add_argument("--quick", action="store_true",
                   help="short run: 30 small / 5 x 1 MB iterations, 5 warm-up (explicit flags win)")
    p.add_argument("--workloads", default="empty,pass,1mb",
                   help="comma-separated subset of: " + ",".join(WORKLOADS))
    p.add_argument("--timeout", type=float, default=30.0, help="per-request timeout in seconds (default 30)")
    p.add_argument("--startup-timeout", type=float, default=60.0, help="kernel start timeout (default 60)")
    p.add_argument("--no-store-history", dest="store_history", action="store_false",
                   help="send store_history=false (skips IPython's sqlite history write, which"
                        " dominates the 'pass' cell on slow disks; '' is never stored anyway)")
    p.add_argument("--json", metavar="PATH", help="also write machine-readable results (with raw samples)")
    a = p.parse_args(argv)
    small, large, warm = (30, 5, 5) if a.quick else (200, 30, 20)
    a.iterations = small if a.iterations is None else a.iterations
    a.iterations_1mb = large if a.iterations_1mb is None else a.iterations_1mb
    a.warmup = warm if a.warmup is None else a.warmup
    a.workloads = [w.strip() for w in a.workloads.split(",") if w.strip()]
    bad = [w for w in a.workloads if w not in WORKLOADS]
    if bad:
        p.error(f"unknown workload(s) {bad}; choose from {list(WORKLOADS)}")
    if a.iterations < 1 or a.iterations_1mb < 1 or a.warmup < 0:
        p.error("iterations must be >= 1 and warmup >= 0")
    return a


def run(args: argparse.Namespace, workdir: str) -> dict:
    nbos = os.path.abspath(args.nbos)
    if not (os.path.isfile(nbos) and os.access(nbos, os.X_OK)):
        raise BenchError(f"nbos binary not found or not executable: {nbos}")

    prefix = os.path.join(workdir, "prefix")
    r = subprocess.run([nbos, "kernelspec", "install", "--prefix", prefix],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise BenchError(f"`nbos kernelspec install` failed ({r.returncode}):\n{r.stdout}{r.stderr}")
    jupyter_data = os.path.join(prefix, "share", "jupyter")
    if not os.path.isfile(os.path.join(jupyter_data, "kernels", "nbos", "kernel.json")):
        raise BenchError(f"nbos kernelspec not found under {jupyter_data} after install")

    # Environment inherited by both kernels (KernelManager copies os.environ).
    os.environ["JUPYTER_PATH"] = os.pathsep.join(
        [jupyter_data] + [x for x in os.environ.get("JUPYTER_PATH", "").split(os.pathsep) if x])
    os.environ["JUPYTER_RUNTIME_DIR"] = os.path.join(workdir, "runtime")
    os.environ["IPYTHONDIR"] = os.path.join(workdir, "ipython")
    os.environ["PYDEVD_DISABLE_FILE_VALIDATION"] = "1"  # silence ipykernel's debugger warning
    os.environ.setdefault("PYTHONUNBUFFERED", "1")

    import jupyter_client

    kernels: list[Kernel] = []
    try:
        kernels.append(Kernel("nbos", "nbos", workdir, args.startup_timeout))
        kernels.append(Kernel("ipykernel", args.baseline_kernel, workdir, args.startup_timeout))
        if os.path.realpath(kernels[0].argv[0]) != os.path.realpath(nbos):
            raise BenchError(f"kernelspec 'nbos' resolves to {kernels[0].argv[0]}, not {nbos}")

        print(f"nbos:      {' '.join(kernels[0].argv)}")
        print(f"ipykernel: {' '.join(kernels[1].argv)}")
        print(f"client:    jupyter_client {jupyter_client.__version__}, python {platform.python_version()}"
              f" ({sys.executable}), {os.cpu_count()} CPUs")
        print(f"settings:  warmup={args.warmup} iterations={args.iterations}"
              f" iterations_1mb={args.iterations_1mb} timeout={args.timeout:.0f}s"
              f" store_history={args.store_history}, interleaved")
        sys.stdout.flush()

        results: dict = {}
        for wl in args.workloads:
            code, expected = WORKLOADS[wl]
            n = args.iterations_1mb if wl == "1mb" else args.iterations
            samples = {k.label: [] for k in kernels}
            t_wl = time.perf_counter()
            for i in range(args.warmup + n):
                order = kernels if i % 2 == 0 else kernels[::-1]
                for k in order:
                    dt = k.roundtrip(code, expected, args.timeout, args.store_history)
                    if i >= args.warmup:
                        samples[k.label].append(dt)
            print(f"  {wl:<6} done: {args.warmup} warm-up + {n} measured per kernel"
                  f" in {time.perf_counter() - t_wl:.1f}s", flush=True)
            results[wl] = {
                "code": code,
                "kernels": {lbl: {**summarize(s), "samples_ms": [x * 1e3 for x in s]}
                            for lbl, s in samples.items()},
            }
            a, b = results[wl]["kernels"]["nbos"], results[wl]["kernels"]["ipykernel"]
            results[wl]["ratio_nbos_over_ipykernel"] = {
                "p50": a["p50_ms"] / b["p50_ms"],
                "mean": a["mean_ms"] / b["mean_ms"],
            }
        return {
            "meta": {
                "nbos": nbos,
                "nbos_argv": kernels[0].argv,
                "ipykernel_argv": kernels[1].argv,
                "jupyter_client": jupyter_client.__version__,
                "python": platform.python_version(),
                "python_executable": sys.executable,
                "cpus": os.cpu_count(),
                "host": platform.node(),
                "warmup": args.warmup,
                "iterations": args.iterations,
                "iterations_1mb": args.iterations_1mb,
                "timeout_s": args.timeout,
                "store_history": args.store_history,
                "timed": "execute_request sent -> execute_reply and iopub idle received"
                         " (and for 1mb all 1,000,001 stdout chars); same client for both kernels,"
                         " interleaved",
                "unix_time": time.time(),
            },
            "workloads": results,
        }
    finally:
        for k in reversed(kernels):
            k.shutdown()


def print_table(res: dict) -> None:
    hdr = ["cell", "kernel", "n", "p50 ms", "p90 ms", "p99 ms", "mean ms", "p50 ratio", "mean ratio"]
    rows = []
    for wl, r in res["workloads"].items():
        for lbl in ("nbos", "ipykernel"):
            s = r["kernels"][lbl]
            ratio = r["ratio_nbos_over_ipykernel"]
            rows.append([
                wl, lbl, str(s["n"]),
                f"{s['p50_ms']:.3f}", f"{s['p90_ms']:.3f}", f"{s['p99_ms']:.3f}", f"{s['mean_ms']:.3f}",
                f"{ratio['p50']:.2f}x" if lbl == "nbos" else "",
                f"{ratio['mean']:.2f}x" if lbl == "nbos" else "",
            ])
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(hdr)]
    left = {0, 1}

    def fmt(cells):
        return "  ".join(c.ljust(w) if i in left else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    print()
    print(fmt(hdr))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))
    print("\nratio = nbos / ipykernel (lower is better for nbos)")


def main(argv: list[str]) -> int:
    args = parse_args(argv)
    try:
        import jupyter_client  # noqa: F401
    except ImportError:
        print(f"error: jupyter_client is not importable by {sys.executable}; run with /usr/bin/python3",
              file=sys.stderr)
        return 1
    workdir = tempfile.mkdtemp(prefix="nbos-bench-")
    ok = False
    try:
        res = run(args, workdir)
        print_table(res)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(res, f, indent=1)
            print(f"wrote {args.json}")
        ok = True
        return 0
    except BenchError as e:
        print(f"\nBENCHMARK FAILED: {e}", file=sys.stderr)
        return 1
    finally:
        if ok:
            shutil.rmtree(workdir, ignore_errors=True)
        else:
            print(f"(kernel logs kept in {workdir})", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
