#!/usr/bin/env python3
"""CPU collectives on one host: gpucoll (Unix-socket and TCP transports) side by side with Gloo.

One run spawns the ranks of each world size once. Every rank opens three communicators --
gpucoll with the default transport (Unix domain sockets between ranks of one host),
gpucoll with ``GPUCOLL_TRANSPORT=tcp`` and torch.distributed's Gloo -- and measures them
interleaved, size by size, so that drift in the machine's load hits all three alike.

Columns follow nccl-tests: ``size`` is the bytes of the collective's full buffer (for
all_gather / reduce_scatter the ``(n, m)`` array), ``count`` the elements per rank that the
call names (all_gather / reduce_scatter: ``m``), ``time`` the mean time per call in the best
of ``--rounds`` rounds (a round counts at its slowest rank), ``algbw = size / time`` and
``busbw = algbw * factor`` (all_reduce ``2(n-1)/n``; all_gather, reduce_scatter ``(n-1)/n``;
broadcast 1). Each size is checked once against a NumPy expectation computed locally from
inputs derived from (rank, index); ``#wrong`` counts the wrong elements over all ranks.
``ratio`` is ``gloo time / gpucoll time`` (above 1: gpucoll is faster). The raw two-way
exchange rate of a Unix stream socket and of loopback TCP between two processes is measured
first, as the ceiling a ring's busbw can reach.

    python bench/bench_cpu.py                  # world sizes 2 and 4, 8 B .. 256 MiB
    python bench/bench_cpu.py --quick          # a short run, 8 B .. 16 MiB
    python bench/bench_cpu.py --json out.json  # every number, machine-readable

Gloo needs PyTorch (a CPU build is enough: ``pip install torch``); without it only gpucoll
is measured.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc as garbage_collector
import importlib.util
import json
import multiprocessing as mp
import os
import platform
import queue as queue_module
import select
import signal
import socket
import statistics
import sys
import tempfile
import time
import traceback
from datetime import timedelta
from pathlib import Path
from typing import Callable, Dict, List, Optional, Tuple

import numpy as np

if importlib.util.find_spec("gpucoll") is None:  # run from a checkout without installing
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

GPUCOLL_DEFAULT, GPUCOLL_TCP, GLOO = "gpucoll-default", "gpucoll-tcp", "gloo"
ALL_VARIANTS = (GPUCOLL_DEFAULT, GPUCOLL_TCP, GLOO)
ITEMSIZE = 4  # float32
MIB = 1 << 20
UNSTEADY_SPREAD = 2.0  # a row is marked "~" when a variant's rounds differ by more than this

# ----------------------------------------------------------------------------- inputs and checks
# Element i of rank r's input is f(r, i) = ((7 i + 1009 r) mod P) - P // 2. P is prime, so no
# power-of-two chunking lines up with the pattern; |sum over 4 ranks| < 2**24 stays exact in
# float32. The pattern repeats every P elements, so fills and checks copy one tiled period.
PERIOD = 65521
_TILE_PERIODS = 16


def period_values(rank: int, start: int = 0) -> np.ndarray:
    """One period of f(rank, start + j), j = 0 .. P-1, in float64."""
    index = (np.arange(PERIOD, dtype=np.int64) + start) % PERIOD
    return ((index * 7 + rank * 1009) % PERIOD - PERIOD // 2).astype(np.float64)


def _tiled(period: np.ndarray, length: int) -> np.ndarray:
    reps = max(1, min(_TILE_PERIODS, -(-length // PERIOD)))
    return np.tile(period.astype(np.float32), reps)


def fill_periodic(dst: np.ndarray, period: np.ndarray) -> None:
    flat = dst.reshape(-1)
    tile = _tiled(period, flat.size)
    for start in range(0, flat.size, tile.size):
        stop = min(start + tile.size, flat.size)
        flat[start:stop] = tile[:stop - start]


def count_wrong(actual: np.ndarray, period: np.ndarray) -> int:
    flat = actual.reshape(-1)
    tile = _tiled(period, flat.size)
    wrong = 0
    for start in range(0, flat.size, tile.size):
        stop = min(start + tile.size, flat.size)
        wrong += int(np.count_nonzero(flat[start:stop] != tile[:stop - start]))
    return wrong


# ----------------------------------------------------------------------------- the collectives
class Buffers:
    """Arrays of one (collective, size), shared by the variants; torch views made once."""

    def __init__(self, in_shape, out_shape):
        self.input = np.empty(in_shape, np.float32)
        self.output = None if out_shape is None else np.empty(out_shape, np.float32)
        self._torch = None

    def torch_views(self):
        if self._torch is None:
            import torch

            flat = lambda a: None if a is None else torch.from_numpy(a.reshape(-1))  # noqa: E731
            self._torch = (flat(self.input), flat(self.output))
        return self._torch


class Collective:
    """One collective: buffers, inputs, expected result, bus factor and the calls that run it."""

    name = ""

    def layout(self, nbytes: int, n: int) -> Tuple[int, tuple, Optional[tuple]]:
        """(count per call, input shape, output shape or None) for a ``nbytes`` collective."""
        count = max(1, nbytes // ITEMSIZE)
        return count, (count,), None

    def total_bytes(self, count: int, n: int) -> int:
        return count * ITEMSIZE

    def bus_factor(self, n: int) -> float:
        return 1.0

    def prepare(self, buf: Buffers, rank: int, n: int) -> None:
        fill_periodic(buf.input, period_values(rank))

    def check(self, buf: Buffers, rank: int, n: int) -> int:
        raise NotImplementedError

    def before_timing(self, buf: Buffers) -> None:
        """Make the timed calls repeatable (all_reduce would otherwise overflow)."""

    def run_gpucoll(self, comm, buf: Buffers) -> None:
        raise NotImplementedError

    def run_gloo(self, dist, buf: Buffers) -> None:
        raise NotImplementedError


def _gloo_op(dist, name: str, older_name: str):
    """``dist.<name>``, or its older (deprecated from torch 2.13) spelling."""
    return getattr(dist, name, None) or getattr(dist, older_name)


class AllReduce(Collective):
    name = "all_reduce"

    def bus_factor(self, n):
        return 2 * (n - 1) / n

    def check(self, buf, rank, n):
        return count_wrong(buf.input, sum(period_values(r) for r in range(n)))

    def before_timing(self, buf):
        buf.input.fill(0)  # in place: repeated sums of the pattern would reach inf

    def run_gpucoll(self, comm, buf):
        comm.all_reduce(buf.input)

    def run_gloo(self, dist, buf):
        dist.all_reduce(buf.torch_views()[0])


class Broadcast(Collective):
    name = "broadcast"

    def prepare(self, buf, rank, n):
        if rank == 0:
            fill_periodic(buf.input, period_values(0))
        else:
            buf.input.fill(np.nan)

    def check(self, buf, rank, n):
        return count_wrong(buf.input, period_values(0))

    def run_gpucoll(self, comm, buf):
        comm.broadcast(buf.input, root=0)

    def run_gloo(self, dist, buf):
        dist.broadcast(buf.torch_views()[0], src=0)


class AllGather(Collective):
    name = "all_gather"

    def layout(self, nbytes, n):
        count = max(1, nbytes // (ITEMSIZE * n))
        return count, (count,), (n, count)

    def total_bytes(self, count, n):
        return n * count * ITEMSIZE

    def bus_factor(self, n):
        return (n - 1) / n

    def prepare(self, buf, rank, n):
        super().prepare(buf, rank, n)
        buf.output.fill(np.nan)

    def check(self, buf, rank, n):
        wrong = count_wrong(buf.input, period_values(rank))  # the input must be left alone
        return wrong + sum(count_wrong(buf.output[r], period_values(r)) for r in range(n))

    def run_gpucoll(self, comm, buf):
        comm.all_gather(buf.input, out=buf.output)

    def run_gloo(self, dist, buf):
        tensor_in, tensor_out = buf.torch_views()
        _gloo_op(dist, "all_gather_single", "all_gather_into_tensor")(tensor_out, tensor_in)


class ReduceScatter(Collective):
    name = "reduce_scatter"

    def layout(self, nbytes, n):
        count = max(1, nbytes // (ITEMSIZE * n))
        return count, (n, count), (count,)

    def total_bytes(self, count, n):
        return n * count * ITEMSIZE

    def bus_factor(self, n):
        return (n - 1) / n

    def prepare(self, buf, rank, n):
        super().prepare(buf, rank, n)
        buf.output.fill(np.nan)

    def check(self, buf, rank, n):
        count = buf.output.size
        expected = sum(period_values(r, start=rank * count) for r in range(n))
        wrong = count_wrong(buf.input, period_values(rank))  # the input must be left alone
        return wrong + count_wrong(buf.output, expected)

    def run_gpucoll(self, comm, buf):
        comm.reduce_scatter(buf.input, out=buf.output)

    def run_gloo(self, dist, buf):
        tensor_in, tensor_out = buf.torch_views()
        _gloo_op(dist, "reduce_scatter_single", "reduce_scatter_tensor")(tensor_out, tensor_in)


COLLECTIVES = {c.name: c for c in (AllReduce(), Broadcast(), AllGather(), ReduceScatter())}


def size_grid(min_bytes: int, max_bytes: int, factor: int) -> List[int]:
    sizes, size = [], max(1, min_bytes)
    while size <= max_bytes:
        sizes.append(size)
        size *= factor
    if not sizes or sizes[-1] != max_bytes:
        sizes.append(max_bytes)
    return sizes


def iterations(nbytes: int, opts) -> int:
    """Timed calls for one size: the same on every rank, fewer for larger sizes."""
    return max(opts.min_iters, min(opts.max_iters, opts.target_bytes // max(1, nbytes)))


# ----------------------------------------------------------------------------- one rank
class Variant:
    """A communicator under test: ``run(collective, buffers)`` and ``barrier()``."""

    def __init__(self, name, comm=None, dist=None, info=""):
        self.name, self.comm, self.dist, self.info = name, comm, dist, info

    def run(self, collective: Collective, buf: Buffers) -> None:
        if self.dist is not None:
            collective.run_gloo(self.dist, buf)
        else:
            collective.run_gpucoll(self.comm, buf)

    def barrier(self) -> None:
        (self.dist or self.comm).barrier()

    def close(self) -> None:
        if self.dist is not None:
            self.dist.destroy_process_group()
        else:
            self.comm.close()


def _open_variant(name: str, rank: int, n: int, port: int, timeout: float) -> Variant:
    if name == GLOO:
        import torch
        import torch.distributed as dist

        if sys.platform.startswith("linux"):
            os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")  # the ranks talk over loopback
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n, timeout=timedelta(seconds=timeout + 60))
        return Variant(name, dist=dist, info=f"torch {torch.__version__}")
    import gpucoll as gc

    saved = os.environ.pop("GPUCOLL_TRANSPORT", None)
    if name == GPUCOLL_TCP:
        os.environ["GPUCOLL_TRANSPORT"] = "tcp"  # read by init, so set it before
    try:
        comm = gc.init(backend="cpu", rank=rank, world_size=n, url=f"tcp://127.0.0.1:{port}",
                       timeout=timeout)
    finally:
        os.environ.pop("GPUCOLL_TRANSPORT", None)
        if saved is not None:
            os.environ["GPUCOLL_TRANSPORT"] = saved
    kinds = sorted(set(comm.transport_kinds.values()))
    return Variant(name, comm=comm, info=f"gpucoll {gc.__version__}, links: {'+'.join(kinds)}")


def _measure_size(variants: List[Variant], collective: Collective, buf: Buffers, rank: int,
                  n: int, opts, timed_total: int, index: int,
                  broken: set) -> Tuple[Dict[str, dict], Dict[str, str]]:
    """Check, warm up and time every variant on one (collective, size).

    Each variant's first call is checked. The timed calls are split into ``opts.rounds``
    rounds, and the variants take turns round by round, so that a burst of load from
    elsewhere on the machine lands on all of them alike. A variant that raises is added to
    ``broken`` and skipped for the rest of this collective.

    Returns:
        ({variant: {"wrong", "round_seconds", "iters"}}, {variant: traceback of its failure})
    """
    cells: Dict[str, dict] = {}
    failures: Dict[str, str] = {}
    warmup = max(1, min(50, timed_total // 5))
    rounds = max(1, min(opts.rounds, timed_total))
    per_round = -(-timed_total // rounds)

    def order(shift: int) -> List[Variant]:
        shift %= max(1, len(variants))
        return [v for v in variants[shift:] + variants[:shift]
                if (collective.name, v.name) not in broken]

    def attempt(variant: Variant, step: Callable[[], None]) -> None:
        try:
            step()
        except Exception:
            broken.add((collective.name, variant.name))
            cells.pop(variant.name, None)
            failures[variant.name] = traceback.format_exc()

    def check(variant: Variant) -> None:
        collective.prepare(buf, rank, n)
        variant.run(collective, buf)
        cells[variant.name] = {"wrong": collective.check(buf, rank, n), "round_seconds": [],
                               "iters": per_round * rounds}

    def warm(variant: Variant) -> None:
        for _ in range(warmup):
            variant.run(collective, buf)

    def timed(variant: Variant) -> None:
        variant.barrier()
        start = time.perf_counter()
        for _ in range(per_round):
            variant.run(collective, buf)
        cells[variant.name]["round_seconds"].append((time.perf_counter() - start) / per_round)

    for variant in order(index):
        attempt(variant, lambda: check(variant))
    collective.before_timing(buf)
    for variant in order(index):
        attempt(variant, lambda: warm(variant))
    garbage_collector.disable()  # no cycle collection inside a timed loop (slow with torch loaded)
    try:
        for round_index in range(rounds):
            for variant in order(index + round_index):
                attempt(variant, lambda: timed(variant))
    finally:
        garbage_collector.enable()
    return cells, failures


def rank_main(rank: int, n: int, ports: Dict[str, int], opts, results) -> None:
    """Body of one spawned rank: open the variants, measure every (collective, size)."""
    if hasattr(faulthandler, "register"):
        # the parent dumps every rank's stacks with SIGUSR1 before it kills them on a timeout
        faulthandler.register(signal.SIGUSR1, all_threads=True)
    try:
        variants = []
        for name in opts.variants:
            try:
                variants.append(_open_variant(name, rank, n, ports[name], opts.op_timeout))
            except Exception:
                results.put(("failed", rank, None, name, traceback.format_exc()))
        results.put(("hello", rank, {v.name: v.info for v in variants}))
        broken = set()  # (collective, variant) that raised: skipped from then on
        for collective in (COLLECTIVES[c] for c in opts.collectives):
            for index, nbytes in enumerate(opts.sizes):
                count, in_shape, out_shape = collective.layout(nbytes, n)
                total = collective.total_bytes(count, n)
                buf = Buffers(in_shape, out_shape)
                cells, failures = _measure_size(variants, collective, buf, rank, n, opts,
                                                iterations(total, opts), index, broken)
                del buf
                for name, text in failures.items():
                    results.put(("failed", rank, collective.name, name, text))
                for name, cell in cells.items():
                    results.put(("row", rank, collective.name, nbytes, name,
                                 dict(cell, count=count, bytes=total)))
        for variant in variants:
            try:
                variant.close()
            except Exception:
                traceback.print_exc()
        results.put(("done", rank))
    except BaseException:
        results.put(("error", rank, traceback.format_exc()))
        raise


# ----------------------------------------------------------------------------- raw exchange rate
def _exchange_once(sock: socket.socket, outgoing: memoryview, incoming: memoryview) -> float:
    """Send ``outgoing`` while receiving ``incoming`` on one non-blocking socket; seconds taken."""
    total, step = len(outgoing), 1 << 20
    sock.setblocking(True)
    sock.sendall(b"s")  # both sides start together
    if sock.recv(1) != b"s":
        raise RuntimeError("raw exchange lost its sync byte")
    sock.setblocking(False)
    poller = select.poll()
    poller.register(sock, select.POLLIN | select.POLLOUT)
    sent = received = 0
    start = time.perf_counter()
    while sent < total or received < total:
        for _, events in poller.poll(1000):
            if events & select.POLLOUT and sent < total:
                try:
                    sent += sock.send(outgoing[sent:sent + step])
                except BlockingIOError:
                    pass
                if sent == total:
                    poller.modify(sock, select.POLLIN)
            if events & (select.POLLIN | select.POLLHUP) and received < total:
                try:
                    got = sock.recv_into(incoming[received:], min(step, total - received))
                except BlockingIOError:
                    continue
                if not got:
                    raise RuntimeError("raw exchange: the peer closed the connection")
                received += got
    return time.perf_counter() - start


def _exchange_peer(kind: str, role: int, address, nbytes: int, reps: int, buffer_bytes: int,
                   results) -> None:
    """One side of the raw test: ``reps`` + 1 exchanges of ``nbytes`` each way at once."""
    if role == 0:
        listener = address  # a listening socket, handed over by the parent
        sock, _ = listener.accept()
        listener.close()
    else:
        sock = socket.socket(socket.AF_UNIX if kind == "unix" else socket.AF_INET,
                             socket.SOCK_STREAM)
        sock.connect(address)
    for option in (socket.SO_SNDBUF, socket.SO_RCVBUF):  # as gpucoll's peer sockets
        sock.setsockopt(socket.SOL_SOCKET, option, buffer_bytes)
    if kind == "tcp":
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    outgoing = memoryview(np.ones(nbytes, np.uint8)).cast("B")
    incoming = memoryview(np.zeros(nbytes, np.uint8)).cast("B")
    times = [_exchange_once(sock, outgoing, incoming) for _ in range(reps + 1)]
    sock.close()
    results.put((kind, role, times[1:]))  # the first exchange warms up


def raw_exchange(ctx, nbytes: int, reps: int, timeout: float) -> Dict[str, dict]:
    """Two processes, each sending and receiving ``nbytes`` at once, per transport."""
    rates = {}
    for kind in ("unix", "tcp"):
        tmpdir = None
        if kind == "unix":
            tmpdir = tempfile.mkdtemp(prefix="gpucoll-bench-")
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(os.path.join(tmpdir, "raw.sock"))
        else:
            listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            listener.bind(("127.0.0.1", 0))
        listener.listen(1)
        address = listener.getsockname()
        results = ctx.Queue()
        procs = [ctx.Process(target=_exchange_peer,
                             args=(kind, role, listener if role == 0 else address, nbytes, reps,
                                   4 << 20, results)) for role in (0, 1)]
        for proc in procs:
            proc.start()
        listener.close()
        try:
            per_role = {}
            deadline = time.monotonic() + timeout
            while len(per_role) < 2:
                try:
                    _, role, times = results.get(timeout=1.0)
                    per_role[role] = times
                except queue_module.Empty:
                    failed = any(p.exitcode not in (None, 0) for p in procs)
                    if failed or time.monotonic() > deadline:
                        raise RuntimeError(f"raw {kind} exchange failed or timed out") from None
            slowest = [max(a, b) for a, b in zip(per_role[0], per_role[1])]
            each_way = [nbytes / t / 1e9 for t in slowest]
            rates[kind] = {"bytes": nbytes, "reps": reps, "gbps_best": max(each_way),
                           "gbps_median": statistics.median(each_way), "gbps_all": each_way}
        except RuntimeError as exc:
            rates[kind] = {"error": str(exc)}
        finally:
            _stop(procs, dump_stacks=False)
            if tmpdir:
                for leftover in Path(tmpdir).iterdir():
                    leftover.unlink()
                os.rmdir(tmpdir)
    return rates


# ----------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def _stop(procs, dump_stacks: bool) -> None:
    alive = [p for p in procs if p.is_alive()]
    if dump_stacks and alive and hasattr(signal, "SIGUSR1"):
        for proc in alive:
            os.kill(proc.pid, signal.SIGUSR1)
        time.sleep(1.0)
    for proc in procs:
        if proc.is_alive():
            proc.kill()
        proc.join(5)


def _fmt(value: Optional[float], width: int, digits: int) -> str:
    if value is None:
        return f"{'-':>{width}}"
    return f"{value:{width}.{digits}f}"


class Table:
    """Collects the rows of one world size as the ranks send them and prints them in order."""

    def __init__(self, n: int, opts, out):
        self.n, self.opts, self.out = n, opts, out
        self.cells: Dict[tuple, Dict[str, Dict[int, dict]]] = {}
        self.failed: Dict[tuple, str] = {}  # (collective, variant) -> first traceback
        self.info: Dict[str, str] = {}
        self.keys = [(c, s) for c in opts.collectives for s in opts.sizes]
        self.printed = 0
        self.unsteady = 0  # rows where some variant's slowest round took > UNSTEADY_SPREAD x its best
        self.rows: List[dict] = []

    def ready(self, key) -> bool:
        cells = self.cells.get(key, {})
        return all(len(cells.get(v, {})) == self.n or (key[0], v) in self.failed
                   for v in self.info)

    def flush(self, force: bool = False) -> None:
        while self.printed < len(self.keys):
            key = self.keys[self.printed]
            if not (force or self.ready(key)):
                return
            if self.printed == 0 or self.keys[self.printed - 1][0] != key[0]:
                self._header(key[0])
            self._row(key)
            self.printed += 1

    def _header(self, collective: str) -> None:
        variants = list(self.info)
        print(f"\n# {collective}  world_size={self.n}  float32  sum  "
              f"(busbw factor {COLLECTIVES[collective].bus_factor(self.n):.3f})", file=self.out)
        for name in variants:
            print(f"#   {name}: {self.info[name]}", file=self.out)
        for (coll, name), text in self.failed.items():
            if coll in (collective, None):
                print(f"#   {name} FAILED: {text.strip().splitlines()[-1]}", file=self.out)
        head1 = f"#{'':>11} {'':>11}"
        head2 = f"#{'size':>11} {'count':>11}"
        head3 = f"#{'(B)':>11} {'(elements)':>11}"
        for name in variants:
            head1 += f"  {name:^37}"
            head2 += f"  {'time':>10} {'algbw':>8} {'busbw':>8} {'#wrong':>8}"
            head3 += f"  {'(us)':>10} {'(GB/s)':>8} {'(GB/s)':>8} {'':>8}"
        if GLOO in variants:
            ratios = [v for v in variants if v != GLOO]
            head1 += f"  {'ratio: gloo time / gpucoll time':>{max(17, 9 * len(ratios))}}"
            head2 += "".join(f"  {v.replace('gpucoll-', ''):>7}" for v in ratios)
        print(head1, head2, head3, sep="\n", file=self.out)

    def _row(self, key) -> None:
        collective, nbytes = key
        factor = COLLECTIVES[collective].bus_factor(self.n)
        cells = self.cells.get(key, {})
        line, times, first, unsteady = "", {}, None, False
        for name in self.info:
            per_rank = cells.get(name, {})
            if len(per_rank) < self.n:
                line += f"  {'-':>10} {'-':>8} {'-':>8} {'-':>8}"
                continue
            first = first or next(iter(per_rank.values()))
            # a round's time is its slowest rank's; the row shows the best round
            rounds = [max(cell["round_seconds"][i] for cell in per_rank.values())
                      for i in range(min(len(cell["round_seconds"]) for cell in per_rank.values()))]
            seconds = min(rounds)
            unsteady = unsteady or max(rounds) > UNSTEADY_SPREAD * seconds
            wrong = sum(r["wrong"] for r in per_rank.values())
            algbw = first["bytes"] / seconds / 1e9
            times[name] = seconds
            line += f"  {seconds * 1e6:10.1f} {algbw:8.3f} {algbw * factor:8.3f} {wrong:8d}"
            self.rows.append({"world_size": self.n, "collective": collective, "variant": name,
                              "info": self.info[name], "requested_bytes": nbytes,
                              "bytes": first["bytes"],
                              "count": first["count"], "iters": first["iters"],
                              "time_us": seconds * 1e6, "algbw_gbps": algbw,
                              "busbw_gbps": algbw * factor, "wrong": wrong,
                              "round_time_us": [t * 1e6 for t in rounds],
                              "unsteady": max(rounds) > UNSTEADY_SPREAD * seconds,
                              "round_time_us_per_rank": {
                                  r: [t * 1e6 for t in per_rank[r]["round_seconds"]]
                                  for r in sorted(per_rank)}})
        if GLOO in self.info:
            for name in (v for v in self.info if v != GLOO):
                ratio = times[GLOO] / times[name] if GLOO in times and name in times else None
                line += "  " + _fmt(ratio, 7, 2)
        size = first["bytes"] if first else nbytes
        count = first["count"] if first else "-"
        if unsteady:
            line += "  ~"
            self.unsteady += 1
        print(f" {size:>11} {count:>11}" + line, file=self.out, flush=True)


def run_world(ctx, n: int, opts, out) -> Tuple[Table, List[str]]:
    ports = {name: _free_port() for name in opts.variants}
    results = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(rank, n, ports, opts, results),
                         name=f"bench-rank{rank}") for rank in range(n)]
    table, problems, done, hello = Table(n, opts, out), [], set(), {}
    deadline = time.monotonic() + opts.timeout
    for proc in procs:
        proc.start()
    try:
        while len(done) < n:
            try:
                message = results.get(timeout=1.0)
            except queue_module.Empty:
                dead = [p.name for p in procs if p.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    problems.append(f"world_size={n}: " + (f"{dead} exited early" if dead else
                                    f"no result within --timeout={opts.timeout:g} s; ranks killed"))
                    _stop(procs, dump_stacks=not dead)
                    break
                continue
            kind, rank = message[0], message[1]
            if kind == "hello":
                hello[rank] = message[2]
                if len(hello) == n:  # a variant that did not open on every rank is left out
                    names = [v for v in opts.variants if all(v in h for h in hello.values())]
                    table.info = {v: hello[0][v] for v in names}
            elif kind == "row":
                _, _, collective, nbytes, name, cell = message
                table.cells.setdefault((collective, nbytes), {}).setdefault(name, {})[rank] = cell
            elif kind == "failed":
                _, _, collective, name, text = message
                table.failed.setdefault((collective, name), text)
                problems.append(f"world_size={n} rank {rank}: {name} "
                                f"{collective or 'init'} failed:\n{text}")
            elif kind == "error":
                problems.append(f"world_size={n} rank {rank} died:\n{message[2]}")
                _stop(procs, dump_stacks=True)
                break
            elif kind == "done":
                done.add(rank)
            if table.info:
                table.flush()
    finally:
        _stop(procs, dump_stacks=False)
    table.flush(force=True)
    return table, problems


def _ratio_rows(rows: List[dict]) -> Dict[tuple, Dict[str, float]]:
    by_key: Dict[tuple, Dict[str, dict]] = {}
    for row in rows:
        key = (row["world_size"], row["collective"], row["bytes"])
        by_key.setdefault(key, {})[row["variant"]] = row
    ratios = {}
    for key, cells in by_key.items():
        if GLOO in cells:
            ratios[key] = {v: cells[GLOO]["time_us"] / cells[v]["time_us"]
                           for v in (GPUCOLL_DEFAULT, GPUCOLL_TCP) if v in cells}
    return ratios


def summarize(rows: List[dict], raw: Dict[str, dict], opts, out) -> dict:
    summary = {"ratios": [], "raw_fraction": []}
    ratios = _ratio_rows(rows)
    gpucoll_variants = [v for v in (GPUCOLL_DEFAULT, GPUCOLL_TCP) if v in opts.variants]
    if ratios:
        print("\n# Summary: gloo time / gpucoll time (above 1: gpucoll is faster)", file=out)
        print(f"#{'world':>6} {'collective':>15} {'variant':>16} {'smallest size':>20} "
              f"{'min from 1 MiB up':>24} {'max from 1 MiB up':>24}", file=out)
        for n in opts.world_sizes:
            for collective in opts.collectives:
                for name in gpucoll_variants:
                    points = sorted((b, r[name]) for (w, c, b), r in ratios.items()
                                    if w == n and c == collective and name in r)
                    if not points:
                        continue
                    large = [(r, b) for b, r in points if b >= MIB]
                    low = min(large) if large else None
                    high = max(large) if large else None
                    entry = {"world_size": n, "collective": collective, "variant": name,
                             "smallest_bytes": points[0][0], "ratio_smallest": points[0][1],
                             "min_ratio_from_1MiB": low and low[0], "at_bytes": low and low[1],
                             "max_ratio_from_1MiB": high and high[0]}
                    summary["ratios"].append(entry)
                    print(f" {n:>6} {collective:>15} {name:>16} "
                          f"{_ratio_cell((points[0][1], points[0][0])):>20} "
                          f"{_ratio_cell(low):>24} {_ratio_cell(high):>24}", file=out)
    if raw and any(r["collective"] == "all_reduce" for r in rows):
        print("\n# Largest all_reduce busbw as a fraction of the best raw two-way rate of its "
              "transport", file=out)
        for n in opts.world_sizes:
            for name in opts.variants:
                sizes = [r for r in rows if r["world_size"] == n and r["variant"] == name
                         and r["collective"] == "all_reduce"]
                if not sizes:
                    continue
                largest = max(sizes, key=lambda r: r["bytes"])
                transport = "unix" if largest["info"].endswith("links: unix") else "tcp"
                rate = raw.get(transport, {}).get("gbps_best")
                if not rate:
                    continue
                fraction = largest["busbw_gbps"] / rate
                summary["raw_fraction"].append({"world_size": n, "variant": name,
                                                "transport": transport, "bytes": largest["bytes"],
                                                "busbw_gbps": largest["busbw_gbps"],
                                                "raw_gbps": rate, "fraction": fraction})
                print(f"#   world_size={n} {name:>16} over {transport:<4}: busbw "
                      f"{largest['busbw_gbps']:.3f} GB/s at {_human(largest['bytes'])} = "
                      f"{fraction:.2f} of {rate:.3f} GB/s", file=out)
    return summary


def _ratio_cell(point: Optional[Tuple[float, int]]) -> str:
    return f"{point[0]:8.2f} at {_human(point[1]):>9}" if point else f"{'-':>20}"


def _human(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", MIB), ("KiB", 1 << 10)):
        if nbytes >= scale and nbytes % scale == 0:
            return f"{nbytes // scale} {unit}"
    return f"{nbytes} B"


def _parse_bytes(text: str) -> int:
    units = {"": 1, "b": 1, "k": 1 << 10, "kib": 1 << 10, "m": MIB, "mib": MIB,
             "g": 1 << 30, "gib": 1 << 30}
    stripped = text.strip().lower()
    number = stripped.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = stripped[len(number):]
    if not number or unit not in units:
        raise argparse.ArgumentTypeError(
            f"expected a byte count such as 8, 64K or 256M, got {text!r}")
    return int(float(number) * units[unit])


def _csv(choices):
    def parse(text: str) -> List[str]:
        names = [name.strip() for name in text.split(",") if name.strip()]
        unknown = [name for name in names if name not in choices]
        if unknown or not names:
            raise argparse.ArgumentTypeError(
                f"{unknown or text!r}: choose from {', '.join(choices)}")
        return names
    return parse


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-sizes", default="2,4",
                        type=lambda s: [int(x) for x in s.split(",") if x.strip()],
                        help="comma-separated world sizes (default 2,4)")
    parser.add_argument("--collectives", default=list(COLLECTIVES), type=_csv(list(COLLECTIVES)),
                        help="comma-separated subset of " + ", ".join(COLLECTIVES))
    parser.add_argument("--variants", default=list(ALL_VARIANTS), type=_csv(list(ALL_VARIANTS)),
                        help="comma-separated subset of " + ", ".join(ALL_VARIANTS))
    parser.add_argument("--min-bytes", type=_parse_bytes, default=8)
    parser.add_argument("--max-bytes", type=_parse_bytes, default=None,
                        help="largest size (default 256M; 16M with --quick)")
    parser.add_argument("--step-factor", type=int, default=None,
                        help="size multiplier between rows (default 4; 8 with --quick)")
    parser.add_argument("--quick", action="store_true", help="a short run (about 1-2 minutes)")
    parser.add_argument("--raw-bytes", type=_parse_bytes, default=None,
                        help="buffer of the raw two-way exchange test (default 64M; 0 skips it)")
    parser.add_argument("--op-timeout", type=float, default=120.0,
                        help="seconds any one collective may take (default 120)")
    parser.add_argument("--timeout", type=float, default=1500.0,
                        help="hard limit in seconds per world size; then every rank is killed")
    parser.add_argument("--rounds", type=int, default=3,
                        help="rounds the timed calls are split into; the best round is shown "
                             "(default 3)")
    parser.add_argument("--json", metavar="FILE", help="write every number to FILE")
    opts = parser.parse_args(argv)
    opts.max_bytes = opts.max_bytes or (16 * MIB if opts.quick else 256 * MIB)
    opts.step_factor = opts.step_factor or (8 if opts.quick else 4)
    if opts.step_factor < 2 or opts.min_bytes > opts.max_bytes or min(opts.world_sizes) < 2:
        parser.error("need --step-factor >= 2, --min-bytes <= --max-bytes, world sizes >= 2")
    if opts.raw_bytes is None:
        opts.raw_bytes = 16 * MIB if opts.quick else 64 * MIB
    opts.sizes = size_grid(opts.min_bytes, opts.max_bytes, opts.step_factor)
    # timed calls per size: target_bytes / size, clamped (the check and warm-up calls come on top)
    opts.target_bytes = 32 * MIB if opts.quick else 1 << 30
    opts.min_iters, opts.max_iters = (3, 100) if opts.quick else (6, 300)
    return opts


def main(argv=None) -> int:
    opts = parse_args(argv)
    out = sys.stdout
    torch_version = None
    if GLOO in opts.variants:
        if importlib.util.find_spec("torch") is None:
            print("# Gloo skipped: torch is not installed (a CPU build is enough: "
                  "pip install torch)", file=out)
            opts.variants = [v for v in opts.variants if v != GLOO]
        else:
            from importlib.metadata import version
            torch_version = version("torch")
    import gpucoll

    ctx = mp.get_context("spawn")
    started = time.time()
    meta = {"gpucoll": gpucoll.__version__, "torch": torch_version, "numpy": np.__version__,
            "python": platform.python_version(), "platform": platform.platform(),
            "cpus": os.cpu_count(), "loadavg_start": os.getloadavg(),
            "args": {k: v for k, v in vars(opts).items()}}
    print(f"# gpucoll {meta['gpucoll']}  torch {torch_version or '-'}  numpy "
          f"{np.__version__}  python {meta['python']}  {os.cpu_count()} CPUs  load average "
          + " ".join(f"{x:.2f}" for x in meta["loadavg_start"]), file=out)
    print(f"# sizes {_human(opts.sizes[0])} .. {_human(opts.sizes[-1])} (x{opts.step_factor}); "
          f"timed calls per size: {_human(opts.target_bytes)} / size within "
          f"[{opts.min_iters}, {opts.max_iters}], after one checked call and warm-up, split "
          f"into {opts.rounds} rounds;\n# time = the best round's mean per call on its slowest "
          "rank; the variants take turns round by round", file=out)

    raw = {}
    if opts.raw_bytes:
        raw = raw_exchange(ctx, opts.raw_bytes, 5 if opts.quick else 10, opts.op_timeout)
        print(f"\n# Raw two-way exchange, 2 processes, {_human(opts.raw_bytes)} each way at once, "
              "4 MiB socket buffers, one non-blocking socket polled for both directions", file=out)
        for kind, r in raw.items():
            if "error" in r:
                print(f"#   {kind:<4}: {r['error']}", file=out)
            else:
                print(f"#   {kind:<4}: {r['gbps_median']:.3f} GB/s each way (median of "
                      f"{r['reps']}; best {r['gbps_best']:.3f})", file=out, flush=True)

    rows, problems, unsteady = [], [], 0
    for n in opts.world_sizes:
        table, world_problems = run_world(ctx, n, opts, out)
        rows += table.rows
        problems += world_problems
        unsteady += table.unsteady
    summary = summarize(rows, raw, opts, out)
    wrong = sum(r["wrong"] for r in rows)
    meta["loadavg_end"] = os.getloadavg()
    meta["seconds"] = time.time() - started
    print(f"\n# {len(rows)} measurements, {wrong} wrong elements, {len(problems)} failures, "
          f"{unsteady} rows marked ~ (a variant's slowest round took more than "
          f"{UNSTEADY_SPREAD:g}x its best: the machine was busy; rerun for firm numbers), "
          f"{meta['seconds']:.0f} s; load average at the end "
          + " ".join(f"{x:.2f}" for x in meta["loadavg_end"]), file=out)
    for problem in problems:
        print(f"# FAILURE {problem}", file=sys.stderr)
    if opts.json:
        meta["args"]["sizes"] = opts.sizes
        with open(opts.json, "w") as handle:
            json.dump({"meta": meta, "raw_exchange": raw, "results": rows, "summary": summary,
                       "failures": problems}, handle, indent=1, default=str)
    return 1 if problems or wrong else 0


if __name__ == "__main__":
    sys.exit(main())
