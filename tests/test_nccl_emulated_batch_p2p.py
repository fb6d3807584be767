"""``batch_isend_irecv`` on the NCCL backend over the CUDA emulation (tests/emulated_cuda/): one
``groupStart`` / every ``ncclSend`` / every ``ncclRecv`` / ``groupEnd`` per call, with the right
pointers, byte counts and peers; a 2x2 grid whose every rank sends first; one shared
``CudaWork``; usage errors before anything is enqueued; arrays handed back.

The emulation runs a lone ``ncclSend`` until its receiver takes the message, as NCCL does with
a large one, so these exchanges complete only when the batch is one group. Ranks are threads
(see tests/nccl_emulated_harness.py).
"""

import threading

import numpy as np
import pytest

import gpucoll as gc
from gpucoll.backends.nccl import CudaWork

from nccl_emulated_harness import _calls, _Foreign, emu, run, traced  # noqa: F401

pytestmark = pytest.mark.timeout(60)

# direction -> (step in x, step in y, shape, dtype) of what goes that way on a 2x2 grid
GRID = {"east": (1, 0, (3, 5), "float64"), "west": (-1, 0, (7,), "int32"),
        "south": (0, 1, (2, 2), "complex64"), "north": (0, -1, (1000, 11), "uint8")}
OPPOSITE = {"east": "west", "west": "east", "south": "north", "north": "south"}


def _neighbour(rank, direction):
    step_x, step_y = GRID[direction][:2]
    return (rank // 2 + step_y) % 2 * 2 + (rank % 2 + step_x) % 2


def _face(rank, direction):
    _, _, shape, dtype = GRID[direction]
    return (np.arange(int(np.prod(shape))) + 1000 * rank + len(direction)).astype(dtype) \
        .reshape(shape)


def test_each_batch_is_one_group_of_its_sends_and_receives(run, emu, traced):
    cp = emu.cupy

    def fn(comm):
        r, ops, sent, outs = comm.rank, [], {}, {}
        for direction in GRID:  # every send before every receive in the list
            sent[direction] = cp.asarray(_face(r, direction))
            ops.append(gc.P2POp("send", sent[direction], _neighbour(r, direction)))
        for direction in GRID:
            expected = _face(0, direction)
            outs[direction] = cp.zeros(expected.shape, dtype=expected.dtype)
            ops.append(gc.P2POp("recv", outs[direction], _neighbour(r, OPPOSITE[direction])))
        before = len(traced[threading.get_ident()])
        works = comm.batch_isend_irecv(ops)
        assert traced[threading.get_ident()][before:] == \
            ["groupStart"] + ["send"] * 4 + ["recv"] * 4 + ["groupEnd"]
        calls = _calls(emu, comm)[-8:]
        assert [(name, args["ptr"], args["nbytes"], args["peer"]) for name, args in calls] == \
            [("send", op.array.data.ptr, op.array.nbytes, op.peer) for op in ops[:4]] + \
            [("recv", op.array.data.ptr, op.array.nbytes, op.peer) for op in ops[4:]]
        assert all(args["datatype"] == emu.nccl.NCCL_UINT8 for _, args in calls)
        for work in works:
            work.synchronize()
        return {d: out.get() for d, out in outs.items()}, comm._seq, comm._p2p_seq

    for r, (got, seq, p2p_seq) in enumerate(run(4, fn)):
        for direction in GRID:
            np.testing.assert_array_equal(
                got[direction], _face(_neighbour(r, OPPOSITE[direction]), direction))
        assert (seq, p2p_seq) == (0, 1)  # one point-to-point number for the whole batch


def test_the_works_share_one_cuda_work_on_the_callers_stream(run, emu):
    cp = emu.cupy

    def fn(comm):
        peer = 1 - comm.rank
        stream = cp.cuda.Stream()
        outs = [cp.zeros(4, dtype=cp.float64), cp.zeros(2, dtype=cp.int8)]
        works = comm.batch_isend_irecv([
            gc.P2POp("recv", outs[0], peer), gc.P2POp(comm.isend, cp.arange(4.0) + comm.rank, peer),
            gc.P2POp(comm.irecv, outs[1], peer),
            gc.P2POp("send", cp.full(2, comm.rank, dtype=cp.int8), peer)], stream=stream)
        shared = {id(work._batch) for work in works}
        batch = works[0]._batch
        assert len(shared) == 1 and isinstance(batch, CudaWork)
        assert (batch.op, batch.seq) == ("batch_isend_irecv", 1)
        assert _calls(emu, comm)[-1][0] == "recv"
        assert works[1].wait() is True  # orders the current stream after the whole batch
        assert works[3].synchronize() and all(work.is_completed() for work in works)
        assert works[0].result() is outs[0] and works[2].result() is outs[1]
        assert works[1].result() is None and works[0].exception() is None
        return [out.get().tolist() for out in outs], repr(works[2])

    results = run(2, fn)
    for r, (outs, text) in enumerate(results):
        assert outs == [[float(i + 1 - r) for i in range(4)], [1 - r] * 2]
        assert text.startswith(f"<Work batch_isend_irecv #1 ops[2] recv from {1 - r} rank {r}")


def test_usage_errors_enqueue_nothing(run, emu):
    cp = emu.cupy

    def fn(comm):
        peer = 1 - comm.rank
        before = len(_calls(emu, comm))
        texts = []
        for ops in ([gc.P2POp("recv", cp.zeros(3), peer), gc.P2POp("send", np.zeros(3), peer)],
                    [gc.P2POp("send", cp.zeros(3), peer), gc.P2POp("recv", cp.zeros(3), 2)]):
            with pytest.raises((TypeError, ValueError)) as caught:
                comm.batch_isend_irecv(ops)
            texts.append(f"{caught.type.__name__}: {caught.value}")
        assert len(_calls(emu, comm)) == before and comm._p2p_seq == 0
        out = cp.zeros(3)
        comm.batch_isend_irecv([gc.P2POp("send", cp.full(3, comm.rank + 1.0), peer),
                                gc.P2POp("recv", out, peer)])[1].synchronize()
        return texts, out.get().tolist()

    for r, (texts, out) in enumerate(run(2, fn)):
        assert texts[0].startswith(f"TypeError: batch_isend_irecv: ops[1] (send with peer "
                                   f"{1 - r}): array is a NumPy array (host memory)"), texts
        assert texts[1].startswith("ValueError: batch_isend_irecv: ops[1] (recv with peer 2): "
                                   "peer=2 is out of range"), texts
        assert out == [2.0 - r] * 3


def test_arrays_come_back_as_the_caller_passed_them(run, emu):
    cp = emu.cupy

    def fn(comm):
        peer = 1 - comm.rank
        out = _Foreign(cp.zeros(3, dtype=cp.int32))
        works = comm.batch_isend_irecv([
            gc.P2POp("send", _Foreign(cp.full(3, comm.rank + 5, dtype=cp.int32)), peer),
            gc.P2POp("recv", out, peer)])
        return works[1].result() is out, out._array.get().tolist(), works[0].result()

    for r, (same, values, sent) in enumerate(run(2, fn)):
        assert same and values == [6 - r] * 3 and sent is None
