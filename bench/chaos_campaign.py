#!/usr/bin/python3
"""A seeded nemesis campaign against a live cluster (tests/chaos/campaign.py): kernels run cells
whose effects the checker reads back on every replica while faults overlap; prints the summary
and the first violation, writes the history (JSON lines). Exit status 1 when any violation.

    /usr/bin/python3 bench/chaos_campaign.py [--seed N] [--duration S] [--kernels K]
        [--hosts H] [--interval A B] [--history FILE] [--nbos build/bin/nbos] [--no-netns]
        [--no-gpu-kernels]

Several seeds: --seeds 1,2,3 (one campaign after another, each on a fresh cluster)."""

import argparse
import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests",
                                "chaos"))


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--seeds", help="comma-separated seeds, run one after another")
    p.add_argument("--duration", type=float, default=180.0, help="seconds of faults")
    p.add_argument("--kernels", type=int, default=3)
    p.add_argument("--hosts", type=int, default=5)
    p.add_argument("--interval", type=float, nargs=2, default=(4.0, 9.0),
                   help="seconds between faults, drawn uniformly")
    p.add_argument("--history", help="history file (default: a file in /tmp per seed)")
    p.add_argument("--nbos", help="the nbos binary (default: build/bin/nbos)")
    p.add_argument("--no-netns", action="store_true", help="no network namespaces (no cuts)")
    p.add_argument("--no-gpu-kernels", action="store_true",
                   help="no kernel asks for a GPU (as in CI; by default every other kernel does)")
    args = p.parse_args()
    if args.nbos:
        os.environ["NBOS_BIN"] = os.path.abspath(args.nbos)
    import campaign as chaos
    seeds = [int(s) for s in args.seeds.split(",")] if args.seeds else [args.seed]
    failed = False
    for seed in seeds:
        c = chaos.Campaign(seed, duration_s=args.duration, kernels=args.kernels,
                           hosts=args.hosts, history_path=args.history,
                           interval_s=tuple(args.interval),
                           netns=False if args.no_netns else None,
                           gpu_kernels=not args.no_gpu_kernels)
        try:
            c.start()
            c.run()
            violations = chaos.check(c)
            print(chaos.summary(c, violations), flush=True)
            failed = failed or bool(violations)
        finally:
            c.close()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
