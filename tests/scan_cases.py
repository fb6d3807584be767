"""``scan`` / ``exscan`` cases run on every rank and their expected results, shared by
tests/test_collectives.py (the conformance suite) and tests/test_scan.py (by algorithm).

A case is ``(case_id, shape, dtype, op, "scan" | "exscan", "inplace" | "out")``; each rank's
input is :func:`reference.scan_input` of the case id and its rank."""

from __future__ import annotations

import numpy as np

from reference import identity_reference, prefix_reference, scan_input


def rank_scans(comm, arr, cases):
    """Each case's result (as NumPy) and the point-to-point calls it was made of."""
    out = {}
    for case_id, shape, dtype, op, name, mode in cases:
        keep = scan_input(case_id, comm.rank, shape, dtype, op)
        x = arr.dev(keep.copy())
        call = comm.scan if name == "scan" else comm.exscan
        before = comm.trace()[-1]["number"] if comm.trace() else 0
        if mode == "inplace":
            result = call(x, op=op)
            assert result is x
        else:
            target = arr.dev(np.full(shape, 5, dtype=keep.dtype))
            result = call(x, op, out=target)
            assert result is target
            np.testing.assert_array_equal(arr.host(x), keep)  # input untouched out of place
        calls = {entry["op"] for entry in comm.trace() if entry["number"] > before}
        out[case_id] = (arr.host(result), calls)
    return out


def scan_expected(case, rank, size):
    """Rank ``rank``'s result: NumPy's accumulate over the ranks' inputs."""
    case_id, shape, dtype, op, name, _ = case
    prefix = prefix_reference(np.stack([scan_input(case_id, r, shape, dtype, op)
                                        for r in range(size)]), op)
    if name == "scan":
        return prefix[rank]
    return identity_reference(op, prefix.dtype, shape) if rank == 0 else prefix[rank - 1]
