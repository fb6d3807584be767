"""The ``gpucoll bench`` timing loop: one row = every variant of one collective at one size.

A *variant* is one thing timed: a mode (``"out"`` of place, ``"in"`` place) of a gpucoll
communicator, one communicator per transport when several are compared, or Gloo's call.
:func:`run_rank` runs the whole sweep on one rank through the Communicator API and emits rows
to rank 0's reporter.

How a row is timed, on every rank: each variant runs ``warmup`` untimed calls, the ranks meet in
that variant's barrier, and ``iters`` calls are timed back to back (a GPU stream is synchronized
before the clock stops); Python's cyclic garbage collector is paused inside the timed loop. With
``rounds`` > 1 the timed calls are split into rounds and the variants take turns round by round
(in an order rotated from size to size), so that a burst of load elsewhere on the machine hits
them alike. Then each variant's result is checked once, from fresh inputs. A round's time is
combined over the ranks as nccl-tests' ``-a`` says (default: the mean of the ranks' mean time
per call); the row shows the best round. With the defaults (one round, ``-a 1``) this is
nccl-tests' method and the method of earlier gpucoll releases.
"""

from __future__ import annotations

import gc as garbage_collector
import os
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from .devices import _device_for, _Host
from .options import _SHOWN_TYPE, BenchOptions
from .specs import COLLECTIVES, Collective

UNSTEADY_SPREAD = 2.0  # an entry is "unsteady" when its slowest round took more than this x its best


# ---------------------------------------------------------------- measuring (every rank)
def _timed(run: Callable[[], None], sync: Callable[[], None], barrier: Callable[[], None],
           iters: int, warmup: int) -> float:
    """Seconds per iteration of ``run`` after ``warmup`` untimed calls.

    Repeated in-place reductions overflow (sums double per call, as in nccl-tests); the
    results of timed calls are not checked, so NumPy's overflow warnings are silenced here.
    """
    with np.errstate(all="ignore"):
        return _timed_quietly(run, sync, barrier, iters, warmup)


def _timed_quietly(run: Callable[[], None], sync: Callable[[], None],
                   barrier: Callable[[], None], iters: int, warmup: int) -> float:
    for _ in range(warmup):
        run()
    sync()
    barrier()
    collecting = garbage_collector.isenabled()
    garbage_collector.disable()  # a cycle collection inside the loop is noise, not the library
    try:
        start = time.perf_counter()
        for _ in range(iters):
            run()
        sync()
        return (time.perf_counter() - start) / iters
    finally:
        if collecting:
            garbage_collector.enable()


def _bandwidths(entry: Dict[str, Any], nbytes: int, factor: float) -> Dict[str, Any]:
    seconds = entry["time_us"] / 1e6
    algbw = nbytes / seconds / 1e9 if seconds > 0 else 0.0
    entry.update(algbw=algbw, busbw=algbw * factor)
    return entry


def variant_keys(labels: Sequence[Optional[str]], modes: Sequence[str]) -> List[Tuple[str, Optional[str], str]]:
    """(key, transport label, mode) of the gpucoll variants of one row.

    One communicator: the keys are the modes (``"out"``, ``"in"``), as nccl-tests' columns;
    several: ``"<transport>/<mode>"``.
    """
    if len(labels) == 1:
        return [(mode, labels[0], mode) for mode in modes]
    return [(f"{label}/{mode}", label, mode) for label in labels for mode in modes]


@dataclass
class _Variant:
    """One timed thing: its calls, barrier, sync, input fill and result check."""

    key: str
    run: Callable[[], None]
    barrier: Callable[[], None]
    sync: Callable[[], None]
    fill: Callable[[int], None]
    wrong: Callable[[int], int]
    seed: int


def _gpucoll_variant(key, comm, dev, coll: Collective, bufs, mode, op, root, seed) -> _Variant:
    rank, nranks = comm.rank, comm.size

    def check(check_seed: int) -> int:
        coll.fill(dev, bufs, mode, check_seed, rank, nranks, op, root)
        coll.run(comm, bufs, mode, op, root)
        dev.sync()
        return coll.wrong(dev, bufs, mode, check_seed, rank, nranks, op, root)

    return _Variant(key, lambda: coll.run(comm, bufs, mode, op, root), comm.barrier, dev.sync,
                    lambda s: coll.fill(dev, bufs, mode, s, rank, nranks, op, root), check, seed)


def _gloo_variant(gloo, host, coll: Collective, bufs, op, root, rank, nranks, seed):
    """Gloo's call on host buffers, or None (N/A) for a dtype torch cannot wrap or an op Gloo lacks."""
    mode = coll.gloo_mode
    try:
        send, recv = gloo.tensor(bufs.send), gloo.tensor(bufs.recv)
        torch_op = gloo.op(op)
    except (TypeError, NotImplementedError):
        return None
    call = lambda: coll.gloo(gloo.dist, send, recv, torch_op, root, rank, nranks)  # noqa: E731

    def check(check_seed: int) -> int:
        coll.fill(host, bufs, mode, check_seed, rank, nranks, op, root)
        call()
        return coll.wrong(host, bufs, mode, check_seed, rank, nranks, op, root)

    return _Variant("gloo", call, gloo.dist.barrier, lambda: None,
                    lambda s: coll.fill(host, bufs, mode, s, rank, nranks, op, root), check, seed)


def _comparison_side(compare: Optional[str], comm, dev, timeout: float):
    """The peer library timed beside gpucoll (``--compare``), or None. Its rows' key stays
    ``"gloo"`` whichever peer it is; the table names the peer."""
    if compare == "gloo":
        from .gloo import GlooSide

        return GlooSide(comm, dev, timeout)
    if compare == "mpi":
        from .mpi import MPISide

        return MPISide(comm, dev, timeout)
    return None


def _play(variants: List[_Variant], iters: int, warmup: int, rounds: int, shift: int,
          check: bool) -> Tuple[List[List[float]], List[Optional[int]]]:
    """Time every variant (seconds per call in each round) and check each once."""
    rounds = max(1, min(rounds, iters))
    per_round = -(-iters // rounds)
    seconds: List[List[float]] = [[] for _ in variants]
    wrong: List[Optional[int]] = [None] * len(variants)
    if rounds == 1:  # nccl-tests' order: each variant filled, warmed, timed and checked in turn
        for index, variant in enumerate(variants):
            variant.fill(variant.seed)
            seconds[index].append(_timed(variant.run, variant.sync, variant.barrier, per_round,
                                         warmup))
            if check:
                wrong[index] = variant.wrong(variant.seed + 1)
        return seconds, wrong

    def order(turn: int) -> List[int]:
        turn %= len(variants)
        return list(range(turn, len(variants))) + list(range(turn))

    for index in order(shift):
        variants[index].fill(variants[index].seed)
        with np.errstate(all="ignore"):  # see _timed
            for _ in range(warmup):
                variants[index].run()
        variants[index].sync()
    for round_index in range(rounds):
        for index in order(shift + round_index):
            variant = variants[index]
            seconds[index].append(_timed(variant.run, variant.sync, variant.barrier, per_round, 0))
    if check:
        for index, variant in enumerate(variants):
            wrong[index] = variant.wrong(variant.seed + 1)
    return seconds, wrong


def _combine(comm, dev, seconds: List[List[float]], wrong: List[Optional[int]],
             average: int) -> List[Dict[str, Any]]:
    """Every rank's round times and wrong counts, gathered once (outside timing) and combined.

    A round's time over the ranks: rank 0's (``average`` 0), the mean (1), the fastest (2) or
    the slowest rank's (3); an entry's time is its best round. Wrong counts add up.
    """
    rounds = len(seconds[0])
    local = np.array([times + [-1.0 if w is None else float(w)] for times, w in zip(seconds, wrong)],
                     np.float64)
    table = local[None]
    if comm.size > 1:
        buf = dev.empty(local.shape, np.float64)
        dev.put(buf, local)
        out = dev.empty((comm.size,) + local.shape, np.float64)
        comm.all_gather(buf, out=out)
        table = np.array(dev.get(out), np.float64)
    combine = {0: lambda t: t[0], 1: lambda t: t.mean(axis=0), 2: lambda t: t.min(axis=0),
               3: lambda t: t.max(axis=0)}[average]
    entries = []
    for index in range(len(seconds)):
        per_round = combine(table[:, index, :rounds])
        counts = table[:, index, rounds]
        entry = {"time_us": float(per_round.min()) * 1e6,
                 "wrong": None if (counts < 0).any() else int(round(counts.sum()))}
        if rounds > 1:
            entry["round_time_us"] = [float(t) * 1e6 for t in per_round]
            entry["unsteady"] = bool(per_round.max() > UNSTEADY_SPREAD * per_round.min())
        entries.append(entry)
    return entries


def _measure(comms, dev, coll: Collective, opts: BenchOptions, dtype, op, root, nbytes: int,
             seed: int, gloo, shift: int) -> Dict[str, Any]:
    """One table row: every variant of ``coll`` at one size."""
    control = comms[0][1]
    nranks, rank = control.size, control.rank
    count = coll.count_for(nbytes, dtype.itemsize, nranks)
    size = coll.size_of(count, dtype.itemsize, nranks)
    factor = coll.bus_factor(nranks)
    row: Dict[str, Any] = {"collective": coll.name, "size": size, "count": count,
                           "type": _SHOWN_TYPE.get(dtype.name, dtype.name),
                           "redop": op.value if op is not None else "none", "root": root,
                           "out": None, "in": None, "gloo": None, "ratio": None}
    bufs = coll.buffers(dev, count, dtype, nranks)
    labels = [label for label, _ in comms]
    keys = variant_keys(labels, opts.modes_of(coll))
    by_label = dict(comms)
    variants = [_gpucoll_variant(key, by_label[label], dev, coll, bufs, mode, op, root,
                                 seed * 16 + 2 * index)
                for index, (key, label, mode) in enumerate(keys)]
    if gloo is not None:
        host = _Host()
        host_bufs = bufs if dev.kind == "host" else coll.buffers(host, count, dtype, nranks)
        theirs = _gloo_variant(gloo, host, coll, host_bufs, op, root, rank, nranks, seed * 16 + 14)
        if theirs is not None:
            variants.append(theirs)
    iters, warmup = opts.iterations(size)
    seconds, wrong = _play(variants, iters, warmup, opts.rounds, shift, opts.check)
    del bufs
    for variant, entry in zip(variants, _combine(control, dev, seconds, wrong, opts.average)):
        row[variant.key] = _bandwidths(entry, size, factor)
    if len(comms) > 1:
        first = labels[0]
        row["out"], row["in"] = row.get(f"{first}/out"), row.get(f"{first}/in")
    if gloo is not None:
        ratios = {}
        for key, label, mode in keys:
            if mode == coll.gloo_mode:
                ratios[label] = _ratio(row["gloo"], row[key])
        row["ratio"] = ratios.get(labels[0])
        if len(comms) > 1:
            row["ratios"] = ratios
    return row


def _ratio(theirs: Optional[Dict[str, Any]], mine: Optional[Dict[str, Any]]) -> Optional[float]:
    """Gloo's time / gpucoll's (= gpucoll busbw / Gloo busbw; above 1: gpucoll is faster)."""
    if theirs is None or mine is None or not mine["time_us"] > 0:
        return None
    return theirs["time_us"] / mine["time_us"]


def describe(label: Optional[str], comm) -> str:
    """``gpucoll 0.1.0, links: unix`` for one measured communicator."""
    from .. import __version__

    kinds = getattr(comm, "transport_kinds", None)
    links = "+".join(sorted(set(kinds.values()))) if kinds else comm.backend
    return f"gpucoll {__version__}, links: {links or 'none (1 rank)'}"


def run_rank(comms, opts: BenchOptions, emit: Optional[Callable[[str, Any], None]]) -> None:
    """Run the whole sweep on this rank; rank 0 passes ``emit`` to receive the events.

    Args:
        comms: a Communicator, or [(transport label, Communicator)] (one per ``--transport``;
            the first also carries the bench's own messages).
        opts: what to measure.
        emit: rank 0's event sink (ignored on other ranks).

    Events: ``("begin", info)`` once, ``("start", name)`` before each collective's rows,
    ``("row", row)``, ``("skip", (name, reason))`` and ``("end", name)``.
    """
    from .machine import describe_machine

    if not isinstance(comms, (list, tuple)):
        comms = [(None, comms)]
    comm = comms[0][1]
    dev = _device_for(comm)
    say = emit if comm.rank == 0 and emit is not None else (lambda kind, value: None)
    pids = np.array([os.getpid()], np.int64)
    if comm.size > 1:
        buf = dev.empty(1, np.int64)
        dev.put(buf, pids)
        out = dev.empty((comm.size, 1), np.int64)
        comm.all_gather(buf, out=out)
        pids = dev.get(out).reshape(-1)
    gloo = _comparison_side(opts.compare, comm, dev, opts.timeout)
    info = {"nranks": comm.size, "backend": comm.backend, "pids": [int(p) for p in pids],
            "labels": [label for label, _ in comms],
            "variants": {label: describe(label, c) for label, c in comms}}
    if comm.rank == 0:
        info["machine"] = describe_machine(comm)
        if gloo is not None:
            info["compare_version"] = gloo.version
    say("begin", info)
    try:
        seed, shift = opts.seed, 0
        for name in opts.collectives:
            coll = COLLECTIVES[name]
            if comm.size < coll.min_ranks:
                say("skip", (name, f"{name} needs at least {coll.min_ranks} ranks"))
                continue
            say("start", name)
            for dtype, op, root in opts.cases(coll, comm.size):
                for nbytes in opts.sizes:
                    seed += 1
                    say("row", _measure(comms, dev, coll, opts, dtype, op, root, nbytes, seed,
                                        gloo, shift))
                    shift += 1
            say("end", name)
    finally:
        if gloo is not None:
            gloo.close()
