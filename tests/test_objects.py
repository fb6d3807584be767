"""The object codec (gpucoll.objects) and the object collectives of the CPU backend.

The codec is checked value by value (types kept exactly, arrays bit for bit) and against
every input it must refuse; the collectives run in real processes at world sizes 1 to 4, every
root, with values whose expected results each rank can rebuild without communication.
"""

from __future__ import annotations

import math
import pickle

import numpy as np
import pytest

from gpucoll import objects
from mp_harness import error_text, rank_pools

pytestmark = pytest.mark.timeout(120)

try:
    import ml_dtypes
except ImportError:  # pragma: no cover - the test extra installs it
    ml_dtypes = None


def assert_same(got, expected, where="obj"):
    """Equal values of exactly the same types, arrays equal in dtype, shape and bits."""
    assert type(got) is type(expected), f"{where}: {type(got)} != {type(expected)}"
    if isinstance(expected, np.ndarray):
        assert got.dtype == expected.dtype and got.shape == expected.shape, where
        assert got.tobytes() == expected.tobytes(), where
        assert got.flags.writeable, where  # a copy the caller may modify
    elif isinstance(expected, np.generic):
        assert got.dtype == expected.dtype and got.tobytes() == expected.tobytes(), where
    elif isinstance(expected, float) and math.isnan(expected):
        assert math.isnan(got), where
    elif isinstance(expected, dict):
        assert list(got) == list(expected), where
        for key in expected:
            assert_same(got[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert len(got) == len(expected), where
        for i, (a, b) in enumerate(zip(got, expected)):
            assert_same(a, b, f"{where}[{i}]")
    else:
        assert got == expected, where


def sample(rank: int, size_hint: int = 0):
    """A value with every kind the codec carries, different per rank."""
    rng = np.random.default_rng([7, rank])
    value = {
        "rank": rank, "neg": -rank - 1, "big": 3 ** 80 * (-1) ** rank, "i64max": 2 ** 63 - 1,
        "i64min": -2 ** 63, "pi": math.pi * rank, "inf": float("inf"), "nan": float("nan"),
        "name": f"rank-{rank}-ünï©ødé", "empty": "", "none": None, "yes": True, "no": False,
        "raw": bytes(range(rank, rank + 7)), "tuple": (rank, "t", (None,)), "list": [1, [2, [3]]],
        7: "int key", -3: {"nested": {"deeper": [rank] * 3}},
        "f32": rng.standard_normal((3, 4)).astype(np.float32),
        "i8": rng.integers(-128, 127, 5, dtype=np.int8),
        "u64": np.array([2 ** 64 - 1, rank], dtype=np.uint64),
        "c128": (rng.standard_normal(3) + 1j).astype(np.complex128),
        "bool": rng.integers(0, 2, (2, 2)).astype(bool), "f16": np.float16([0.5, -2]),
        "zero_d": np.array(rank * 1.5), "empty_2d": np.zeros((0, 3), dtype=np.int32),
        "big_endian": np.arange(4, dtype=">i4"), "fortran": np.asfortranarray(np.eye(3)),
        "strided": np.arange(10.0)[::3],
        "scalars": [np.float32(rank + 0.25), np.int16(-rank), np.bool_(rank % 2), np.uint8(255),
                    np.complex64(1 - 2j)],
    }
    if ml_dtypes is not None:
        value["bf16"] = np.array([1.5, -rank], dtype=ml_dtypes.bfloat16)
        value["bf16_scalar"] = ml_dtypes.bfloat16(rank)
    if size_hint:
        value["payload"] = rng.standard_normal(size_hint)
    return value


def expected_after_codec(value):
    """What the codec gives back: arrays contiguous, little-endian (native) byte order."""
    if isinstance(value, np.ndarray):
        return np.array(value, dtype=value.dtype.newbyteorder("="), order="C")
    if isinstance(value, dict):
        return {k: expected_after_codec(v) for k, v in value.items()}
    if isinstance(value, list):
        return [expected_after_codec(v) for v in value]
    if isinstance(value, tuple):
        return tuple(expected_after_codec(v) for v in value)
    return value


# ---------------------------------------------------------------- the codec
@pytest.mark.parametrize("rank", [0, 1, 5])
def test_codec_round_trip_keeps_types_and_bits(rank):
    value = sample(rank, size_hint=1000)
    data = objects.encode(value)
    assert data.dtype == np.uint8 and data.ndim == 1 and data.flags.writeable
    assert bytes(data[:4]) == b"GCO1"
    assert_same(objects.decode(data), expected_after_codec(value))
    assert_same(objects.decode(bytes(data)), expected_after_codec(value))


@pytest.mark.parametrize("value", [None, True, 0, -1, 2 ** 200, -(2 ** 200), 0.0, -0.0, "",
                                   "x" * 100_000, b"", [], (), {}, [[[]]], {"": {}},
                                   np.zeros(0, dtype=np.uint8), np.ones((2, 0, 3))])
def test_codec_edge_values(value):
    got = objects.decode(objects.encode(value))
    assert_same(got, value)
    if isinstance(value, float):
        assert math.copysign(1, got) == math.copysign(1, value)


def test_subclasses_come_back_as_their_base_type():
    from collections import OrderedDict

    value = [OrderedDict(a=1), np.str_("s"), np.bytes_(b"b"), bytearray(b"ba"), memoryview(b"mv"),
             np.memmap]  # the last one is refused, below
    assert_same(objects.decode(objects.encode(value[:5])), [{"a": 1}, "s", b"b", b"ba", b"mv"])


class Custom:
    pass


@pytest.mark.parametrize("value,kind,pattern", [
    ({1, 2}, TypeError, r"type set at obj:.*never pickles"),
    ({"a": [0, Custom()]}, TypeError, r"type .*Custom at obj\['a'\]\[1\]"),
    ({"k": {(1, 2): 3}}, TypeError, r"dict key of type tuple .* in the dict at obj\['k'\]"),
    ({1.5: 0}, TypeError, r"dict key of type float"),
    ({True: 0}, TypeError, r"dict key of type bool"),
    ([np.array(["a"])], TypeError, r"dtype <U1 at obj\[0\]"),
    ({"o": np.array([1], dtype=object)}, TypeError, r"dtype object at obj\['o'\]"),
    ({"r": np.zeros(2, dtype=[("a", "i4")])}, TypeError, r"at obj\['r'\]"),
    ([np.datetime64("2020-01-01")], TypeError, r"datetime64 at obj\[0\]"),
    ([print], TypeError, r"builtin_function_or_method at obj\[0\]"),
    (Custom, TypeError, r"type type at obj"),
    ({"s": "bad \udc80"}, ValueError, r"str at obj\['s'\]"),
])
def test_codec_refuses_what_it_cannot_carry(value, kind, pattern):
    with pytest.raises(kind, match=pattern):
        objects.encode(value)


def test_codec_refuses_cycles_and_deep_nesting():
    loop = [1]
    loop.append({"back": loop})
    with pytest.raises(ValueError, match=r"obj\[1\]\['back'\] contains itself"):
        objects.encode(loop)
    deep = []
    for _ in range(objects.MAX_DEPTH + 1):
        deep = [deep]
    with pytest.raises(ValueError, match=f"nested deeper than {objects.MAX_DEPTH}"):
        objects.encode(deep, "objs[3]")
    shared = [1, 2]
    assert objects.decode(objects.encode([shared, shared])) == [[1, 2], [1, 2]]  # not a cycle


def test_decode_refuses_corrupt_data_and_never_unpickles():
    data = bytes(objects.encode({"a": [1, 2.5, "x"], "arr": np.arange(5)}))
    for cut in range(len(data)):
        with pytest.raises(ValueError):
            objects.decode(data[:cut])
    with pytest.raises(ValueError, match="left over"):
        objects.decode(data + b"N")
    with pytest.raises(ValueError, match="not gpucoll object data"):
        objects.decode(pickle.dumps({"a": 1}))
    with pytest.raises(ValueError, match="unknown tag"):
        objects.decode(b"GCO1\x80")
    with pytest.raises(ValueError, match="unknown dtype code 99"):
        objects.decode(b"GCO1a\x63\x00")
    with pytest.raises(ValueError, match="count of"):
        objects.decode(b"GCO1l" + (2 ** 40).to_bytes(8, "little"))


# ---------------------------------------------------------------- collectives, real processes
pool = rank_pools([1, 2, 3, 4], ids=lambda n: f"world{n}", shared=True)


def rank_object_collectives(comm):
    out = {"bcast": [], "gather": []}
    for root in range(comm.size):
        value = sample(root) if comm.rank == root else "ignored"
        out["bcast"].append(comm.broadcast_object(value, root=root))
        out["gather"].append(comm.gather_object(sample(comm.rank), root=root))
    out["all"] = comm.all_gather_object(sample(comm.rank, size_hint=comm.rank * 3000))
    out["tiny"] = comm.all_gather_object(None)
    out["scatter"] = [comm.scatter_object([("to", r, sample(r)) for r in range(comm.size)]
                                          if comm.rank == root else None, root=root)
                      for root in range(comm.size)]
    out["default_root"] = comm.broadcast_object("hello" if comm.rank == 0 else None)
    return out


def test_object_collectives_every_root(pool):
    n = pool.world_size
    results = pool.run(rank_object_collectives)
    for rank, got in enumerate(results):
        for root in range(n):
            assert_same(got["bcast"][root], expected_after_codec(sample(root)), f"bcast {root}")
            if rank == root:
                assert_same(got["gather"][root],
                            [expected_after_codec(sample(r)) for r in range(n)], "gather")
            else:
                assert got["gather"][root] is None
            assert_same(got["scatter"][root], expected_after_codec(("to", rank, sample(rank))))
        assert_same(got["all"], [expected_after_codec(sample(r, size_hint=r * 3000))
                                 for r in range(n)], "all_gather_object")
        assert got["tiny"] == [None] * n
        assert got["default_root"] == "hello"


def rank_object_messages(comm):
    """Values to the next rank and from the previous one (even ranks send first), two per
    pair in order, one large; then the usage errors, after which the ranks still agree."""
    n, r = comm.size, comm.rank
    if n == 1:
        return None
    nxt, prev = (r + 1) % n, (r - 1) % n
    got = []
    for turn in (0, 1):
        if (r % 2 == 0) == (turn == 0):
            comm.send_object(sample(r), nxt, tag=4)
            comm.send_object(("second", r, np.arange(40000, dtype=np.int64) * r), dst=nxt, tag=4)
        else:
            got.append(comm.recv_object(prev, tag=4))
            got.append(comm.recv_object(src=prev, tag=4))
    errors = [error_text(lambda: comm.send_object({1}, nxt)),
              error_text(lambda: comm.send_object(1, r)),
              error_text(lambda: comm.recv_object(n))]
    return got, errors, comm.all_gather_object(r)


def test_object_messages_arrive_in_order(pool):
    n = pool.world_size
    for rank, result in enumerate(pool.run(rank_object_messages)):
        if n == 1:
            assert result is None
            continue
        got, errors, after = result
        prev = (rank - 1) % n
        assert_same(got, [expected_after_codec(sample(prev)),
                          ("second", prev, np.arange(40000, dtype=np.int64) * prev)])
        assert errors[0].startswith("TypeError") and "type set at obj" in errors[0]
        assert errors[1] == f"ValueError: dst={rank} is this rank; send/recv need another rank"
        assert errors[2] == f"ValueError: src={n} is out of range for a communicator of size {n}"
        assert after == list(range(n))


def rank_bad_objects(comm):
    """Usage errors raise before anything is sent; the communicator stays usable."""
    errors = []
    if comm.rank == 0:
        for call in (lambda: comm.broadcast_object({"s": {1}}, root=0),
                     lambda: comm.all_gather_object([object()]),
                     lambda: comm.gather_object({"k": {(1,): 2}}),
                     lambda: comm.scatter_object({"not": "a list"}),
                     lambda: comm.scatter_object(list(range(comm.size + 1))),
                     lambda: comm.scatter_object([1] * (comm.size - 1) + [{3}])):
            try:
                call()
                errors.append("no error")
            except (TypeError, ValueError) as exc:
                errors.append(f"{type(exc).__name__}: {exc}")
    for call in (lambda: comm.broadcast_object(1, root=comm.size),
                 lambda: comm.gather_object(1, root=-1),
                 lambda: comm.scatter_object([1], root="0")):
        try:
            call()
            errors.append("no error")
        except (TypeError, ValueError) as exc:
            errors.append(f"{type(exc).__name__}: {exc}")
    after = comm.all_gather_object({"still": comm.rank})  # nothing was left on the wire
    return errors, after


def test_object_usage_errors_are_eager(pool):
    n = pool.world_size
    results = pool.run(rank_bad_objects)
    own = results[0][0][:6]
    assert own[0].startswith("TypeError") and "type set at obj['s']" in own[0]
    assert own[1].startswith("TypeError") and "type object at obj[0]" in own[1]
    assert own[2].startswith("TypeError") and "dict key of type tuple" in own[2]
    assert own[3] == f"TypeError: scatter_object: objs must be a list or tuple of {n} values " \
                     f"on the root, got dict"
    assert own[4] == f"ValueError: scatter_object: objs has {n + 1} values, expected one per " \
                     f"rank ({n})"
    assert own[5].startswith("TypeError") and f"type set at objs[{n - 1}]" in own[5]
    for rank, (errors, after) in enumerate(results):
        common = errors[6:] if rank == 0 else errors
        assert common[0] == f"ValueError: root={n} is out of range for a communicator of size {n}"
        assert common[1] == f"ValueError: root=-1 is out of range for a communicator of size {n}"
        assert common[2] == "TypeError: root must be an int, got str"
        assert after == [{"still": r} for r in range(n)]
