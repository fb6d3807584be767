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
    broadcast, reduce, sendrecv, halo 1

For all_gather, reduce_scatter and all_to_all ``size`` is the total (n x block) bytes and
``count`` the elements of one rank's block, as nccl-tests prints them. The time is the mean
over ranks of each rank's mean time per iteration (``-a`` chooses rank 0's, the fastest or the
slowest rank's instead; ``--rounds N`` keeps the best of N rounds).

Modules: :mod:`.reference` (inputs from (seed, rank, index) and expected results, shared with
the test suite), :mod:`.specs` (the collectives), :mod:`.options` (sizes, types, ops,
:class:`BenchOptions`), :mod:`.devices` (host and CuPy buffers), :mod:`.engine` (the timing
loop: variants, rounds, combining the ranks' times), :mod:`.gloo` (``--compare gloo``),
:mod:`.ranks` (spawning or joining the ranks, ``--transport``), :mod:`.ceiling` (the raw socket
rate), :mod:`.machine` (host and versions for the JSON), :mod:`.table` and :mod:`.report`
(table layouts, progress, summaries, JSON and CSV) and :mod:`.plot`.

Example::

    gpucoll bench all_reduce -g 2 -b 8 -e 64M -f 4
    gpucoll run -n 4 -m gpucoll bench all -b 1K -e 1M      # ranks from a launcher
    gpucoll bench all_reduce -g 2 --transport unix,tcp --compare gloo --rounds 3
"""

# Every public name is re-exported here (gpucoll.cli and gpucoll.topo use some beyond __all__),
# and so are the private helpers the tests use.
from .devices import _Cuda, _Host  # noqa: F401
from .engine import _bandwidths, run_rank, variant_keys  # noqa: F401
from .options import (ALL_DTYPES, ALL_OPS, AVERAGES, BenchOptions, UsageError,  # noqa: F401
                      parse_dtypes, parse_ops, parse_size, parse_transports, size_sweep)
from .plot import make_figure, plot_title, require_matplotlib, size_label, write_plot  # noqa: F401
from .ranks import measure, run_bench  # noqa: F401
from .reference import count_wrong, expected_reduction, pattern  # noqa: F401
from .report import (Reporter, finish, from_document, human_bytes, ratio_summary, row_cells,  # noqa: F401
                     summarize, table_header, write_csv)
from .specs import (COLLECTIVES, AllGather, AllReduce, AllToAll, Broadcast, Buffers,  # noqa: F401
                    Collective, Reduce, ReduceScatter, SendRecv)

__all__ = [
    "COLLECTIVES", "Collective", "BenchOptions", "UsageError", "parse_size", "size_sweep",
    "pattern", "expected_reduction", "count_wrong", "run_rank", "row_cells", "run_bench",
    "measure",
]
