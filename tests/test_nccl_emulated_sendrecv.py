"""``sendrecv`` on the NCCL backend over the CUDA emulation (tests/emulated_cuda/): one
``groupStart`` / ``ncclSend`` / ``ncclRecv`` / ``groupEnd`` per call, with the right pointers,
byte counts and peers; values in a ring; its ``CudaWork``; arrays handed back.

The emulation runs a lone ``ncclSend`` until its receiver takes the message, as NCCL does with
a large one, so a ring in which every rank sends first completes only when each send is
grouped with its receive. Ranks are threads (see tests/nccl_emulated_harness.py).
"""

import threading

import numpy as np
import pytest

from gpucoll.backends.nccl import CudaWork

from nccl_emulated_harness import _calls, _Foreign, emu, run, traced  # noqa: F401

pytestmark = pytest.mark.timeout(60)

GROUPED = ["groupStart", "send", "recv", "groupEnd"]


def _message(rank, n):
    """What ``rank`` sends: shape and dtype its own, so a rank's x and out differ."""
    dtype = ("float32", "int64", "uint8")[rank % 3]
    return (np.arange(6 + rank) + 100 * rank).astype(dtype).reshape(1, 6 + rank)


@pytest.mark.parametrize("n", [2, 3])
def test_each_sendrecv_is_one_group_of_one_send_and_one_receive(run, emu, traced, n):
    cp = emu.cupy

    def fn(comm):
        r = comm.rank
        right, left = (r + 1) % n, (r - 1) % n
        x = cp.asarray(_message(r, n))
        got = {}
        for name, dst, src in (("from left", right, left), ("from right", left, right)):
            out = cp.zeros(_message(src, n).shape, dtype=_message(src, n).dtype)
            before = len(traced[threading.get_ident()])
            assert comm.sendrecv(x, dst, out, src, tag=3) is out
            assert traced[threading.get_ident()][before:] == GROUPED
            (_, sent), (_, received) = _calls(emu, comm)[-2:]
            assert (sent["ptr"], sent["nbytes"], sent["peer"]) == (x.data.ptr, x.nbytes, dst)
            assert (received["ptr"], received["nbytes"], received["peer"]) == \
                (out.data.ptr, out.nbytes, src)
            assert sent["datatype"] == received["datatype"] == emu.nccl.NCCL_UINT8
            got[name] = out.get()
        return got, comm._seq, comm._p2p_seq

    for r, (got, seq, p2p_seq) in enumerate(run(n, fn)):
        np.testing.assert_array_equal(got["from left"], _message((r - 1) % n, n))
        np.testing.assert_array_equal(got["from right"], _message((r + 1) % n, n))
        assert (seq, p2p_seq) == (0, 2)  # one point-to-point number per call, no collective one


def test_async_sendrecv_is_a_cuda_work(run, emu):
    cp = emu.cupy

    def fn(comm):
        peer = 1 - comm.rank
        stream = cp.cuda.Stream()
        out = cp.zeros(4, dtype=cp.float64)
        work = comm.sendrecv(cp.arange(4, dtype=cp.float64) + 10 * comm.rank, peer, out, peer,
                             async_op=True, stream=stream)
        assert isinstance(work, CudaWork) and (work.op, work.seq) == ("sendrecv", 1)
        assert work.wait() is True  # orders the current stream after the exchange
        assert work.synchronize() and work.is_completed() and work.exception() is None
        assert work.result() is out
        return out.get()

    results = run(2, fn)
    np.testing.assert_array_equal(results[0], np.arange(4.0) + 10)
    np.testing.assert_array_equal(results[1], np.arange(4.0))


def test_arrays_come_back_as_the_caller_passed_them(run, emu):
    cp = emu.cupy

    def fn(comm):
        peer = 1 - comm.rank
        out = _Foreign(cp.zeros(3, dtype=cp.int32))
        result = comm.sendrecv(_Foreign(cp.full(3, comm.rank + 5, dtype=cp.int32)), peer, out,
                               peer)
        work = comm.sendrecv(cp.full(2, comm.rank, dtype=cp.int16), peer,
                             _Foreign(cp.zeros(2, dtype=cp.int16)), peer, async_op=True)
        return result is out, out._array.get().tolist(), type(work.result()).__name__

    for r, (same, values, work_type) in enumerate(run(2, fn)):
        assert same and values == [6 - r] * 3 and work_type == "_Foreign"


def test_object_messages_go_through_device_buffers(run, emu):
    """``send_object`` / ``recv_object`` on NCCL: the length and the bytes as two ncclSend /
    ncclRecv of device buffers, the value decoded on the host; in order per pair."""
    def fn(comm):
        if comm.rank == 0:
            comm.send_object({"step": 3, "w": np.arange(5.0)}, 1, tag=2)
            comm.send_object("after", 1, tag=2)
            return [n for n, _ in _calls(emu, comm)]
        return [comm.recv_object(0, tag=2), comm.recv_object(0, tag=2),
                [n for n, _ in _calls(emu, comm)]]

    sent, (first, second, received) = run(2, fn)
    assert first["step"] == 3 and first["w"].tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    assert second == "after"
    assert sent.count("send") == 4 and received.count("recv") == 4


def test_a_first_receive_grouped_after_sends_needs_the_peers_connected_first(run, emu):
    """NCCL connects two ranks lazily, inside the host call of their first send / receive
    (the emulation does too). Rank 0 sends twice, then groups its first receive from rank 1
    with a third send; rank 1 sends only after that third message arrived: rank 0's
    ``groupEnd`` waits for rank 1's first send, which waits for it (GPipe on two stages hung
    so on an H100). The watchdog ends it; with ``connect_peers`` first it runs."""
    cp = emu.cupy

    def exchange(comm, connect):
        if connect:
            comm.connect_peers([1 - comm.rank])
        if comm.rank == 0:
            comm.isend(cp.full(2, 1.0), 1)
            comm.isend(cp.full(2, 2.0), 1)
            got = comm.sendrecv(cp.full(2, 3.0), 1, cp.zeros(2), 1)
            return got.get().tolist()
        got = [comm.recv(cp.zeros(2), 0).get().tolist() for _ in range(3)]
        comm.send(cp.full(2, 9.0), 0)
        return got

    assert run(2, lambda comm: exchange(comm, True)) == \
        [[9.0, 9.0], [[1.0, 1.0], [2.0, 2.0], [3.0, 3.0]]]

    def hangs(comm):
        if comm.rank == 1:  # waits longer: rank 0's watchdog ends the hang, not rank 1's abort
            comm.timeout = 5.0
        try:
            exchange(comm, False)
        except Exception as exc:
            return type(exc).__name__, str(exc)
        return None

    results = run(2, hangs, timeout=0.5)
    assert results[0][0] == "CommTimeoutError", results
    assert "rank 0: sendrecv #3 did not complete on GPU 0 within 0.5 s (peer rank 1)" \
        in results[0][1], results
    assert results[1] is not None, results  # rank 1 waits for its third message in vain
