"""Rank program for tests/test_launch_elastic.py: all-reduce in a loop until a rank dies, then
shrink and go on.

Usage: ``elastic_shrink.py VICTIM KILL_STEP SLOW_RANK``

Rank VICTIM SIGKILLs itself at step KILL_STEP. The survivors catch the failure; SLOW_RANK waits
1 s before it calls shrink (a slow but live rank). Each survivor then all-reduces its world
rank on the new communicator and prints ``SHRUNK {json}`` with what it saw.
"""

import json
import os
import signal
import sys

import numpy as np

import gpucoll
from gpucoll.errors import CommAbortedError, CommTimeoutError, PeerError

victim, kill_step, slow_rank = (int(word) for word in sys.argv[1:4])
comm = gpucoll.init(backend="cpu", timeout=60)  # a dead rank must not be waited for this long
x = np.ones(4096)
for step in range(200):
    if comm.rank == victim and step == kill_step:
        os.kill(os.getpid(), signal.SIGKILL)
    try:
        comm.all_reduce(x)
    except (PeerError, CommTimeoutError, CommAbortedError):
        break
else:
    raise SystemExit(f"rank {comm.rank}: the loop ended without a failure")
if comm.rank == slow_rank:
    import time

    time.sleep(1.0)
new = comm.shrink()
comm.close()
total = new.all_reduce(np.array([float(new.to_world(new.rank))]))
print("SHRUNK " + json.dumps({"rank": new.rank, "size": new.size, "ranks": new.ranks,
                              "lost": {str(k): v for k, v in new.lost.items()},
                              "sum": float(total[0])}), flush=True)
new.close()
