"""Bad input and broken peers: clear errors, raised in time, nothing lost, never a hang."""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from mp_harness import run_ranks, shared_pool

pytestmark = pytest.mark.timeout(120)


# ---------------------------------------------------------------- usage errors (eager)
def _raises(fn, *args, **kwargs):
    try:
        fn(*args, **kwargs)
    except (ValueError, TypeError) as exc:
        return type(exc).__name__, str(exc)
    return None


def rank_usage_errors(comm):
    n = comm.size
    x = np.arange(4, dtype=np.float32)
    ro = np.arange(4, dtype=np.float32)
    ro.flags.writeable = False
    strided = np.arange(8, dtype=np.float32)[::2]
    errors = {
        "root_high": _raises(comm.broadcast, x, root=n),
        "root_negative": _raises(comm.reduce, x, root=-1),
        "root_type": _raises(comm.gather, x, root="0"),
        "dst_range": _raises(comm.send, x, n + 3),
        "src_self": _raises(comm.recv, x, comm.rank),
        "out_shape": _raises(comm.all_reduce, x, out=np.empty(5, np.float32)),
        "out_dtype": _raises(comm.all_reduce, x, out=np.empty(4, np.float64)),
        "out_readonly": _raises(comm.all_reduce, x, out=ro),
        "inplace_readonly": _raises(comm.all_reduce, ro),
        "noncontiguous": _raises(comm.all_reduce, strided),
        "not_array": _raises(comm.all_reduce, [1.0, 2.0]),
        "bad_dtype": _raises(comm.all_reduce, np.array(["a", "b"])),
        "bad_op": _raises(comm.all_reduce, x, op="median"),
        "band_float": _raises(comm.all_reduce, x, op="band"),
        "max_complex": _raises(comm.all_reduce, np.ones(2, np.complex64), op="max"),
        "avg_bool": _raises(comm.all_reduce, np.ones(2, bool), op="avg"),
        "reduce_scatter_shape": _raises(comm.reduce_scatter, np.ones((n + 1, 2), np.float32)),
        "all_gather_out": _raises(comm.all_gather, x, out=np.empty((n, 5), np.float32)),
        "all_to_all_shape": _raises(comm.all_to_all, np.ones((n + 2,), np.float32)),
        "scatter_nonroot": (_raises(comm.scatter, None, root=0) if comm.rank != 0 else "root"),
        "tag": _raises(comm.send, x, (comm.rank + 1) % max(n, 2) if n > 1 else 0, tag=-1),
        "group": _raises(comm.new_group, [0, 0]),
        "barrier_timeout": _raises(comm.barrier, timeout=0),
    }
    # nothing was sent: the communicator still works and sequence numbers still agree
    y = np.full(3, comm.rank + 1.0)
    comm.all_reduce(y)
    return errors, y.tolist()


def test_usage_errors_are_eager_and_lose_nothing():
    results = shared_pool(2).run(rank_usage_errors)  # the errors leave the communicator usable
    for rank, (errors, after) in enumerate(results):
        assert after == [3.0, 3.0, 3.0]
        for name, error in errors.items():
            if error == "root":
                continue
            assert error is not None, f"rank {rank}: {name} raised nothing"
        assert errors["root_high"] == ("ValueError", "root=2 is out of range for a communicator of size 2")
        assert "-1" in errors["root_negative"][1]
        assert errors["root_type"][0] == "TypeError"
        assert "dst=5" in errors["dst_range"][1]
        assert "this rank" in errors["src_self"][1]
        assert "(5,)" in errors["out_shape"][1] and "(4,)" in errors["out_shape"][1]
        assert errors["out_dtype"][0] == "TypeError" and "float64" in errors["out_dtype"][1]
        assert "read-only" in errors["out_readonly"][1]
        assert "read-only" in errors["inplace_readonly"][1]
        assert "C-contiguous" in errors["noncontiguous"][1]
        assert errors["not_array"][0] == "TypeError" and "list" in errors["not_array"][1]
        assert errors["bad_dtype"][0] == "TypeError" and "<U1" in errors["bad_dtype"][1] or \
            "str" in errors["bad_dtype"][1]
        assert "median" in errors["bad_op"][1]
        assert "float32" in errors["band_float"][1]
        assert "complex64" in errors["max_complex"][1]
        assert "bool" in errors["avg_bool"][1]
        assert "(3, 2)" in errors["reduce_scatter_shape"][1]
        assert "(2, 5)" in errors["all_gather_out"][1]
        assert "tag" in errors["tag"][1]
        assert "distinct" in errors["group"][1]


# ---------------------------------------------------------------- mismatches across ranks
def rank_mismatched_shapes(comm):
    from gpucoll import CollectiveMismatchError, GpucollError

    x = np.ones(10 if comm.rank == 0 else 12, np.float32)
    try:
        comm.all_reduce(x)
    except GpucollError as exc:
        return type(exc).__name__, str(exc), isinstance(exc, CollectiveMismatchError)
    return None


@pytest.mark.parametrize("debug", ["0", "1"])
def test_mismatched_shapes_raise_never_silent(debug):
    results = run_ranks(rank_mismatched_shapes, 2, env={"GPUCOLL_DEBUG": debug,
                                                        "GPUCOLL_TIMEOUT": "10"})
    assert all(r is not None for r in results), results
    # at least the rank that saw the bad header names the mismatch; the other sees it fail
    assert any(r[2] for r in results), results
    if debug == "1":
        for name, message, is_mismatch in results:
            assert is_mismatch, message
            assert "shape=(10,)" in message and "shape=(12,)" in message
            assert "all_reduce #1" in message


def rank_mismatched_ops(comm):
    from gpucoll import GpucollError

    x = np.ones(4, np.float32)
    try:
        if comm.rank == 1:
            comm.broadcast(x, root=0)
        else:
            comm.all_reduce(x)
        comm.all_reduce(np.ones(1))
    except GpucollError as exc:
        return type(exc).__name__, str(exc)
    return None


def test_debug_mode_names_the_odd_rank():
    results = run_ranks(rank_mismatched_ops, 3, env={"GPUCOLL_DEBUG": "1", "GPUCOLL_TIMEOUT": "10"})
    for name, message in results:
        assert name == "CollectiveMismatchError", message
        assert "rank 1 called broadcast #1" in message
        assert "all_reduce #1" in message and "rank 0 (and 1 more)" in message


def rank_root_disagreement(comm):
    from gpucoll import GpucollError

    x = np.full(4, float(comm.rank))
    try:
        comm.broadcast(x, root=comm.rank)  # every rank believes it is the root
    except GpucollError as exc:  # shared memory: every rank sees the others' headers
        return "broadcast", type(exc).__name__, str(exc)
    try:  # sockets: nobody receives, which close() notices
        comm.close(timeout=10)
    except GpucollError as exc:
        return "close", type(exc).__name__, str(exc)
    return None


@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_root_disagreement_surfaces(transport):
    results = run_ranks(rank_root_disagreement, 2, env={"GPUCOLL_TIMEOUT": "10",
                                                        "GPUCOLL_TRANSPORT": transport})
    for rank, result in enumerate(results):
        assert result is not None, f"rank {rank}: the disagreement went unnoticed"
        where, name, message = result
        assert name == "CollectiveMismatchError", message
        assert "broadcast #1" in message
        if transport == "socket":
            assert where == "close" and "never received" in message, message
        else:
            assert where == "broadcast" and "root 0" in message and "root 1" in message, message


# ---------------------------------------------------------------- dead and slow ranks
def rank_dies_mid_collective(comm):
    from gpucoll import CommAbortedError, GpucollError, PeerError

    x = np.ones(1 << 20, np.float32)
    comm.all_reduce(x)  # one good round first
    if comm.rank == 1:
        os._exit(17)  # dies without a word, before the next collective completes
    start = time.monotonic()
    try:
        for _ in range(3):
            comm.all_reduce(x)
    except PeerError as exc:
        error = ("PeerError", str(exc), exc.peer)
    except GpucollError as exc:
        error = (type(exc).__name__, str(exc), getattr(exc, "peer", None))
    else:
        return None
    elapsed = time.monotonic() - start
    try:
        comm.all_reduce(x)
        after = None
    except CommAbortedError as exc:
        after = str(exc)
    return error, elapsed, after


@pytest.mark.parametrize("transport", ["socket", "shm"])
@pytest.mark.parametrize("world_size", [2, 4])
def test_dead_rank_raises_on_every_survivor(world_size, transport):
    survivors = [r for r in range(world_size) if r != 1]
    results = run_ranks(rank_dies_mid_collective, world_size,
                        env={"GPUCOLL_TIMEOUT": "20", "GPUCOLL_TRANSPORT": transport},
                        timeout=60, ranks=survivors)
    for r, outcome in zip(survivors, results):
        assert outcome is not None, f"rank {r} completed all_reduce with a dead peer"
        (name, message, peer), elapsed, after = outcome
        assert name in ("PeerError", "CommAbortedError"), message
        assert f"rank {r}" in message and "all_reduce #" in message, message
        assert elapsed < 15, f"rank {r} took {elapsed:.1f} s to notice"
        assert after is not None and "aborted" in after
    # the rank next to the dead one names it as the peer
    direct = [outcome for outcome in results if outcome[0][2] == 1]
    assert direct, results


def rank_timeout(comm):
    from gpucoll import CommTimeoutError

    if comm.rank == 1:
        time.sleep(30)  # never calls the collective in time (ended once rank 0 answered)
        return None
    start = time.monotonic()
    try:
        comm.all_reduce(np.ones(4))
    except CommTimeoutError as exc:
        return str(exc), exc.peer, exc.op, exc.seq, time.monotonic() - start
    return "no error"


def test_timeout_names_op_seq_and_peer():
    results = run_ranks(rank_timeout, 2, env={"GPUCOLL_TIMEOUT": "1"}, timeout=30, ranks=[0])
    message, peer, op, seq, elapsed = results[0]
    assert (peer, op, seq) == (1, "all_reduce", 1)
    assert "rank 0: all_reduce #1 timed out waiting for peer(s) [1]" in message
    assert 0.9 < elapsed < 5


def rank_never_joins(rank, size, url):
    import gpucoll
    from gpucoll import CommTimeoutError

    if rank == 2:
        return None  # never calls init
    try:
        gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=2)
    except CommTimeoutError as exc:
        return str(exc)
    return "joined?"


def test_missing_rank_is_named_at_init():
    results = run_ranks(rank_never_joins, 3, init=False, timeout=30)
    for rank in (0, 1):
        assert "rank(s) [2] of 3 did not join within 2 s" in results[rank], results[rank]


def rank_wrong_token(rank, size, url):
    import gpucoll
    from gpucoll import AuthenticationError, GpucollError

    if rank == 1:
        os.environ["GPUCOLL_AUTH_TOKEN"] = "not-the-job-token"
    try:
        comm = gpucoll.init(backend="cpu", rank=rank, world_size=size, url=url, timeout=3)
    except AuthenticationError as exc:
        return "AuthenticationError", str(exc)
    except GpucollError as exc:
        return type(exc).__name__, str(exc)
    comm.close()
    return "joined"


def test_wrong_token_is_refused():
    results = run_ranks(rank_wrong_token, 2, init=False, timeout=30)
    assert results[1][0] == "AuthenticationError", results[1]
    assert "the authentication token differs from node 0's" in results[1][1], results[1]
    # rank 0 learns it from the store at once, instead of timing out waiting for rank 1
    assert results[0][0] == "AuthenticationError" and "rank(s) [1] of 2 cannot join" in \
        results[0][1] and "differs from node 0's" in results[0][1], results[0]


def rank_abort(comm):
    from gpucoll import CommAbortedError

    x = np.ones(4)
    comm.all_reduce(x)
    comm.abort()
    try:
        comm.all_reduce(x)
    except CommAbortedError as exc:
        return str(exc)
    return None


def test_abort_fails_later_calls():
    results = run_ranks(rank_abort, 2, timeout=30)
    for rank, message in enumerate(results):
        assert message is not None and f"rank {rank}" in message and "abort" in message


def rank_dtype_mismatch(comm):
    import numpy as np

    from gpucoll import CollectiveMismatchError

    x = np.ones(4, np.float32 if comm.rank == 0 else np.int32)  # same bytes, other dtype
    try:
        comm.all_reduce(x)
    except CollectiveMismatchError as exc:
        return str(exc)
    return "no error"


def test_mismatch_names_op_and_dtypes_without_debug(monkeypatch):
    monkeypatch.delenv("GPUCOLL_DEBUG", raising=False)
    messages = run_ranks(rank_dtype_mismatch, 2, timeout=30)
    joined = "\n".join(messages)
    assert "float32" in joined and "int32" in joined, messages
    assert "all_reduce #" in joined and "dtype code" not in joined, messages
