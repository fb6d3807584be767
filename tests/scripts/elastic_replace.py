"""Rank program for tests/test_grow.py: a rank dies, the survivors shrink, the launcher's
replacement joins through ``grow()``, and every rank all-reduces on the grown communicator.

Usage: ``elastic_replace.py VICTIM KILL_STEP``

Rank VICTIM SIGKILLs itself at step KILL_STEP. The survivors shrink, then call ``grow()``
after every all-reduce until the replacement (started by ``gpucoll run --elastic --replace``)
is in. Each rank prints ``GROWN {json}`` with what it saw, the replacement ``JOINED {json}``;
then every rank shrinks the grown communicator while healthy (nobody may be left out: the
replacement's death record was cleared when it joined) and all-reduces once more.
"""

import json
import sys
import time

import numpy as np

import gpucoll
from elastic_loss import all_reduce_until_a_rank_dies  # beside this script

victim, kill_step = (int(word) for word in sys.argv[1:3])
comm = gpucoll.init(backend="cpu", timeout=30)
if comm.joined:   # the replacement: admitted by the survivors' grow()
    print("JOINED " + json.dumps({"rank": comm.rank, "size": comm.size, "ranks": comm.ranks,
                                  "joined": list(comm.joined)}), flush=True)
else:
    all_reduce_until_a_rank_dies(comm, np.ones(1024), victim, kill_step)
    old, comm = comm, comm.shrink()
    old.close()
    calls, deadline = 0, time.monotonic() + 20
    while comm.size < 3 and time.monotonic() < deadline:
        y = comm.all_reduce(np.ones(4))   # training goes on meanwhile
        assert y[0] == comm.size
        bigger = comm.grow()
        calls += 1
        if bigger is not comm:
            comm.close()
            comm = bigger
    print("GROWN " + json.dumps({"rank": comm.rank, "size": comm.size, "ranks": comm.ranks,
                                 "joined": list(comm.joined), "calls": calls}), flush=True)
total = comm.all_reduce(np.array([float(comm.to_world(comm.rank) + 1)]))
again = comm.shrink()
comm.close()
total_again = again.all_reduce(np.array([float(again.to_world(again.rank) + 1)]))
print("SUMS " + json.dumps([float(total[0]), float(total_again[0]), again.size]), flush=True)
again.close()
