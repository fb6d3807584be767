"""What the flight recorder costs per call: ``all_reduce`` of a 1-element array on a world of
one (CPU backend), recording on (``GPUCOLL_TRACE_BUFFER=256``) against off (``0``).

    python bench/bench_flight_recorder.py [--calls 20000] [--repeat 7]

Two communicators in one process, one per setting (the setting is read at a communicator's
first operation); they take turns round by round and each keeps its best round, so both see
the same machine. Prints microseconds per call and the difference.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll as gc  # noqa: E402


def _communicator(buffer: int):
    os.environ["GPUCOLL_TRACE_BUFFER"] = str(buffer)
    comm = gc.init(backend="cpu", rank=0, world_size=1, url="tcp://127.0.0.1:0", timeout=60)
    comm.all_reduce(np.ones(1))  # the recorder is made (or not) here
    return comm


def _round(comm, x: np.ndarray, calls: int) -> float:
    start = time.perf_counter()
    for _ in range(calls):
        comm.all_reduce(x)
    return (time.perf_counter() - start) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    os.environ["GPUCOLL_QUIET"] = "1"
    comms = {"off": _communicator(0), "on": _communicator(256)}
    x = np.ones(1)
    best = {name: float("inf") for name in comms}
    for _ in range(args.repeat):
        for name, comm in comms.items():
            best[name] = min(best[name], _round(comm, x, args.calls))
    assert comms["off"].trace() == [] and len(comms["on"].trace()) == 256
    for name, seconds in best.items():
        print(f"recording {name:3}: {seconds * 1e6:.2f} us per all_reduce")
    print(f"difference: {(best['on'] - best['off']) * 1e6:.2f} us per call")
    for comm in comms.values():
        comm.close()


if __name__ == "__main__":
    main()
