"""The README's pattern with a failing rank, for the launcher's root-cause test: rank 1 raises
inside ``with gc.init() as comm:`` while the others wait for it in an all-reduce."""

import numpy as np

import gpucoll as gc

with gc.init(backend="cpu", timeout=30) as comm:
    if comm.rank == 1:
        raise RuntimeError("boom")
    comm.all_reduce(np.ones(4))
