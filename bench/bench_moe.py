"""One training step of ``gpucoll.ep.MoELayer`` (forward and backward), timed per step.

    gpucoll run -n 4 bench/bench_moe.py [--tokens 64,1024] [--features 256] [--experts 2] [--repeat 15]

Each rank holds ``--experts`` experts (hidden = 2 x features) and routes ``--tokens`` float32
tokens of its own. The step's time is the slowest rank's, best of ``--repeat`` (every rank starts
together after a barrier). The collectives one step issues are counted by wrapping the
communicator's methods, so the line says both how long a step takes and how many collectives it
took. Run it on two versions of gpucoll to compare them; the result of the first step is checked
against a second run of the same step (the layer is deterministic).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import gpucoll as gc  # noqa: E402
from gpucoll.ep import MoELayer, init_experts  # noqa: E402

_COUNTED = ("all_gather", "all_to_all", "all_reduce", "all_to_all_v", "broadcast")


def count_calls(comm) -> collections.Counter:
    """Count the calls of ``comm``'s collectives from now on (instance attributes wrap them)."""
    calls: collections.Counter = collections.Counter()
    for name in _COUNTED:
        method = getattr(comm, name)

        def counted(*args, _name=name, _method=method, **kwargs):
            calls[_name] += 1
            return _method(*args, **kwargs)
        setattr(comm, name, counted)
    return calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", default="64,1024", help="tokens per rank, comma list")
    parser.add_argument("--features", type=int, default=256)
    parser.add_argument("--experts", type=int, default=2, help="experts per rank")
    parser.add_argument("--repeat", type=int, default=15)
    args = parser.parse_args()
    comm = gc.init(backend="cpu")
    n, r, k = comm.size, comm.rank, args.experts
    gate, experts = init_experts(n * k, args.features, 2 * args.features, seed=0)
    layer = MoELayer(comm, gate, experts[r * k:(r + 1) * k])
    calls = count_calls(comm)
    if r == 0:
        print(f"# MoELayer step (forward + backward), CPU backend "
              f"({os.environ.get('GPUCOLL_TRANSPORT', 'auto')}), {n} ranks x {k} experts, "
              f"features {args.features}, best of {args.repeat}, slowest rank")
        print(f"# {'tokens':>7} {'step us':>9}  collectives per step")
    for tokens in (int(t) for t in args.tokens.split(",")):
        x = np.random.default_rng([tokens, r]).standard_normal(
            (tokens, args.features)).astype(np.float32)
        grad = np.ones_like(x)

        def step():
            return layer.forward(x), layer.backward(grad)

        first = step()
        calls.clear()
        again = step()
        per_step = dict(calls)
        assert all(np.array_equal(a, b) for a, b in zip(first, again)), "steps differ"
        times = []
        for _ in range(args.repeat):
            comm.barrier()
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        best = float(comm.all_gather(np.array([min(times)])).max())
        if r == 0:
            listed = ", ".join(f"{name} {count}" for name, count in sorted(per_step.items()))
            print(f"  {tokens:>7} {best * 1e6:9.0f}  {listed}")
    comm.close()


if __name__ == "__main__":
    main()
