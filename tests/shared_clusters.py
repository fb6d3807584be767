"""Clusters (tests/clusters.py) that several test modules share for the whole session.

``shared_cluster_pools(clusters)`` is ``clusters.cluster_pools(clusters)`` except that the
CPU clusters are started once per session, on first use, and handed to every module that asks
for the same one (through ``mp_harness.share_for_session``: started again if a failure killed
it, closed when the session ends or room is needed). An ``nccl-emulated`` cluster patches this
process while it lives, a ``nccl-gpu`` one holds the GPU and an ``mpi`` one 16 MiB of /dev/shm
per rank, so those stay the module's own, as in ``cluster_pools``. Only for modules whose
functions leave the communicator as they found it.
"""

from __future__ import annotations

import pytest

from clusters import cluster_id, cluster_marks, make_cluster
from mp_harness import pool_alive, share_for_session

_SHAREABLE = ("cpu-unix", "cpu-tcp", "cpu-shm", "cpu-shmcopy")


def shared_cluster_pools(clusters):
    """A module-scoped ``pool`` fixture over ``clusters``, as ``cluster_pools`` makes, whose
    CPU clusters live for the session. Use as ``pool = shared_cluster_pools([...])``."""
    @pytest.fixture(scope="module", params=[pytest.param(c, marks=cluster_marks(c))
                                            for c in clusters], ids=cluster_id)
    def pool(request):
        name, world_size = request.param
        if name in _SHAREABLE:
            yield share_for_session(repr(("cluster", name, world_size)), world_size,
                                    lambda: make_cluster(name, world_size),
                                    lambda cluster: pool_alive(cluster.pool))
            return
        cluster = make_cluster(name, world_size)
        yield cluster
        cluster.close()

    return pool
