"""Host-side cost of one NCCL-backend ``all_reduce`` call, measurable without a GPU.

Runs gpucoll's NCCL backend on the test suite's emulation of CuPy and NCCL
(``tests/emulated_cuda/``) with the NCCL call, the CUDA event and the stream lookup replaced
by no-ops, so what is timed is gpucoll's own Python per call: argument checks, dtype and op
translation, sequence numbers, the watchdog record, the result hand-back. The emulated
arrays' ``data``/``flags``/``device`` properties are Python here (Cython in CuPy), so this is
an upper bound of gpucoll's part of the per-call overhead that ``bench_nccl.py`` measures on
a GPU. It is a proxy for tracking regressions, not a GPU measurement.

    python bench/bench_nccl_host.py
"""

from __future__ import annotations

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
from gpucoll import api  # noqa: E402
from gpucoll import cuda_env  # noqa: E402


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


def main() -> int:
    emu = emulated_cuda.Emulation(device_count=1)
    cuda_env._LOADED = (emu.cupy, emu.nccl)
    store = tempfile.mkdtemp(prefix="gpucoll-host-")
    comm = gpucoll.init(backend="nccl", rank=0, world_size=1, url=f"file://{store}/s", timeout=60)
    x = emu.cupy.ones(2, dtype="float32")
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

    def ours():
        comm.all_reduce(x)

    calls, rounds = 50000, 7
    results = {}
    for name, fn in (("direct no-op call", direct), ("gpucoll all_reduce", ours)):
        times = []
        for _ in range(rounds):
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            times.append((time.perf_counter() - start) / calls * 1e6)
        results[name] = times
    comm.nccl_comm = real
    comm.close()
    for name, times in results.items():
        print(f"{name:20s} median {statistics.median(times):6.2f} us/call, "
              f"best {min(times):6.2f} (of {rounds} rounds x {calls} calls)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
