"""Uneven all-to-all: ``comm.all_to_all_v`` against torch.distributed's ``all_to_all_single``
with split sizes on Gloo, in the same ranks and the same run (MoE token dispatch).

    gpucoll run -n 4 bench/bench_alltoallv.py [--tokens 256,4096] [--features 512] [--repeat 7]

Each rank routes ``--tokens`` float32 rows of ``--features`` to the ranks by a multinomial draw:
``uniform`` (every rank equally likely) or ``skewed`` (rank 0 takes 70 %, like a popular expert).
Both libraries move the same rows; every result is checked against the rows the senders meant
for this rank before timing. Times are best-of-``repeat`` per rank, the slowest rank's counting
(a collective ends when its last rank does); they take turns round by round. gpucoll is timed
twice: with ``send_counts`` only (its time includes the count exchange, one small all_gather)
and with the whole count matrix known (``counts=``, nothing exchanged first: like Gloo, which is
given both split lists, which a caller would first have to exchange itself). Needs torch (CPU
build) for the Gloo column.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll as gc  # noqa: E402


def routing(pattern: str, tokens: int, size: int, rank: int, seed: int) -> np.ndarray:
    """``send[d]``: rows this rank sends to rank d."""
    if pattern == "uniform" or size == 1:
        probs = np.full(size, 1.0 / size)
    else:
        probs = np.full(size, 0.3 / (size - 1))
        probs[0] = 0.7
    return np.random.default_rng([seed, rank]).multinomial(tokens, probs)


def rows_for(sender: int, send: np.ndarray, features: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng([seed, sender, 1])
    return rng.standard_normal((int(send.sum()), features)).astype(np.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="256,4096", help="rows each rank sends, comma list")
    parser.add_argument("--features", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=7)
    args = parser.parse_args()
    comm = gc.init(backend="cpu")
    n, r = comm.size, comm.rank
    try:  # every rank agrees whether torch is there before any of them starts Gloo
        import torch
        import torch.distributed as dist
    except ImportError:
        torch = None
    if comm.all_gather_object(torch is not None).count(True) != n:
        torch = None
        if r == 0:
            print("# Gloo skipped: torch is not importable on every rank")
    else:
        from gpucoll.perf.devices import _Host
        from gpucoll.perf.gloo import GlooSide

        GlooSide(comm, _Host(), timeout=60.0)  # its store's port travels through gpucoll
    if r == 0:
        print(f"# all_to_all_v, CPU backend ({os.environ.get('GPUCOLL_TRANSPORT', 'auto')}), {n} "
              f"ranks, float32 rows of {args.features}, best of {args.repeat}, slowest rank")
        print(f"# {'tokens':>7} {'pattern':>8} {'MiB/rank':>9} {'gpucoll us':>11} {'known us':>9} "
              f"{'gloo us':>8} {'gloo/gpucoll':>13} {'gloo/known':>11}")
    for seed, tokens in enumerate(int(t) for t in args.tokens.split(",")):
        for pattern in ("uniform", "skewed"):
            sends = [routing(pattern, tokens, n, s, seed) for s in range(n)]
            x = rows_for(r, sends[r], args.features, seed)
            expected = np.concatenate([rows_for(s, sends[s], args.features, seed)[
                int(sends[s][:r].sum()):int(sends[s][:r + 1].sum())] for s in range(n)])
            recv = [int(sends[s][r]) for s in range(n)]
            matrix = np.array(sends)
            ours = lambda: comm.all_to_all_v(x, [int(c) for c in sends[r]])[0]  # noqa: E731
            known = lambda: comm.all_to_all_v(x, counts=matrix)[0]  # noqa: E731
            assert np.array_equal(ours(), expected), "all_to_all_v: wrong result"
            assert np.array_equal(known(), expected), "all_to_all_v(counts=): wrong result"
            times = {"gpucoll": [], "known": [], "gloo": []}
            if torch is not None:
                tx = torch.from_numpy(x)
                tout = torch.empty((sum(recv), args.features), dtype=torch.float32)

                def theirs():
                    dist.all_to_all_single(tout, tx, output_split_sizes=recv,
                                           input_split_sizes=[int(c) for c in sends[r]])
                    return tout.numpy()

                assert np.array_equal(theirs(), expected), "Gloo all_to_all_single: wrong result"
            for round_ in range(args.repeat):
                order = [("gpucoll", ours), ("known", known)] + \
                    ([("gloo", theirs)] if torch is not None else [])
                for name, fn in (order if round_ % 2 == 0 else order[::-1]):
                    comm.barrier()
                    start = time.perf_counter()
                    fn()
                    times[name].append(time.perf_counter() - start)
            best = {k: float(comm.all_gather(np.array([min(v)])).max()) for k, v in times.items() if v}
            if r == 0:
                gloo = best.get("gloo")
                mib = x.nbytes / (1 << 20)
                print(f"  {tokens:>7} {pattern:>8} {mib:9.2f} {best['gpucoll'] * 1e6:11.0f} "
                      f"{best['known'] * 1e6:9.0f} "
                      + (f"{gloo * 1e6:8.0f} {gloo / best['gpucoll']:13.2f} "
                         f"{gloo / best['known']:11.2f}" if gloo else
                         f"{'-':>8} {'-':>13} {'-':>11}"))
    if torch is not None:
        dist.destroy_process_group()
    comm.close()


if __name__ == "__main__":
    main()
