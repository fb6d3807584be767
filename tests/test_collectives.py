"""The conformance suite: every collective against a NumPy reference, on every backend.

One body of tests runs on each cluster of ``clusters.py``: the CPU backend over Unix and TCP
sockets in real processes (world sizes 1-4 and 2-3), the NCCL backend over the CUDA emulation
(1-3 ranks as threads) and on a real GPU when there is one. Counts 0, 1, a prime and a
multi-chunk size (beyond the ring threshold and the pipelining chunk); every root; in place
and ``out=``; every op and dtype family the backend reduces (``scan`` / ``exscan``: every op
but avg on every dtype, bfloat16 too, since they combine with the array's own module). Ranks return their outputs (as
NumPy); the test recomputes the expected ones with NumPy.
"""

from __future__ import annotations

import numpy as np
import pytest

from clusters import CLUSTERS
from mp_harness import RankPool
from reference import ALL_DTYPES, OPS, assert_equal_result, make_input, op_valid, reduce_reference
from scan_cases import rank_scans, scan_expected
from shared_clusters import shared_cluster_pools

pytestmark = pytest.mark.timeout(300)

COUNTS = [0, 1, 13, 100_003]
BIG = 100_003


pool = shared_cluster_pools(CLUSTERS)


def _host_only(pool):
    if pool.kind != "numpy":
        pytest.skip(f"{pool.name}: the emulation runs a lone NCCL send synchronously, so a ring of "
                    f"sends cannot be emulated; NCCL point-to-point is tested in test_nccl_emulated")


# ---------------------------------------------------------------- rank-side functions
def rank_all_reduce(comm, arr, cases):
    out = {}
    for case_id, shape, dtype, op, mode in cases:
        keep = make_input(case_id, comm.rank, shape, dtype, op)
        x = arr.dev(keep.copy())
        if mode == "inplace":
            result = comm.all_reduce(x, op=op)
            assert result is x
        else:
            target = arr.dev(np.full(shape, 77, dtype=dtype))
            result = comm.all_reduce(x, op=op, out=target)
            assert result is target
            np.testing.assert_array_equal(arr.host(x), keep)  # input untouched out of place
        out[case_id] = arr.host(result)
    return out


def rank_rooted(comm, arr, name, cases):
    out = {}
    for case_id, shape, dtype, op, root, mode in cases:
        keep = make_input(case_id, comm.rank, shape, dtype, op)
        if name == "broadcast":
            x = arr.dev(keep if comm.rank == root else np.zeros_like(keep))
            result = comm.broadcast(x, root=root)
            assert result is x
        elif name == "reduce":
            x = arr.dev(keep.copy())
            target = arr.zeros(shape, dtype) if mode == "out" else None
            result = comm.reduce(x, root=root, op=op, out=target)
            if comm.rank != root:
                assert result is None
                np.testing.assert_array_equal(arr.host(x), keep)  # non-roots keep their input
            elif mode == "out":
                assert result is target
                np.testing.assert_array_equal(arr.host(x), keep)
            else:
                assert result is x
        elif name == "gather":
            target = arr.zeros((comm.size,) + tuple(shape), dtype) if mode == "out" else None
            result = comm.gather(arr.dev(keep), root=root, out=target)
            if comm.rank != root:
                assert result is None
            elif mode == "out":
                assert result is target
        elif name == "scatter":
            full = np.stack([make_input(case_id, r, shape, dtype, op) for r in range(comm.size)])
            if comm.rank == root:
                target = arr.zeros(shape, dtype) if mode == "out" else None
                result = comm.scatter(arr.dev(full), root=root, out=target)
            else:  # non-roots pass only the chunk buffer
                result = comm.scatter(None, root=root, out=arr.zeros(shape, dtype))
            assert result.shape == tuple(shape)
        out[case_id] = arr.host(result)
    return out


def rank_gather_like(comm, arr, name, cases):
    out = {}
    for case_id, shape, dtype, op, mode in cases:
        if name == "all_gather":
            x = arr.dev(make_input(case_id, comm.rank, shape, dtype, op))
            target = arr.zeros((comm.size,) + tuple(shape), dtype) if mode == "out" else None
            result = comm.all_gather(x, out=target)
        elif name == "reduce_scatter":
            keep = make_input(case_id, comm.rank, (comm.size,) + tuple(shape), dtype, op)
            x = arr.dev(keep.copy())
            target = arr.zeros(shape, dtype) if mode == "out" else None
            result = comm.reduce_scatter(x, op=op, out=target)
            np.testing.assert_array_equal(arr.host(x), keep)
        else:  # all_to_all
            x = arr.dev(make_input(case_id, comm.rank, (comm.size,) + tuple(shape), dtype, op))
            target = arr.zeros((comm.size,) + tuple(shape), dtype) if mode == "out" else None
            result = comm.all_to_all(x, out=target)
        if target is not None:
            assert result is target
        out[case_id] = arr.host(result)
    return out


# ---------------------------------------------------------------- helpers
def _numpy(comm, fn, *args):
    """For the socket-level tests that run on a plain RankPool: ``fn`` with NumPy arrays."""
    from clusters import Arrays

    return fn(comm, Arrays("numpy"), *args)


def _check(results, expected_of, cases, op_index=3):
    for rank, by_case in enumerate(results):
        for case in cases:
            expected = expected_of(case, rank)
            if expected is None:
                assert by_case[case[0]] is None, f"rank {rank} case {case}: expected None"
                continue
            assert_equal_result(by_case[case[0]], expected, f"rank {rank} case {case}",
                                op=case[op_index])


def _stack(case_id, size, shape, dtype, op):
    return np.stack([make_input(case_id, r, shape, dtype, op) for r in range(size)])


# ---------------------------------------------------------------- tests
def test_all_reduce_every_op_and_dtype(pool):
    cases, case_id = [], 1000
    for dtype in ALL_DTYPES:
        for op in OPS:
            if not op_valid(op, dtype) or not pool.reduces(op, dtype):
                continue
            for count in (0, 1, 13):
                case_id += 1
                cases.append((case_id, (count,), dtype, op, "inplace" if case_id % 2 else "out"))
    results = pool.run(rank_all_reduce, cases)
    _check(results, lambda c, r: reduce_reference(_stack(c[0], pool.world_size, c[1], c[2], c[3]),
                                                  c[3]), cases)
    # every rank holds bitwise-identical results
    for case in cases:
        for rank in range(1, pool.world_size):
            assert results[rank][case[0]].tobytes() == results[0][case[0]].tobytes()


def test_all_reduce_large_multi_chunk(pool):
    cases = []
    for i, (dtype, op) in enumerate([("float32", "sum"), ("float64", "avg"), ("int32", "max"),
                                     ("int64", "bxor"), ("float16", "sum"), ("uint8", "min"),
                                     ("complex64", "prod")]):
        cases.append((2000 + i, (BIG,), dtype, op, "inplace" if i % 2 else "out"))
    cases.append((2100, (317, 331), "float32", "sum", "inplace"))  # 2-D, 420 KB
    cases = [case for case in cases if pool.reduces(case[3], case[2])]
    results = pool.run(rank_all_reduce, cases)
    _check(results, lambda c, r: reduce_reference(_stack(c[0], pool.world_size, c[1], c[2], c[3]),
                                                  c[3]), cases)
    for case in cases:
        for rank in range(1, pool.world_size):
            assert results[rank][case[0]].tobytes() == results[0][case[0]].tobytes()


def test_all_reduce_forced_algorithms():
    """Both all-reduce algorithms over real sockets at a non-power-of-two size."""
    for algorithm in ("ring", "recursive_doubling"):
        pool = RankPool(3, env={"GPUCOLL_ALGORITHM": f"all_reduce={algorithm}"})
        try:
            cases = [(3000 + c, (c,), "float32", "sum", "inplace") for c in (0, 1, 13, BIG)]
            cases += [(3100 + c, (c,), "int16", "max", "out") for c in (2, 7, BIG)]
            results = pool.run(_numpy, rank_all_reduce, cases)
            _check(results, lambda c, r: reduce_reference(_stack(c[0], 3, c[1], c[2], c[3]), c[3]),
                   cases)
        finally:
            pool.close()


def test_bandwidth_algorithms_over_sockets():
    """The large-message algorithms forced at small sizes, over real sockets, 3 and 4 ranks."""
    override = ("broadcast=scatter_allgather,reduce=ring,all_gather=ring,reduce_scatter=ring,"
                "all_reduce=ring")
    for n in (3, 4):
        pool = RankPool(n, env={"GPUCOLL_ALGORITHM": override})
        try:
            for name in ("broadcast", "reduce"):
                cases = [(8000 + 10 * root + i, (count,), "float64", "sum", root, "out")
                         for root in range(n) for i, count in enumerate((0, 1, 13, 1001))]
                results = pool.run(_numpy, rank_rooted, name, cases)
                for rank, by_case in enumerate(results):
                    for case_id, shape, dtype, op, root, _ in cases:
                        if name == "broadcast":
                            expected = make_input(case_id, root, shape, dtype, op)
                        elif rank == root:
                            expected = reduce_reference(_stack(case_id, n, shape, dtype, op), op)
                        else:
                            assert by_case[case_id] is None
                            continue
                        assert_equal_result(by_case[case_id], expected, f"{name} {case_id}")
            cases = [(8500 + c, (c,), "int32", "sum", "out") for c in (0, 1, 13, 1001)]
            for name in ("all_gather", "reduce_scatter"):
                results = pool.run(_numpy, rank_gather_like, name, cases)
                for rank, by_case in enumerate(results):
                    for case_id, shape, dtype, op, _ in cases:
                        if name == "all_gather":
                            expected = _stack(case_id, n, shape, dtype, op)
                        else:
                            full = [make_input(case_id, r, (n,) + shape, dtype, op) for r in range(n)]
                            expected = reduce_reference(np.stack([f[rank] for f in full]), op)
                        assert_equal_result(by_case[case_id], expected, f"{name} {case_id}")
        finally:
            pool.close()


@pytest.mark.parametrize("name", ["broadcast", "reduce", "gather", "scatter"])
def test_rooted_collectives_every_root(pool, name):
    n = pool.world_size
    cases, case_id = [], 4000
    for root in range(n):
        for count in COUNTS:
            for dtype, op in (("float32", "sum"), ("int64", "max"), ("bool", "sum")):
                if count == BIG and dtype != "float32":
                    continue
                case_id += 1
                shape = (count,) if case_id % 3 else (1, count)
                cases.append((case_id, shape, dtype, op, root, "out" if case_id % 2 else "inplace"))
    if name == "reduce":
        cases += [(4900 + i, (13,), "int32", op, i % n, "out") for i, op in
                  enumerate(["prod", "min", "avg", "band", "bor", "bxor"])]
        cases = [case for case in cases if pool.reduces(case[3], case[2])]
    results = pool.run(rank_rooted, name, cases)

    def expected(case, rank):
        case_id, shape, dtype, op, root, _ = case
        if name == "broadcast":
            return make_input(case_id, root, shape, dtype, op)
        if name == "reduce":
            if rank != root:
                return None
            return reduce_reference(_stack(case_id, n, shape, dtype, op), op)
        if name == "gather":
            return _stack(case_id, n, shape, dtype, op) if rank == root else None
        return make_input(case_id, rank, shape, dtype, op)  # scatter: block `rank`

    _check(results, expected, cases)


@pytest.mark.parametrize("name", ["all_gather", "reduce_scatter", "all_to_all"])
def test_gather_like_collectives(pool, name):
    n = pool.world_size
    cases, case_id = [], 5000
    for count in (0, 1, 13, BIG // n):
        for dtype in ("float32", "int8", "complex128", "bool"):
            for op in (["sum", "max", "bxor", "avg"] if name == "reduce_scatter" else ["sum"]):
                if not op_valid(op, dtype) or (count > 13 and dtype != "float32"):
                    continue
                if name == "reduce_scatter" and not pool.reduces(op, dtype):
                    continue
                case_id += 1
                shape = (count,) if case_id % 2 else (1, count)
                cases.append((case_id, shape, dtype, op, "out" if case_id % 3 else "new"))
    results = pool.run(rank_gather_like, name, cases)

    def expected(case, rank):
        case_id, shape, dtype, op, _ = case
        if name == "all_gather":
            return _stack(case_id, n, shape, dtype, op)
        full = [make_input(case_id, r, (n,) + tuple(shape), dtype, op) for r in range(n)]
        if name == "reduce_scatter":
            return reduce_reference(np.stack([f[rank] for f in full]), op)
        return np.stack([full[src][rank] for src in range(n)])  # all_to_all

    _check(results, expected, cases)


def rank_composites(comm, arr):
    r = comm.rank
    obj = comm.broadcast_object({"from": r, "cfg": [1.5, "x"]} if r == 0 else None)
    everyone = comm.all_gather_object((r, "rank"))
    rows, counts = comm.all_gather_v(arr.dev(np.full((r + 1, 2), r, np.int32)))
    rooted, _ = comm.gather_v(arr.dev(np.full(r, r, np.float32)), root=0)
    return obj, everyone, arr.host(rows), counts, None if rooted is None else arr.host(rooted)


def test_composite_collectives_on_every_backend(pool):
    """The object collectives and uneven gathers, built on the public collectives, run on every
    backend (they allocate through the backend's own memory helpers)."""
    n = pool.world_size
    for rank, (obj, everyone, rows, counts, rooted) in enumerate(pool.run(rank_composites)):
        assert obj == {"from": 0, "cfg": [1.5, "x"]}
        assert everyone == [(q, "rank") for q in range(n)]
        assert counts == [q + 1 for q in range(n)]
        np.testing.assert_array_equal(rows, np.concatenate(
            [np.full((q + 1, 2), q, np.int32) for q in range(n)]))
        if rank == 0:
            np.testing.assert_array_equal(rooted, np.concatenate(
                [np.full(q, q, np.float32) for q in range(n)]))
        else:
            assert rooted is None


def _send_matrix(case_id: int, n: int) -> np.ndarray:
    """Rows rank s sends rank d in an all_to_all_v case: zeros, uneven, one large block."""
    matrix = np.random.default_rng(case_id).integers(0, 6, (n, n))
    if case_id % 3 == 0:
        matrix[n - 1, 0] = 30_000  # one large block (padding would be n times the rest)
    return matrix


def rank_all_to_all_v(comm, arr, cases):
    out = {}
    for case_id, rest, dtype in cases:
        matrix = _send_matrix(case_id, comm.size)
        keep = make_input(case_id, comm.rank, (int(matrix[comm.rank].sum()),) + rest, dtype)
        x = arr.dev(keep.copy())
        result, recv = comm.all_to_all_v(x, [int(c) for c in matrix[comm.rank]])
        known, known_recv = comm.all_to_all_v(x, counts=matrix)  # nothing exchanged first
        np.testing.assert_array_equal(arr.host(x), keep)  # the input is never touched
        assert known_recv == recv
        np.testing.assert_array_equal(arr.host(known), arr.host(result))
        out[case_id] = (arr.host(result), recv)
    return out


def test_all_to_all_v(pool):
    """Uneven all-to-all: exact on NCCL (grouped sends and receives) and through shared memory
    with single-copy reads, padded elsewhere; the same rows either way."""
    n = pool.world_size
    cases = [(7000 + i, rest, dtype) for i, (rest, dtype) in enumerate(
        [((), "float32"), ((3,), "int64"), ((2, 2), "float16"), ((), "uint8"), ((5,), "float64"),
         ((), "int32")])]
    results = pool.run(rank_all_to_all_v, cases)
    for rank, got in enumerate(results):
        for case_id, rest, dtype in cases:
            matrix = _send_matrix(case_id, n)
            parts = []
            for s in range(n):
                rows = make_input(case_id, s, (int(matrix[s].sum()),) + rest, dtype)
                start = int(matrix[s, :rank].sum())
                parts.append(rows[start:start + int(matrix[s, rank])])
            result, recv = got[case_id]
            assert recv == [int(c) for c in matrix[:, rank]], case_id
            assert_equal_result(result, np.concatenate(parts), f"rank {rank} case {case_id}")


def rank_p2p(comm, arr, count):
    n, r = comm.size, comm.rank
    if n == 1:
        return None
    right, left = (r + 1) % n, (r - 1) % n
    # blocking send/recv with tags, in an order that cannot deadlock: even ranks send first
    mine = make_input(6000, r, (13,), "int32")
    got = np.zeros(13, np.int32)
    if r % 2 == 0:
        comm.send(mine, right, tag=5)
        comm.recv(got, left, tag=5)
    else:
        comm.recv(got, left, tag=5)
        comm.send(mine, right, tag=5)
    # large isend/irecv in both directions at once: must not deadlock
    big = make_input(6001, r, (count,), "float64")
    inbox = np.zeros(count, np.float64)
    send_work = comm.isend(big, right, tag=1)
    recv_work = comm.irecv(inbox, left, tag=1)
    assert recv_work.wait() is True and send_work.wait() is True
    assert send_work.is_completed() and send_work.exception() is None
    # several messages on one channel arrive in order
    works = [comm.isend(np.full(3, i, np.int16), right) for i in range(4)]
    received = []
    for _ in range(4):
        buf = np.zeros(3, np.int16)
        comm.recv(buf, left)
        received.append(int(buf[0]))
    for work in works:
        work.wait()
    return got, inbox, received


def test_point_to_point_ring(pool):
    _host_only(pool)
    n = pool.world_size
    results = pool.run(rank_p2p, 300_007)
    if n == 1:
        return
    for r, (got, inbox, order) in enumerate(results):
        left = (r - 1) % n
        np.testing.assert_array_equal(got, make_input(6000, left, (13,), "int32"))
        np.testing.assert_array_equal(inbox, make_input(6001, left, (300_007,), "float64"))
        assert order == [0, 1, 2, 3]


def rank_async_and_barrier(comm, arr):
    xs = [arr.dev(make_input(7000 + i, comm.rank, (1000 * (i + 1),), "float32")) for i in range(3)]
    works = [comm.all_reduce(x, async_op=True) for x in xs]
    y = arr.dev(make_input(7100, comm.rank, (5,), "int32"))
    comm.all_reduce(y, op="max")  # blocking op issued after async ones: runs after them
    for work in works:
        assert work.wait(timeout=30)
        work.synchronize()  # the host waits too (on a GPU, wait() only orders the stream)
        assert work.is_completed()
    results = [work.result() for work in works]
    for x, result in zip(xs, results):
        assert result is x
    comm.barrier(timeout=10)
    b = arr.dev(make_input(7200, 0, (4,), "float64") if comm.rank == 0 else np.zeros(4))
    work = comm.broadcast(b, async_op=True)
    work.wait()
    work.synchronize()
    return [arr.host(x) for x in xs], arr.host(y), arr.host(b)


def test_async_ops_and_barrier(pool):
    n = pool.world_size
    results = pool.run(rank_async_and_barrier)
    for xs, y, b in results:
        for i, x in enumerate(xs):
            assert_equal_result(x, reduce_reference(_stack(7000 + i, n, (1000 * (i + 1),), "float32",
                                                           "sum"), "sum"), f"async {i}")
        assert_equal_result(y, reduce_reference(_stack(7100, n, (5,), "int32", "sum"), "max"), "y")
        assert_equal_result(b, make_input(7200, 0, (4,), "float64"), "broadcast")


def rank_split(comm, arr):
    evens = comm.new_group([r for r in range(comm.size) if r % 2 == 0])
    info = {"world": (comm.rank, comm.size)}
    if evens is not None:
        x = arr.dev(np.array([comm.rank], np.int64))
        evens.all_reduce(x)
        info["evens"] = (evens.rank, evens.size, int(arr.host(x)[0]))
        evens.close()
    else:
        info["evens"] = None
    halves = comm.split(color=comm.rank % 2, key=-comm.rank)  # reversed order inside each half
    y = arr.dev(np.array([comm.rank], np.int64))
    gathered = arr.host(halves.all_gather(y))
    info["halves"] = (halves.rank, halves.size, gathered.ravel().tolist(), halves.ranks)
    halves.close()
    none = comm.split(color=None if comm.rank == 0 else 1)
    info["none"] = None if none is None else none.size
    if none is not None:
        none.close()
    # the parent still works after its children are gone
    z = arr.dev(np.ones(2))
    comm.all_reduce(z)
    info["after"] = arr.host(z).tolist()
    return info


def test_split_and_new_group(pool):
    n = pool.world_size
    results = pool.run(rank_split)
    evens = [r for r in range(n) if r % 2 == 0]
    for r, info in enumerate(results):
        if r % 2 == 0:
            assert info["evens"] == (evens.index(r), len(evens), sum(evens))
        else:
            assert info["evens"] is None
        half = sorted([q for q in range(n) if q % 2 == r % 2], reverse=True)
        assert info["halves"] == (half.index(r), len(half), half, half)  # ranks: world ranks
        assert info["none"] == (None if r == 0 else n - 1)
        assert info["after"] == [float(n)] * 2


def rank_split_bad_input(comm, arr):
    for kwargs, error, text in (({"color": 2**31}, ValueError, "color=2147483648 is too large"),
                                ({"color": 0, "key": 2**31}, ValueError, "key=2147483648 is out"),
                                ({"color": 0, "key": -2**31 - 1}, ValueError, "is out of range"),
                                ({"color": "x"}, TypeError, "color must be an int"),
                                ({"color": 0, "key": 1.5}, TypeError, "key must be an int")):
        with pytest.raises(error, match=text):
            comm.split(**kwargs)
    # nothing was sent: the extremes that fit, then the communicator, still work
    part = comm.split(color=2**31 - 1, key=-2**31)
    x = arr.dev(np.ones(3))
    part.all_reduce(x)
    part.close()
    return arr.host(x).tolist()


def test_split_refuses_colors_and_keys_out_of_range(pool):
    assert pool.run(rank_split_bad_input) == [[float(pool.world_size)] * 3] * pool.world_size


# ---------------------------------------------------------------- scan / exscan
def _check_scan(pool, cases):
    results = pool.run(rank_scans, cases)
    for rank, by_case in enumerate(results):
        for case in cases:
            assert_equal_result(by_case[case[0]][0], scan_expected(case, rank, pool.world_size),
                                f"rank {rank} case {case}")


_SCAN_EVERY_OP = ("int8", "uint64", "float16", "float32", "complex64", "bool", "bfloat16")


def test_scan_and_exscan_every_op_and_dtype(pool):
    """Every op but avg on one dtype of each family (bfloat16 where the array module holds
    it), and sum, min, max and band (whose identities depend on the dtype; as exscan) on every
    dtype; scan and exscan in turn otherwise, in place and out=, 1-D and 2-D."""
    dtypes = ALL_DTYPES + (["bfloat16"] if pool.kind != "cupy" else [])
    cases, case_id = [], 9000
    for dtype in dtypes:
        for op in OPS:
            if op == "avg" or not op_valid(op, "float32" if dtype == "bfloat16" else dtype):
                continue
            every_op = dtype in _SCAN_EVERY_OP
            if not every_op and op not in ("sum", "min", "max", "band"):
                continue
            case_id += 1
            name = "exscan" if not every_op and op != "sum" else ("scan", "exscan")[case_id % 2]
            cases.append((case_id, (13,) if case_id % 3 else (1, 13), dtype, op, name,
                          ("inplace", "out")[case_id // 2 % 2]))
    _check_scan(pool, cases)


def test_scan_and_exscan_counts(pool):
    """Counts 0, 1, a prime and a multi-chunk size, on the generic path and MPI's own
    (float16 is not an MPI type)."""
    cases, case_id = [], 9500
    for count, dtype, op in ((0, "float32", "sum"), (1, "float32", "sum"), (13, "float32", "sum"),
                             (13, "int64", "max"), (13, "float16", "prod")):
        for name in ("scan", "exscan"):
            case_id += 1
            cases.append((case_id, (count,), dtype, op, name, "out" if case_id % 2 else "inplace"))
    cases += [(9600, (BIG,), "float32", "sum", "scan", "inplace"),
              (9601, (BIG,), "float16", "sum", "exscan", "out")]
    _check_scan(pool, cases)


def _last_record(comm):
    trace = comm.trace()
    return trace[-1]["number"] if trace else 0


def rank_scan_bad_input(comm, arr):
    x = arr.dev(np.arange(4, dtype=np.int32))
    before = _last_record(comm)
    for call in (comm.scan, comm.exscan):
        with pytest.raises(ValueError, match=r"op avg is not a prefix reduction.*op='sum'"):
            call(x, op="avg")
        with pytest.raises(ValueError, match="unknown reduction op 'mean'"):
            call(x, op="mean")
        with pytest.raises(TypeError, match="op band needs an integer or bool array, got dtype "
                                            "float64"):
            call(arr.dev(np.ones(3)), op="band")
        with pytest.raises(TypeError, match="op min is undefined for complex dtype complex64"):
            call(arr.dev(np.ones(3, np.complex64)), op="min")
        with pytest.raises(ValueError, match=r"out has shape \(3,\), expected \(4,\)"):
            call(x, out=arr.zeros((3,), np.int32))
        with pytest.raises(TypeError, match="out has dtype int64, expected int32"):
            call(x, out=arr.zeros((4,), np.int64))
        if arr.xp is np:
            with pytest.raises(TypeError, match="dtype <U1 is not supported|dtype str"):
                call(np.array(["a", "b"]))
            frozen = np.arange(3)
            frozen.flags.writeable = False
            with pytest.raises(ValueError, match="x is read-only"):
                call(frozen)
    assert _last_record(comm) == before  # usage errors are not operations: nothing was sent
    np.testing.assert_array_equal(arr.host(x), np.arange(4))
    comm.exscan(x)  # the communicator is still usable
    records = [entry["op"] for entry in comm.trace() if entry["number"] > before]
    return arr.host(x), records


def test_scan_bad_input_raises_before_anything_is_sent(pool):
    n = pool.world_size
    for rank, (x, records) in enumerate(pool.run(rank_scan_bad_input)):
        np.testing.assert_array_equal(x, np.full(4, 0) if rank == 0 else np.arange(4) * rank)
        assert records[0] == "exscan", records
        if n > 1 and pool.backend != "mpi":  # the sends it is made of follow it
            assert set(records[1:]) <= {"send", "recv", "sendrecv"} and records[1:], records
