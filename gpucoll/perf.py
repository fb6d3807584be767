"""Benchmark engine of ``gpucoll bench``: nccl-tests' sweep, table, checks and bus bandwidth.

One engine times any collective; each collective is a small :class:`Collective` object that
declares, in one place, its byte count, bus-bandwidth factor, buffers, data generator and
checker. Inputs come from :func:`pattern` (seed, rank, element index), so every rank computes
its own expected result without extra communication, and every timed size is also checked
(``#wrong``). Only the Communicator API is used, so any registered backend can be measured;
CuPy is imported only when the communicator's backend is ``nccl``.

Bandwidth, as nccl-tests defines it (GB/s are 1e9 bytes per second)::

    algbw = size / time          busbw = algbw * factor(n)
    all_reduce 2(n-1)/n;  all_gather, reduce_scatter, all_to_all (n-1)/n;
    broadcast, reduce, sendrecv 1

For all_gather, reduce_scatter and all_to_all ``size`` is the total (n x block) bytes and
``count`` the elements of one rank's block, as nccl-tests prints them. The time is the mean
over ranks of each rank's mean time per iteration.

Example::

    gpucoll bench all_reduce -g 2 -b 8 -e 64M -f 4
    gpucoll run -n 4 -m gpucoll bench all -b 1K -e 1M      # ranks from a launcher
"""

from __future__ import annotations

import os
import re
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence

import numpy as np

from .types import ReduceOp, check_op_dtype, combine_fn, finish_avg

__all__ = [
    "COLLECTIVES", "Collective", "BenchOptions", "UsageError", "parse_size", "size_sweep",
    "pattern", "expected_reduction", "count_wrong", "run_rank", "row_cells",
]


class UsageError(ValueError):
    """A bad ``gpucoll bench`` argument (the CLI exits 2)."""


# ---------------------------------------------------------------- sizes, dtypes, ops
_SIZE = re.compile(r"^\s*(\d+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_SCALE = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """Bytes from ``8``, ``1K``, ``64M``, ``1G`` (binary multiples, as nccl-tests; ``B`` optional)."""
    match = _SIZE.match(str(text))
    if not match:
        raise UsageError(f"bad size {text!r}: expected a byte count such as 8, 1K, 64M or 1G")
    return int(match.group(1)) * _SCALE[match.group(2).lower()]


def size_sweep(min_bytes: int, max_bytes: int, factor: int = 2, step: int = 0) -> List[int]:
    """Sizes from ``min_bytes`` to ``max_bytes``: times ``factor``, or plus ``step`` when given."""
    if min_bytes < 0 or max_bytes < min_bytes:
        raise UsageError(f"bad size range: -b {min_bytes} -e {max_bytes} (need 0 <= min <= max)")
    if step <= 0 and factor < 2:
        raise UsageError(f"-f must be at least 2, got {factor}")
    sizes, size = [], min_bytes
    while size <= max_bytes:
        sizes.append(size)
        nxt = size + step if step > 0 else max(size * factor, 1)
        if nxt <= size:
            break
        size = nxt
    return sizes


# nccl-tests' type names; NumPy names are accepted too. bfloat16 has no NumPy dtype.
_TYPE_NAMES = {"int8": "int8", "char": "int8", "uint8": "uint8", "int32": "int32", "int": "int32",
               "uint32": "uint32", "int64": "int64", "uint64": "uint64", "half": "float16",
               "float16": "float16", "float": "float32", "float32": "float32",
               "double": "float64", "float64": "float64"}
ALL_DTYPES = ("int8", "uint8", "int32", "uint32", "int64", "uint64", "float16", "float32", "float64")
ALL_OPS = ("sum", "prod", "max", "min", "avg")
_SHOWN_TYPE = {"float16": "half", "float32": "float", "float64": "double"}


def parse_dtypes(text: str) -> List[np.dtype]:
    names = ALL_DTYPES if text == "all" else [t.strip() for t in text.split(",")]
    out = []
    for name in names:
        if name not in _TYPE_NAMES:
            raise UsageError(f"unknown data type {name!r} for -d; choose from "
                             f"{', '.join(sorted(_TYPE_NAMES))} or all (bfloat16 has no NumPy dtype)")
        out.append(np.dtype(_TYPE_NAMES[name]))
    return out


def parse_ops(text: str) -> List[ReduceOp]:
    names = ALL_OPS if text == "all" else [t.strip() for t in text.split(",")]
    try:
        return [ReduceOp.parse(name) for name in names]
    except ValueError as exc:
        raise UsageError(f"-o: {exc}") from None


# ---------------------------------------------------------------- data and checks
_BLOCK = 1 << 20  # elements generated or checked at a time (bounds the checker's memory)


def pattern(seed: int, rank: int, count: int, dtype, op: Optional[ReduceOp] = None,
            offset: int = 0) -> np.ndarray:
    """Input of ``rank``: element ``i`` depends only on (seed, rank, offset + i).

    Values are small integers so that every reduction order gives the same exact answer:
    -8..8 (0..16 unsigned) for sum/avg/min/max, {-1, 1, 2} ({1, 2, 3} unsigned) for prod,
    0..16 for the bitwise ops.
    """
    dtype = np.dtype(dtype)
    index = np.arange(offset, offset + count, dtype=np.int64)
    value = (index * 7 + rank * 13 + seed * 31) % 17
    unsigned = dtype.kind == "u"
    if op is ReduceOp.PROD:
        value = np.array([1, 2, 3] if unsigned else [-1, 1, 2], np.int64)[value % 3]
    elif op not in (ReduceOp.BAND, ReduceOp.BOR, ReduceOp.BXOR) and not unsigned:
        value = value - 8
    return value.astype(dtype)


def expected_reduction(op: ReduceOp, seed: int, nranks: int, count: int, dtype,
                       offset: int = 0) -> np.ndarray:
    """The reduction over ranks 0..nranks-1 of :func:`pattern`, computed in ``dtype``."""
    acc = pattern(seed, 0, count, dtype, op, offset)
    combine = combine_fn(op, acc.dtype)
    for rank in range(1, nranks):
        combine(acc, pattern(seed, rank, count, dtype, op, offset))
    if op is ReduceOp.AVG:
        finish_avg(acc, nranks)
    return acc


def count_wrong(got: np.ndarray, expected: np.ndarray, nranks: int = 1) -> int:
    """Elements of ``got`` that differ from ``expected``.

    Integers must match exactly; floats within ``nranks`` ulps relative to the value (reduction
    order and avg's division may round differently on another backend); NaN is always wrong.
    """
    got, expected = np.asarray(got).reshape(-1), np.asarray(expected).reshape(-1)
    if got.shape != expected.shape:
        return max(got.size, expected.size)
    if got.dtype.kind != "f":
        return int(np.count_nonzero(got != expected))
    exp64, got64 = expected.astype(np.float64), got.astype(np.float64)
    tolerance = float(np.finfo(got.dtype).eps) * max(nranks, 2) * np.maximum(np.abs(exp64), 1.0)
    both_inf = np.isinf(exp64) & (got64 == exp64)
    ok = both_inf | (np.abs(got64 - exp64) <= tolerance)
    return int(np.count_nonzero(~ok))


def _blocks(count: int):
    for start in range(0, count, _BLOCK):
        yield start, min(count, start + _BLOCK)


# ---------------------------------------------------------------- devices
class _Host:
    """NumPy buffers: the CPU backend (and Gloo's tensors)."""

    kind = "host"

    def empty(self, shape, dtype):
        return np.empty(shape, dtype)

    def put(self, dst, host: np.ndarray) -> None:
        np.copyto(dst, host.reshape(dst.shape))

    def get(self, src) -> np.ndarray:
        return src

    def sync(self) -> None:
        pass


class _Cuda:
    """CuPy buffers on this rank's current device (imported only for the nccl backend)."""

    kind = "cuda"

    def __init__(self):
        import cupy  # noqa: WPS433 (lazy: only GPU runs need it)

        self.cupy = cupy

    def empty(self, shape, dtype):
        return self.cupy.empty(shape, dtype)

    def put(self, dst, host: np.ndarray) -> None:
        dst.set(np.ascontiguousarray(host.reshape(dst.shape)))

    def get(self, src) -> np.ndarray:
        return self.cupy.asnumpy(src)

    def sync(self) -> None:
        self.cupy.cuda.get_current_stream().synchronize()


def _device_for(comm):
    return _Cuda() if comm.backend == "nccl" else _Host()


# ---------------------------------------------------------------- collectives
@dataclass
class Buffers:
    send: Any
    recv: Any
    count: int  # elements per rank (block elements for the blocked collectives)


class Collective:
    """One collective: sizes, bus-bandwidth factor, buffers, inputs, the call and its check.

    Modes are ``"out"`` (out-of-place) and ``"in"`` (in-place); ``gloo_mode`` is the mode
    torch.distributed's call matches, used for the ``--compare gloo`` ratio.
    """

    name = ""
    reduces = False
    rooted = False
    blocked = False  # size column = nranks x block bytes
    modes = ("out", "in")
    gloo_mode = "in"

    def bus_factor(self, nranks: int) -> float:
        return 1.0

    def count_for(self, nbytes: int, itemsize: int, nranks: int) -> int:
        """Elements per rank (per block when blocked) for a requested size."""
        return nbytes // (itemsize * nranks) if self.blocked else nbytes // itemsize

    def size_of(self, count: int, itemsize: int, nranks: int) -> int:
        """Bytes in the size column (and in algbw)."""
        return count * itemsize * (nranks if self.blocked else 1)

    def buffers(self, dev, count: int, dtype, nranks: int) -> Buffers:
        return Buffers(dev.empty(count, dtype), dev.empty(count, dtype), count)

    def input(self, seed, rank, nranks, count, dtype, op) -> np.ndarray:
        return pattern(seed, rank, count, dtype, op)

    def fill(self, dev, bufs: Buffers, mode: str, seed, rank, nranks, op, root) -> None:
        """Put this rank's input where ``mode`` reads it; poison the output."""
        host = self.input(seed, rank, nranks, bufs.count, bufs.send.dtype, op)
        dev.put(bufs.recv if mode == "in" else bufs.send, host)
        if mode == "out":
            dev.put(bufs.recv, np.full(bufs.recv.size, 77, bufs.recv.dtype))

    def run(self, comm, bufs: Buffers, mode: str, op, root) -> None:
        raise NotImplementedError

    def expected(self, seed, rank, nranks, bufs: Buffers, op, root, start, stop) -> Optional[np.ndarray]:
        """Elements [start, stop) of this rank's flattened result (None: nothing to check)."""
        raise NotImplementedError

    def wrong(self, dev, bufs: Buffers, mode: str, seed, rank, nranks, op, root) -> int:
        result = dev.get(bufs.recv).reshape(-1)
        wrong = 0
        for start, stop in _blocks(result.size):
            expected = self.expected(seed, rank, nranks, bufs, op, root, start, stop)
            if expected is not None:
                wrong += count_wrong(result[start:stop], expected, nranks)
        return wrong

    def gloo(self, dist, send, recv, op, root, rank, nranks) -> None:
        raise NotImplementedError


class AllReduce(Collective):
    name, reduces = "all_reduce", True

    def bus_factor(self, nranks):
        return 2.0 * (nranks - 1) / nranks

    def run(self, comm, bufs, mode, op, root):
        if mode == "in":
            comm.all_reduce(bufs.recv, op)
        else:
            comm.all_reduce(bufs.send, op, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return expected_reduction(op, seed, nranks, stop - start, bufs.recv.dtype, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.all_reduce(recv, op=op)


class Broadcast(Collective):
    name, rooted, modes = "broadcast", True, ("in",)  # the API's broadcast is in place

    def fill(self, dev, bufs, mode, seed, rank, nranks, op, root):
        host = pattern(seed, rank, bufs.count, bufs.recv.dtype)
        dev.put(bufs.recv, host if rank == root else np.full(bufs.count, 77, bufs.recv.dtype))

    def run(self, comm, bufs, mode, op, root):
        comm.broadcast(bufs.recv, root)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return pattern(seed, root, stop - start, bufs.recv.dtype, None, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.broadcast(recv, src=root)


class Reduce(Collective):
    name, reduces, rooted = "reduce", True, True

    def run(self, comm, bufs, mode, op, root):
        if mode == "in":
            comm.reduce(bufs.recv, root, op)
        else:
            comm.reduce(bufs.send, root, op, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        if rank != root:
            return None  # only the root's result is defined
        return expected_reduction(op, seed, nranks, stop - start, bufs.recv.dtype, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.reduce(recv, dst=root, op=op)


class AllGather(Collective):
    name, blocked, modes, gloo_mode = "all_gather", True, ("out",), "out"

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def buffers(self, dev, count, dtype, nranks):
        return Buffers(dev.empty(count, dtype), dev.empty((nranks, count), dtype), count)

    def run(self, comm, bufs, mode, op, root):
        comm.all_gather(bufs.send, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        index = np.arange(start, stop)
        owner, within = index // max(bufs.count, 1), index % max(bufs.count, 1)
        values = np.empty(stop - start, bufs.recv.dtype)
        for peer in np.unique(owner):
            mask = owner == peer
            first = int(within[mask][0])
            values[mask] = pattern(seed, int(peer), int(mask.sum()), bufs.recv.dtype, None, first)
        return values

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
        gather(recv.reshape(-1), send)


class ReduceScatter(Collective):
    name, reduces, blocked, modes, gloo_mode = "reduce_scatter", True, True, ("out",), "out"

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def buffers(self, dev, count, dtype, nranks):
        return Buffers(dev.empty((nranks, count), dtype), dev.empty(count, dtype), count)

    def input(self, seed, rank, nranks, count, dtype, op):
        return pattern(seed, rank, count * nranks, dtype, op)

    def run(self, comm, bufs, mode, op, root):
        comm.reduce_scatter(bufs.send, op, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return expected_reduction(op, seed, nranks, stop - start, bufs.recv.dtype,
                                  rank * bufs.count + start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
        scatter(recv, send.reshape(-1), op=op)


class AllToAll(Collective):
    name, blocked, modes, gloo_mode = "all_to_all", True, ("out",), "out"

    def bus_factor(self, nranks):
        return (nranks - 1) / nranks

    def buffers(self, dev, count, dtype, nranks):
        return Buffers(dev.empty((nranks, count), dtype), dev.empty((nranks, count), dtype), count)

    def input(self, seed, rank, nranks, count, dtype, op):
        return pattern(seed, rank, count * nranks, dtype, op)

    def run(self, comm, bufs, mode, op, root):
        comm.all_to_all(bufs.send, out=bufs.recv)

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        # block j of the result is block `rank` of rank j's input
        block = max(bufs.count, 1)
        index = np.arange(start, stop)
        owner, within = index // block, index % block
        values = np.empty(stop - start, bufs.recv.dtype)
        for peer in np.unique(owner):
            mask = owner == peer
            first = rank * bufs.count + int(within[mask][0])
            values[mask] = pattern(seed, int(peer), int(mask.sum()), bufs.recv.dtype, None, first)
        return values

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        dist.all_to_all_single(recv.reshape(-1), send.reshape(-1))


class SendRecv(Collective):
    """Rank r sends to r+1 and receives from r-1 (a ring shift), as nccl-tests' sendrecv."""

    name, modes, gloo_mode = "sendrecv", ("out",), "out"

    def run(self, comm, bufs, mode, op, root):
        work = comm.isend(bufs.send, (comm.rank + 1) % comm.size)
        comm.recv(bufs.recv, (comm.rank - 1) % comm.size)
        work.wait()

    def expected(self, seed, rank, nranks, bufs, op, root, start, stop):
        return pattern(seed, (rank - 1) % nranks, stop - start, bufs.recv.dtype, None, start)

    def gloo(self, dist, send, recv, op, root, rank, nranks):
        work = dist.isend(send, (rank + 1) % nranks)
        dist.recv(recv, (rank - 1) % nranks)
        work.wait()


COLLECTIVES: Dict[str, Collective] = {c.name: c for c in (
    AllReduce(), AllGather(), ReduceScatter(), Broadcast(), Reduce(), AllToAll(), SendRecv())}


# ---------------------------------------------------------------- options
@dataclass
class BenchOptions:
    """What one ``gpucoll bench`` run measures (the CLI fills it; see ``gpucoll bench -h``)."""

    collectives: Sequence[str] = ("all_reduce",)
    nranks: Optional[int] = None
    min_bytes: int = 32 << 20
    max_bytes: int = 32 << 20
    factor: int = 2
    step_bytes: int = 0
    iters: int = 20
    warmup: int = 5
    check: bool = True
    dtypes: Sequence[np.dtype] = (np.dtype("float32"),)
    ops: Sequence[ReduceOp] = (ReduceOp.SUM,)
    root: int = 0
    timeout: float = 300.0
    backend: Optional[str] = None
    compare: Optional[str] = None
    seed: int = 0
    sizes: List[int] = field(default_factory=list)

    def validate(self) -> None:
        if self.iters < 1 or self.warmup < 0:
            raise UsageError(f"-n must be >= 1 and -w >= 0, got -n {self.iters} -w {self.warmup}")
        if not self.timeout > 0:
            raise UsageError(f"-T must be positive, got {self.timeout}")
        if self.nranks is not None and self.nranks < 1:
            raise UsageError(f"-g must be at least 1, got {self.nranks}")
        self.sizes = size_sweep(self.min_bytes, self.max_bytes, self.factor, self.step_bytes)
        explicit = len(self.ops) == 1
        for name in self.collectives:
            if COLLECTIVES[name].reduces:
                for dtype in self.dtypes:
                    for op in self.ops:
                        try:
                            check_op_dtype(op, dtype)
                        except TypeError as exc:
                            if explicit and len(self.dtypes) == 1:
                                raise UsageError(f"-o {op.value} -d {dtype.name}: {exc}") from None

    def cases(self, coll: Collective, nranks: int):
        """(dtype, op, root) triples measured for ``coll``."""
        for dtype in self.dtypes:
            for op in (self.ops if coll.reduces else [None]):
                if op is not None:
                    try:
                        check_op_dtype(op, dtype)
                    except TypeError:
                        continue
                yield dtype, op, (self.root if coll.rooted else -1)


# ---------------------------------------------------------------- measuring (every rank)
def _timed(run: Callable[[], None], sync: Callable[[], None], barrier: Callable[[], None],
           iters: int, warmup: int) -> float:
    """Seconds per iteration of ``run`` after ``warmup`` untimed calls."""
    for _ in range(warmup):
        run()
    sync()
    barrier()
    start = time.perf_counter()
    for _ in range(iters):
        run()
    sync()
    return (time.perf_counter() - start) / iters


def _stats(comm, dev, seconds: float, wrong: Optional[int]) -> Dict[str, Any]:
    """Mean time over ranks and the total wrong count (one small all_reduce, outside timing)."""
    values = np.array([seconds, wrong or 0], np.float64)
    if comm.size > 1:
        buf = dev.empty(2, np.float64)
        dev.put(buf, values)
        comm.all_reduce(buf)
        values = np.array(dev.get(buf), np.float64)
    return {"time_us": values[0] / comm.size * 1e6,
            "wrong": None if wrong is None else int(round(values[1]))}


def _bandwidths(entry: Dict[str, Any], nbytes: int, factor: float) -> Dict[str, Any]:
    seconds = entry["time_us"] / 1e6
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    entry.update(algbw=algbw, busbw=algbw * factor)
    return entry


class _GlooSide:
    """torch.distributed's Gloo backend in the same rank processes (a second process group)."""

    _OPS = {"sum": "SUM", "prod": "PRODUCT", "min": "MIN", "max": "MAX", "band": "BAND",
            "bor": "BOR", "bxor": "BXOR"}

    def __init__(self, comm, dev, timeout: float):
        import datetime
        import warnings

        import torch
        import torch.distributed as dist
        from .api import detect_environment

        warnings.filterwarnings("ignore", category=FutureWarning, module="torch")
        self.torch, self.dist = torch, dist
        host = detect_environment().master_addr or "127.0.0.1"
        wait = datetime.timedelta(seconds=timeout)
        store = (dist.TCPStore(host, 0, comm.size, True, timeout=wait, wait_for_workers=False)
                 if comm.rank == 0 else None)
        port = np.array([store.port if store is not None else 0], np.int64)
        if comm.size > 1:  # publish rank 0's port through gpucoll itself
            buf = dev.empty(1, np.int64)
            dev.put(buf, port)
            comm.broadcast(buf, 0)
            port = dev.get(buf)
        if store is None:
            store = dist.TCPStore(host, int(port[0]), comm.size, False, timeout=wait)
        dist.init_process_group("gloo", store=store, rank=comm.rank, world_size=comm.size,
                                timeout=wait)

    def op(self, op: Optional[ReduceOp]):
        if op is None:
            return None
        name = self._OPS.get(op.value)
        if name is None:
            raise NotImplementedError(f"Gloo has no {op.value} reduction")
        return getattr(self.dist.ReduceOp, name)

    def close(self) -> None:
        self.dist.destroy_process_group()


def _measure(comm, dev, coll: Collective, opts: BenchOptions, dtype, op, root, nbytes: int,
             seed: int, gloo: Optional[_GlooSide]) -> Dict[str, Any]:
    """One table row: every mode of ``coll`` at one size (and Gloo's, when compared)."""
    nranks, rank = comm.size, comm.rank
    count = coll.count_for(nbytes, dtype.itemsize, nranks)
    size = coll.size_of(count, dtype.itemsize, nranks)
    factor = coll.bus_factor(nranks)
    row: Dict[str, Any] = {"collective": coll.name, "size": size, "count": count,
                           "type": _SHOWN_TYPE.get(dtype.name, dtype.name),
                           "redop": op.value if op is not None else "none", "root": root,
                           "out": None, "in": None, "gloo": None, "ratio": None}
    bufs = coll.buffers(dev, count, dtype, nranks)
    for index, mode in enumerate(coll.modes):
        mode_seed = seed * 4 + index
        coll.fill(dev, bufs, mode, mode_seed, rank, nranks, op, root)
        seconds = _timed(lambda: coll.run(comm, bufs, mode, op, root), dev.sync, comm.barrier,
                         opts.iters, opts.warmup)
        wrong = None
        if opts.check:
            coll.fill(dev, bufs, mode, mode_seed + 2, rank, nranks, op, root)
            coll.run(comm, bufs, mode, op, root)
            dev.sync()
            wrong = coll.wrong(dev, bufs, mode, mode_seed + 2, rank, nranks, op, root)
        row[mode] = _bandwidths(_stats(comm, dev, seconds, wrong), size, factor)
    del bufs
    if gloo is not None:
        row["gloo"] = _measure_gloo(comm, dev, coll, opts, dtype, op, root, count, size, factor,
                                    seed, gloo)
        mine = row[coll.gloo_mode]
        if row["gloo"] is not None and mine is not None and row["gloo"]["busbw"] > 0:
            row["ratio"] = mine["busbw"] / row["gloo"]["busbw"]
    return row


def _measure_gloo(comm, dev, coll, opts, dtype, op, root, count, size, factor, seed, gloo):
    host = _Host()
    bufs = coll.buffers(host, count, dtype, comm.size)
    torch = gloo.torch
    mode = coll.gloo_mode
    try:
        send, recv = torch.from_numpy(bufs.send), torch.from_numpy(bufs.recv)
        torch_op = gloo.op(op)
    except (TypeError, NotImplementedError):
        return None  # e.g. a dtype torch cannot wrap, or an op Gloo lacks: N/A on every rank
    call = lambda: coll.gloo(gloo.dist, send, recv, torch_op, root, comm.rank, comm.size)  # noqa: E731
    coll.fill(host, bufs, mode, seed * 4 + 3, comm.rank, comm.size, op, root)
    seconds = _timed(call, lambda: None, gloo.dist.barrier, opts.iters, opts.warmup)
    wrong = None
    if opts.check:
        coll.fill(host, bufs, mode, seed * 4 + 3, comm.rank, comm.size, op, root)
        call()
        wrong = coll.wrong(host, bufs, mode, seed * 4 + 3, comm.rank, comm.size, op, root)
    return _bandwidths(_stats(comm, dev, seconds, wrong), size, factor)


def run_rank(comm, opts: BenchOptions, emit: Optional[Callable[[str, Any], None]]) -> None:
    """Run the whole sweep on this rank; rank 0 passes ``emit`` to receive the events.

    Events: ``("begin", info)`` once, ``("start", name)`` before each collective's rows,
    ``("row", row)``, ``("skip", (name, reason))`` and ``("end", name)``.
    """
    dev = _device_for(comm)
    say = emit if comm.rank == 0 and emit is not None else (lambda kind, value: None)
    pids = np.array([os.getpid()], np.int64)
    if comm.size > 1:
        buf = dev.empty(1, np.int64)
        dev.put(buf, pids)
        out = dev.empty((comm.size, 1), np.int64)
        comm.all_gather(buf, out=out)
        pids = dev.get(out).reshape(-1)
    say("begin", {"nranks": comm.size, "backend": comm.backend, "pids": [int(p) for p in pids]})
    gloo = _GlooSide(comm, dev, opts.timeout) if opts.compare == "gloo" else None
    try:
        seed = opts.seed
        for name in opts.collectives:
            coll = COLLECTIVES[name]
            if name == "sendrecv" and comm.size < 2:
                say("skip", (name, "sendrecv needs at least 2 ranks"))
                continue
            say("start", name)
            for dtype, op, root in opts.cases(coll, comm.size):
                for nbytes in opts.sizes:
                    seed += 1
                    say("row", _measure(comm, dev, coll, opts, dtype, op, root, nbytes, seed, gloo))
            say("end", name)
    finally:
        if gloo is not None:
            gloo.close()


# ---------------------------------------------------------------- formatting (rank 0 / parent)
def _fmt_time(us: float) -> str:
    return f"{us:8.2f}" if us < 1e4 else f"{us:8.0f}"


def _fmt_mode(entry: Optional[Dict[str, Any]]) -> str:
    if entry is None:
        return f"{'N/A':>8}  {'N/A':>7}  {'N/A':>7}  {'N/A':>6}"
    wrong = "N/A" if entry["wrong"] is None else str(entry["wrong"])
    return f"{_fmt_time(entry['time_us'])}  {entry['algbw']:7.2f}  {entry['busbw']:7.2f}  {wrong:>6}"


def table_header(compare: Optional[str]) -> List[str]:
    block = 8 + 2 + 7 + 2 + 7 + 2 + 6  # one mode's columns
    labels = ["out-of-place", "in-place"] + ([compare] if compare else [])
    group = "#" + " " * 48 + "  ".join(label.center(block) for label in labels)
    names = (f"#{'size':>11}  {'count':>12}  {'type':>6}  {'redop':>5}  {'root':>4}  "
             + "  ".join([f"{'time':>8}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}"] * 2))
    units = (f"#{'(B)':>11}  {'(elements)':>12}  {'':>6}  {'':>5}  {'':>4}  "
             + "  ".join([f"{'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}"] * 2))
    if compare:
        names += f"  {'time':>8}  {'algbw':>7}  {'busbw':>7}  {'#wrong':>6}  {'ratio':>6}"
        units += f"  {'(us)':>8}  {'(GB/s)':>7}  {'(GB/s)':>7}  {'':>6}  {'':>6}"
    return [group, names, units]


def row_cells(row: Dict[str, Any], compare: Optional[str]) -> str:
    """One table line in nccl-tests' layout (plus Gloo's columns and the ratio)."""
    line = (f"{row['size']:12d}  {row['count']:12d}  {row['type']:>6}  {row['redop']:>5}  "
            f"{row['root']:4d}  {_fmt_mode(row['out'])}  {_fmt_mode(row['in'])}")
    if compare:
        ratio = "N/A" if row["ratio"] is None else f"{row['ratio']:.2f}"
        line += f"  {_fmt_mode(row['gloo'])}  {ratio:>6}"
    return line


class Reporter:
    """Prints the table as rows arrive; keeps them for ``--json``, ``--csv`` and ``--plot``.

    Runs where the output goes: in the parent of spawned ranks, or on rank 0 under a launcher.
    """

    def __init__(self, opts: BenchOptions, out=None, err=None):
        import sys

        self.opts, self.out, self.err = opts, out or sys.stdout, err or sys.stderr
        self.rows: List[Dict[str, Any]] = []
        self.info: Dict[str, Any] = {}
        self.skipped: List[List[str]] = []
        self._current: List[Dict[str, Any]] = []
        self.progress = bool(getattr(self.err, "isatty", lambda: False)())
        self._total = 0

    def _print(self, text: str = "") -> None:
        if self.progress:
            self.err.write("\r\033[K")
            self.err.flush()
        self.out.write(text + "\n")
        self.out.flush()

    def __call__(self, kind: str, value: Any) -> None:
        getattr(self, "_on_" + kind)(value)

    def _on_begin(self, info: Dict[str, Any]) -> None:
        opts = self.opts
        self.info = info
        cases = sum(len(list(opts.cases(COLLECTIVES[n], info["nranks"]))) for n in opts.collectives)
        self._total = cases * len(opts.sizes)
        step = f"{opts.step_bytes}(bytes)" if opts.step_bytes > 0 else f"{opts.factor}(factor)"
        self._print(f"# gpucoll bench  nRanks {info['nranks']}  backend {info['backend']}  "
                    f"minBytes {opts.min_bytes} maxBytes {opts.max_bytes} step: {step} "
                    f"warmup iters: {opts.warmup} iters: {opts.iters} validation: {int(opts.check)}"
                    + (f"  compare: {opts.compare}" if opts.compare else ""))
        self._print("#")
        self._print("# Using devices")
        for rank, pid in enumerate(info["pids"]):
            self._print(f"#  Rank {rank:2d} Pid {pid:7d} backend {info['backend']}")

    def _on_start(self, name: str) -> None:
        self._current = []
        self._print("#")
        self._print(f"# Collective test starting: {name}")
        if self.opts.compare:
            mode = "in-place" if COLLECTIVES[name].gloo_mode == "in" else "out-of-place"
            self._print(f"# ratio = gpucoll {mode} busbw / {self.opts.compare} busbw")
        for line in table_header(self.opts.compare):
            self._print(line)

    def _on_row(self, row: Dict[str, Any]) -> None:
        row = dict(row, backend=self.info.get("backend"), nranks=self.info.get("nranks"))
        self.rows.append(row)
        self._current.append(row)
        self._print(row_cells(row, self.opts.compare))
        if self.progress and self._total > 1:
            self.err.write(f"\r[gpucoll bench] {len(self.rows)}/{self._total} done, last "
                           f"{row['collective']} {row['size']} B")
            self.err.flush()

    def _on_skip(self, value) -> None:
        self.skipped.append(list(value))
        self._print(f"# {value[0]} skipped: {value[1]}")

    def _on_end(self, name: str) -> None:
        summary = summarize(self._current)
        self._print(f"# Out of bounds values : {summary['wrong']} "
                    f"{'OK' if summary['wrong'] == 0 else 'FAILED'}")
        self._print(f"# Avg bus bandwidth    : {summary['avg_busbw']:.4g}")
        if self.opts.compare:
            self._print(f"# Avg bus bandwidth ({self.opts.compare}) : "
                        f"{summary['avg_compare_busbw']:.4g}")

    @property
    def wrong(self) -> int:
        return summarize(self.rows)["wrong"]

    def document(self) -> Dict[str, Any]:
        """The ``--json`` document."""
        from . import __version__

        opts = self.opts
        return {
            "gpucoll_version": __version__, "backend": self.info.get("backend"),
            "nranks": self.info.get("nranks"), "compare": opts.compare,
            "settings": {"collectives": list(opts.collectives), "min_bytes": opts.min_bytes,
                         "max_bytes": opts.max_bytes, "factor": opts.factor,
                         "step_bytes": opts.step_bytes, "iters": opts.iters,
                         "warmup": opts.warmup, "check": opts.check,
                         "dtypes": [d.name for d in opts.dtypes],
                         "ops": [o.value for o in opts.ops], "root": opts.root},
            "bus_factors": {name: COLLECTIVES[name].bus_factor(self.info.get("nranks") or 1)
                            for name in opts.collectives},
            "rows": self.rows,
            "summary": {name: summarize([r for r in self.rows if r["collective"] == name])
                        for name in opts.collectives},
            "skipped": self.skipped,
            "wrong": self.wrong,
        }


def summarize(rows: Sequence[Dict[str, Any]]) -> Dict[str, Any]:
    """Wrong elements and average bus bandwidth over every measured entry (as nccl-tests)."""
    wrong, bws, compare = 0, [], []
    for row in rows:
        for mode in ("out", "in"):
            entry = row.get(mode)
            if entry is not None:
                bws.append(entry["busbw"])
                wrong += entry["wrong"] or 0
        if row.get("gloo") is not None:
            compare.append(row["gloo"]["busbw"])
            wrong += row["gloo"]["wrong"] or 0
    return {"wrong": wrong, "avg_busbw": sum(bws) / len(bws) if bws else 0.0,
            "avg_compare_busbw": sum(compare) / len(compare) if compare else 0.0}


_CSV_FIELDS = ("collective", "backend", "nranks", "size", "count", "type", "redop", "root")


def write_csv(path: str, rows: Sequence[Dict[str, Any]]) -> None:
    """One line per row; ``out_*``, ``in_*`` and ``gloo_*`` columns, empty where N/A."""
    import csv

    parts = ("time_us", "algbw", "busbw", "wrong")
    header = list(_CSV_FIELDS) + [f"{m}_{p}" for m in ("out", "in", "gloo") for p in parts] + ["ratio"]
    with open(path, "w", newline="") as handle:
        writer = csv.writer(handle)
        writer.writerow(header)
        for row in rows:
            line = [row.get(name) for name in _CSV_FIELDS]
            for mode in ("out", "in", "gloo"):
                entry = row.get(mode) or {}
                line += ["" if entry.get(p) is None else entry[p] for p in parts]
            line.append("" if row.get("ratio") is None else row["ratio"])
            writer.writerow(line)


def require_matplotlib(flag: str = "--plot"):
    """``matplotlib.pyplot`` with a headless backend, or UsageError saying what to install."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise UsageError(f"{flag} needs matplotlib: pip install 'gpucoll[plot]' "
                         "(or pip install matplotlib)") from None
    return plt


def write_plot(path: str, rows: Sequence[Dict[str, Any]], compare: Optional[str]) -> None:
    """busbw against size (log x): one line per collective, and per compared backend."""
    plt = require_matplotlib()
    figure, axes = plt.subplots(figsize=(8, 5))
    for name in dict.fromkeys(r["collective"] for r in rows):
        coll = COLLECTIVES[name]
        mine = [r for r in rows if r["collective"] == name and r.get(coll.gloo_mode) and r["size"] > 0]
        if not mine:
            continue
        label = f"{name} ({mine[0].get('backend')}, {'in' if coll.gloo_mode == 'in' else 'out-of'}-place)"
        axes.plot([r["size"] for r in mine], [r[coll.gloo_mode]["busbw"] for r in mine],
                  marker="o", label=label)
        theirs = [r for r in mine if r.get("gloo")]
        if compare and theirs:
            axes.plot([r["size"] for r in theirs], [r["gloo"]["busbw"] for r in theirs],
                      marker="x", linestyle="--", label=f"{name} ({compare})")
    axes.set_xscale("log", base=2)
    axes.set_xlabel("size (bytes)")
    axes.set_ylabel("bus bandwidth (GB/s)")
    axes.set_title("gpucoll bench")
    axes.grid(True, which="both", alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def finish(reporter: Reporter, json_path: Optional[str], csv_path: Optional[str],
           plot_path: Optional[str]) -> int:
    """Write the requested files; 0 when every check passed, 1 otherwise (as nccl-tests)."""
    import json

    if json_path:
        with open(json_path, "w") as handle:
            json.dump(reporter.document(), handle, indent=1)
    if csv_path:
        write_csv(csv_path, reporter.rows)
    if plot_path:
        write_plot(plot_path, reporter.rows, reporter.opts.compare)
    return 0 if reporter.wrong == 0 else 1


# ---------------------------------------------------------------- running the ranks
def _launched_rank(opts: BenchOptions, reporter_factory: Callable[[], Reporter], files) -> int:
    """Under ``gpucoll run`` / torchrun / mpiexec / srun: this process is one rank."""
    import gpucoll
    from .api import detect_environment

    env = detect_environment()
    if opts.nranks is not None and opts.nranks != env.world_size:
        raise UsageError(f"-g {opts.nranks} does not match the launcher's world size "
                         f"{env.world_size} ({env.source}); leave -g out under a launcher")
    comm = gpucoll.init(backend=opts.backend, timeout=opts.timeout)
    try:
        reporter = reporter_factory() if comm.rank == 0 else None
        run_rank(comm, opts, reporter)
        status = finish(reporter, *files) if reporter is not None else 0
        codes = np.array([status], np.int64)
        if comm.size > 1:  # every rank exits with the same code
            dev = _device_for(comm)
            buf = dev.empty(1, np.int64)
            dev.put(buf, codes)
            comm.broadcast(buf, 0)
            codes = dev.get(buf)
        comm.close()
        return int(codes[0])
    except BaseException:
        comm.abort()
        raise


def _spawned_rank(rank: int, nranks: int, url: str, env: Dict[str, str], opts: BenchOptions,
                  events) -> None:
    """Entry point of a rank started by :func:`run_bench` (multiprocessing, spawn)."""
    import traceback

    os.environ.update(env)
    comm = None
    try:
        import gpucoll

        if opts.backend == "nccl":
            import cupy

            cupy.cuda.Device(rank % cupy.cuda.runtime.getDeviceCount()).use()
        comm = gpucoll.init(backend=opts.backend, rank=rank, world_size=nranks, url=url,
                            timeout=opts.timeout)
        run_rank(comm, opts, lambda kind, value: events.put((kind, rank, value)))
        comm.close()
        events.put(("done", rank, None))
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
        if comm is not None:
            comm.abort()
        raise SystemExit(1)


def _spawn_all(opts: BenchOptions, reporter: Reporter) -> None:
    """Start ``opts.nranks`` rank processes; relay rank 0's events to ``reporter``.

    Raises:
        RuntimeError: a rank failed or died (with its traceback); every rank is stopped.
    """
    import multiprocessing
    import queue
    import secrets

    from .rendezvous import TCPStoreServer

    nranks = opts.nranks or 1
    token = secrets.token_hex(16)
    server = TCPStoreServer("127.0.0.1", 0, token=token)
    env = {"GPUCOLL_AUTH_TOKEN": token, "GPUCOLL_LAUNCHER_STORE": "1"}
    ctx = multiprocessing.get_context("spawn")
    events = ctx.Queue()
    url = f"tcp://127.0.0.1:{server.port}"
    procs = [ctx.Process(target=_spawned_rank, args=(r, nranks, url, env, opts, events),
                         name=f"gpucoll-bench-rank{r}", daemon=True) for r in range(nranks)]
    try:
        for proc in procs:
            proc.start()
        done = set()
        while len(done) < nranks:
            try:
                kind, rank, value = events.get(timeout=0.5)
            except queue.Empty:
                dead = [r for r, p in enumerate(procs) if r not in done and p.exitcode is not None]
                if dead:
                    time.sleep(0.5)  # let a dying rank's error report arrive first
                    if events.empty():
                        raise RuntimeError(f"rank {dead[0]} died (exit code "
                                           f"{procs[dead[0]].exitcode}) without reporting an error")
                continue
            if kind == "error":
                raise RuntimeError(f"rank {rank} failed:\n{value.rstrip()}")
            if kind == "done":
                done.add(rank)
            else:
                reporter(kind, value)
        for proc in procs:
            proc.join(30)
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
        for proc in procs:
            if proc.pid is not None:
                proc.join(5)
        server.close()


def run_bench(opts: BenchOptions, json_path: Optional[str] = None, csv_path: Optional[str] = None,
              plot_path: Optional[str] = None, out=None, err=None) -> int:
    """Run ``gpucoll bench``: spawn the ranks, or be one rank when a launcher started us.

    Returns:
        0 when every result was right, 1 when some were wrong or a rank failed.

    Raises:
        UsageError: bad options, or a missing optional dependency (the CLI exits 2).
    """
    import importlib.util

    from .api import detect_environment

    opts.validate()
    if opts.compare == "gloo" and importlib.util.find_spec("torch") is None:
        raise UsageError("--compare gloo needs PyTorch (torch.distributed's Gloo backend): "
                         "pip install torch")
    if plot_path:
        require_matplotlib()
    files = (json_path, csv_path, plot_path)
    make = lambda: Reporter(opts, out, err)  # noqa: E731
    if detect_environment().source != "none":
        return _launched_rank(opts, make, files)
    if "sendrecv" in opts.collectives and (opts.nranks or 1) < 2 and len(opts.collectives) == 1:
        raise UsageError("sendrecv needs at least 2 ranks: pass -g 2 or more")
    reporter = make()
    _spawn_all(opts, reporter)
    return finish(reporter, *files)
