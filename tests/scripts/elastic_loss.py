"""For the elastic rank programs (elastic_shrink.py, elastic_replace.py): all-reduce until a
rank is lost, the victim SIGKILLing itself at its step."""

import os
import signal

from gpucoll.errors import CommAbortedError, CommTimeoutError, PeerError


def all_reduce_until_a_rank_dies(comm, x, victim: int, kill_step: int) -> None:
    """All-reduce ``x`` up to 200 times; rank ``victim`` dies at step ``kill_step``, the others
    return at the failure they see (a loop that ends without one is an error)."""
    for step in range(200):
        if comm.rank == victim and step == kill_step:
            os.kill(os.getpid(), signal.SIGKILL)
        try:
            comm.all_reduce(x)
        except (PeerError, CommTimeoutError, CommAbortedError):
            return
    raise SystemExit(f"rank {comm.rank}: the loop ended without a failure")
