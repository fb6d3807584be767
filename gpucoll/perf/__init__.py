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

Modules: :mod:`.specs` (the collectives, their inputs and checks), :mod:`.options` (sizes,
types, ops, :class:`BenchOptions`), :mod:`.devices` (host and CuPy buffers), :mod:`.engine`
(timing loop, Gloo comparison, spawning or joining the ranks) and :mod:`.report` (table,
progress, JSON, CSV and plot).

Example::

    gpucoll bench all_reduce -g 2 -b 8 -e 64M -f 4
    gpucoll run -n 4 -m gpucoll bench all -b 1K -e 1M      # ranks from a launcher
"""

# Every public name is re-exported here (gpucoll.cli and gpucoll.topo use some beyond __all__),
# and so are the private helpers the tests use.
from .devices import _Cuda, _Host  # noqa: F401
from .engine import _bandwidths, run_bench, run_rank  # noqa: F401
from .options import (ALL_DTYPES, ALL_OPS, BenchOptions, UsageError, parse_dtypes,  # noqa: F401
                      parse_ops, parse_size, size_sweep)
from .report import (Reporter, finish, require_matplotlib, row_cells, summarize,  # noqa: F401
                     table_header, write_csv, write_plot)
from .specs import (COLLECTIVES, AllGather, AllReduce, AllToAll, Broadcast, Buffers,  # noqa: F401
                    Collective, Reduce, ReduceScatter, SendRecv, count_wrong, expected_reduction,
                    pattern)

__all__ = [
    "COLLECTIVES", "Collective", "BenchOptions", "UsageError", "parse_size", "size_sweep",
    "pattern", "expected_reduction", "count_wrong", "run_rank", "row_cells",
]
