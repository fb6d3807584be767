"""Host-side cost of one NCCL-backend call of each collective, measurable without a GPU.

Runs gpucoll's NCCL backend on the test suite's emulation of CuPy and NCCL
(``tests/emulated_cuda/``) as rank 0 of two, with the NCCL calls, the CUDA event and the stream
lookup replaced by no-ops, so what is timed is gpucoll's own Python per call: argument checks,
dtype and op translation, sequence numbers, the watchdog record, the flight recorder's record,
the result hand-back. It is a proxy for tracking regressions, not a GPU measurement. Lines:

- ``direct no-op call``: the replaced NCCL call alone (what a direct ``cupy.cuda.nccl``
  ``allReduce`` would cost here: nothing).
- ``all_reduce, emulated``: ``comm.all_reduce(x)`` on an emulated array. Its ``data``,
  ``flags``, ``device``, ``shape``... are Python properties that build objects on every read
  (``data.ptr`` goes through ``numpy.ndarray.ctypes``, about 2 us alone here), where CuPy's
  are Cython attributes; this line overstates gpucoll's part. It is the line earlier entries
  of ``RESULTS.md`` recorded.
- ``<op>, cached attrs``: each collective (``all_reduce``, ``broadcast``, ``reduce``,
  ``all_gather`` and ``reduce_scatter`` into ``out=``, ``send``, ``recv``, ``barrier``) on
  arrays seen through a subclass of the emulated array whose ``data``, ``flags``, ``device``,
  ``shape``, ``dtype``, ``size``... are plain attributes read once, at a few tens of ns each,
  about what CuPy's cost. This is the closer estimate of gpucoll's own Python per call on a GPU
  (slightly low: CuPy builds a small ``Flags`` / ``Device`` object on each read of ``flags`` /
  ``device``).

The lines run interleaved, round by round, so a busy machine slows them alike; each line's
median and best are over the rounds. ``--calls`` and ``--rounds`` set the sizes, ``--ops``
which collectives run.

``--instructions`` counts instead of timing: it runs this script under
``valgrind --tool=cachegrind --cache-sim=no`` once with ``--loop OP --calls 1000`` and once
with ``--calls 6000`` per collective and prints the difference per call, which does not depend
on the machine's load. In ``--loop`` mode the watchdog thread is stopped (its queues are emptied
every 500 calls, as its polls would), so only the calling thread's work is counted.

    python bench/bench_nccl_host.py [--calls 50000] [--rounds 7] [--ops all_reduce,broadcast]
    python bench/bench_nccl_host.py --instructions [--ops ...]
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import emulated_cuda  # noqa: E402
from gpucoll import cuda_env  # noqa: E402
from gpucoll.rendezvous.memory_store import MemoryStore  # noqa: E402

# what gpucoll reads of an array on the collectives' paths (and a little more)
_CACHED = ("data", "flags", "device", "shape", "dtype", "size", "nbytes", "ndim", "itemsize",
           "strides", "_c_contiguous")
OPS = ("all_reduce", "broadcast", "reduce", "all_gather", "reduce_scatter", "send", "recv",
       "barrier")
_INSTRUCTION_CALLS = (1000, 6000)  # --instructions: two runs, their difference per call


class _NoopComm:
    """An NCCL communicator whose calls do nothing."""

    def _noop(self, *args):
        pass

    allReduce = broadcast = reduce = allGather = reduceScatter = send = recv = _noop
    check_async_error = abort = destroy = _noop


class _DoneEvent:
    ptr = 1
    done = True


_CACHED_CLASSES: dict = {}


def cached_attributes(array):
    """``array``'s memory as an array of a subclass whose attributes in ``_CACHED`` are read
    once and then stored (plain class attributes shadow the base class's properties, so the
    instance's own values are found first)."""
    cls = _CACHED_CLASSES.get(type(array))
    if cls is None:  # one per array type, as CuPy has one ndarray type
        cls = _CACHED_CLASSES[type(array)] = type(
            "CachedAttributeArray", (type(array),),
            dict(dict.fromkeys(_CACHED), __module__=type(array).__module__))  # still "cupy"
    view = cls(array._a, array._device_id, array._owner, array._owndata)
    view.__dict__.update({name: getattr(array, name) for name in _CACHED})
    return view


def setup():
    """Rank 0 of a two-rank NCCL communicator whose NCCL calls, events and stream are no-ops;
    the emulated cupy module."""
    from gpucoll.backends.nccl import NCCLCommunicator

    emu = emulated_cuda.Emulation(device_count=1)
    cuda_env._LOADED = (emu.cupy, emu.nccl)
    comm = NCCLCommunicator(MemoryStore(), 0, 2, comm_id="bench", timeout=60,
                            _nccl_comm=_NoopComm(), _local=(0, 1))
    comm._new_event = _DoneEvent
    comm._runtime = types.SimpleNamespace(getDevice=lambda: 0, eventRecord=lambda e, s: None,
                                          streamIsCapturing=lambda s: False)
    comm._event_done = lambda event: True   # the watchdog's event query: the no-op event is done
    current = types.SimpleNamespace(ptr=0)
    emu.cupy.cuda.get_current_stream = lambda: current
    return comm, emu.cupy


def calls(comm, cupy):
    """name -> a no-argument function making one call, for every line."""
    x = cupy.ones(2, dtype="float32")
    fast = cached_attributes(x)
    gathered = cached_attributes(cupy.ones((2, 2), dtype="float32"))
    chunk = cached_attributes(cupy.ones(2, dtype="float32"))
    raw = comm.nccl_comm
    return {
        "direct no-op call": lambda: raw.allReduce(1, 1, 2, 7, 0, 0),
        "all_reduce, emulated": lambda: comm.all_reduce(x),
        "all_reduce": lambda: comm.all_reduce(fast),
        "broadcast": lambda: comm.broadcast(fast, 0),
        "reduce": lambda: comm.reduce(fast, 0),
        "all_gather": lambda: comm.all_gather(chunk, out=gathered),
        "reduce_scatter": lambda: comm.reduce_scatter(gathered, out=chunk),
        "send": lambda: comm.send(fast, 1),
        "recv": lambda: comm.recv(fast, 1),
        "barrier": lambda: comm.barrier(),
    }


def loop(op: str, count: int) -> None:
    """``count`` calls of ``op`` after 200 to warm up, the watchdog thread stopped."""
    comm, cupy = setup()
    comm._watchdog.stop()
    streams = comm._watchdog._streams
    fn = calls(comm, cupy)[op]

    def retire():  # what the watchdog's polls would do: release the completed work
        for queue in streams.values():
            while queue:
                queue.popleft().release()

    for _ in range(200):
        fn()
    retire()
    for i in range(count):
        fn()
        if i % 500 == 499:
            retire()


def count_instructions(command) -> int:
    """Instructions ``command`` (a Python script and its arguments) runs, under
    ``valgrind --tool=cachegrind --cache-sim=no``, with a fixed hash seed."""
    env = dict(os.environ, PYTHONHASHSEED="0", OPENBLAS_NUM_THREADS="1")
    run = subprocess.run(["valgrind", "--tool=cachegrind", "--cache-sim=no",
                          "--cachegrind-out-file=/dev/null", sys.executable] + list(command),
                         env=env, capture_output=True, text=True, check=True)
    found = re.search(r"I\s+refs:\s+([\d,]+)", run.stderr)
    if found is None:
        raise RuntimeError(f"no instruction count in valgrind's output:\n{run.stderr}")
    return int(found.group(1).replace(",", ""))


def instructions(op: str) -> float:
    """Instructions per call of ``op``: two runs under cachegrind, their difference."""
    counts = [count_instructions([os.path.abspath(__file__), "--loop", op, "--calls", str(count)])
              for count in _INSTRUCTION_CALLS]
    return (counts[1] - counts[0]) / (_INSTRUCTION_CALLS[1] - _INSTRUCTION_CALLS[0])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--ops", default=",".join(OPS),
                        help=f"comma-separated, of {', '.join(OPS)} (default: all)")
    parser.add_argument("--instructions", action="store_true",
                        help="count instructions per call under valgrind instead of timing")
    parser.add_argument("--loop", metavar="OP", help=argparse.SUPPRESS)  # one run counted
    args = parser.parse_args(argv)
    ops = [op for op in args.ops.split(",") if op]
    unknown = sorted(set(ops) - set(OPS))
    if unknown:
        parser.error(f"unknown --ops {', '.join(unknown)}; choose from {', '.join(OPS)}")
    if args.loop:
        loop(args.loop, args.calls)
        return 0
    if args.instructions:
        for op in ops:
            print(f"{op:25s} {instructions(op):8.0f} instructions/call", flush=True)
        return 0
    comm, cupy = setup()
    every = calls(comm, cupy)
    names = ["direct no-op call"] + (["all_reduce, emulated"] if "all_reduce" in ops else []) \
        + [f"{op}" for op in ops]
    cases = [(name, every[name]) for name in names]
    results = {name: [] for name in names}
    for _, fn in cases:  # warm up: dtype and op caches, the event pool
        for _ in range(1000):
            fn()
    for _ in range(args.rounds):
        for name, fn in cases:
            start = time.perf_counter()
            for _ in range(args.calls):
                fn()
            results[name].append((time.perf_counter() - start) / args.calls * 1e6)
    comm.close()
    for name, times in results.items():
        label = name if name in ("direct no-op call", "all_reduce, emulated") \
            else f"{name}, cached attrs"
        print(f"{label:28s} median {statistics.median(times):6.2f} us/call, "
              f"best {min(times):6.2f} (of {args.rounds} rounds x {args.calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
