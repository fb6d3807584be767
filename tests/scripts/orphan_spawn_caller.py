"""Starts two ranks with gc.spawn that all-reduce forever, each writing its pid to
PIDDIR/rank<R>.pid; the orphan tests and bench/bench_orphans.py SIGKILL this caller and
check that the ranks stop too."""

import os
import sys
import time

import numpy as np

import gpucoll as gc


def work(comm, piddir):
    path = os.path.join(piddir, f"rank{comm.rank}.pid")
    with open(path + ".tmp", "w") as handle:
        handle.write(str(os.getpid()))
    os.replace(path + ".tmp", path)
    while True:
        comm.all_reduce(np.ones(3))
        time.sleep(0.01)


if __name__ == "__main__":
    gc.spawn(work, 2, args=(sys.argv[1],), backend="cpu", timeout=60)
