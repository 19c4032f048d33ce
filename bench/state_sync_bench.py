#!/usr/bin/python3
"""Per-cell cost of a replica's namespace bookkeeping (`nbos_state.StateSync.begin` + `end` for
the cell `pass`) as a session grows, printed beside its baseline from the same run: the same
namespace before any cell ran.

IPython binds hidden names with every cell it keeps in its history (`_iN`, and `_N` for a cell
with a result), adds them to its hidden set and never drops them, so a kernel that ran N cells holds about N such names. The
replica looks at every name before and after each cell; this shows what that costs at N cells.

    /usr/bin/python3 bench/state_sync_bench.py [--cells 1000,10000,30000] [--repeat 2000]
        [--nbos-state DIR]

--nbos-state: the directory holding the nbos_state.py to measure (default: this checkout's), e.g.
a `git show REV:src/replica/python/nbos_state.py` copy, to compare two versions in one session.
Exit status: 0; 2 on usage errors.
"""

import argparse
import hashlib
import pathlib
import statistics
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent


class MemStore:
    """The blob store's interface, in memory (`pass` stores nothing)."""

    def __init__(self):
        self.blobs = {}

    def put(self, data):
        key = hashlib.sha256(data).hexdigest()
        self.blobs[key] = bytes(data)
        return key

    def get(self, key):
        return bytearray(self.blobs[key])

    def contains(self, key):
        return key in self.blobs


def session(cells):
    """A namespace and hidden set as IPython leaves them after `cells` cells, a third of which
    had a result, with a user's 20 names."""
    ns = {"In": [], "Out": {}, "get_ipython": print, "exit": None, "quit": None}
    hidden = dict.fromkeys(ns)
    for i in range(1, cells + 1):
        ns[f"_i{i}"] = "pass"
        hidden[f"_i{i}"] = None
        if i % 3 == 0:
            ns[f"_{i}"] = i
            hidden[f"_{i}"] = None
    for k in range(20):
        ns[f"user_{k}"] = [k] * 4
    return ns, hidden


def per_cell_us(nbos_state, cells, repeat):
    ns, hidden = session(cells)
    sync = nbos_state.StateSync(ns, hidden, MemStore())
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        delta, problems = sync.end(sync.begin("pass"))
        times.append(time.perf_counter() - t0)
        assert delta == b"" and not problems
    return statistics.median(times) * 1e6


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cells", default="1000,10000,30000",
                    help="session lengths, comma-separated (default 1000,10000,30000)")
    ap.add_argument("--repeat", type=int, default=2000, help="cells timed per length (2000)")
    ap.add_argument("--nbos-state", default=str(ROOT / "src" / "replica" / "python"),
                    help="directory of the nbos_state.py to measure")
    args = ap.parse_args()
    try:
        lengths = [int(x) for x in args.cells.split(",") if x.strip()]
    except ValueError:
        ap.error("--cells: comma-separated whole numbers")
    if not lengths or min(lengths) < 0 or args.repeat < 1:
        ap.error("--cells must be >= 0 and --repeat >= 1")
    sys.path.insert(0, args.nbos_state)
    import nbos_state

    base = per_cell_us(nbos_state, 0, args.repeat)
    print(f"nbos_state from {nbos_state.__file__}; median of {args.repeat} cells `pass`")
    print(f"{'cells run before':>16}  {'begin+end us':>12}  {'vs a new session':>16}")
    print(f"{0:>16}  {base:>12.1f}  {1.0:>15.2f}x  (baseline)")
    for n in lengths:
        us = per_cell_us(nbos_state, n, args.repeat)
        print(f"{n:>16}  {us:>12.1f}  {us / base:>15.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
