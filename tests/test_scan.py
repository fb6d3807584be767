"""``scan`` / ``exscan`` by algorithm: the pipelined chain and recursive doubling, each forced.

Every op (bitwise ones on integers), integer and float dtypes, counts that are and are not a
multiple of the chain's segment, count 0, 1-D and 2-D, in place and ``out=``, world sizes 1-4
on the CPU backend, 3 over shared memory, on the emulated NCCL backend (device arrays,
combined on the call's stream) and on the MPI backend (float16, which MPI does not reduce,
takes the generic algorithms there). Expected values: NumPy's ``accumulate`` over the ranks'
inputs. Also: which algorithm the default thresholds pick, and a rank dying mid-chain.
"""

from __future__ import annotations

import os
import time

import numpy as np
import pytest

from clusters import CLUSTERS
from mp_harness import RankFailure, run_ranks
from reference import assert_equal_result, op_valid
from scan_cases import rank_scans, scan_expected
from shared_clusters import shared_cluster_pools

pytestmark = pytest.mark.timeout(180)

_CHAIN_CLUSTERS = [c for c in CLUSTERS if c in (
    ("cpu-unix", 1), ("cpu-unix", 2), ("cpu-unix", 3), ("cpu-unix", 4), ("cpu-shm", 3),
    ("nccl-emulated", 3), ("mpi", 3))]
pool = shared_cluster_pools(_CHAIN_CLUSTERS)

SEGMENT_BYTES = 24  # int32, float32: 6 elements, uint8: 24, float16: 12; 37 end mid-segment
FORCE = {"chain": (((1, 0),), 1 << 30, SEGMENT_BYTES),  # from 1 rank, 0 bytes, no model
         "recursive_doubling": ((), 1 << 30, SEGMENT_BYTES)}  # no threshold applies
DEFAULT_MIN_BYTES = {2: 4 << 20, 3: 256 << 10, 4: 256 << 10}  # as README and RESULTS say


def rank_set_algorithm(comm, arr, min_bytes, measured_ranks, segment_bytes):
    """Set the module's thresholds (forcing an algorithm)."""
    from gpucoll import scan

    scan.CHAIN_MIN_BYTES, scan.CHAIN_MEASURED_RANKS, scan.CHAIN_SEGMENT_BYTES = (
        min_bytes, measured_ranks, segment_bytes)


def _run_forced(pool, algorithm, fn, *args):
    """``pool.run(fn, *args)`` with ``algorithm`` forced on every rank, then the defaults
    restored (the pools are shared with other modules; ranks that are threads share this
    process's module, whose values are the defaults between tests)."""
    from gpucoll import scan

    before = (scan.CHAIN_MIN_BYTES, scan.CHAIN_MEASURED_RANKS, scan.CHAIN_SEGMENT_BYTES)
    pool.run(rank_set_algorithm, *FORCE[algorithm])
    try:
        results = pool.run(fn, *args)
    except BaseException:
        try:  # ranks that are threads of this process live on; dead ones need nothing
            pool.run(rank_set_algorithm, *before)
        except RankFailure:
            pass
        raise
    pool.run(rank_set_algorithm, *before)
    return results


def _cases(dtypes):
    cases, case_id = [], 11000
    shapes = [(37,), (5, 11), (48,), (0,), (1,)]
    for dtype in dtypes:
        for op in ("sum", "prod", "min", "max", "band", "bor", "bxor"):
            if not op_valid(op, dtype):
                continue
            for name in ("scan", "exscan"):
                case_id += 1
                cases.append((case_id, shapes[case_id % len(shapes)], dtype, op, name,
                              ("inplace", "out")[case_id // 2 % 2]))
    return cases


@pytest.mark.parametrize("algorithm", ["chain", "recursive_doubling"])
def test_every_op_dtype_and_count_against_numpy(pool, algorithm):
    dtypes = ["float16"] if pool.backend == "mpi" else ["int32", "uint8", "float32"]
    cases = _cases(dtypes)
    results = _run_forced(pool, algorithm, rank_scans, cases)
    p2p = {"isend", "irecv"} if algorithm == "chain" else {"send", "recv", "sendrecv"}
    for rank, by_case in enumerate(results):
        for case in cases:
            got, calls = by_case[case[0]]
            assert_equal_result(got, scan_expected(case, rank, pool.world_size),
                                f"{algorithm} rank {rank} case {case}")
            sends_something = pool.world_size > 1 and int(np.prod(case[1])) > 0
            if pool.backend != "mpi" or case[2] == "float16":  # the path under test ran
                assert calls - {"scan", "exscan"} <= p2p, (algorithm, case, calls)
                if sends_something and algorithm == "chain":
                    assert calls & p2p, (case, calls)


def test_default_thresholds_pick_the_chain_for_large_arrays(pool):
    """Just below the measured threshold of the world size recursive doubling, above it
    the chain, with the default segment."""
    if pool.world_size == 1:
        pytest.skip("one rank sends nothing")
    dtype = "float16" if pool.backend == "mpi" else "float32"
    threshold = DEFAULT_MIN_BYTES[pool.world_size] // np.dtype(dtype).itemsize  # elements
    cases = [(11900, (threshold - 1,), dtype, "sum", "scan", "inplace"),
             (11901, (threshold + 3,), dtype, "sum", "exscan", "out"),
             (11902, (threshold + 3,), dtype, "max", "scan", "inplace")]
    results = pool.run(rank_scans, cases)
    for rank, by_case in enumerate(results):
        for case in cases:
            got, calls = by_case[case[0]]
            assert_equal_result(got, scan_expected(case, rank, pool.world_size),
                                f"rank {rank} case {case}")
            picked = "chain" if calls & {"isend", "irecv"} else "recursive_doubling"
            expected = "chain" if case[1][0] > threshold else "recursive_doubling"
            assert picked == expected, (case[0], pool.world_size, calls)


def test_scan_algorithm_thresholds():
    """The measured thresholds on 2-4 ranks; beyond 4, the chain only with at least
    size - 1 segments of 4 MiB."""
    from gpucoll.scan import scan_algorithm

    MiB = 1 << 20
    picks = {(1 << 40, 1): "recursive_doubling",
             (4 * MiB - 1, 2): "recursive_doubling", (4 * MiB, 2): "chain",
             (256 * 1024 - 1, 3): "recursive_doubling", (256 * 1024, 3): "chain",
             (256 * 1024 - 1, 4): "recursive_doubling", (256 * 1024, 4): "chain",
             (256 * 1024, 5): "recursive_doubling", (12 * MiB, 5): "recursive_doubling",
             (12 * MiB + 1, 5): "chain",
             (24 * MiB, 8): "recursive_doubling", (24 * MiB + 1, 8): "chain"}
    for (nbytes, size), expected in picks.items():
        assert scan_algorithm(nbytes, size) == expected, (nbytes, size)


# ---------------------------------------------------------------- a rank dies mid-chain
def rank_dies_mid_chain(comm):
    from gpucoll import GpucollError, scan

    scan.CHAIN_MIN_BYTES, scan.CHAIN_SEGMENT_BYTES = ((1, 0),), 64 << 10  # the chain, always
    x = np.ones(1 << 20, np.float32)  # 64 segments
    comm.scan(x.copy())  # one good chain first
    if comm.rank == 1:
        isend, sent = comm.isend, []

        def isend_then_die(*args, **kwargs):
            sent.append(isend(*args, **kwargs))
            if len(sent) == 4:
                sent[-1].wait()
                os._exit(17)  # dies without a word, a few segments into the chain
            return sent[-1]

        comm.isend = isend_then_die
    start = time.monotonic()
    try:
        comm.scan(x)
    except GpucollError as exc:
        return type(exc).__name__, str(exc), time.monotonic() - start
    return x


@pytest.mark.parametrize("transport", ["socket", "shm"])
def test_rank_dying_mid_chain_raises_on_the_others(transport):
    """Rank 2 waits on the dead rank 1 and raises within the timeout. Rank 0 receives
    nothing: it raises when a send fails, or finishes when the link took every segment (as
    shared memory may), with its own input as its result."""
    results = run_ranks(rank_dies_mid_chain, 3, timeout=60, ranks=[0, 2],
                        env={"GPUCOLL_TIMEOUT": "10", "GPUCOLL_TRANSPORT": transport})
    for rank, outcome in zip((0, 2), results):
        if rank == 0 and isinstance(outcome, np.ndarray):
            np.testing.assert_array_equal(outcome, np.ones(1 << 20, np.float32))
            continue
        assert isinstance(outcome, tuple), f"rank {rank} finished a scan whose rank 1 died"
        name, message, elapsed = outcome
        assert name in ("PeerError", "CommAbortedError", "CommTimeoutError"), message
        assert f"rank {rank}" in message, message
        assert elapsed < 12, f"rank {rank} took {elapsed:.1f} s to notice"
