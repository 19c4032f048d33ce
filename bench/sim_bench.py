#!/usr/bin/python3
"""Wall time of `nbos sim` on the whole Adobe June trace (30,909 trainings), per policy, printed
beside its baseline from the same run: `nbos sim` on a copy of the trace cut to one training
(process start, option parsing, trace open and policy set-up, with nothing to simulate).

Design target (DESIGN.md §9): <= 5 s per policy on 2 cores.

    /usr/bin/python3 bench/sim_bench.py --nbos build/bin/nbos [--trace PATH] [--repeat N]

Exit status: 0 (a missed target is reported, not fatal); 1 if a run fails; 2 on usage errors.
"""

from __future__ import annotations

import argparse
import json
import pathlib
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared/traces/notebookos-adobe-idlt/sensei_june_60sec.csv"
POLICIES = ["reservation", "batch", "notebookos", "notebookos-lcp"]
TARGET_S = 5.0


def timed(cmd: list[str]) -> tuple[float, str]:
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True)
    elapsed = time.perf_counter() - t0
    if proc.returncode != 0:
        sys.exit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr}")
    return elapsed, proc.stdout


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nbos", default=str(ROOT / "build/bin/nbos"))
    ap.add_argument("--trace", default=str(TRACE))
    ap.add_argument("--repeat", type=int, default=3)
    args = ap.parse_args()
    if not pathlib.Path(args.trace).exists():
        print(f"trace not found: {args.trace}", file=sys.stderr)
        return 2

    # Baseline: parse the whole trace and simulate nothing but one training.
    lines = pathlib.Path(args.trace).read_text().splitlines()
    with tempfile.TemporaryDirectory() as tmp:
        one = pathlib.Path(tmp) / "one.csv"
        one.write_text("\n".join(lines[:2]) + "\n")
        startup = statistics.median(
            timed([args.nbos, "sim", "--trace", str(one), "--policy", "notebookos"])[0]
            for _ in range(args.repeat))
    print(f"trace: {args.trace} ({len(lines) - 1} trainings)")
    print(f"baseline: process start + 1-training simulation  {startup * 1000:8.1f} ms")
    print(f"{'policy':<16} {'wall s (median)':>16} {'minus baseline':>15} {'target':>8}  "
          "GPU-h prov  immediate %")
    missed = []
    for policy in POLICIES:
        runs = []
        out = ""
        for _ in range(args.repeat):
            t, out = timed([args.nbos, "sim", "--trace", args.trace, "--policy", policy,
                            "--json"])
            runs.append(t)
        r = json.loads(out)
        wall = statistics.median(runs)
        ok = wall <= TARGET_S
        if not ok:
            missed.append(policy)
        print(f"{policy:<16} {wall:16.3f} {wall - startup:15.3f} {'ok' if ok else 'MISSED':>8}  "
              f"{r['gpu_hours_provisioned']:10.1f}  {r['pct_immediate']:11.1f}")
    if missed:
        print(f"target <= {TARGET_S} s missed for: {', '.join(missed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
