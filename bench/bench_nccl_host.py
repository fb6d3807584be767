"""Host-side cost of one NCCL-backend ``all_reduce`` call, measurable without a GPU.

Runs gpucoll's NCCL backend on the test suite's emulation of CuPy and NCCL
(``tests/emulated_cuda/``) with the NCCL call, the CUDA event and the stream lookup replaced
by no-ops, so what is timed is gpucoll's own Python per call: argument checks, dtype and op
translation, sequence numbers, the watchdog record, the flight recorder's record, the result
hand-back. It is a proxy for tracking regressions, not a GPU measurement. Three lines:

- ``direct no-op call``: the replaced NCCL call alone (what a direct ``cupy.cuda.nccl``
  ``allReduce`` would cost here: nothing).
- ``all_reduce, emulated``: ``comm.all_reduce(x)`` on an emulated array. Its ``data``,
  ``flags``, ``device``, ``shape``... are Python properties that build objects on every read
  (``data.ptr`` goes through ``numpy.ndarray.ctypes``, about 2 us alone here), where CuPy's
  are Cython attributes; this line overstates gpucoll's part. It is the line earlier entries
  of ``RESULTS.md`` recorded.
- ``all_reduce, cached attrs``: the same call on the same memory seen through a subclass of
  the emulated array whose ``data``, ``flags``, ``device``, ``shape``, ``dtype``, ``size``...
  are plain attributes read once, at a few tens of ns each, about what CuPy's cost. This is
  the closer estimate of gpucoll's own Python per call on a GPU (slightly low: CuPy builds a
  small ``Flags`` / ``Device`` object on each read of ``flags`` / ``device``).

The three run interleaved, round by round, so a busy machine slows them alike; each line's
median and best are over the rounds. ``--calls`` and ``--rounds`` set the sizes.

    python bench/bench_nccl_host.py [--calls 50000] [--rounds 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import types

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import emulated_cuda  # noqa: E402
import gpucoll  # noqa: E402
from gpucoll import cuda_env  # noqa: E402

# what gpucoll reads of an array on the all_reduce path (and a little more)
_CACHED = ("data", "flags", "device", "shape", "dtype", "size", "nbytes", "ndim", "itemsize",
           "strides")


class _NoopComm:
    def allReduce(self, *args):
        pass

    def check_async_error(self):
        pass

    def abort(self):
        pass

    def destroy(self):
        pass


class _DoneEvent:
    ptr = 1
    done = True


def cached_attributes(array):
    """``array``'s memory as an array of a subclass whose attributes in ``_CACHED`` are read
    once and then stored (plain class attributes shadow the base class's properties, so the
    instance's own values are found first)."""
    cls = type("CachedAttributeArray", (type(array),), dict.fromkeys(_CACHED))
    view = cls(array._a, array._device_id, array._owner, array._owndata)
    view.__dict__.update({name: getattr(array, name) for name in _CACHED})
    return view


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50000, help="calls per round")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args(argv)
    emu = emulated_cuda.Emulation(device_count=1)
    cuda_env._LOADED = (emu.cupy, emu.nccl)
    store = tempfile.mkdtemp(prefix="gpucoll-host-")
    comm = gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{store}/s", timeout=60)
    x = emu.cupy.ones(2, dtype="float32")
    fast = cached_attributes(x)
    real = comm.nccl_comm
    comm.nccl_comm = _NoopComm()
    comm._new_event = _DoneEvent
    comm._runtime = types.SimpleNamespace(getDevice=lambda: 0, eventRecord=lambda e, s: None)
    comm._event_done = lambda event: True   # the watchdog's event query: the no-op event is done
    current = types.SimpleNamespace(ptr=0)
    emu.cupy.cuda.get_current_stream = lambda: current
    raw = comm.nccl_comm

    def direct():
        raw.allReduce(1, 1, 2, 7, 0, 0)

    cases = (("direct no-op call", direct),
             ("all_reduce, emulated", lambda: comm.all_reduce(x)),
             ("all_reduce, cached attrs", lambda: comm.all_reduce(fast)))
    calls = args.calls
    results = {name: [] for name, _ in cases}
    for fn in (fn for _, fn in cases):  # warm up: dtype and op caches, the event pool
        for _ in range(1000):
            fn()
    for _ in range(args.rounds):
        for name, fn in cases:
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            results[name].append((time.perf_counter() - start) / calls * 1e6)
    comm.nccl_comm = real
    comm.close()
    for name, times in results.items():
        print(f"{name:25s} median {statistics.median(times):6.2f} us/call, "
              f"best {min(times):6.2f} (of {args.rounds} rounds x {calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
