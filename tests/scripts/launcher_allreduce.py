"""Rank program for tests/test_real_launchers.py: the README's pattern under a real launcher.

Prints ``RESULT {json}`` with the launcher gpucoll detected, rank, size, local rank, backend
and the all-reduced values (rank r contributes r + 1).
"""

import json
import os
import sys

import numpy as np

import gpucoll as gc
from gpucoll.api import detect_environment

backend = sys.argv[1] if len(sys.argv) > 1 else "cpu"
with gc.init(backend=backend, timeout=60) as comm:
    x = np.full(4, comm.rank + 1.0)
    comm.all_reduce(x)
    line = "RESULT " + json.dumps({
        "source": detect_environment().source, "rank": comm.rank, "size": comm.size,
        "local_rank": comm.local_rank, "backend": comm.backend, "values": x.tolist()})
    os.write(1, (line + "\n").encode())  # one write: ranks sharing a pipe do not interleave
