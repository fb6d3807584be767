"""Rank program for tests/test_real_launchers.py: under mpirun on the MPI backend, rank 1
never joins the all-reduce; rank 0 must get gpucoll's timeout, not block forever in MPI. The
timeout (argv[1]) also bounds init's own exchange, so it must exceed the ranks' start-up skew
on a loaded machine (the tests use 4 s). Rank 1 prints ``AWAKE`` if it is still running when
its 20 s sleep ends."""

import os
import sys
import time

import numpy as np

import gpucoll as gc

comm = gc.init(backend="mpi", timeout=float(sys.argv[1]))
if comm.rank == 1:
    time.sleep(20)  # stuck, never calls all_reduce
    print("AWAKE", flush=True)  # the job outlived the stuck rank's sleep
    os._exit(0)
start = time.monotonic()
try:
    comm.all_reduce(np.ones(4))
except gc.CommTimeoutError as exc:
    print(f"TIMEOUT after {time.monotonic() - start:.1f} s: {exc}", flush=True)
else:
    print("NO TIMEOUT", flush=True)
os._exit(0)
