"""Reliability figures: how long after a fault every surviving rank raises, on test hosts.

Two test hosts made of Linux network namespaces joined by a veth pair (link-local addresses
that exist only inside them; tests/netns.py), ``gpucoll run -n 2 --nnodes 2`` on each (4
ranks, the store on host 0), every rank in a loop of 256 KiB all_reduces with
``init(timeout=T)``. Once every rank is busy, one fault (tests/multihost_jobs.py):

- link cut: host 1's interface set down (no packet passes, no connection is reset);
- host killed: every process of host 1 SIGKILLed;
- store host killed: every process of host 0 (the launcher serving the store, its ranks);
- store host lost: host 0 cut off, then its processes SIGKILLed (a power loss);
- link cut in split: host 1's link down while the ranks loop on ``split`` (each new
  communicator meets its peers through the store) and an all_reduce on the half.

For each it prints the survivors, the error each raised, and the worst time from the fault to
an error (the ranks print wall-clock times; the test hosts share the machine's clock). The goal
is every survivor raising a named gpucoll error within T + 2 s.

Needs root and iproute2::

    python bench/bench_faults.py                 # T = 4 s, each scenario 3 times
    python bench/bench_faults.py --timeout 8 --repeat 1
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT))

import netns  # noqa: E402
from multihost_jobs import SCENARIOS, run_fault_scenario  # noqa: E402

SLACK = 2.0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--timeout", type=float, default=4.0, help="init(timeout=) of every rank")
    parser.add_argument("--repeat", type=int, default=3, help="runs of each scenario")
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS),
                        help="run only these (default: all)")
    args = parser.parse_args(argv)
    if args.timeout <= 0 or args.repeat < 1:
        parser.error("--timeout must be positive and --repeat at least 1")
    reason = netns.unavailable_reason()
    if reason:
        print(f"bench_faults: cannot make test hosts: {reason}")
        return 0
    netns.remove_stale()
    rows = []
    failures = 0
    for scenario in args.scenario or list(SCENARIOS):
        worst, errors, named, survivors = 0.0, set(), True, []
        for _ in range(args.repeat):
            with netns.TestHosts(2) as hosts:
                report = run_fault_scenario(hosts, scenario, args.timeout)
            survivors = report.survivors
            named = named and report.all_named
            for rank in report.survivors:
                if rank in report.errors:
                    name, delay, _ = report.errors[rank]
                    errors.add(name)
                    worst = max(worst, delay)
            if report.missing or not report.all_named:
                print(report.output, file=sys.stderr)
        ok = named and worst < args.timeout + SLACK
        failures += not ok
        rows.append((scenario, report.ranks, ", ".join(map(str, survivors)), f"{worst:.2f}",
                     ", ".join(sorted(errors)) or "-", "yes" if named else "NO",
                     "yes" if ok else "NO"))
        print(f"{scenario}: worst {worst:.2f} s, {'ok' if ok else 'FAILED'}", file=sys.stderr)
    print(f"\ninit(timeout={args.timeout:g}), {args.repeat} run(s) per scenario, "
          f"bound = timeout + {SLACK:g} s = {args.timeout + SLACK:g} s, {os.cpu_count()} CPUs\n")
    head = ("scenario", "ranks", "survivors", "worst fault to error (s)", "errors raised",
            "every survivor named", "within bound")
    print("| " + " | ".join(head) + " |")
    print("|" + "|".join("---" for _ in head) + "|")
    for row in rows:
        print("| " + " | ".join(str(v) for v in row) + " |")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
