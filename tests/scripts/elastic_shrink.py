"""Rank program for tests/test_launch_elastic.py: all-reduce in a loop until a rank dies, then
shrink and go on.

Usage: ``elastic_shrink.py VICTIM KILL_STEP SLOW_RANK``

Rank VICTIM SIGKILLs itself at step KILL_STEP. The survivors catch the failure; SLOW_RANK waits
1 s before it calls shrink (a slow but live rank). Each survivor then all-reduces its world
rank on the new communicator and prints ``SHRUNK {json}`` with what it saw.
"""

import json
import sys

import numpy as np

import gpucoll
from elastic_loss import all_reduce_until_a_rank_dies  # beside this script

victim, kill_step, slow_rank = (int(word) for word in sys.argv[1:4])
comm = gpucoll.init(backend="cpu", timeout=60)  # a dead rank must not be waited for this long
all_reduce_until_a_rank_dies(comm, np.ones(4096), victim, kill_step)
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
