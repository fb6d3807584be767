"""Two ranks (threads) of gpucoll's NCCL backend over the emulated CUDA runtime, calling CuPy's
REAL NCCL binding; run under LD_PRELOAD of tests/nccl_stub/libnccl_stub.c, which records the C
arguments. Prints JSON: each rank's GPU and stream handle (tests/test_real_nccl_binding.py)."""

import json
import os
import sys
import tempfile
import threading

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/

import cupy.cuda.nccl as real_nccl  # noqa: E402

import gpucoll  # noqa: E402
from gpucoll import cuda_env  # noqa: E402

from emulated_cuda import Emulation, ml_dtypes  # noqa: E402

emu = Emulation(device_count=2)
cuda_env._LOADED = (emu.cupy, real_nccl)  # the runtime emulated, NCCL's binding real
cp = emu.cupy


def rank_body(comm, seen):
    other = 1 - comm.rank
    stream = cp.cuda.Stream()
    seen[comm.rank] = {"device": comm.device, "stream": stream.ptr}
    with stream:
        comm.all_reduce(cp.asarray(np.arange(6, dtype=np.float32)))
        comm.all_reduce(cp.asarray(np.ones(3, np.complex64)), "avg",
                        out=cp.zeros(3, dtype=np.complex64))
        if ml_dtypes is not None:
            comm.all_reduce(cp.asarray(np.ones(4, ml_dtypes.bfloat16)), "max")
        comm.reduce(cp.asarray(np.arange(5, dtype=np.int64)), root=1, op="min")
        comm.broadcast(cp.zeros((3, 5), dtype=np.int16), root=1)
        comm.all_gather(cp.asarray(np.arange(4, dtype=np.float64)))
        comm.reduce_scatter(cp.ones((2, 3), dtype=np.uint32), "prod")
        comm.all_to_all(cp.zeros((2, 4), dtype=np.float32))
        if comm.rank == 0:
            comm.send(cp.zeros(5), 1)
        else:
            comm.recv(cp.zeros(5), 0)
        theirs = cp.zeros(3 + other, dtype=np.float32)  # 12 bytes from rank 0, 16 from rank 1
        assert comm.sendrecv(cp.zeros(3 + comm.rank, dtype=np.float32), other, theirs,
                             other) is theirs
        works = comm.batch_isend_irecv([  # int64: 16 bytes from rank 0, 24 from rank 1
            gpucoll.P2POp("recv", cp.zeros(2 + other, dtype=np.int64), other),
            gpucoll.P2POp("send", cp.zeros(2 + comm.rank, dtype=np.int64), other),
            gpucoll.P2POp("send", cp.zeros(5, dtype=np.uint8), other),
            gpucoll.P2POp("recv", cp.zeros(5, dtype=np.uint8), other)])
        works[3].wait()
        comm.barrier(timeout=10)
        child = comm.split(None if comm.rank == 0 else 7, key=3)
        if child is not None:
            child.close()
    assert other in (0, 1)


def main():
    seen, errors = {}, []
    with tempfile.TemporaryDirectory() as tmp:
        def run(rank):
            try:
                comm = gpucoll.init(backend="nccl", rank=rank, world_size=2,
                                    url=f"file://{tmp}/store", timeout=20)
                try:
                    rank_body(comm, seen)
                finally:
                    comm.close()
            except BaseException as exc:  # reported below
                errors.append(f"rank {rank}: {type(exc).__name__}: {exc}")

        threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(2)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(60)
        if errors or any(t.is_alive() for t in threads):
            print("\n".join(errors) or "a rank did not finish", file=sys.stderr)
            sys.exit(1)
    print(json.dumps({"ranks": seen, "bfloat16": ml_dtypes is not None}))


if __name__ == "__main__":
    main()
