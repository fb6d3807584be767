#!/usr/bin/env python3
"""CPU collectives on one host: gpucoll over Unix sockets and over TCP, side by side with Gloo.

A preset of ``gpucoll bench`` (the engine in ``gpucoll.perf``). For each world size it runs the
equivalent of

    gpucoll bench <collective> -g N -b 8 -e 256M -f 4 --transport unix,tcp --compare gloo \\
        --modes matched --rounds 3 -a 3 --iter-bytes 1G --min-iters 6 -n 300 -w 50 \\
        --table side-by-side --ceiling 64M        # the ceiling once, before the first world size

so every rank opens one gpucoll communicator per transport and a Gloo process group, and the
three take turns round by round at each size. ``time`` is the best of 3 rounds, a round counting
at its slowest rank; ``ratio`` is ``gloo time / gpucoll time`` (above 1: gpucoll is faster); a
row ending in ``~`` had a round more than twice as slow as its best (the machine was busy).
Every size is also checked (``#wrong``). The raw two-way rate of a Unix stream socket and of
loopback TCP between two processes comes first, as the ceiling a ring's busbw can reach.

    python bench/bench_cpu.py                  # world sizes 2 and 4, 8 B .. 256 MiB
    python bench/bench_cpu.py --quick          # a short run, 8 B .. 16 MiB
    python bench/bench_cpu.py --json out.json  # every number, machine-readable

Gloo needs PyTorch (a CPU build is enough: ``pip install torch``); without it only gpucoll is
measured.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import sys
import time
from pathlib import Path

if importlib.util.find_spec("gpucoll") is None:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpucoll import perf  # noqa: E402

COLLECTIVES = ("all_reduce", "broadcast", "all_gather", "reduce_scatter")


def _csv(choices):
    def parse(text):
        names = [name.strip() for name in text.split(",") if name.strip()]
        if not names or any(name not in choices for name in names):
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(choices)}")
        return names
    return parse


def _size(text):
    try:
        return perf.parse_size(text)
    except perf.UsageError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add = parser.add_argument
    add("--world-sizes", default=[2, 4], type=lambda s: [int(x) for x in s.split(",") if x.strip()],
        help="comma-separated world sizes (default 2,4)")
    add("--collectives", default=list(COLLECTIVES), type=_csv(COLLECTIVES),
        help="comma-separated subset of " + ", ".join(COLLECTIVES))
    add("--transports", default=["unix", "tcp"], type=perf.parse_transports,
        help="GPUCOLL_TRANSPORT values to measure (default unix,tcp)")
    add("--no-gloo", action="store_true", help="measure gpucoll only")
    add("--min-bytes", type=_size, default=8)
    add("--max-bytes", type=_size, default=None, help="largest size (default 256M; 16M with --quick)")
    add("--step-factor", type=int, default=None, help="size multiplier (default 4; 8 with --quick)")
    add("--quick", action="store_true", help="a short run (about 1-2 minutes)")
    add("--raw-bytes", type=_size, default=None,
        help="bytes of the raw two-way exchange (default 64M; 16M with --quick; 0 skips it)")
    add("--rounds", type=int, default=3, help="rounds per size; the best is shown (default 3)")
    add("--op-timeout", type=float, default=120.0, help="seconds any one call may take")
    add("--json", metavar="FILE", help="write every number to FILE")
    opts = parser.parse_args(argv)
    if min(opts.world_sizes) < 2:
        parser.error("world sizes must be at least 2")
    return opts


def preset(args, nranks: int, gloo: bool, first: bool) -> perf.BenchOptions:
    """The gpucoll bench options of one world size."""
    quick = args.quick
    raw = args.raw_bytes if args.raw_bytes is not None else (16 << 20 if quick else 64 << 20)
    return perf.BenchOptions(
        collectives=args.collectives, nranks=nranks, min_bytes=args.min_bytes,
        max_bytes=args.max_bytes or (16 << 20 if quick else 256 << 20),
        factor=args.step_factor or (8 if quick else 4),
        iters=100 if quick else 300, min_iters=3 if quick else 6,
        iter_bytes=32 << 20 if quick else 1 << 30, warmup=50, rounds=args.rounds, average=3,
        transports=args.transports, compare="gloo" if gloo else None, modes="matched",
        table="side-by-side", timeout=args.op_timeout, ceiling_bytes=raw if first else 0)


def main(argv=None) -> int:
    args = parse_args(argv)
    gloo = not args.no_gloo and importlib.util.find_spec("torch") is not None
    if not args.no_gloo and not gloo:
        print("# Gloo skipped: torch is not installed (a CPU build is enough: pip install torch)")
    started, load_start = time.time(), os.getloadavg()
    print(f"# bench_cpu: {os.cpu_count()} CPUs, load average "
          + " ".join(f"{x:.2f}" for x in load_start), flush=True)
    documents, failures = [], []
    for index, nranks in enumerate(args.world_sizes):
        try:
            reporter = perf.measure(preset(args, nranks, gloo, first=index == 0))
            documents.append(reporter.document())
        except (RuntimeError, perf.UsageError) as exc:
            failures.append(f"world_size={nranks}: {exc}")
            print(f"# FAILURE world_size={nranks}: {exc}", file=sys.stderr)
    rows = sum(len(doc["rows"]) for doc in documents)
    wrong = sum(doc["wrong"] for doc in documents)
    unsteady = sum(doc["unsteady_rows"] for doc in documents)
    load_end = os.getloadavg()
    print(f"\n# {rows} rows, {wrong} wrong elements, {len(failures)} failures, {unsteady} rows "
          f"marked ~ (a round took more than 2x its best: the machine was busy; rerun for firm "
          f"numbers), {time.time() - started:.0f} s; load average at the end "
          + " ".join(f"{x:.2f}" for x in load_end))
    if args.json:
        meta = {"argv": sys.argv[1:] if argv is None else list(argv), "seconds": time.time() - started,
                "loadavg_start": load_start, "loadavg_end": load_end}
        with open(args.json, "w") as handle:
            json.dump({"meta": meta, "runs": documents, "failures": failures}, handle, indent=1)
    return 1 if failures or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
