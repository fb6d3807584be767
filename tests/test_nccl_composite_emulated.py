"""Object collectives, uneven gathers and world ranks on the NCCL backend, run against the
emulation of CuPy and NCCL (tests/emulated_cuda/; ranks are threads).

They are built on the public collectives in the base class; what is checked here is that they
keep to device memory on the NCCL backend (internal buffers are CuPy arrays on the
communicator's GPU, results come back as CuPy arrays), agree with NumPy, and that split and
new_group hand their world ranks to the child.
"""

import numpy as np
import pytest

import emulated_cuda
from test_nccl_emulated import emu, run  # noqa: F401 (fixtures)
from reference import make_input

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(autouse=True)
def host_to_device_copy(monkeypatch):
    """CuPy's ``ndarray.set(host_array)`` (host to device copy), which the emulation lacks."""
    def set_(self, host, stream=None):
        host = np.asarray(host)
        if host.shape != self.shape or host.dtype != self.dtype:
            raise ValueError("emulated CuPy: set() needs the same shape and dtype")
        self._a[...] = host

    monkeypatch.setattr(emulated_cuda.ndarray, "set", set_, raising=False)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_object_collectives_on_the_device(run, emu, n):
    def fn(comm):
        r = comm.rank
        value = {"rank": r, "grid": np.arange(6.0).reshape(2, 3) * r, "tag": ("t", r)}
        out = {
            "bcast": [comm.broadcast_object(value if r == root else None, root)
                      for root in range(n)],
            "all": comm.all_gather_object(value),
            "gather": comm.gather_object([r] * r, root=n - 1),
            "scatter": comm.scatter_object([{"to": q} for q in range(n)] if r == 0 else None),
        }
        out["calls"] = sorted({name for name, _ in
                               [(nm, a) for c, nm, a in list(emu.history) if c is comm.nccl_comm]})
        return out

    for r, got in enumerate(run(n, fn)):
        for root in range(n):
            assert got["bcast"][root]["rank"] == root and got["bcast"][root]["tag"] == ("t", root)
            np.testing.assert_array_equal(got["bcast"][root]["grid"],
                                          np.arange(6.0).reshape(2, 3) * root)
        assert [v["rank"] for v in got["all"]] == list(range(n))
        assert got["gather"] == ([[q] * q for q in range(n)] if r == n - 1 else None)
        assert got["scatter"] == {"to": r}
        assert set(got["calls"]) <= {"allGather", "broadcast", "send", "recv"}, got["calls"]


@pytest.mark.parametrize("n", [1, 2, 3])
def test_uneven_gathers_return_device_arrays(run, emu, n):
    cp = emu.cupy
    counts = [(3 * q + 1) % 4 for q in range(n)]  # 1, 0, 3: a zero among them from n=2

    def fn(comm):
        r = comm.rank
        x = cp.asarray(make_input(5, r, (counts[r], 2), "float32"))
        gathered, got_counts = comm.all_gather_v(x)
        given, _ = comm.all_gather_v(x, counts=counts)
        rooted = [comm.gather_v(x, root=root) for root in range(n)]
        empty, zeros = comm.all_gather_v(cp.asarray(np.zeros((0, 5), np.int64)))
        return {
            "types": {type(gathered), type(given), type(empty)},
            "device": gathered.device.id, "counts": got_counts, "values": gathered.get(),
            "given": given.get(),
            "rooted": [(None if a is None else (type(a) is cp.ndarray, a.get()), c)
                       for a, c in rooted],
            "empty": (empty.shape, zeros),
        }

    expected = np.concatenate([make_input(5, q, (counts[q], 2), "float32") for q in range(n)])
    for r, got in enumerate(run(n, fn)):
        assert got["types"] == {emu.cupy.ndarray} and got["device"] == r
        assert got["counts"] == counts
        np.testing.assert_array_equal(got["values"], expected)
        np.testing.assert_array_equal(got["given"], expected)
        for root, (result, got_counts) in enumerate(got["rooted"]):
            assert got_counts == counts
            if r == root:
                assert result[0] is True
                np.testing.assert_array_equal(result[1], expected)
            else:
                assert result is None
        assert got["empty"] == ((0, 5), [0] * n)


@pytest.mark.parametrize("n", [1, 2, 3])
def test_uneven_scatters_return_device_arrays(run, emu, n):
    cp = emu.cupy
    counts = [(3 * q + 1) % 4 for q in range(n)]  # 1, 0, 3: a zero among them from n=2
    start, total = [sum(counts[:q]) for q in range(n)], sum(counts)

    def fn(comm):
        r = comm.rank
        x = cp.asarray(make_input(7, r, (total, 2), "float32"))
        reduced, got_counts = comm.reduce_scatter_v(x, counts, op="max")
        ways = [comm._reduce_scatter_v_padded(x, counts, comm_op("max")),
                comm._reduce_scatter_v_reduces(x, counts, comm_op("max"))]
        scattered = [comm.scatter_v(x if r == root else None, root, counts) for root in range(n)]
        return {
            "types": {type(reduced)} | {type(a) for a, _ in scattered} | {type(a) for a in ways},
            "device": reduced.device.id, "counts": got_counts, "reduced": reduced.get(),
            "ways": [a.get() for a in ways],
            "scattered": [(a.get(), c) for a, c in scattered],
        }

    inputs = [make_input(7, q, (total, 2), "float32") for q in range(n)]
    for r, got in enumerate(run(n, fn)):
        mine = slice(start[r], start[r] + counts[r])
        assert got["types"] == {emu.cupy.ndarray} and got["device"] == r
        assert got["counts"] == counts
        for reduced in [got["reduced"]] + got["ways"]:
            np.testing.assert_array_equal(reduced, np.max(inputs, axis=0)[mine])
        for root, (rows, got_counts) in enumerate(got["scattered"]):
            assert got_counts == counts
            np.testing.assert_array_equal(rows, inputs[root][mine])


def comm_op(name):
    import gpucoll
    return gpucoll.ReduceOp.parse(name)


def test_uneven_gather_refuses_host_arrays_and_mismatched_layouts(run, emu):
    cp = emu.cupy

    def fn(comm):
        errors = []
        try:
            comm.all_gather_v(np.ones((2, 2)))
        except TypeError as exc:
            errors.append(str(exc))
        try:
            comm.all_gather_v(cp.zeros((comm.rank, 2 + comm.rank), dtype=np.float32))
        except ValueError as exc:
            errors.append(str(exc))
        after, counts = comm.all_gather_v(cp.ones((comm.rank, 1), dtype=np.int32))
        return errors, after.get().tolist(), counts

    for errors, after, counts in run(2, fn):
        assert errors[0].startswith("x is a NumPy array (host memory); backend 'nccl' needs GPU")
        assert errors[1].startswith("gather of uneven arrays: ranks disagree on dtype or trailing "
                                    "shape (rank 0: float32 (n, 2); rank 1: float32 (n, 3))")
        assert after == [[1]] and counts == [0, 1]


def test_world_ranks_of_nccl_groups(run, emu):
    def fn(comm):
        group = comm.new_group([2, 0])
        out = {"world": comm.ranks}
        if group is not None:
            sub = group.split(0, key=-group.rank)
            out["group"] = (group.ranks, group.to_world(1), group.from_world(2),
                            sub.ranks, sub.all_gather_object(comm.rank))
            sub.close()
            group.close()
        return out

    results = run(3, fn)
    assert results[1] == {"world": [0, 1, 2]}
    for r in (0, 2):
        assert results[r]["group"] == ([2, 0], 0, 0, [0, 2], [0, 2])


def test_nccl_timeout_says_how_to_change_the_limit(run, emu):
    from gpucoll.errors import CommTimeoutError

    cp = emu.cupy

    def fn(comm):
        stream = cp.cuda.Stream(non_blocking=True)
        emu.stall(stream)
        work = comm.all_reduce(cp.ones(4), async_op=True, stream=stream)
        with pytest.raises(CommTimeoutError) as first:
            work.synchronize(timeout=0.2)
        with pytest.raises(CommTimeoutError) as later:
            comm.all_reduce(cp.ones(4))
        emu.release(stream)
        return str(first.value), str(later.value)

    [(first, later)] = run(1, fn)
    for message in (first, later):
        assert message.startswith("rank 0: all_reduce #1 did not complete on GPU 0 within 0.2 s")
        assert message.endswith("the communicator was aborted, create a new one; "
                                "GPUCOLL_TIMEOUT or init(timeout=) sets the limit"), message
