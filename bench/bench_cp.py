"""Context parallelism measured: ring and Ulysses attention against all-gathering the keys and
values (the simple way to split attention by tokens), and against one process.

Every method computes exact causal attention over the same sequence (zigzag sharding), forward
and backward, with the same blockwise kernel (``gpucoll.cp.blockwise``), so the rows differ only
in what travels and when:

* ``ring``       - ``RingAttention``: p - 1 sendrecv steps forward, overlapped with the math;
* ``ulysses``    - ``UlyssesAttention``: two all-to-alls forward, two backward;
* ``allgather``  - every rank all-gathers every rank's k and v (one ``all_gather``), attends
  with its queries over the whole sequence, and reduce-scatters the key / value gradients;
* ``1 process``  - the whole sequence in one process (``RingAttention`` on one rank).

Per configuration: milliseconds per forward + backward (mean over ranks of the mean after the
warm-up steps), the bytes one rank sends per step, and the peak of memory one rank allocates
during a step (``tracemalloc``, which sees NumPy's allocations), inputs excluded.
``--kv-heads`` runs grouped-query attention (k and v with that many heads; 8 is plain
attention, 1 multi-query).

    python bench/bench_cp.py [--seq 2048 4096] [--ranks 2 4] [--kv-heads 8 2] [--steps 6]
                             [--json F]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import tracemalloc

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

HEADS, HEAD_DIM, BATCH = 8, 64, 1
METHODS = ("ring", "ulysses", "allgather")


class AllGatherAttention:
    """The baseline: all-gather k and v, attend locally, reduce-scatter their gradients."""

    def __init__(self, comm, sharding: str):
        from gpucoll.cp.base import ContextParallelAttention

        self.layout = ContextParallelAttention(comm, causal=True, sharding=sharding)
        self.comm = comm
        self.sent_bytes = {}

    def forward(self, q, k, v):
        from gpucoll.cp.base import group_queries, grouped_segments, ungroup_queries
        from gpucoll.cp.blockwise import RunningSoftmax, attend

        layout, comm, size = self.layout, self.comm, self.comm.size
        xp, compute = layout._check_inputs(q, k, v)
        seq, kv_heads = int(q.shape[1]), int(k.shape[2])
        total, scale = seq * size, layout._scale(int(q.shape[3]))
        queries = group_queries(layout.to_heads_first(q, compute, xp), kv_heads)
        mine = xp.stack([layout.to_heads_first(k, compute, xp),
                         layout.to_heads_first(v, compute, xp)])
        gathered = comm.all_gather(mine)                       # (p, 2, b, kv_h, s, d)
        keys = np.ascontiguousarray(gathered.transpose(1, 2, 3, 0, 4, 5)).reshape(
            2, q.shape[0], kv_heads, total, q.shape[3])
        everyone = [s for r in range(size) for s in layout.local_segments(total, r, r * seq)]
        own = grouped_segments(layout.local_segments(total, comm.rank),
                               int(q.shape[2]) // kv_heads, seq)
        softmax = RunningSoftmax(queries, xp)
        attend(queries, keys[0], keys[1], own, everyone, True, scale, xp, softmax)
        out, lse = softmax.finish()
        self.sent_bytes = {"forward": mine.nbytes * (size - 1)}
        self._saved = (queries, keys, out, lse, own, everyone, scale, q.dtype, seq, q.shape[2])
        return layout.to_tokens_first(ungroup_queries(out, q.shape[2]), q.dtype, xp)

    def backward(self, grad_out):
        from gpucoll.cp.base import group_queries, ungroup_queries
        from gpucoll.cp.blockwise import attend_backward

        queries, keys, out, lse, own, everyone, scale, dtype, seq, heads = self._saved
        layout, size = self.layout, self.comm.size
        grad = group_queries(layout.to_heads_first(grad_out, queries.dtype, np), keys.shape[2])
        delta = (grad * out).sum(axis=-1)
        dq, dk, dv = attend_backward(queries, keys[0], keys[1], grad, lse, delta, own, everyone,
                                     True, scale, np)
        shape = dk.shape[:2] + (size, seq, dk.shape[-1])
        both = np.stack([dk.reshape(shape), dv.reshape(shape)])   # (2, b, h, p, s, d)
        per_rank = np.ascontiguousarray(both.transpose(3, 0, 1, 2, 4, 5))
        mine = self.comm.reduce_scatter(per_rank)
        self.sent_bytes["backward"] = per_rank.nbytes * (size - 1) // size
        dq = ungroup_queries(dq, heads)
        return (layout.to_tokens_first(dq, dtype, np), layout.to_tokens_first(mine[0], dtype, np),
                layout.to_tokens_first(mine[1], dtype, np))


def one_rank(comm, method: str, seq: int, steps: int, warmup: int, kv_heads: int) -> dict:
    from gpucoll.cp import RingAttention, UlyssesAttention, shard_sequence

    rng = np.random.default_rng(0)
    full = [rng.standard_normal((BATCH, seq, heads, HEAD_DIM), dtype=np.float32)
            for heads in (HEADS, kv_heads, kv_heads, HEADS)]
    q, k, v, grad = (shard_sequence(x, comm.rank, comm.size, "zigzag") for x in full)
    del full
    layer = {"ring": RingAttention, "ulysses": UlyssesAttention}.get(method)
    attention = (layer(comm, causal=True, sharding="zigzag") if layer
                 else AllGatherAttention(comm, "zigzag"))
    times, peak = [], 0
    for step in range(steps):
        comm.barrier()
        tracemalloc.start()
        start = time.perf_counter()
        attention.forward(q, k, v)
        attention.backward(grad)
        times.append(time.perf_counter() - start)
        peak = max(peak, tracemalloc.get_traced_memory()[1])
        tracemalloc.stop()
    sent = attention.sent_bytes
    return {"ms": 1e3 * float(np.mean(times[warmup:])), "peak": peak,
            "sent": int(sent.get("forward", 0) + sent.get("backward", 0))}


def measure(method: str, ranks: int, seq: int, steps: int, warmup: int,
            kv_heads: int = HEADS) -> dict:
    import gpucoll

    threads = str(max(1, (os.cpu_count() or 1) // ranks))
    env = {"OMP_NUM_THREADS": threads, "OPENBLAS_NUM_THREADS": threads}
    rows = gpucoll.spawn(one_rank, ranks, args=(method, seq, steps, warmup, kv_heads),
                         backend="cpu", timeout=600, env=env)
    return {"method": method if ranks > 1 else "1 process", "ranks": ranks, "seq": seq,
            "kv_heads": kv_heads,
            "ms": float(np.mean([r["ms"] for r in rows])),
            "peak_mb": max(r["peak"] for r in rows) / 2 ** 20,
            "sent_mb": max(r["sent"] for r in rows) / 2 ** 20}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seq", type=int, nargs="+", default=[2048, 4096])
    parser.add_argument("--ranks", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--methods", nargs="+", default=list(METHODS), choices=METHODS)
    parser.add_argument("--kv-heads", type=int, nargs="+", default=[HEADS],
                        help=f"key/value heads (each dividing {HEADS}; fewer: grouped-query)")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if args.steps <= args.warmup:
        parser.error(f"--steps {args.steps} must exceed --warmup {args.warmup}")
    for kv_heads in args.kv_heads:
        if kv_heads < 1 or HEADS % kv_heads:
            parser.error(f"--kv-heads {kv_heads} must divide the {HEADS} query heads")
    load = os.getloadavg()
    print(f"# causal attention, batch {BATCH}, {HEADS} heads of {HEAD_DIM}, float32, zigzag; "
          f"{args.steps} steps (first {args.warmup} not timed); {os.cpu_count()} CPUs, load "
          f"{load[0]:.2f}")
    print(f"# {'seq':>6} {'kv_heads':>8} {'method':>10} {'ranks':>5} {'ms/step':>9} "
          f"{'vs ring':>7} {'MB sent/rank':>12} {'peak MB/rank':>12}")
    rows = []
    for seq in args.seq:
        for kv_heads in args.kv_heads:
            single = measure("ring", 1, seq, args.steps, args.warmup, kv_heads)
            rows.append(single)
            print(f"  {seq:>6} {kv_heads:>8} {'1 process':>10} {1:>5} {single['ms']:9.1f} "
                  f"{'-':>7} {0:12.2f} {single['peak_mb']:12.1f}")
            for ranks in args.ranks:
                ring = None
                for method in args.methods:
                    row = measure(method, ranks, seq, args.steps, args.warmup, kv_heads)
                    rows.append(row)
                    ring = row["ms"] if method == "ring" else ring
                    ratio = f"{row['ms'] / ring:7.2f}" if ring else "      -"
                    print(f"  {seq:>6} {kv_heads:>8} {method:>10} {ranks:>5} {row['ms']:9.1f} "
                          f"{ratio} {row['sent_mb']:12.2f} {row['peak_mb']:12.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as handle:
            json.dump(rows, handle, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
